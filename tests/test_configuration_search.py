"""The prescription's search over configurations: which savers are combined,
which configurations cannot win (and why), and the step timings the choice
rests on (their noise; ratios that cannot be)."""

from __future__ import annotations

from oomdoc.fixes import fix_named
from oomdoc.model import FixResult, Snapshot, Step
from oomdoc.replay.orchestrate import shape_warmup_note, time_ratio
from oomdoc.replay.plan import ReplayState, combination_to_measure
from oomdoc.replay.replayer import Replay
from oomdoc.replay.search import dominated, only_adds_work
from oomdoc.replay.timing import (
    StepTiming,
    cannot_be_faster,
    ratio_noise,
    step_timing,
)

MiB = 1024**2


def steps(*durations):
    return [Step(index=index, duration_s=duration) for index, duration in enumerate(durations)]


def test_a_timing_is_the_median_of_the_steps_after_the_first_and_their_spread():
    timing = step_timing(steps(9.0, 1.0, 1.2, 0.8))
    assert timing == StepTiming(1.0, 0.2, 3)
    assert step_timing(steps(9.0, 2.0)) == StepTiming(2.0, None, 1)  # one timed step: unseen
    assert step_timing(steps(9.0)) == StepTiming(9.0, None, 1)
    # One slow step (an epoch's end) does not make the timing noisy.
    assert step_timing(steps(9.0, 1.0, 1.02, 3.0)) == StepTiming(1.02, 0.0196, 3)
    assert step_timing([]) is None


def test_a_replay_s_record_keeps_the_step_durations_its_timing_came_from():
    """The snapshot's replay runs say which step was slow, not only the
    median: what the flags timings that decide were made of."""
    capture = Snapshot(steps=steps(9.0, 0.17, 0.16, 0.27))
    replay = Replay("flags", "fits", step_s=0.17, step_noise=0.0588, capture=capture)
    record = replay.timing()
    assert record["step_s"] == 0.17 and record["step_noise"] == 0.0588
    assert record["timed_steps_s"] == [0.17, 0.16, 0.27]  # the first step is never timed
    assert "timed_steps_s" not in Replay("b8", "oom").timing()
    # Every step, the untimed first ones too: where a replay's time went.
    assert record["steps_s"] == [9.0, 0.17, 0.16, 0.27]
    assert "steps_cpu_wait_s" not in record  # not kept in this capture
    capture.steps[1].cpu_wait_s = 0.0504
    assert replay.timing()["steps_cpu_wait_s"] == [0.05]
    assert "steps_s" not in Replay("b8", "oom").timing()


def test_a_ratio_carries_the_noise_of_both_timings():
    assert ratio_noise(0.03, 0.04) == 0.05
    assert ratio_noise(None, None) == round((2 * 0.05**2) ** 0.5, 4)  # unseen: 5% each
    assert cannot_be_faster(0.82, 0.05) and not cannot_be_faster(0.97, 0.05)
    assert not cannot_be_faster(0.85, 0.2)  # within its noise


def test_a_saver_that_only_adds_work_on_top_of_one_that_fits_cannot_win():
    assert only_adds_work(("checkpointing",)) and not only_adds_work(("autocast",))
    assert not only_adds_work(("lighter_optimizer",))  # cheaper state updates: not only work
    reason = dominated(("autocast", "checkpointing"), [("autocast",)])
    assert reason and "autocast already fits" in reason and "checkpointing only adds" in reason
    # Autocast can make a step faster: on top of checkpointing it is measured.
    assert dominated(("autocast", "checkpointing"), [("checkpointing",)]) is None
    assert dominated(("checkpointing",), []) is None


def test_autocast_is_combined_whatever_it_did_alone():
    """Autocast that saved nothing measurable alone (it ran out of memory
    early in the forward, or fit with the same peak) is still combined with
    the savers that helped: together they may fit and be the fastest."""
    snapshot = Snapshot.from_dict(
        {
            "device": {"capacity_bytes": 100 * MiB},
            "oom": {"allocated_bytes": 99 * MiB, "requested_bytes": 2 * MiB, "step": 0},
        }
    )
    need = snapshot.oom.needed_bytes
    state = ReplayState(skipped=[])
    for name, peak in (("autocast", need - 1), ("checkpointing", 60 * MiB)):
        state.results.append(FixResult(name=name, fits=True, peak_allocated_bytes=peak))
        state.replays[name] = Replay(label=name, outcome="fits", peak_allocated_bytes=peak)
        state.applied.add(name)
    assert combination_to_measure(snapshot, state) == "autocast+checkpointing"
    state.applied.discard("autocast")  # it did not apply (no model ran): not combined
    assert combination_to_measure(snapshot, state) is None


def test_a_step_time_ratio_that_cannot_be_is_flagged_not_used():
    reference = StepTiming(1.0, 0.02, 3)
    checkpointing = FixResult(name="checkpointing", fits=True, step_s=0.8)
    time_ratio(checkpointing, fix_named("checkpointing"), reference, 0.03, same_batch=True)
    assert checkpointing.step_time_ratio is None and checkpointing.step_time_noise == 0.03
    assert "0.80x" in (checkpointing.step_time_flag or "")
    # Against a smaller batch scaled up, a larger batch may truly be faster per sample.
    scaled = FixResult(name="checkpointing", fits=True, step_s=0.8)
    time_ratio(scaled, fix_named("checkpointing"), reference, 0.03, same_batch=False)
    assert scaled.step_time_ratio == 0.8 and scaled.step_time_flag is None
    autocast = FixResult(name="autocast", fits=True, step_s=0.6)
    time_ratio(autocast, fix_named("autocast"), reference, 0.03, same_batch=True)
    assert autocast.step_time_ratio == 0.6 and autocast.step_time_flag is None


def test_a_saver_whose_estimated_largest_batch_gives_no_larger_micro_batch_is_not_searched():
    """Lightning's encoder on the H100: the logits fill the memory, so
    checkpointing's replay at batch 256 estimates its largest batch at 20,
    whose micro-batch (even 25% larger) is no fix's 16: checkpointing only
    adds work there. Autocast can be faster at the same micro-batch: searched."""
    from oomdoc.replay.batch import BatchRun
    from oomdoc.replay.search import estimated_no_larger

    run = BatchRun(batch_size=256, fits=False, estimated_max=20)
    reason = estimated_no_larger(("checkpointing",), run, {(): 16}, 256)
    assert reason and "estimated at 20" in reason and "no fix does (16)" in reason
    assert estimated_no_larger(("autocast",), run, {(): 16}, 256) is None
    run.estimated_max = 60  # micro-batches of 64 possible: searched
    assert estimated_no_larger(("checkpointing",), run, {(): 16}, 256) is None
    run.estimated_max = None
    assert estimated_no_larger(("checkpointing",), run, {(): 16}, 256) is None
    # Ruled out only by what its OOM showed: the estimate without the
    # tensors still to come past the blocks (the logits' copies) decides.
    run.estimated_max, run.estimated_max_bound = 20, 60
    assert estimated_no_larger(("checkpointing",), run, {(): 16}, 256) is None
    run.estimated_max_bound = 20
    assert estimated_no_larger(("checkpointing",), run, {(): 16}, 256)


def test_a_search_above_an_assumed_floor_bisects_while_nothing_fits():
    """Lightning's encoder on the H100: under autocast nothing above no fix's
    largest batch (24) fits. The lower bounds of the OOMs alone put every
    prediction just under the last OOM (57, 56, 55, 54 were tried); above
    the floor the search bisects instead, and stops once any largest batch
    left gives the same prescription."""
    from oomdoc.replay.batch import BatchRun, accumulation_plan, search_max_batch

    asked = []

    def trial(batch_size):
        asked.append(batch_size)
        run = BatchRun(batch_size=batch_size, fits=False)
        run.lower_bounds[("first", "forward")] = 300 * MiB * batch_size
        return run

    def enough(fit, oom):
        settled = accumulation_plan(256, fit) == accumulation_plan(256, oom - 1)
        return "settled" if settled else None

    at_original = BatchRun(batch_size=256, fits=False)
    at_original.lower_bounds[("first", "forward")] = 16 * 1024 * MiB
    result = search_max_batch(
        256, 16 * 1024 * MiB, [at_original], trial, probe=57, max_trials=4, enough=enough, floor=24
    )
    assert asked == [57, 40, 32] and result.stopped == "settled"
    assert result.max_batch_size is None  # the floor was assumed, never found


def test_a_leak_only_the_replays_showed_is_the_prescription():
    """The failing run ran out of memory before a leak could show; a replay
    ran long enough to show one (a retained graph): no configuration is
    prescribed, the leak's remedy is."""
    from types import SimpleNamespace

    from oomdoc.replay.leaks import StillLeaks
    from oomdoc.replay.prescription import prescription_for

    snapshot = Snapshot.from_dict({"device": {"capacity_bytes": 100 * MiB}})
    leaking = Replay(label="autocast", outcome="grows", capture=Snapshot())
    leaking.leaks = StillLeaks(text="memory still grows")
    replayer = SimpleNamespace(leak=False, replays=[leaking])
    prescription = prescription_for(snapshot, replayer, ReplayState(skipped=[]))
    assert prescription is not None and prescription.kind == "leak" and not prescription.fits


def test_steps_after_the_replays_steps_are_left_out_of_its_step_time():
    # Batches fetched ahead and the longest batch again after the evaluation
    # (oomdoc.capture.whole_run) trained after the replay's steps were done.
    timed = steps(9.0, 1.0, 1.2, 0.8, 3.0, 3.2)
    for step in timed[4:]:
        step.after_timed_steps = True
    assert step_timing(timed) == StepTiming(1.0, 0.2, 3)


def test_steps_on_shapes_met_for_the_first_time_are_left_out_when_others_were_met_before():
    # The HF Trainer's replay on variable-length text, longest batch first:
    # step 1 repeats the longest batch's length, steps 2 and 3 meet new
    # lengths (cuDNN attention builds a plan for each: seconds in bf16).
    timed = steps(4.5, 0.43, 3.56, 2.9)
    for step in (timed[0], timed[2], timed[3]):
        step.new_shapes = True
    assert step_timing(timed) == StepTiming(0.43, None, 1)
    # Every timed step on new shapes (no length ever repeats): all of them,
    # as before, rather than none.
    timed[1].new_shapes = True
    assert step_timing(timed) == StepTiming(2.9, 0.2276, 3)


def test_a_large_warm_up_per_new_shape_is_told_to_the_user():
    """Left out of the step times, a per-shape warm-up is still paid by the
    user's run once per shape: the report says how much, and on CUDA what
    the likely cause (cuDNN attention's plan per length) and its switch are."""
    from types import SimpleNamespace

    timed = steps(4.5, 0.43, 3.56, 2.9)
    for step in (timed[0], timed[2], timed[3]):
        step.new_shapes = True
    replay = Replay(
        label="autocast (--per_device_train_batch_size 8)",
        outcome="fits",
        capture=Snapshot(steps=timed),
    )
    cuda = Snapshot.from_dict({"device": {"kind": "cuda", "capacity_bytes": 100 * MiB}})
    note = shape_warmup_note(cuda, SimpleNamespace(replays=[replay]))
    assert note is not None and "took 3.56 s against 0.43 s" in note
    assert "enable_cudnn_sdp(False)" in note
    simulated = Snapshot.from_dict({"device": {"kind": "simulated", "capacity_bytes": 100 * MiB}})
    assert "cuDNN" not in (shape_warmup_note(simulated, SimpleNamespace(replays=[replay])) or "")
    # A warm-up within the steps' own spread says nothing.
    timed[2].duration_s = timed[3].duration_s = 0.5
    assert shape_warmup_note(cuda, SimpleNamespace(replays=[replay])) is None


def test_a_saver_search_replays_the_smallest_batch_with_each_prescription():
    """The Lightning encoder's pattern on the simulated device (batch 64, no
    fix's largest 5, no saver fits above it): the searches had replayed 17,
    11 and 8 under autocast, 23, 14, 9 and 7 under both savers, where only
    16 and 8 could change the prescription (4 x 16 at any largest batch from
    5 to 7). Snapped to the smallest batch of each prescription, a search
    asks for 16 and 8 and ends settled; one whose saver fits goes on up
    through the prescriptions (16 fits: 32 next); an evaluation batch,
    which accumulates nothing, is its own prescription."""
    from oomdoc.replay.batch import BatchRun, SearchResult, search_max_batch
    from oomdoc.replay.search import settled_by_accumulation, smallest_with_its_plan

    snapshot = Snapshot.from_dict({"device": {"capacity_bytes": 24 * MiB}})
    state = ReplayState(
        skipped=[], batch_info={"source": "--batch-size"}, search=SearchResult(64, 5, True, [], [])
    )
    snap = smallest_with_its_plan(snapshot, state)
    assert [snap(b, 5, 64) for b in (17, 11, 8, 63)] == [16, 8, 8, 32]
    assert snap(7, 5, 64) == 8 and snap(6, 5, 8) == 6  # nothing between changes it: as asked

    def search(fits_up_to, lanes=1, beside=None):
        asked = []

        def trial(batch_size):
            asked.append(batch_size)
            run = BatchRun(batch_size=batch_size, fits=batch_size <= fits_up_to)
            run.lower_bounds[("first", "forward")] = MiB * batch_size
            run.peak_allocated_bytes = MiB * batch_size if run.fits else None
            return run

        at_original = BatchRun(batch_size=64, fits=False, estimated_max=17)
        at_original.lower_bounds[("first", "forward")] = 64 * MiB
        result = search_max_batch(
            64,
            24 * MiB,
            [at_original],
            trial,
            probe=17,
            max_trials=4,
            enough=settled_by_accumulation(snapshot, state),
            floor=5,
            snap=snap,
            speculate=None if beside is None else lambda b: beside.append((b, len(asked))),
            lanes=lanes,
        )
        return asked, result

    asked, result = search(fits_up_to=5)
    assert asked == [16, 8] and result.stopped.startswith("any largest batch from 5 to 7")
    # With spare lanes the other prescriptions' batches run beside the first
    # (bracket_fill, snapped): 8 is running when the search asks for it.
    beside: list[tuple[int, int]] = []
    assert search(fits_up_to=5, lanes=4, beside=beside)[0] == [16, 8]
    assert beside == [(8, 0), (32, 0)]
    asked, result = search(fits_up_to=20)
    assert asked[:2] == [16, 32] and result.max_batch_size == 16
    assert result.stopped.startswith("any largest batch from 16 to 31")
    evaluation = ReplayState(
        skipped=[],
        batch_info={"source": "--per_device_eval_batch_size"},
        search=SearchResult(64, 5, True, [], []),
    )
    evaluation_snapshot = Snapshot.from_dict(
        {
            "outcome": "oom",
            "device": {"capacity_bytes": 24 * MiB},
            "oom": {"phase": "evaluation", "requested_bytes": MiB, "allocated_bytes": 20 * MiB},
        }
    )
    assert evaluation_snapshot.oom_in_evaluation
    assert smallest_with_its_plan(evaluation_snapshot, evaluation)(17, 5, 64) == 17


def test_a_saver_search_started_ahead_is_the_one_its_search_asks_for_first():
    """The savers' searches start their first replays at once, beside each
    other (start_saver_searches_ahead): on the H100 the HF Trainer's autocast
    and autocast + checkpointing searches ran one after another. Started
    ahead, a replay is used only when its key is the one the search asks for:
    first_saver_trial picks the batch search_max_batch picks first."""
    from oomdoc.replay.batch import BatchRun, SearchResult, search_max_batch
    from oomdoc.replay.search import (
        first_saver_trial,
        saver_probe,
        settled_by_accumulation,
        smallest_with_its_plan,
    )

    snapshot = Snapshot.from_dict({"device": {"capacity_bytes": 16 * 1024 * MiB}})
    cases = [
        (32, 9, 20),  # the H100 run: plain largest 9, the saver's estimate 20
        (32, 9, None),  # no estimate: halfway from 9 to 32
        (32, 9, 5),  # an estimate below the plain largest: one above it
        (64, 0, None),  # nothing fit without a fix
        (256, 24, 57),
    ]
    for original, plain, estimate in cases:
        state = ReplayState(
            skipped=[],
            batch_info={"source": "--batch-size"},
            search=SearchResult(original, plain or None, True, [], []),
        )
        at_original = BatchRun(batch_size=original, fits=False, estimated_max=estimate)
        at_original.lower_bounds[("first", "forward")] = 20 * 1024 * MiB
        asked = []

        def trial(batch_size, asked=asked):
            asked.append(batch_size)
            return BatchRun(batch_size=batch_size, fits=True, peak_allocated_bytes=MiB)

        search_max_batch(
            original,
            16 * 1024 * MiB,
            [at_original],
            trial,
            probe=saver_probe(state.search, at_original),
            max_trials=1,
            enough=settled_by_accumulation(snapshot, state),
            floor=plain,
            snap=smallest_with_its_plan(snapshot, state),
        )
        assert first_saver_trial(snapshot, state, at_original) == (asked[0] if asked else None)
    # Between 16 and 31 every largest batch gives micro-batches of 16 x 2:
    # the search asks for none, and none starts ahead.
    state = ReplayState(
        skipped=[], batch_info={"source": "--batch-size"}, search=SearchResult(32, 16, True, [], [])
    )
    assert first_saver_trial(snapshot, state, BatchRun(batch_size=32, fits=False)) is None


def test_a_probe_started_ahead_is_stopped_once_the_search_asks_for_another():
    """The batch search's probe started ahead (search.BatchProbes) beside the
    trial asked for next: kept when the search asks for its batch after that
    trial, stopped (Replayer.discard, listed among the unused replays) when it
    asks for another; none without lanes."""
    from oomdoc.replay.search import BatchProbes

    class Lanes:
        def __init__(self):
            self.discarded: list = []

        def ahead(self, payload, label, args=None, extra_env=None):
            return None if label == "probe 7" else (label,)  # 7: no lane free

        def discard(self, keys, keep_finished=False):
            self.discarded.extend(keys)

    replayer = Lanes()
    probes = BatchProbes(replayer, lambda batch: ({}, f"probe {batch}", None))  # type: ignore[arg-type]
    probes.drop_others(23)  # the first probe
    probes.speculate(9)  # beside the next trial, 12
    probes.drop_others(12)
    assert replayer.discarded == []  # started for the trial after this one
    probes.drop_others(9)  # asked for: it runs on
    assert replayer.discarded == []
    probes.speculate(19)
    probes.speculate(7)  # no lane: nothing was started
    probes.drop_others(26)
    probes.drop_others(24)  # not 19: stopped
    assert replayer.discarded == [("probe 19",)]
    probes.drop_others(25)
    assert replayer.discarded == [("probe 19",)]
    # Started again beside each trial (the endgame's bracket_fill): kept
    # while it is; stopped at the trial after the one it was last started beside.
    probes.speculate(21)
    probes.drop_others(22)
    probes.speculate(21)
    probes.drop_others(20)
    assert replayer.discarded == [("probe 19",)]
    probes.drop_others(18)
    assert replayer.discarded == [("probe 19",), ("probe 21",)]
    # The search ends: what it started ahead and never asked for stops.
    probes.speculate(30)
    probes.speculate(31)
    probes.drop_all()
    assert replayer.discarded[2:] == [("probe 30",), ("probe 31",)]
    probes.drop_all()
    assert len(replayer.discarded) == 4


def test_the_savers_searches_run_side_by_side_and_one_ruled_out_stops(monkeypatch):
    """With lanes, every configuration the decisions could search starts at
    once, one thread each (search.SaverSearches); the decisions take them in
    order, and one they rule out stops at its next trial."""
    import threading
    from types import SimpleNamespace

    from oomdoc.replay import search

    both_running = threading.Barrier(2, timeout=20)
    stopped = []

    def search_under(replayer, snapshot, state, fix, at_original, dropped=None):
        if fix == "autocast+checkpointing":  # the decisions rule it out
            assert dropped is not None and dropped.wait(20)
            stopped.append(fix)
            raise search.SearchDropped()
        both_running.wait()  # one after another, this would time out
        return f"searched {fix}"

    eager = [(("autocast",), "autocast", None), (("checkpointing",), "checkpointing", None)]
    eager.append((("autocast", "checkpointing"), "autocast+checkpointing", None))
    monkeypatch.setattr(search, "search_under", search_under)
    monkeypatch.setattr(search, "searchable_now", lambda *args: iter(eager))
    replayer = SimpleNamespace(lanes=object(), settler=None)
    with search.SaverSearches(replayer, None, None, {}, 0) as searches:  # type: ignore[arg-type]
        assert searches.result(("autocast",), "autocast", None) == "searched autocast"  # type: ignore[arg-type]
        searches.drop(("autocast", "checkpointing"))
        found = searches.result(("checkpointing",), "checkpointing", None)  # type: ignore[arg-type]
        assert found == "searched checkpointing"
    assert stopped == ["autocast+checkpointing"]

    # Without lanes: in order, when asked, each search's first replay
    # started ahead instead.
    asked, ahead = [], []
    monkeypatch.setattr(search, "search_under", lambda *args, **kwargs: asked.append(args[3]))
    monkeypatch.setattr(
        search, "start_saver_searches_ahead", lambda *args: ahead.append(list(args[3]))
    )
    replayer = SimpleNamespace(lanes=None, settler=None)
    with search.SaverSearches(replayer, None, None, {}, 0) as searches:  # type: ignore[arg-type]
        assert asked == [] and ahead == [eager]
        searches.result(("checkpointing",), "checkpointing", None)  # type: ignore[arg-type]
        assert asked == ["checkpointing"]
