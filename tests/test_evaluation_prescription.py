"""The prescription of an OOM in evaluation (issue 28's evaluation loop, in
transformers' Seq2SeqTrainer idiom: `predict_with_generate`): the batch
searched is the evaluation's, so the training batch stays in every snippet,
every configuration trains the same steps, and a saver whose script flag
does not do what oomdoc's replay did gives way to the next configuration."""

from __future__ import annotations

from types import SimpleNamespace

from oomdoc.frameworks import framework_of
from oomdoc.model import FixResult, FlagsCheck, Prescription, Snapshot
from oomdoc.replay.batch import BatchRun, SearchResult
from oomdoc.replay.candidates import Candidate, pick
from oomdoc.replay.certificate import allocator_drift
from oomdoc.replay.evaluation_batch import training_batch_size
from oomdoc.replay.own_flags import flags_disagree
from oomdoc.replay.plan import ReplayState
from oomdoc.replay.prescription import prescription_for
from oomdoc.replay.replayer import Replay

MiB = 2**20
SCRIPT = "seq2seq_generate.py"
COMMAND = [SCRIPT, "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "64"]


def seq2seq_snapshot() -> Snapshot:
    """A Seq2SeqTrainer run out of memory in its evaluation at batch 64."""
    return Snapshot.from_dict(
        {
            "outcome": "oom",
            "device": {"capacity_bytes": 100 * MiB},
            "oom": {"phase": "evaluation", "step": 7},
            "framework": {"name": "transformers", "entry": "Trainer"},
            "command": COMMAND,
            "script_options": [
                "--per_device_train_batch_size",
                "--per_device_eval_batch_size",
                "--bf16",
                "--max_steps",
            ],
            "script_option_values": {
                "--per_device_train_batch_size": [],
                "--per_device_eval_batch_size": [],
                "--max_steps": [],
            },
            "script_option_defaults": {"--per_device_train_batch_size": "16"},
        }
    )


def test_the_training_batch_an_evaluation_search_keeps_is_the_one_given_else_the_default():
    snapshot = seq2seq_snapshot()
    assert training_batch_size(snapshot) == 8
    snapshot.command = [SCRIPT, "--per_device_eval_batch_size", "64"]
    assert training_batch_size(snapshot) == 16


def test_every_evaluation_batch_trains_alike_so_the_largest_within_the_margin_wins():
    """Timing noise made evaluation batch 1 look 25% faster than 54, though
    both train batch 8: they share one throughput, the training's, and the
    larger evaluation batch is prescribed."""
    noisy_small = Candidate([], 1, 77 * MiB, 8 / 38.5, "eval 1", trained_per_step=8)
    middle = Candidate([], 29, 77 * MiB, 8 / 31.0, "eval 29", trained_per_step=8)
    large = Candidate([], 54, 84 * MiB, 8 / 30.0, "eval 54", trained_per_step=8)
    over = Candidate([], 60, 99 * MiB, 8 / 31.0, "eval 60", trained_per_step=8)
    chosen, fits = pick([noisy_small, middle, large, over], 100 * MiB, 0.05)
    assert fits and chosen is large
    # The throughput is the training's: 8 samples a step, not the evaluation batch.
    assert round(large.samples_per_second, 1) == 30.0


def test_flags_that_ran_out_of_memory_where_the_saver_fit_disagree():
    prescription = Prescription(fixes=["autocast"], batch_size=58, fits=True)
    prescription.verified_by_flags = FlagsCheck(
        args=["--per_device_eval_batch_size", "58", "--bf16"], outcome="oom", covers=["autocast"]
    )
    reason = flags_disagree(prescription)
    assert reason is not None and "autocast" in reason and "--bf16" in reason
    prescription.verified_by_flags.outcome = "fits"
    assert flags_disagree(prescription) is None
    # A batch change or an allocator setting is the same by flags or by oomdoc.
    for covers in (["smaller_batch"], ["expandable_segments"]):
        check = FlagsCheck(args=[], outcome="oom", covers=covers)
        plain = Prescription(fixes=["expandable_segments"], batch_size=8, fits=True)
        plain.verified_by_flags = check
        assert flags_disagree(plain) is None


class EvaluationReplayer:
    """The replays a prescription asks for: the script's own flags with
    `--bf16` run out of memory in the evaluation (the Trainer does not
    autocast `generate()`), every other replay fits."""

    def __init__(self):
        self.asked: list = []
        self.replays: list = []
        self.leak = self.stopped = False
        self.max_steps = 2
        self.options = SimpleNamespace(margin_fraction=0.05, batch_arg=None, whole_run=False)
        self.request = SimpleNamespace(args=list(COMMAND[1:]))

    def ahead(self, *args, **kwargs):
        return None

    def discard(self, keys, keep_finished=False):
        pass

    def run(self, payload, label, args=None, extra_env=None, **kwargs):
        self.asked.append(args)
        if args and "--bf16" in args:
            return Replay(label=label, outcome="oom", peak_allocated_bytes=None)
        return Replay(label=label, outcome="fits", peak_allocated_bytes=90 * MiB, step_s=0.25)


def fitting(batch: int, peak_mib: int, step_s: float, label: str) -> BatchRun:
    replay = Replay(label=label, outcome="fits", peak_allocated_bytes=peak_mib * MiB, step_s=step_s)
    return BatchRun(batch, True, peak_allocated_bytes=peak_mib * MiB, step_s=step_s, replay=replay)


def test_a_saver_whose_flag_runs_out_of_memory_gives_way_to_the_next_configuration():
    """Autocast trains faster and fits at evaluation batch 58 in oomdoc's
    replay; the script's own `--bf16` at 58 runs out of memory. The
    prescription is then no fix at the largest evaluation batch, with
    autocast listed as not applied by the script's flags."""
    snapshot = seq2seq_snapshot()
    plain = SearchResult(
        64, 56, True, [fitting(29, 80, 0.27, "e29"), fitting(56, 90, 0.26, "e56")], []
    )
    autocast = SearchResult(64, 58, True, [fitting(58, 89, 0.2, "a58")], [])
    state = ReplayState(
        skipped=[],
        search=plain,
        batch_info={"source": "--per_device_eval_batch_size", "original_batch_size": 64},
        saver_searches={("autocast",): autocast},
        # Autocast ran out of memory at the failing evaluation batch, 64.
        results=[FixResult(name="autocast", measured=True, outcome="oom", fits=False)],
    )
    replayer = EvaluationReplayer()
    prescription = prescription_for(snapshot, replayer, state)
    assert prescription is not None and prescription.fits
    assert prescription.fixes == [] and prescription.batch_size == 56
    assert prescription.evaluation_batch_flag == "--per_device_eval_batch_size"
    # The --bf16 check ran at the evaluation batch it would prescribe.
    (flags,) = [args for args in replayer.asked if args and "--bf16" in args]
    assert flags[flags.index("--per_device_eval_batch_size") + 1] == "58"
    verdicts = {tuple(entry.fixes): entry.verdict for entry in prescription.considered}
    assert verdicts[("autocast",)] == "flags_disagree"
    assert "per_device_eval_batch_size=56" in prescription.snippet
    assert "per_device_train_batch_size" not in prescription.snippet.split("\n")[2]


def test_the_evaluation_batch_is_written_as_the_evaluation_s_knob_in_each_framework():
    snapshot = seq2seq_snapshot()
    context = {"how": "--per_device_eval_batch_size", "command": COMMAND}
    text = framework_of(snapshot).evaluation_batch_snippet(56, context)
    assert "per_device_eval_batch_size=56" in text
    assert (
        f"python {SCRIPT} --per_device_train_batch_size 8 --per_device_eval_batch_size 56" in text
    )
    lightning = Snapshot.from_dict({"framework": {"name": "lightning", "entry": "Trainer"}})
    text = framework_of(lightning).evaluation_batch_snippet(12, {"how": "DataLoader"})
    assert "def val_dataloader" in text and "batch_size=12" in text
    text = framework_of(Snapshot()).evaluation_batch_snippet(12, {"how": "DataLoader"})
    assert "DataLoader(val_set, batch_size=12)" in text and "training batch stays" in text


def test_a_device_without_a_caching_allocator_has_no_drift_when_longer_batches_come_later():
    """On the simulated device reserved is what is allocated: a step that
    peaks higher later (a longer batch, the evaluation) is no fragmentation."""
    steps = Snapshot.from_dict(
        {
            "steps": [
                {"index": i, "peak_allocated_bytes": peak, "peak_reserved_bytes": peak}
                for i, peak in enumerate([75 * MiB, 25 * MiB, 78 * MiB, 31 * MiB, 60 * MiB])
            ]
        }
    ).steps
    assert allocator_drift(steps) == (0, 0)


def test_a_saver_prescribed_at_an_evaluation_batch_is_written_at_that_batch():
    """The savers' command line ran at the failing evaluation batch, 64,
    beside a block at the prescribed one: run as printed, it ran out of
    memory. Both now say 58, and the training batch stays 8."""
    from oomdoc.replay.own_flags import prescription_snippet

    snapshot = seq2seq_snapshot()
    state = ReplayState(
        skipped=[],
        batch_info={"source": "--per_device_eval_batch_size", "original_batch_size": 64},
    )
    prescription = Prescription(fixes=["autocast"], batch_size=58, accumulation_steps=1)
    text = prescription_snippet(snapshot, prescription, state)
    assert "bf16=True" in text and "per_device_eval_batch_size=58" in text
    commands = [line for line in text.splitlines() if line.startswith("python")]
    assert commands and all("--per_device_eval_batch_size 58" in line for line in commands)
    assert all("--per_device_train_batch_size 8" in line for line in commands)
    assert "--bf16" in commands[0]
