"""A replay that ran its steps without an OOM fits only if it does not leak
(oomdoc.replay.leaks): judged against the failing run's leak growth per step
under a diagnosed leak, else by the leak rule on the replay's own steps. On
built snapshots, the same typed fields on CUDA and the simulated device."""

from __future__ import annotations

import pytest
from test_prescribe import ScriptedReplayer, prescribe_with

from oomdoc.model import OomsSeen, Snapshot, to_dict
from oomdoc.replay.batch import BatchRun, observe, search_max_batch
from oomdoc.replay.leaks import MIN_DELTAS, leak_growth_per_step, still_grows, still_leaks
from oomdoc.replay.prescription import Candidate
from oomdoc.replay.replayer import LEAK_REPLAY_STEPS, measure
from oomdoc.runner import ChildResult

KiB, MiB = 1024, 1024 * 1024
BASE = 1200 * KiB
LEAK = 64 * KiB  # the failing run's growth per step


def run_document(ends, kind="cpu", outcome="ok", retained=None, capacity=5 * MiB, oom_step=None):
    """A run's capture as the child writes it: one optimizer step per step,
    each ending with `ends[i]` bytes allocated; `retained`: {step: variable}
    whose autograd graph reaches back to step 0 at that step's end."""
    steps = []
    for index, end in enumerate(ends):
        step = {
            "index": index,
            "end_allocated_bytes": end,
            "peak_allocated_bytes": end + 100 * KiB,
            "forward_calls": 1,
            "backward_calls": 1,
            "optimizer_steps": 1,
        }
        if retained and index in retained:
            step["retained_graphs"] = [
                {
                    "variable": retained[index],
                    "file": "train.py",
                    "line": 45,
                    "function": "main",
                    "from_step": 0,
                }
            ]
        steps.append(step)
    document = {
        "outcome": outcome,
        "step_unit": "optimizer",
        "device": {"kind": kind, "capacity_bytes": capacity},
        "steps": steps,
        "peak": {"allocated_bytes": max(ends) + 100 * KiB},
    }
    if oom_step is not None:
        document["oom"] = {"step": oom_step, "phase": "forward", "capacity_bytes": capacity}
    return Snapshot.from_dict(document)


def growing(count, per_step, start=BASE):
    return [start + index * per_step for index in range(count)]


FAILING = run_document(growing(60, LEAK), outcome="oom", oom_step=60)


def test_the_failing_runs_leak_grows_by_its_steady_growth():
    assert leak_growth_per_step(FAILING) == LEAK
    assert leak_growth_per_step(run_document([BASE] * 10)) is None


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_growth_at_a_fraction_of_the_leaks_is_the_leak(kind):
    """Autocast halves what each step keeps: 32 KiB a step over a replay's
    six steps is 128 KiB, under the leak diagnosis's 256 KiB run-wide floor,
    yet it is the leak. An eighth of it still is."""
    replay = run_document(growing(6, LEAK // 2), kind=kind)
    assert still_grows(replay, LEAK) == LEAK // 2
    assert still_grows(run_document(growing(6, LEAK // 8), kind=kind), LEAK) == LEAK // 8
    found = still_leaks(replay, FAILING, LEAK)
    assert found is not None and found.per_step_bytes == LEAK // 2
    assert "still grows by 32.00 KiB per step" in found.text
    # From its last step's peak to the 5 MiB capacity at 32 KiB a step.
    last_peak = BASE + 5 * (LEAK // 2) + 100 * KiB
    reaches = 5 + (5 * MiB - last_peak) // (LEAK // 2)
    assert found.delays_oom_by_steps == reaches - 60
    assert f"near step {reaches}" in found.text


def test_replays_under_a_leak_run_enough_steps_to_judge_growth():
    """The first step is left out, and MIN_DELTAS deltas follow it."""
    assert LEAK_REPLAY_STEPS >= MIN_DELTAS + 2
    assert still_grows(run_document(growing(MIN_DELTAS + 2, LEAK)), LEAK) == LEAK
    assert still_grows(run_document(growing(MIN_DELTAS + 1, LEAK)), LEAK) is None


def test_a_flat_replay_is_no_leak():
    flat = run_document([BASE + 3 * MiB, BASE, BASE, BASE, BASE, BASE])
    assert still_grows(flat, LEAK) is None
    assert still_leaks(flat, FAILING, LEAK) is None


@pytest.mark.parametrize(
    "ends",
    [
        # Growth far below the leak's in every step (a scalar, a small cache).
        growing(6, LEAK // 16),
        # Up and down by more than the floor.
        [BASE, BASE, BASE + 40 * KiB, BASE, BASE + 40 * KiB, BASE],
        # One buffer made once in a later step.
        [BASE, BASE, BASE, BASE + 2 * MiB, BASE + 2 * MiB, BASE + 2 * MiB],
        # Too few steps after the first to call it steady.
        growing(3, LEAK),
    ],
)
def test_noise_is_no_leak(ends):
    assert still_leaks(run_document(ends), FAILING, LEAK) is None


def test_without_a_leak_on_the_failing_run_a_retained_graph_in_the_replay_is_one():
    """A failing run that ran out of memory in its second step showed no leak;
    the replay of a fix that let it run two steps shows `total_loss` keeping
    step 0's graph (its memory two steps cannot show growing)."""
    early = run_document(growing(2, LEAK), outcome="oom", oom_step=1)
    assert leak_growth_per_step(early) is None
    replay = run_document(growing(2, LEAK), kind="cuda", retained={1: "total_loss"})
    found = still_leaks(replay, early, None)
    assert found is not None and found.per_step_bytes is None
    assert "`total_loss` in main() (train.py:45) keeps the autograd graph of step 0" in found.text
    assert still_leaks(run_document(growing(2, LEAK)), early, None) is None


def test_without_a_leak_on_the_failing_run_steady_growth_in_a_long_replay_is_one():
    early = run_document(growing(3, LEAK), outcome="oom", oom_step=2)
    replay = run_document(growing(12, LEAK))  # replays run up to the failing step and beyond
    found = still_leaks(replay, early, None)
    assert found is not None and found.per_step_bytes == LEAK
    assert "memory grows by 64.00 KiB per step" in found.text


def child_result(capture: Snapshot) -> ChildResult:
    return ChildResult(exit_code=0, capture=to_dict(capture), wall_s=1.0)


def test_a_replay_that_still_leaks_grows_and_does_not_fit():
    """measure is where every replay (single fix, combination, batch trial,
    prescription) is judged."""
    result = child_result(run_document(growing(6, LEAK // 2)))
    replay = measure(result, "autocast", "", FAILING, LEAK)
    assert replay.outcome == "grows" and not replay.fits and replay.ran
    assert replay.leaks is not None and replay.message == replay.leaks.text
    assert replay.peak_allocated_bytes  # what it reached in its steps
    flat = measure(child_result(run_document([BASE] * 6)), "autocast", "", FAILING, LEAK)
    assert flat.outcome == "fits" and flat.leaks is None


def test_a_batch_that_still_leaks_is_no_largest_batch():
    """observe: a leaking replay does not fit; the search stops at it (a
    smaller batch only delays the OOM), with no largest batch."""
    failing = observe(FAILING, 64)
    leaks = still_leaks(run_document(growing(6, LEAK // 2)), FAILING, LEAK)
    leaking = observe(run_document(growing(6, LEAK // 2)), 32, still_leaks=leaks)
    assert not leaking.fits and not leaking.inconclusive
    calls = []

    def trial(batch_size: int) -> BatchRun:
        calls.append(batch_size)
        return observe(run_document(growing(6, LEAK // 2)), batch_size, still_leaks=leaks)

    result = search_max_batch(64, 5 * MiB, [failing], trial, probe=32)
    assert calls == [32]
    assert result.max_batch_size is None and result.best_run is None
    assert "batch size 32 still leaks" in result.stopped
    # A known run that leaks (the DataLoader probe) stops it before any trial.
    result = search_max_batch(64, 5 * MiB, [failing, leaking], trial, probe=16)
    assert calls == [32] and result.max_batch_size is None and "still leaks" in result.stopped


def test_a_prescription_whose_replay_still_leaks_is_not_prescribed():
    """The prescription's replay with accumulation ran its steps but still
    leaks: the configuration gives way to the next, here the user's own
    batch with autocast, which needs no replay of its own."""
    replayer = ScriptedReplayer([("grows", 60 * MiB)])
    chosen = prescribe_with(
        replayer,
        [Candidate([], 16, 70 * MiB, 0.1, "b16"), Candidate(["autocast"], 64, 90 * MiB, 1.0, "a")],
    )
    assert len(replayer.calls) == 1
    assert chosen is not None and chosen.fixes == ["autocast"]
    assert "batch 16 x 4 accumulation steps: still leaks, peak 60.00 MiB so far;" in (
        chosen.detail + ";"
    )


def test_a_replay_whose_script_caught_an_oom_and_went_on_did_not_fit():
    """A batch-size finder in the script (accelerate's
    find_executable_batch_size) catches the replay's OOM and goes on at a
    smaller batch: the replay ends `ok` but did not fit at its batch."""
    capture = run_document([BASE] * 6)
    capture.ooms_seen = OomsSeen(
        count=1, step=0, phase="forward", requested_bytes=MiB, allocated_bytes=4 * MiB
    )
    replay = measure(child_result(capture), "autocast", "", FAILING, None)
    assert replay.outcome == "oom" and not replay.fits and replay.ran
    assert replay.peak_allocated_bytes == 5 * MiB
    assert replay.message == "ran out of memory in step 0 during forward, caught"
    assert not observe(capture, 32).fits
