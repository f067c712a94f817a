"""The prescription: the measured configuration with the highest throughput
that leaves the safety margin free; no-op fixes are never combined; one with
gradient accumulation is measured with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from oomdoc.analysis import analyse
from oomdoc.model import Prescription, Snapshot
from oomdoc.replay.batch import SearchResult
from oomdoc.replay.candidates import (
    Candidate,
    choose,
    considered,
    pick,
    plan_limits,
    planned_below,
)
from oomdoc.replay.own_flags import verify_with_flags
from oomdoc.replay.plan import ReplayState, is_no_op
from oomdoc.replay.prescription import (
    measured_choice,
    measured_points,
    untimed_savers,
)
from oomdoc.replay.replayer import Replay, ReplaysInterrupted, replay_key
from oomdoc.reporters.tables import prescription_lines

MiB = 1024**2
# A replay's capture that ran an optimizer step and two more micro-batches.
COVERING = Snapshot.from_dict(
    {"step_unit": "optimizer", "steps": [{"index": 0}, {"index": 1, "forward_calls": 2}]}
)


def test_the_fastest_configuration_within_the_margin_wins():
    plain = Candidate([], 58, 190 * MiB, 10.0, "smaller_batch 58")  # 5.8 samples/s, no margin
    checkpointing = Candidate(["checkpointing"], 64, 88 * MiB, 12.0, "checkpointing")  # 5.33
    autocast = Candidate(["autocast"], 64, 145 * MiB, 8.0, "autocast")  # 8.0
    small = Candidate([], 32, 120 * MiB, 7.0, "smaller_batch 32")  # 4.57
    chosen = choose([plain, checkpointing, autocast, small], 64, 192 * MiB, 0.05, reference=plain)
    assert chosen is not None and chosen.fits and chosen.fixes == ["autocast"]
    assert chosen.batch_size == 64 and chosen.accumulation_steps == 1
    assert chosen.samples_per_second == 8.0 and chosen.throughput_ratio == round(8.0 / 5.8, 3)
    assert chosen.headroom_bytes == 47 * MiB and chosen.margin_bytes == int(0.05 * 192 * MiB)


def test_a_smaller_batch_gets_gradient_accumulation_for_the_effective_batch():
    chosen = choose([Candidate([], 20, 15 * MiB, 1.0, "b20")], 64, 20 * MiB, 0.05, reference=None)
    # 64 samples in 4 micro-batches of 16 (a divisor of 64 that fits under 20).
    assert (chosen.batch_size, chosen.accumulation_steps) == (16, 4)


def test_without_room_for_the_margin_the_lowest_peak_is_offered_and_says_so():
    tight = Candidate(["checkpointing"], 64, 190 * MiB, 1.0, "checkpointing")
    tighter = Candidate(["autocast"], 64, 189 * MiB, 2.0, "autocast")
    chosen = choose([tight, tighter], 64, 192 * MiB, 0.05, reference=None)
    assert not chosen.fits and chosen.fixes == ["autocast"]
    assert "safety margin" in chosen.detail
    assert choose([], 64, 192 * MiB, 0.05, reference=None) is None


def test_no_op_fixes():
    need = 100 * MiB
    assert is_no_op(99.5 * MiB, True, None, None, need)  # fits but saved 0.5%
    assert not is_no_op(90 * MiB, True, None, None, need)
    failing = (0, "backward", 16 * MiB, 180 * MiB)
    assert is_no_op(None, False, (0, "backward", 16 * MiB, 180 * MiB + 1000), failing, need)
    # Out of memory later, or with less in use: it helped.
    assert not is_no_op(None, False, (1, "forward", 16 * MiB, 180 * MiB), failing, need)
    assert not is_no_op(None, False, (0, "backward", 16 * MiB, 150 * MiB), failing, need)


class ScriptedReplayer:
    """Stands in for the orchestrator's Replayer: each replay's outcome and
    peak come from a script, and what was asked is kept."""

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.script = list(outcomes)
        self.calls = []
        self.max_steps = 2
        self.options = SimpleNamespace(margin_fraction=0.05, batch_arg=None)
        self.request = SimpleNamespace(args=["--batch-size", "64"])
        self.snapshot = Snapshot()  # the failing run's, as the Replayer keeps it

    def ahead(self, payload, label, args=None, extra_env=None, priority=0, **kwargs):
        return None  # no lanes: nothing starts ahead, as the Replayer without them

    def discard(self, keys, keep_finished=False):
        assert not keys  # nothing was started ahead

    def run(
        self, payload, label, args=None, extra_env=None, micro_batches_per_step=None, timed=True
    ):
        self.calls.append((payload, args, micro_batches_per_step))
        self.untimed = getattr(self, "untimed", []) + ([] if timed else [label])
        outcome, peak, *step_s = self.outcomes.pop(0)
        if outcome == "interrupted":
            raise ReplaysInterrupted()
        return Replay(
            label=label,
            outcome=outcome,
            peak_allocated_bytes=peak,
            step_s=step_s[0] if step_s else None,
            capture=COVERING if outcome == "fits" else None,
        )


def prescribe_with(replayer, candidates):
    snapshot, state = prescription_inputs(replayer, original=64)
    chosen, interrupted = measured_choice(replayer, snapshot, state, candidates, 64, None)
    assert interrupted == ("interrupted" in [outcome for outcome, *_rest in replayer.script])
    return chosen


def test_a_prescription_with_accumulation_is_measured_with_it():
    """The micro-batch's peak without accumulation is not the configuration's:
    one replay runs the prescribed micro-batch with oomdoc's accumulation, for
    two optimizer steps (the script's --steps raised), and its peak is the
    prescription's."""
    replayer = ScriptedReplayer([("fits", 80 * MiB)])
    chosen = prescribe_with(replayer, [Candidate([], 16, 70 * MiB, 1.0, "b16")])
    assert (chosen.batch_size, chosen.accumulation_steps) == (16, 4)
    assert chosen.fits and chosen.accumulation_measured is True
    assert chosen.peak_allocated_bytes == 80 * MiB and chosen.headroom_bytes == 20 * MiB
    ((payload, args, micro_batches),) = replayer.calls
    assert payload == {
        "name": "smaller_batch",
        "batch_size": 16,
        "accumulation_steps": 4,
        "batch_mode": "argv",
    }
    assert args == ["--batch-size", "16", "--steps", "8"] and micro_batches == 4
    assert chosen.accumulation_replay is not None
    assert "--steps raised to 8" in chosen.accumulation_replay["note"]


def test_a_prescription_over_the_margin_with_accumulation_gives_way():
    """b32 x 2 peaks over the margin once accumulating: b48 (the same
    micro-batch of 32) is not tried again, b16 x 4 is measured and prescribed;
    a configuration at the user's own batch needs no second replay."""
    replayer = ScriptedReplayer([("fits", 97 * MiB), ("fits", 70 * MiB)])
    candidates = [
        Candidate([], 48, 90 * MiB, 9.0, "b48"),
        Candidate([], 32, 85 * MiB, 8.0, "b32"),
        Candidate([], 16, 60 * MiB, 4.0, "b16"),
        Candidate(["checkpointing"], 64, 99 * MiB, 100.0, "over the margin at 64"),
    ]
    chosen = prescribe_with(replayer, candidates)
    assert (chosen.batch_size, chosen.accumulation_steps) == (16, 4)
    assert chosen.peak_allocated_bytes == 70 * MiB and chosen.accumulation_measured is True
    assert [call[0]["batch_size"] for call in replayer.calls] == [32, 16]
    assert "batch 32 x 2 accumulation steps" in chosen.detail
    at_own_batch = ScriptedReplayer([])
    chosen = prescribe_with(at_own_batch, [Candidate(["autocast"], 64, 50 * MiB, 1.0, "a")])
    assert chosen.accumulation_steps == 1 and chosen.accumulation_measured is None
    assert at_own_batch.calls == []


@pytest.mark.parametrize("outcome", ["error", "timeout", "interrupted"])
def test_a_failed_replay_with_accumulation_says_the_peak_is_the_micro_batchs(outcome):
    replayer = ScriptedReplayer([(outcome, None)])
    chosen = prescribe_with(replayer, [Candidate([], 32, 60 * MiB, 1.0, "b32")])
    assert chosen.fits and chosen.peak_allocated_bytes == 60 * MiB
    assert chosen.accumulation_measured is False
    assert "the peak is batch 32's without accumulation" in chosen.detail


def test_plan_limits_interpolate_toward_the_next_batch_over_the_margin():
    """Batch 10 peaks at 40 MiB, 20 at 100 MiB (over a 95 MiB limit): about
    6 MiB a sample, so batches up to 19 are predicted to stay within it."""
    ten = Candidate([], 10, 40 * MiB, 1.0, "b10")
    other_fixes = Candidate(["autocast"], 10, 40 * MiB, 1.0, "a10")
    alone = Candidate([], 5, 30 * MiB, 1.0, "b5")
    points = [((), 5, 30 * MiB), ((), 10, 40 * MiB), ((), 20, 100 * MiB), ((), 21, 104 * MiB)]
    plan_limits([ten, other_fixes], points, 95 * MiB)
    assert ten.plan_limit == 19  # 10 + (95 - 40) / 6
    assert other_fixes.plan_limit is None  # nothing measured with autocast above 10
    plan_limits([alone], points, 95 * MiB)
    assert alone.plan_limit is None  # batch 10 is within the limit: a candidate of its own
    # The planned micro-batch is the largest divisor-friendly one up to it.
    chosen = choose([ten], 64, 100 * MiB, 0.05, reference=None)
    assert (chosen.batch_size, chosen.accumulation_steps) == (16, 4)


def test_a_planned_micro_batch_is_prescribed_only_as_measured():
    """Planned 16 x 4 from batch 10's measurements: measured within the
    margin, it is prescribed; over it, 8 x 8 (within batch 10) is measured
    and prescribed instead."""

    def planned():
        candidate = Candidate([], 10, 40 * MiB, 1.0, "b10")
        candidate.plan_limit = 19
        return candidate

    replayer = ScriptedReplayer([("fits", 90 * MiB)])
    chosen = prescribe_with(replayer, [planned()])
    assert (chosen.batch_size, chosen.accumulation_steps) == (16, 4)
    assert chosen.accumulation_measured is True and chosen.peak_allocated_bytes == 90 * MiB
    assert chosen.throughput_batch_size is None  # untimed there: no throughput is made up
    assert chosen.samples_per_second is None
    timed = ScriptedReplayer([("fits", 90 * MiB, 2.0)])
    chosen = prescribe_with(timed, [planned()])
    # Measured at the batch it prescribes: 16 samples per 0.5 s micro-batch.
    assert chosen.samples_per_second == 32.0 and chosen.throughput_batch_size is None
    over = ScriptedReplayer([("fits", 97 * MiB), ("fits", 60 * MiB)])
    chosen = prescribe_with(over, [planned()])
    assert [call[0]["batch_size"] for call in over.calls] == [16, 8]
    assert (chosen.batch_size, chosen.accumulation_steps) == (8, 8)
    assert chosen.peak_allocated_bytes == 60 * MiB and "batch 16 x 4" in chosen.detail
    failed = ScriptedReplayer([("error", None), ("fits", 60 * MiB)])
    chosen = prescribe_with(failed, [planned()])
    assert (chosen.batch_size, chosen.accumulation_steps) == (8, 8)
    assert chosen.accumulation_measured is True


class LanedReplayer(ScriptedReplayer):
    """A ScriptedReplayer with lanes: what is started ahead is kept by key."""

    lanes = object()

    def __init__(self, outcomes):
        super().__init__(outcomes)
        self.started_ahead = []
        self.asked = []
        self.discarded = []

    def ahead(self, payload, label, args=None, extra_env=None, priority=0, **kwargs):
        key = replay_key(
            payload,
            label,
            args,
            extra_env,
            kwargs.get("micro_batches_per_step"),
            kwargs.get("timed", True),
        )
        self.started_ahead.append(key)
        return key

    def discard(self, keys, keep_finished=False):
        self.discarded += keys  # none has run: scripted replays run when asked for

    def run(
        self, payload, label, args=None, extra_env=None, micro_batches_per_step=None, timed=True
    ):
        self.asked.append(
            replay_key(payload, label, args, extra_env, micro_batches_per_step, timed)
        )
        return super().run(payload, label, args, extra_env, micro_batches_per_step, timed)


def hugging_face_case():
    """A Trainer script at batch 64 whose HfArgumentParser declares flags for
    the batch, the accumulation, bf16 and checkpointing."""
    options = [
        "--per_device_train_batch_size",
        "--gradient_accumulation_steps",
        "--max_steps",
        "--bf16",
        "--gradient_checkpointing",
    ]
    snapshot = Snapshot.from_dict(
        {
            "device": {"capacity_bytes": 100 * MiB, "kind": "simulated"},
            "framework": {"name": "transformers", "entry": "Trainer", "module": "transformers"},
            "command": ["train.py", "--per_device_train_batch_size", "64"],
            "script_options": options,
            "script_option_values": {option: [] for option in options},
        }
    )
    state = ReplayState(
        skipped=[],
        batch_info={"source": "--per_device_train_batch_size"},
        search=SearchResult(64, 10, True, [], []),
    )
    replayer = LanedReplayer([("fits", 80 * MiB), ("fits", 80 * MiB)])
    replayer.request = SimpleNamespace(args=["--per_device_train_batch_size", "64"])
    return snapshot, state, replayer


def prescribed_16_x_4(fixes: list[str], **measured) -> Prescription:
    """A prescription of `fixes` at 16 x 4 that fits at 80 MiB."""
    return Prescription(
        fixes=fixes,
        batch_size=16,
        accumulation_steps=4,
        peak_allocated_bytes=80 * MiB,
        fits=True,
        **measured,
    )


def test_the_script_own_flags_check_starts_beside_the_prescription_replay():
    """The check of a prescription with the script's own flags used to start
    only after its replay with accumulation had confirmed it: one more replay
    deep. The choice starts it ahead, beside that replay, exactly as
    verify_with_flags later asks for it."""
    snapshot, state, replayer = hugging_face_case()
    chosen, _interrupted = measured_choice(
        replayer, snapshot, state, [Candidate([], 16, 70 * MiB, 1.0, "b16")], 64, None
    )
    assert (chosen.batch_size, chosen.accumulation_steps) == (16, 4)
    assert len(replayer.started_ahead) == 1 and len(replayer.asked) == 1
    verify_with_flags(replayer, snapshot, chosen, state)
    assert replayer.asked[1] == replayer.started_ahead[0]
    # Timed as the replay with accumulation is: its throughput is the user's.
    assert replayer.asked[1][-1] is True and replayer.asked[0][-1] is True
    assert replayer.untimed == []


def test_the_prescription_s_throughput_is_its_own_flags_replay_s():
    """The script's own flags are what the user runs: their timed replay
    gives the prescription's throughput (on an H200 the Lightning encoder's
    bf16-mixed at 16 x 16: 497.0 samples/s by its flags, 492.9 in a plain
    run, 433.4 in oomdoc's replay of the same changes), and the report
    shows both."""
    snapshot, state, replayer = hugging_face_case()
    replayer.outcomes = [("fits", 80 * MiB, 16 * 4 / 100.0)]  # an optimizer step of 4 x 16
    prescription = prescribed_16_x_4(
        ["autocast"], samples_per_second=140.0, samples_per_second_noise=0.01, throughput_ratio=2.8
    )
    verify_with_flags(replayer, snapshot, prescription, state)
    checked = prescription.verified_by_flags
    assert checked.samples_per_second == 100.0 and checked.replay_samples_per_second == 140.0
    assert prescription.samples_per_second == 100.0
    assert prescription.throughput_ratio == 2.0  # rebased with it
    snapshot.prescription = prescription
    lines = prescription_lines(analyse(snapshot))
    line = next(line for line in lines if "own flags" in line)
    assert "100.0 samples/s (oomdoc's own replay of these changes: 140.0)" in line, line
    assert any(line.startswith("  throughput 100.0 samples/s") for line in lines), lines


def test_a_bound_measured_slower_gives_way_to_the_fastest_measured():
    """Issue 24's case: batch 7 ran 26.2 samples/s without accumulation, but
    the prescription would be 4 x 4, which runs slower. Measured at 4 x 4
    (21.9), it gives way to checkpointing at the user's batch (24.0)."""
    plain = Candidate([], 7, 70 * MiB, 7 / 26.2, "b7")
    checkpointing = Candidate(["checkpointing"], 16, 60 * MiB, 16 / 24.0, "c16", exact=True)
    replayer = ScriptedReplayer([("fits", 50 * MiB, 4 * 4 / 21.9)])
    measured = []
    snapshot, state = prescription_inputs(replayer, original=16)
    chosen, _ = measured_choice(
        replayer, snapshot, state, [plain, checkpointing], 16, None, measured
    )
    assert chosen.fixes == ["checkpointing"] and chosen.batch_size == 16
    assert chosen.samples_per_second == 24.0
    assert [call[0]["batch_size"] for call in replayer.calls] == [4]
    assert [(c.batch_size, c.accumulation_steps, c.exact) for c in measured] == [(4, 4, True)]
    entries = considered(
        [(), ("checkpointing",)], [plain, checkpointing, *measured], chosen, {}, 16, 95 * MiB, True
    )
    assert [(entry.fixes, entry.verdict, entry.measured) for entry in entries] == [
        (["checkpointing"], "prescribed", True),
        ([], "slower", True),
    ]
    assert entries[1].batch_size == 4 and entries[1].accumulation_steps == 4


def test_a_bound_below_the_best_measured_is_not_replayed_and_says_why():
    fast = Candidate(["autocast", "checkpointing"], 16, 60 * MiB, 16 / 41.1, "ac16", exact=True)
    plain = Candidate([], 7, 70 * MiB, 7 / 26.2, "b7")
    replayer = ScriptedReplayer([])
    snapshot, state = prescription_inputs(replayer, original=16)
    chosen, _ = measured_choice(replayer, snapshot, state, [plain, fast], 16, None)
    assert chosen.fixes == ["autocast", "checkpointing"] and replayer.calls == []
    entries = considered(
        [(), ("autocast", "checkpointing")], [plain, fast], chosen, {}, 16, 95 * MiB, True
    )
    assert entries[1].verdict == "slower" and not entries[1].measured
    assert "bounds it from above" in entries[1].reason


def test_a_configuration_over_the_margin_is_listed_at_the_plan_it_would_have():
    """A Fabric language model at batch 64: autocast never fit above no
    fix's largest batch, 11, which left the margin short; its entry was
    "autocast 8 x 1", a plan that trains on 8 samples a step instead of 64."""
    plain = Candidate([], 10, 80 * MiB, 10 / 8.0, "b10")
    autocast = Candidate(["autocast"], 8, 96 * MiB, None, "a", plan_limit=11)
    chosen = Prescription(fixes=[], batch_size=8, accumulation_steps=8, fits=True)
    chosen.samples_per_second = 8.0
    entries = considered([(), ("autocast",)], [plain, autocast], chosen, {}, 64, 95 * MiB, True)
    over = next(entry for entry in entries if entry.fixes == ["autocast"])
    assert over.verdict == "over_margin"
    assert (over.batch_size, over.accumulation_steps) == (8, 8)


def test_a_saver_that_never_fit_is_not_said_to_have_run_over_the_margin():
    """karpathy/makemore at -b 1024: autocast ran only at 1024 and ran out of
    memory; its candidate at no fix's micro-batch, taken to need no fix's
    peak, was listed as "every batch it ran left the safety margin short"."""
    plain = Candidate([], 516, 99 * MiB, 516 / 500.0, "b516")
    autocast = Candidate(["autocast"], 512, 99 * MiB, None, "a", untimed=True)
    chosen = Prescription(fixes=[], batch_size=256, accumulation_steps=4, fits=True)
    chosen.samples_per_second = 515.0
    entries = considered([(), ("autocast",)], [plain, autocast], chosen, {}, 1024, 95 * MiB, True)
    over = next(entry for entry in entries if entry.fixes == ["autocast"])
    assert over.verdict == "over_margin" and not over.measured
    assert over.reason.startswith("not measured: no batch it ran fit"), over.reason


def test_throughputs_within_the_timing_noise_prefer_fewer_changes():
    one = Candidate(["checkpointing"], 16, 60 * MiB, 16 / 40.0, "c", exact=True, step_noise=0.03)
    two = Candidate(["autocast", "checkpointing"], 16, 50 * MiB, 16 / 41.0, "ac", exact=True)
    chosen = choose([two, one], 16, 100 * MiB, 0.05, reference=None)
    assert chosen.fixes == ["checkpointing"]
    clearly = Candidate(["autocast", "checkpointing"], 16, 50 * MiB, 16 / 48.0, "ac", exact=True)
    assert choose([clearly, one], 16, 100 * MiB, 0.05, reference=None).fixes == [
        "autocast",
        "checkpointing",
    ]


def prescription_inputs(replayer, original):
    snapshot = Snapshot.from_dict(
        {
            "device": {"capacity_bytes": 100 * MiB},
            "script_options": ["--batch-size", "--steps"],
            "script_option_values": {"--batch-size": [], "--steps": []},
        }
    )
    replayer.snapshot = snapshot
    replayer.request = SimpleNamespace(args=["--batch-size", str(original)])
    return snapshot, ReplayState(skipped=[], batch_info={"source": "--batch-size"})


def test_a_configuration_over_the_margin_plans_a_smaller_micro_batch_to_measure():
    """Batches 57 and 58 fit but leave the margin short (limit 182 MiB): on
    the line through them (3 MiB a sample), 32 x 2 peaks near 112 MiB: a
    candidate, its throughput bounded by batch 57's, to be measured."""
    b57 = Candidate([], 57, 187 * MiB, 0.57, "b57")
    b58 = Candidate([], 58, 190 * MiB, 0.58, "b58")
    saver = Candidate(["checkpointing"], 64, 90 * MiB, 0.8, "c")
    points = [((), 57, 187 * MiB), ((), 58, 190 * MiB), ((), 59, 193 * MiB)]
    (planned,) = planned_below([b57, b58, saver], points, 64, 182 * MiB)
    assert (planned.fixes, planned.batch_size) == ([], 32)
    assert planned.peak_allocated_bytes == 112 * MiB and not planned.exact
    assert planned.samples_per_second == b57.samples_per_second  # a bound from above
    assert planned_below([b57], [((), 57, 187 * MiB)], 64, 182 * MiB) == []  # no slope


def test_a_noisy_timing_against_a_close_rival_is_taken_again():
    """Autocast at the user's batch measured 10.0 samples/s +-20%, checkpointing
    9.5: too close to tell, so autocast's replay runs once more; pooled with
    the second timing (8 samples/s), checkpointing is faster."""
    timed_again = []

    def again():
        timed_again.append(True)
        return Replay(label="a again", outcome="fits", peak_allocated_bytes=50 * MiB, step_s=2.0)

    noisy = Candidate(["autocast"], 16, 50 * MiB, 1.6, "a", exact=True, step_noise=0.2)
    noisy.remeasure = again
    rival = Candidate(["checkpointing"], 16, 40 * MiB, 16 / 9.5, "c", exact=True, step_noise=0.02)
    replayer = ScriptedReplayer([])
    snapshot, state = prescription_inputs(replayer, original=16)
    chosen, _ = measured_choice(replayer, snapshot, state, [noisy, rival], 16, None)
    assert timed_again == [True] and noisy.retimed
    assert noisy.step_s == 1.8 and noisy.step_noise == 0.1111
    assert chosen.fixes == ["checkpointing"]
    # A clear winner is not timed again.
    clear = Candidate(["autocast"], 16, 50 * MiB, 0.8, "a", exact=True, step_noise=0.2)
    clear.remeasure = again
    measured_choice(replayer, snapshot, state, [clear, rival], 16, None)
    assert timed_again == [True]


def test_a_planned_micro_batch_over_the_margin_plans_the_next_smaller_one():
    """The H100 case: autocast fit at batch 9 just over the margin, so 8 x 2
    was planned; measured with the accumulation it went over too (97 MiB,
    the limit is 95): 4 x 4 is planned down from it and measured; the report
    lists autocast as measured at 4 x 4, never the superseded 8 x 2."""
    nine = Candidate(["autocast"], 9, 96 * MiB, 9 / 90.0, "a9")
    both = Candidate(["autocast", "checkpointing"], 16, 50 * MiB, 16 / 80.0, "ac", exact=True)
    replayer = ScriptedReplayer(
        [("fits", 97 * MiB, 2 * 8 / 88.0), ("fits", 85 * MiB, 4 * 4 / 85.0)]
    )
    snapshot, state = prescription_inputs(replayer, original=16)
    state.saver_searches[("autocast",)] = SearchResult(
        16, 9, True, [saver_run(9, 96 * MiB), saver_run(10, 106 * MiB, fits=False)], []
    )
    candidates = [nine, both, *planned_below([nine, both], measured_points(state), 16, 95 * MiB)]
    measured = []
    chosen, _ = measured_choice(replayer, snapshot, state, candidates, 16, None, measured)
    assert [call[0]["batch_size"] for call in replayer.calls] == [8, 4]
    assert chosen.fixes == ["autocast"] and (chosen.batch_size, chosen.accumulation_steps) == (4, 4)
    assert chosen.samples_per_second == 85.0 and chosen.peak_allocated_bytes == 85 * MiB
    entries = considered(
        [(), ("autocast",), ("autocast", "checkpointing")],
        candidates + measured,
        chosen,
        {},
        16,
        95 * MiB,
        True,
    )
    autocast = next(entry for entry in entries if entry.fixes == ["autocast"])
    assert autocast.verdict == "prescribed" and autocast.batch_size == 4 and autocast.measured


def saver_run(batch_size, peak, fits=True):
    from oomdoc.replay.batch import BatchRun

    run = BatchRun(batch_size=batch_size, fits=fits, peak_allocated_bytes=peak)
    if not fits:
        run.lower_bounds[("first", "forward")] = peak
    return run


def test_a_saver_that_fit_nowhere_above_the_plain_batch_is_measured_at_its_micro_batch():
    """Lightning's encoder on the H100: no batch above no fix's largest (24)
    fit under autocast or checkpointing. Autocast may still be faster at
    no fix's micro-batch (16 x 16): it is measured there before anything is
    prescribed, and wins; checkpointing there only adds work: not measured,
    with the reason."""
    plain = SearchResult(256, 24, True, [saver_run(24, 90 * MiB)], [])
    plain.trials[0].step_s = 24 / 71.0
    plain.trials[0].replay = Replay(label="b24", outcome="fits")
    replayer = ScriptedReplayer([("fits", 80 * MiB, 16 * 16 / 130.0)])
    snapshot, state = prescription_inputs(replayer, original=256)
    state.search = plain
    state.saver_searches[("autocast",)] = SearchResult(
        256, None, False, [saver_run(57, 99 * MiB, False)], []
    )
    state.saver_searches[("checkpointing",)] = SearchResult(
        256, None, False, [saver_run(80, 99 * MiB, False)], []
    )
    untimed = untimed_savers(state, 256, True)
    assert [(c.fixes, c.batch_size, c.untimed) for c in untimed] == [(["autocast"], 16, True)]
    assert "only adds work" in state.not_searched[("checkpointing",)]
    bound = Candidate([], 24, 90 * MiB, 24 / 71.0, "b24")
    chosen, _ = measured_choice(replayer, snapshot, state, [bound, *untimed], 256, None)
    assert [call[0]["batch_size"] for call in replayer.calls] == [16]
    assert chosen.fixes == ["autocast"] and (chosen.batch_size, chosen.accumulation_steps) == (
        16,
        16,
    )
    assert chosen.samples_per_second == 130.0 and chosen.accumulation_measured is True
    # Never prescribed unmeasured: when its replay fails, the rest decide.
    failing = ScriptedReplayer([("error", None), ("fits", 70 * MiB, 16 * 16 / 60.0)])
    snapshot, state = prescription_inputs(failing, original=256)
    chosen, _ = measured_choice(
        failing, snapshot, state, [bound, *untimed_again(untimed)], 256, None
    )
    assert chosen.fixes == []


def untimed_again(candidates):
    return [
        Candidate(c.fixes, c.batch_size, c.peak_allocated_bytes, None, c.label, untimed=True)
        for c in candidates
    ]


def test_a_planned_micro_batch_whose_replay_ended_too_soon_is_not_prescribed():
    """The word-LM case: 8 x 8 planned below batch 9 (over the margin); its
    replay ended before an optimizer step and two more micro-batches, so its
    low peak says nothing (by hand it peaked over batch 9's): not prescribed."""
    nine = Candidate([], 9, 96 * MiB, 9 / 100.0, "b9")
    planned = Candidate([], 8, 90 * MiB, 8 / 100.0, "p8", planned_from=9)
    replayer = ScriptedReplayer([("fits", 85 * MiB, 1.0)])
    replayer.script = []  # (not an interruption)
    short = Replay(label="p", outcome="fits", peak_allocated_bytes=85 * MiB, step_s=1.0)
    replayer.run = lambda *args, **kwargs: short  # no capture: it covered nothing
    snapshot, state = prescription_inputs(replayer, original=64)
    chosen, _ = measured_choice(replayer, snapshot, state, [nine, planned], 64, None)
    assert not chosen.fits and chosen.peak_allocated_bytes == 96 * MiB  # the closest measured
    assert "its peak is not known" in chosen.detail


def test_a_script_that_updates_by_hand_is_prescribed_with_its_gradients_on_top():
    """pytorch/examples' word language model (no optimizer) on the H200:
    autocast + checkpointing fit at the user's 128 (1674.8 samples/s); no
    autocast batch fit above no fix's 94, so autocast at 64 x 2 was replayed
    and fit at 0.0346 s a step. Its replay updates after each micro-batch (a
    step is a backward): the peak claimed adds the gradients the user's
    accumulation keeps alive, and a step is one micro-batch, not two. It was
    rejected as of unknown peak, and would have been counted twice as fast."""
    by_hand = Snapshot.from_dict(
        {
            "step_unit": "backward",
            "steps": [{"index": 0}, {"index": 1}, {"index": 2}],
            "category_peaks": {"gradients": 4 * MiB},
        }
    )
    both = Candidate(["autocast", "checkpointing"], 128, 95 * MiB, 128 / 1674.8, "a+c", exact=True)
    autocast = Candidate(["autocast"], 64, 93 * MiB, None, "a at no fix's 94", untimed=True)
    replayer = ScriptedReplayer([])
    measured = Replay(
        label="p", outcome="fits", peak_allocated_bytes=87 * MiB, step_s=0.0346, capture=by_hand
    )
    replayer.run = lambda *args, **kwargs: measured
    snapshot, state = prescription_inputs(replayer, original=128)
    chosen, _ = measured_choice(replayer, snapshot, state, [both, autocast], 128, None)
    assert chosen.fixes == ["autocast"]
    assert (chosen.batch_size, chosen.accumulation_steps) == (64, 2)
    assert chosen.peak_allocated_bytes == 91 * MiB  # 87 and the gradients' 4
    assert chosen.samples_per_second == pytest.approx(64 / 0.0346, rel=1e-3)
    assert "updates by hand" in chosen.detail
    # Without the gradients' peak its replay shows nothing of the later
    # micro-batches: not prescribed, as before.
    measured.capture = Snapshot.from_dict({"step_unit": "backward", "steps": [{"index": 0}]})
    chosen, _ = measured_choice(replayer, snapshot, state, [both, autocast], 128, None)
    assert chosen.fixes == ["autocast", "checkpointing"]
    assert "its peak is not known" in chosen.detail
    # The configurations weighed say why, not that its replay did not run.
    entries = considered([("autocast",)], [both, autocast], chosen, {}, 128, 95 * MiB, True)
    assert entries[0].verdict == "not_measured"
    assert entries[0].reason.endswith(
        "micro-batch did not count: its replay ended before an optimizer step and two more "
        "micro-batches, so its peak is not known"
    )


def test_the_runner_up_is_replayed_as_prescribed_beside_the_first_choice():
    """Both bounds need a replay with accumulation, and no check of the
    first shares the device (the script has no flags to check it with);
    should the first be measured slower, the next is asked for next: it was
    started beside it, under the very key the choice then asks for."""
    plain = Candidate([], 7, 70 * MiB, 7 / 26.2, "b7")
    autocast = Candidate(["autocast"], 12, 60 * MiB, 12 / 25.0, "a12")
    replayer = LanedReplayer([("fits", 50 * MiB, 4 * 4 / 21.9), ("fits", 55 * MiB, 2 * 8 / 24.5)])
    snapshot, state = prescription_inputs(replayer, original=16)
    chosen, _ = measured_choice(replayer, snapshot, state, [plain, autocast], 16, None)
    assert chosen.fixes == ["autocast"] and (chosen.batch_size, chosen.accumulation_steps) == (8, 2)
    assert len(replayer.asked) == 2
    assert replayer.asked[1] in replayer.started_ahead  # started beside the first
    assert replayer.asked[0] not in replayer.started_ahead


def test_an_allocator_setting_is_verified_with_the_script_s_own_flags_in_its_environment():
    """expandable_segments has no flag: the script's own flags for the rest
    run with PYTORCH_CUDA_ALLOC_CONF set (before, no check ran at all), and
    the report prints the setting before the flags."""
    snapshot, state, replayer = hugging_face_case()
    prescription = prescribed_16_x_4(["expandable_segments"])
    verify_with_flags(replayer, snapshot, prescription, state)
    checked = prescription.verified_by_flags
    assert checked is not None and checked.outcome == "fits"
    assert checked.covers == ["expandable_segments", "smaller_batch"]
    assert checked.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    # Asked for with the environment set.
    assert replayer.asked[0][3] == (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
    snapshot.prescription = prescription
    line = next(line for line in prescription_lines(analyse(snapshot)) if "own flags" in line)
    assert (
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --per_device_train_batch_size 16" in line
    )


def test_a_prescription_near_a_drifting_largest_batch_starts_its_expandable_checks_ahead():
    """On the H100 the HF Trainer's largest batch drifted at the allocator's
    defaults; its prescription 8 x 4 then drifted too, and its replay with
    expandable segments and that one's own-flags check ran one after another
    at the end of the diagnosis. Now both start beside the replay with
    accumulation, with exactly the keys the drift's refusal and the flags
    check ask for; without the drift, only the own-flags check starts."""
    from oomdoc.replay.fragmentation import with_expandable_segments
    from oomdoc.replay.own_flags import flags_replay
    from oomdoc.replay.prescription import prescription_replay, start_checks_ahead

    def flags_key(flags):  # timed: its throughput is the prescription's
        return replay_key(
            None, flags.label, flags.replayed_args, flags.env or None, flags.micro_batches_per_step
        )

    snapshot, state, replayer = hugging_face_case()
    snapshot.device.kind = "cuda"
    chosen = Prescription(fixes=[], batch_size=16, accumulation_steps=4)
    start_checks_ahead(replayer, snapshot, state, chosen)
    assert replayer.started_ahead == [flags_key(flags_replay(replayer, snapshot, state, chosen))]

    replayer.started_ahead.clear()
    state.defaults_drift_bytes, state.defaults_drift_peak_bytes = 454 * MiB, 90 * MiB
    chosen.peak_allocated_bytes = 50 * MiB  # far below the drifting peak: not expected to drift
    start_checks_ahead(replayer, snapshot, state, chosen)
    assert replayer.started_ahead == [flags_key(flags_replay(replayer, snapshot, state, chosen))]
    replayer.started_ahead.clear()
    chosen.peak_allocated_bytes = 80 * MiB
    start_checks_ahead(replayer, snapshot, state, chosen)
    trial = with_expandable_segments(chosen)
    payload, label, args, env, micro_batches, _raised = prescription_replay(
        replayer, snapshot, state, trial.fixes, 16, 4
    )
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    flags = flags_replay(replayer, snapshot, state, trial)
    assert flags.env == env
    assert replayer.started_ahead == [
        replay_key(payload, label, args, env, micro_batches, timed=False),  # a certificate check
        flags_key(flags),
    ]
    # Not when --fixes leaves the setting out, nor off CUDA.
    own_flags_only = [flags_key(flags_replay(replayer, snapshot, state, chosen))]
    replayer.started_ahead.clear()
    replayer.options.fixes = ["autocast"]
    start_checks_ahead(replayer, snapshot, state, chosen)
    assert replayer.started_ahead == own_flags_only
    replayer.started_ahead.clear()
    replayer.options.fixes = None
    snapshot.device.kind = "simulated"
    start_checks_ahead(replayer, snapshot, state, chosen)
    assert replayer.started_ahead == own_flags_only


def choice_near_a_drifting_batch(plain_bound, autocast_bound, measured):
    """The choice between no fix at 16 (x 4) and autocast at 32 (x 2), both
    bounds in samples/s, on CUDA after the plain largest batch (75 MiB) drifted
    at the allocator's defaults; `measured`: each one's samples/s with its
    accumulation, in the order measured."""
    snapshot, state, replayer = hugging_face_case()
    snapshot.device.kind = "cuda"
    state.defaults_drift_bytes, state.defaults_drift_peak_bytes = 454 * MiB, 75 * MiB
    replayer.outcomes = [("fits", 80 * MiB, 64 / rate) for rate in measured]
    plain = Candidate([], 16, 70 * MiB, 16 / plain_bound, "b16")
    autocast = Candidate(["autocast"], 32, 66 * MiB, 32 / autocast_bound, "a32")
    chosen, _ = measured_choice(replayer, snapshot, state, [plain, autocast], 64, None)
    return snapshot, state, replayer, chosen


def test_the_checks_start_beside_the_choice_and_no_runner_up_shares_the_device_with_them():
    """The first choice's checks (its replay with expandable segments, its
    own-flags run) start beside its replay with accumulation; the runner-up
    (the one the choice asks for next should it be measured slower) does
    not: its timed steps would take the device in turns with them (on the
    H100 the prescription's replays took 16 to 18.5 s with it, 12 to 12.7 s
    without, and it was never used). Once the choice is made, the checks of
    the other configurations are discarded (not as the choice moves on: a
    first choice measured again after a runner-up may still be prescribed)."""
    from oomdoc.replay.prescription import start_checks_ahead

    snapshot, state, replayer, chosen = choice_near_a_drifting_batch(
        plain_bound=26.2, autocast_bound=25.0, measured=(21.9, 24.5)
    )
    assert chosen.fixes == ["autocast"] and (chosen.batch_size, chosen.accumulation_steps) == (
        32,
        2,
    )
    first_checks = replayer.started_ahead[:2]
    assert [key[0] for key in first_checks] == [
        "the prescription (expandable_segments, batch 16 x 4 accumulation steps)",
        "the script's own flags: --per_device_train_batch_size 16 --gradient_accumulation_steps 4 "
        "--max_steps 8 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ]
    # The runner-up was asked for once the first choice measured slower: not ahead.
    assert replayer.asked[1] not in replayer.started_ahead
    assert replayer.discarded == first_checks
    probe = LanedReplayer([])
    probe.request, probe.options = replayer.request, replayer.options
    assert replayer.started_ahead[2:] == start_checks_ahead(probe, snapshot, state, chosen)


def test_a_first_choice_prescribed_after_its_runner_up_keeps_the_checks_it_started():
    """No fix at 16 x 4 is measured first (25 samples/s); autocast's bound
    (30) is measured next and runs slower (20): no fix is prescribed, and
    its checks started beside its replay are the ones kept; autocast's go."""
    _snapshot, _state, replayer, chosen = choice_near_a_drifting_batch(
        plain_bound=32.0, autocast_bound=30.0, measured=(25.0, 20.0)
    )
    assert chosen.fixes == [] and (chosen.batch_size, chosen.accumulation_steps) == (16, 4)
    plain_checks = replayer.started_ahead[:2]
    autocast_checks = replayer.started_ahead[2:]
    assert [key[0] for key in autocast_checks][0].startswith(
        "the prescription (autocast + expandable_segments, batch 32 x 2"
    )
    assert replayer.discarded == autocast_checks
    assert not set(plain_checks) & set(replayer.discarded)


def test_an_evaluation_batch_s_prescription_says_its_throughput_is_the_training_s():
    """An OOM in evaluation is prescribed an evaluation batch, ranked by the
    training steps' throughput (Candidate.trained_per_step): the report says
    so, or the number reads as the evaluation's."""
    snapshot, _state, _replayer = hugging_face_case()
    prescription = Prescription(
        fixes=[], batch_size=54, accumulation_steps=1, fits=True, samples_per_second=12.5
    )
    snapshot.prescription = prescription
    assert "  throughput 12.5 samples/s" in prescription_lines(analyse(snapshot))
    prescription.evaluation_batch_flag = "--per_device_eval_batch_size"
    assert "  training throughput 12.5 samples/s" in prescription_lines(analyse(snapshot))


def imagenet_candidates():
    """pytorch/examples' ImageNet trainer (ResNet-50, batch 1024) on the
    H200 under 16 GiB, scaled to 100 MiB: no fix ran batch 69 at 1234.5
    samples/s, within the margin, and batch 191 over it, so its plan is
    16 x 64 here (user's batch 1024, plan limit 17); autocast was measured
    as prescribed at 256 x 4."""
    plain = Candidate([], 8, 40 * MiB, 8 / 1234.5, "b8", plan_limit=17)
    autocast = Candidate(["autocast"], 256, 70 * MiB, 256 / 2340.4, "a256", exact=True)
    autocast.accumulation_steps = 4
    return plain, autocast


def test_a_candidate_planned_above_the_batch_it_ran_is_weighed_by_what_it_could_run_there():
    """Batch 8's 1234.5 samples/s is no bound for the micro-batch of 16
    planned from it: 16 samples take no less than batch 8's step, so at most
    2469 samples/s, which beats autocast's 2340.4, and it is measured as
    prescribed before autocast is prescribed."""
    plain, autocast = imagenet_candidates()
    picked, fits = choose_pick([plain, autocast], original=1024)
    assert picked is plain and fits
    assert choose_pick([plain, autocast], original=None)[0] is autocast  # as it ran
    replayer = ScriptedReplayer([("fits", 60 * MiB, 64 * 16 / 2000.0)])
    snapshot, state = prescription_inputs(replayer, original=1024)
    measured = []
    chosen, _ = measured_choice(replayer, snapshot, state, [plain, autocast], 1024, None, measured)
    assert [call[0]["batch_size"] for call in replayer.calls] == [16]
    assert chosen.fixes == ["autocast"] and chosen.samples_per_second == pytest.approx(2340.4)
    entries = considered(
        [(), ("autocast",)], [plain, autocast, *measured], chosen, {}, 1024, 95 * MiB, True
    )
    assert [(entry.fixes, entry.verdict, entry.measured) for entry in entries] == [
        (["autocast"], "prescribed", True),
        ([], "slower", True),
    ]
    assert entries[1].samples_per_second == pytest.approx(2000.0)


def test_a_bound_planned_above_the_batch_it_ran_says_how_far_it_reaches():
    plain, autocast = imagenet_candidates()
    plain.step_s = 8 / 1000.0  # at most 2000 at 16: below autocast, not replayed
    replayer = ScriptedReplayer([])
    snapshot, state = prescription_inputs(replayer, original=1024)
    chosen, _ = measured_choice(replayer, snapshot, state, [plain, autocast], 1024, None)
    assert chosen.fixes == ["autocast"] and replayer.calls == []
    entries = considered([(), ("autocast",)], [plain, autocast], chosen, {}, 1024, 95 * MiB, True)
    assert (entries[1].batch_size, entries[1].accumulation_steps) == (16, 64)
    assert entries[1].samples_per_second == pytest.approx(2000.0) and not entries[1].measured
    assert entries[1].reason == (
        "not measured at batch 16 x 64: batch 8 ran 1000.0 samples/s, and a step over 16 "
        "samples is never shorter: at most 2000.0, below the prescription's 2340.4"
    )


def choose_pick(candidates, original):
    return pick(candidates, 100 * MiB, 0.05, original)
