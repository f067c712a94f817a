"""The evaluation's own batch (oomdoc.replay.evaluation_batch): a training
OOM whose smaller-batch replays train and then run out of memory in the
evaluation, at the script's own evaluation batch."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_capped, two_at_a_time

from oomdoc.replay.evaluation_batch import (
    EvaluationApart,
    search_evaluation_batch,
    with_evaluation_batch,
)
from oomdoc.replay.replayer import Replay
from oomdoc.runner import ChildRequest

MiB = 1 << 20
HF_VARLEN = Path(__file__).parents[1] / "benchmarks" / "scripts" / "hf_trainer_varlen.py"


# A tiny HF Trainer (GPT-2, one layer, vocabulary 2000, samples up to 128
# tokens), evaluating every 4 steps and keeping the evaluation's logits.
TINY_TRAINER = (
    "--n_layer 1 --n_embd 32 --vocab_size 2000 --max_len 128 --median_len 16 --train_samples 256 "
    "--eval_samples 128 --max_steps 8 --eval_steps 4 --use_cpu True"
).split()


def diagnose(tmp_path: Path, training_batch: int, evaluation_batch: int, lanes: int = 1) -> tuple:
    """oomdoc's diagnosis of the tiny trainer on 48 MiB (the batch searches
    only), its replays one at a time or in `lanes`."""
    pytest.importorskip("transformers")
    args = [*TINY_TRAINER, "--per_device_train_batch_size", str(training_batch)]
    args += ["--per_device_eval_batch_size", str(evaluation_batch)]
    options = ["--fixes", "smaller_batch", "--replay-jobs", str(lanes)]
    return run_capped(tmp_path / "hf.json", "48MiB", HF_VARLEN, args, options)


def whole_epoch(flags: list[str]) -> list[str]:
    """The prescription's flags with --max_steps raised to a whole epoch,
    so that the run by hand meets the longest batch (the replays train on it
    first; a few steps by hand may not)."""

    def value(flag: str) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else 1

    per_step = value("--per_device_train_batch_size") * value("--gradient_accumulation_steps")
    samples = int(TINY_TRAINER[TINY_TRAINER.index("--train_samples") + 1])
    raised = list(flags)
    raised[raised.index("--max_steps") + 1] = str(-(-samples // per_step))
    return raised


def test_the_evaluation_batch_is_set_where_given_and_added_where_not():
    flag = "--per_device_eval_batch_size"
    assert with_evaluation_batch(["--a", "1", flag, "64"], flag, 24, None) == [
        "--a", "1", flag, "24",
    ]  # fmt: skip
    assert with_evaluation_batch([f"{flag}=64"], flag, 24, None) == [f"{flag}=24"]
    assert with_evaluation_batch(["--a", "1"], flag, 24, None) == ["--a", "1", flag, "24"]
    assert with_evaluation_batch(["--a=1"], "--eval_batch_size", 8, "configurator") == [
        "--a=1", "--eval_batch_size=8",
    ]  # fmt: skip


def _replays(base: int, per_sample: int, capacity: int):
    """Replays of an evaluation whose need is base + per_sample x batch."""
    tried = []

    def trial(batch: int) -> Replay:
        tried.append(batch)
        need = base + per_sample * batch
        if need <= capacity:
            return Replay("eval", "fits", peak_allocated_bytes=need)
        # An OOM reports what it held and asked for: a lower bound of the need.
        return Replay("eval", "oom", peak_allocated_bytes=min(need, capacity + per_sample))

    return trial, tried


def test_the_evaluation_search_goes_where_the_line_reaches_the_margin():
    """Base 20 MiB, 2 MiB a sample, 100 MiB device and 95 MiB free of the
    margin: 37 fits under it (94 MiB), 40 fits the device only. The search
    gets there from the OOM at 64 in a few replays and chooses under the margin."""
    capacity, limit = 100 * MiB, 95 * MiB
    trial, tried = _replays(20 * MiB, 2 * MiB, capacity)
    failed = Replay("eval", "oom", peak_allocated_bytes=102 * MiB)
    search = search_evaluation_batch(64, failed, trial, limit)
    assert search.chosen is not None and 30 <= search.chosen <= 37, tried
    assert 20 * MiB + 2 * MiB * search.chosen <= limit
    assert len(tried) <= 4


def test_no_evaluation_batch_is_chosen_when_none_fits():
    trial, tried = _replays(200 * MiB, 2 * MiB, 100 * MiB)
    failed = Replay("eval", "oom", peak_allocated_bytes=101 * MiB)
    search = search_evaluation_batch(64, failed, trial, 95 * MiB)
    assert search.chosen is None and search.stopped and len(tried) <= 4


def test_an_hf_trainer_whose_evaluation_batch_is_too_large_gets_both_batches(tmp_path):
    """HF Trainer (pad-to-longest collator, evaluation every 4 steps, the
    Trainer keeping the evaluation's logits), training batch 24 and
    `--per_device_eval_batch_size 64` on 48 MiB: the training runs out of
    memory; at a training batch that trains, the evaluation at 64 does. The
    evaluation batch is searched once and every later replay runs with it:
    the largest training batch is found (not "nothing fits"), and the
    prescription prints both batches. By hand under the same cap over a whole
    epoch, its flags hold, peaking no higher than the replays' worst case;
    the same with the evaluation batch of 64 runs out of memory in the
    evaluation."""
    completed, document = diagnose(tmp_path, training_batch=24, evaluation_batch=64)
    assert document["outcome"] == "oom" and document["oom"]["phase"] != "evaluation"
    search = document["replay"]["evaluation_batch_search"]
    assert search["source"] == "--per_device_eval_batch_size"
    assert search["original_batch_size"] == 64 and 1 <= search["max_batch_size"] < 64
    assert document["max_batch_size"] == 12, completed.stderr[-3000:]
    prescription = document["prescription"]
    chosen = prescription["evaluation_batch_size"]
    assert chosen == search["max_batch_size"]
    assert prescription["evaluation_batch_option"] == "--per_device_eval_batch_size"
    assert f"--per_device_eval_batch_size {chosen}" in prescription["snippet"]
    assert "--per_device_eval_batch_size 64" not in prescription["snippet"]
    assert f"and the evaluation batch at {chosen}" in completed.stderr
    flags = prescription["verified_by_flags"]["args"]
    assert flags[flags.index("--per_device_eval_batch_size") + 1] == str(chosen)

    def by_hand(evaluation_batch: int) -> dict:
        argv = whole_epoch(flags)
        argv[argv.index("--per_device_eval_batch_size") + 1] = str(evaluation_batch)
        _completed, run = run_capped(
            tmp_path / f"by-hand-{evaluation_batch}.json",
            "48MiB",
            HF_VARLEN,
            argv,
            ["--no-replay"],
        )
        return run

    prescribed, original = two_at_a_time(by_hand, [chosen, 64])
    assert prescribed["outcome"] == "ok", json.dumps(prescribed.get("oom"))
    # The replays' worst case bounds the run by hand (its order is the seed's).
    assert prescribed["peak"]["allocated_bytes"] <= 1.05 * prescription["peak_allocated_bytes"]
    assert original["outcome"] == "oom" and original["oom"]["phase"] == "evaluation"


def test_in_lanes_the_evaluation_batch_is_searched_once_beside_the_batch_search(tmp_path):
    """The same trainer with two lanes, through the CLI: the plain search
    runs beside the decisions and its probes beside its trials, so replays
    at the old evaluation batch may end while the evaluation batch is
    searched (whether one does depends on timing: the test with threads
    below forces it). It is searched once; every replay that ran out of
    memory in the evaluation only did so at the old batch; the largest
    training batch is found exactly, the same as one replay at a time (test
    above), and the prescription's flags fit."""
    completed, document = diagnose(tmp_path, training_batch=24, evaluation_batch=64, lanes=2)
    search = document["replay"]["evaluation_batch_search"]
    chosen = search["max_batch_size"]
    assert search["original_batch_size"] == 64 and 1 <= chosen < 64
    labels = [run["label"] for run in document["replay"]["runs"]]
    assert sum(", evaluation " in label for label in labels) == len(search["trials"])
    evaluation_ooms = re.findall(
        r"replay \d+: (.*?): out of memory in the evaluation at batch (\d+)", completed.stderr
    )
    assert evaluation_ooms, completed.stderr[-3000:]
    for label, batch in evaluation_ooms:
        assert int(batch) > chosen or ", evaluation " in label, (label, batch)
    batch_search = document["replay"]["batch_search"]
    assert batch_search["exact"] and document["max_batch_size"] == 12
    prescription = document["prescription"]
    assert prescription["evaluation_batch_size"] == chosen
    assert prescription["verified_by_flags"]["outcome"] == "fits"


def test_an_evaluation_oom_whose_replays_run_out_in_training_searches_both(tmp_path):
    """The mirror case: training batch 16 and evaluation 64 on 48 MiB. The
    failing run runs out of memory in its first evaluation (its first steps
    never met the longest batch); the replays train on the longest batch
    first, and run out of memory there at any evaluation batch. So after one
    replay the training batch is searched instead (the effective batch kept
    by accumulation), and the evaluation batch once a replay trains: the
    prescription holds both, and by hand its flags hold over a whole epoch."""
    completed, document = diagnose(tmp_path, training_batch=16, evaluation_batch=64)
    assert document["outcome"] == "oom" and document["oom"]["phase"] == "evaluation"
    assert "ran out of memory in training, on its longest batch" in completed.stderr
    search = document["replay"]["batch_search"]
    assert search["source"] == "--per_device_train_batch_size" and search["exact"]
    prescription = document["prescription"]
    assert prescription["fits"] and prescription["batch_size"] < 16
    assert prescription["batch_size"] * prescription["accumulation_steps"] == 16
    assert not prescription.get("evaluation_batch_flag")  # the batch is the training's
    chosen = prescription["evaluation_batch_size"]
    assert 1 <= chosen < 64
    flags = prescription["verified_by_flags"]["args"]
    assert flags[flags.index("--per_device_eval_batch_size") + 1] == str(chosen)
    _completed, by_hand = run_capped(
        tmp_path / "by-hand.json", "48MiB", HF_VARLEN, whole_epoch(flags), ["--no-replay"]
    )
    assert by_hand["outcome"] == "ok", json.dumps(by_hand.get("oom"))


class _LaneReplayer:
    """Replayer.run's contract for the settler, from several threads: the
    training fits at every batch; the evaluation needs 20 MiB + 2 MiB a
    sample of a 100 MiB device. The search's trials wait until the other
    thread's replay at the old evaluation batch has ended."""

    FLAG = "--per_device_eval_batch_size"

    def __init__(self, settler):
        self.settler = settler
        args = ["--per_device_train_batch_size", "8", self.FLAG, "64"]
        self.request = ChildRequest(target="train.py", args=args, device="cpu")
        self.ran: list[tuple[str, list[str]]] = []
        self.searching, self.other_ended = threading.Event(), threading.Event()
        self.discarded = 0

    def run(self, payload, label, args=None, extra_env=None, micro_batches_per_step=None):
        child_args = self.settler.rewrite(list(self.request.args if args is None else args))
        if ", evaluation " in label:  # the search's trial
            self.searching.set()
            assert self.other_ended.wait(10)
        evaluation = int(child_args[child_args.index(self.FLAG) + 1])
        need = 20 * MiB + 2 * MiB * evaluation
        fits = need <= 100 * MiB
        capture = SimpleNamespace(
            oom=None if fits else SimpleNamespace(in_evaluation=True),
            steps=[SimpleNamespace(backward_calls=1, optimizer_steps=1, evaluation_calls=1,
                                   start_allocated_bytes=20 * MiB)],
            data_loaders=[],
        )  # fmt: skip
        replay = Replay(
            label,
            "fits" if fits else "oom",
            peak_allocated_bytes=min(need, 101 * MiB),
            capture=capture,  # type: ignore[arg-type]
            args=child_args,
        )
        self.ran.append((label, child_args))
        if label == "other":
            self.other_ended.set()
        return self.settler.settle(self, replay, payload, label, args, extra_env, None)

    def discard_ahead(self):
        self.discarded += 1


def test_replays_from_other_threads_wait_for_the_evaluation_batch_and_run_again_with_it():
    """Two lanes' threads (the plain search beside a saver's search): the
    first replay whose evaluation alone ran out of memory searches the
    evaluation batch; a replay of the other thread that ran with the old
    batch meanwhile waits for the choice and is run again with it, never
    counted as a training OOM, and the search happens once."""
    snapshot = SimpleNamespace(
        oom=SimpleNamespace(in_evaluation=False),
        device=SimpleNamespace(capacity_bytes=100 * MiB),
        script_option_syntax=None,
        script_option_defaults={},
    )
    settler = EvaluationApart(snapshot, _LaneReplayer.FLAG, 0.05)  # type: ignore[arg-type]
    replayer = _LaneReplayer(settler)
    answers: dict[str, Replay] = {}

    def ask(label: str) -> None:
        answers[label] = replayer.run(None, label)

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert replayer.searching.wait(10)  # the first thread searches
    other = threading.Thread(target=ask, args=("other",))
    other.start()
    first.join(20)
    other.join(20)
    chosen = settler.chosen
    assert chosen is not None and 30 <= chosen <= 37
    assert answers["first"].fits and answers["other"].fits
    assert answers["other"].args is not None
    assert answers["other"].args[-1] == str(chosen)
    labels = [label for label, _args in replayer.ran]
    assert labels.count("other") == 2 and labels.count("first") == 2
    assert sum(", evaluation " in label for label in labels) == len(settler.search.trials)
    assert replayer.discarded == 1
