"""A replay's whole-run data (oomdoc.capture.whole_run): DataLoaders yield
their longest batches first, the training epoch ends once the replay's
steps are done so that the script's own evaluation runs, and the next epoch
trains one more step (the longest batch, on the cache the evaluation left)
and stops the replay. The failing run sees its data as it would."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomdoc.model import Snapshot
from oomdoc.runner import ChildRequest, run_child

SCRIPT = Path(__file__).parent / "scripts" / "whole_run_loaders.py"


def replay(
    tmp_path: Path,
    *args: str,
    whole_run: bool = True,
    steps: int = 2,
    sizes: Path | None = None,
    log_name: str = "log.txt",
) -> tuple:
    log = tmp_path / log_name
    request = ChildRequest(
        target=str(SCRIPT),
        args=list(args),
        device="cpu",
        capacity_bytes=1 << 30,
        max_steps=steps,
        expected_unit="optimizer",
        whole_run=whole_run,
        dataset_sizes=str(sizes) if sizes else None,
        output_path=str(log),
    )
    result = run_child(request)
    assert result.capture is not None
    capture = Snapshot.from_dict(result.capture)
    lines = [
        line.split() for line in log.read_text().splitlines() if line[:5] in ("train", "eval ")
    ]
    return capture, lines


def shapes(lines: list, kind: str) -> list[str]:
    return [" ".join(line[2:]) for line in lines if line[0] == kind]


def test_longest_batches_first_then_the_scripts_evaluation_then_one_step_after_it(tmp_path):
    capture, lines = replay(tmp_path, "--batch_size", "4")
    assert capture.outcome == "ok"
    # Two steps, the longest batch (40 is the longest sample) first and again
    # once the optimizer's state exists, then the evaluation's two longest
    # batches (33 the longest there), then epoch 1's one step on the longest
    # batch, trained on the cache the evaluation left; then the replay stops.
    assert shapes(lines, "train") == ["(4, 40)", "(4, 40)", "(4, 40)"]
    assert shapes(lines, "eval")[0] == "(8, 33)"
    assert len(shapes(lines, "eval")) == 2
    assert [line[1] for line in lines] == ["0"] * 4 + ["1"]
    training, evaluation = capture.data_loaders
    assert (training.role, evaluation.role) == ("training", "evaluation")
    assert training.longest_first and training.complete
    assert training.first_batch is not None and training.first_batch.longest_sample == 37
    assert training.longest_elements == 40 and training.trained_after_evaluation
    assert not training.stopped_replay
    assert training.longest_repeated == 2
    assert evaluation.batches_taken == 2 and evaluation.epoch_ended_early
    assert evaluation.batch_size == 8
    # The evaluation ran in the replay's last step: its peak is recorded.
    assert any("evaluation" in step.phase_peaks for step in capture.steps)


def test_replays_of_one_diagnosis_read_each_dataset_once_and_order_it_alike(tmp_path):
    """The first replay reads the datasets' sizes into the shared folder;
    the next, at another batch, takes them from there (each once), and its
    batches are ordered by them just the same."""
    sizes = tmp_path / "sizes"
    sizes.mkdir()
    first, first_lines = replay(tmp_path, "--batch_size", "4", sizes=sizes, log_name="1.txt")
    second, second_lines = replay(tmp_path, "--batch_size", "2", sizes=sizes, log_name="2.txt")
    assert len(list(sizes.glob("dataset-sizes-*.json"))) == 2  # training, evaluation
    for before, after in zip(first.data_loaders, second.data_loaders):
        assert not before.sizes_shared and after.sizes_shared
        assert after.read_s == before.read_s and after.samples_read == before.samples_read
        assert after.longest_sample == before.longest_sample
    assert shapes(first_lines, "train")[0] == "(4, 40)"
    assert shapes(second_lines, "train")[0] == "(2, 40)"


def test_the_failing_run_sees_its_data_as_it_would(tmp_path):
    capture, lines = replay(
        tmp_path, "--batch_size", "4", "--epochs", "1", whole_run=False, steps=None
    )
    assert capture.data_loaders == []
    assert len(shapes(lines, "train")) == 16  # the whole epoch, shuffled
    assert shapes(lines, "train")[:3] != ["(4, 40)", "(4, 33)", "(4, 33)"]


def test_a_scripts_own_batch_sampler_gives_its_largest_batches_first(tmp_path):
    capture, lines = replay(tmp_path, "--batch_size", "4", "--bucketing")
    # The bucketing sampler's batches, by padded size: the one holding 40 first.
    assert shapes(lines, "train")[0] == "(4, 40)"
    assert capture.data_loaders[0].longest_first


def test_an_iterable_dataset_is_not_reordered_and_says_why(tmp_path):
    capture, lines = replay(tmp_path, "--batch_size", "4", "--iterable")
    training = capture.data_loaders[0]
    assert not training.longest_first
    assert training.not_ordered is not None and "iterable" in training.not_ordered
    # Its epoch still ends once the steps are done: the evaluation runs.
    # (and one step after it, in the next epoch).
    assert len(shapes(lines, "train")) == 3 and shapes(lines, "eval")


def test_an_evaluation_that_gathers_outputs_runs_to_the_end_of_its_pass(tmp_path):
    capture, lines = replay(tmp_path, "--batch_size", "4", "--gather")
    evaluation = capture.data_loaders[1]
    assert evaluation.evaluation_grows
    assert evaluation.batches_taken == 3  # 24 samples in batches of 8
    assert len(shapes(lines, "eval")) == 3


@pytest.mark.parametrize("workers", ["2"])
def test_loader_workers_fetching_ahead_do_not_add_steps(tmp_path, workers):
    """Workers prefetch batches: the epoch is still cut where the script
    takes its batches, not where the sampler was asked for them."""
    capture, lines = replay(tmp_path, "--batch_size", "4", "--workers", workers)
    # Two steps, the evaluation, one step after it.
    assert shapes(lines, "train") == ["(4, 40)", "(4, 40)", "(4, 40)"]
    assert [line[:2] for line in lines if line[0] == "train"][-1] == ["train", "1"]
    assert len(shapes(lines, "eval")) == 2


HF_VARLEN = Path(__file__).parents[1] / "benchmarks" / "scripts" / "hf_trainer_varlen.py"


def test_an_hf_trainer_evaluating_every_n_steps_evaluates_at_the_step_end_and_trains_on(tmp_path):
    """A `max_steps` run is one epoch: cutting it would end the training.
    The Trainer is asked to evaluate at the replay's last step end instead,
    and trains on: the longest batch again, on the cache the evaluation left."""
    pytest.importorskip("transformers")
    args = "--n_layer 1 --n_embd 32 --vocab_size 500 --max_len 128 --median_len 16"
    args += " --train_samples 256 --eval_samples 64 --per_device_train_batch_size 8"
    args += " --max_steps 32 --eval_steps 16 --use_cpu True"
    request = ChildRequest(
        target=str(HF_VARLEN),
        args=args.split(),
        device="cpu",
        capacity_bytes=1 << 30,
        max_steps=3,
        expected_unit="optimizer",
        whole_run=True,
        output_path=str(tmp_path / "log.txt"),
    )
    result = run_child(request)
    assert result.capture is not None
    capture = Snapshot.from_dict(result.capture)
    assert capture.outcome == "ok"
    training = next(loader for loader in capture.data_loaders if loader.role == "training")
    assert training.evaluation_asked == "transformers: at the step end"
    assert training.trained_after_evaluation and not training.epoch_ended_early
    evaluated = [step.index for step in capture.steps if step.evaluation_calls]
    assert evaluated == [2]  # the replay's last step (max_steps=3)
    after = [step for step in capture.steps if step.index > 2]
    assert len(after) == 2
    # Past the replay's steps: not part of its step time.
    assert all(step.after_timed_steps for step in after)
    assert not any(step.after_timed_steps for step in capture.steps[:3])
    # The longest batch (the first step's) trained again after the evaluation.
    first = capture.steps[0].phase_peaks["forward"]
    assert max(step.phase_peaks["forward"] for step in after) == pytest.approx(first, rel=0.05)
