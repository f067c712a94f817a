"""The largest-batch search on what replays measured on an H100 (torch 2.11,
16 GiB cap): tests/data/batch_grid/, recorded by benchmarks/batch_grid.py and
replayed offline as benchmarks/batch_search.py --offline does. Deterministic:
the search reads only the recorded captures."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT, benchmark_module

from oomdoc.replay.batch import observe, search_max_batch
from oomdoc.replay.limit_estimate import first_probe_for


def recorded(case: str):
    module = benchmark_module("batch_grid")
    return module.RecordedGrid.load(REPO_ROOT / "tests" / "data" / "batch_grid" / f"{case}.json")


# The largest batch that fits, as `oomdoc run` found it on that H100 before.
KNOWN_MAX = {"gpt": 20, "resnet": 192, "hf": 7, "lightning": 24}


@pytest.mark.parametrize("case", sorted(KNOWN_MAX))
def test_the_recorded_runs_hold_the_limit(case):
    grid = recorded(case)
    assert grid.true_max == KNOWN_MAX[case]
    assert grid.runs[grid.true_max]["outcome"] == "ok"
    assert grid.runs[grid.true_max + 1]["outcome"] == "oom"
    assert grid.failing.outcome == "oom" and grid.failing.oom.step == 0


@pytest.mark.parametrize("case", sorted(KNOWN_MAX))
def test_exact_in_at_most_three_replays(case):
    grid = recorded(case)
    failing = grid.failing
    result = search_max_batch(
        grid.original,
        failing.device.capacity_bytes,
        [observe(failing, grid.original)],
        grid.trial,
        probe=first_probe_for(failing, grid.original),
    )
    probes = [(run.batch_size, run.fits) for run in result.trials]
    assert result.exact and result.max_batch_size == grid.true_max, probes
    assert len(result.trials) <= 3, probes
    # Proven by measurement: the maximum ran and fit, one more ran out of memory.
    assert (grid.true_max, True) in probes and (grid.true_max + 1, False) in probes


def test_the_first_probe_is_near_the_limit_not_half_the_batch():
    """From the failing run alone (how far its first forward got, the
    parameters and the optimizer). The transformers' blocks are alike: within
    a fifth of the limit, where half the failing batch is up to 5x off.
    ResNet's later blocks hold far less than its first ones, which the
    estimate takes as alike: it errs low, on a batch that fits."""
    for case in ("gpt", "hf", "lightning"):
        grid = recorded(case)
        probe = first_probe_for(grid.failing, grid.original)
        assert abs(probe - KNOWN_MAX[case]) <= KNOWN_MAX[case] / 5, (case, probe)
    assert recorded("lightning").original // 2 > 5 * KNOWN_MAX["lightning"]
    resnet = recorded("resnet")
    assert first_probe_for(resnet.failing, resnet.original) < KNOWN_MAX["resnet"] / 2


def test_an_off_grid_batch_is_interpolated_between_recorded_ones():
    grid = recorded("resnet")
    low, high, middle = grid.runs[128], grid.runs[160], grid.capture(144)
    assert middle["outcome"] == "ok" and grid.interpolated == [144]
    for step in range(2):
        for phase in ("forward", "backward"):
            values = [run["steps"][step]["phase_peaks"][phase] for run in (low, middle, high)]
            assert values[0] < values[1] < values[2]
    above = grid.capture(grid.true_max + 5)
    assert above["outcome"] == "oom"


def test_a_second_backward_that_never_ran_is_the_first_moved_up_by_the_optimizer_state():
    """Batch 23 ran out of memory at the first request of its second backward:
    the need there (15.43 GiB) says little about that backward's peak. The
    first step's backward line moved up by what the second forward held more
    predicts it: batch 22's second backward needed 16.21 GiB."""
    from oomdoc.replay.batch import STEADY, fit_model

    grid = recorded("gpt")
    run = grid.trial(23)
    assert not run.fits and (STEADY, "backward") in run.lower_bounds
    model = fit_model([observe(grid.failing, grid.original), run])
    need_at_22 = grid.runs[22]["oom"]["allocated_bytes"] + grid.runs[22]["oom"]["requested_bytes"]
    predicted = model.lines[(STEADY, "backward")].at(22)
    assert abs(predicted - need_at_22) <= 0.01 * need_at_22
    assert run.lower_bounds[(STEADY, "backward")] < 0.97 * model.lines[(STEADY, "backward")].at(23)


def search_grid(grid, trial, probe: int, **options):
    """search_max_batch from the recorded failing run, with `trial`."""
    failing = grid.failing
    return search_max_batch(
        grid.original,
        failing.device.capacity_bytes,
        [observe(failing, grid.original)],
        trial,
        probe=probe,
        **options,
    )


@pytest.mark.parametrize("case", sorted(KNOWN_MAX))
def test_a_probe_started_ahead_never_changes_the_searchs_path(case):
    """`speculate` starts a probe a quarter below an estimate from a first
    forward's OOM (where the model is least sure) beside it, and with spare
    lanes the batches next to a trial near the limit: the search runs
    the same trials with or without it, and where it asks for the batch
    started ahead, that replay has run beside the one before."""
    grid = recorded(case)
    failing = grid.failing
    for probe in (first_probe_for(failing, grid.original), grid.original - 1):
        paths = []
        for speculating, lanes in ((False, 1), (True, 1), (True, 4)):
            events: list[tuple[str, int]] = []

            def trial(batch_size: int, events=events):
                events.append(("trial", batch_size))
                return grid.trial(batch_size)

            def speculate(batch_size: int, events=events):
                events.append(("ahead", batch_size))

            result = search_grid(
                grid, trial, probe, speculate=speculate if speculating else None, lanes=lanes
            )
            paths.append([(run.batch_size, run.fits) for run in result.trials])
            for (kind, batch_size), after in zip(events, events[1:]):
                if kind == "ahead" and lanes == 1:  # started beside the trial asked for next
                    assert after[0] == "trial" and batch_size == after[1] * 3 // 4
        # Spare lanes (the endgame's bracket_fill) change no trial either.
        assert paths[0] == paths[1] == paths[2]
    # The Lightning module's first probe at 255 runs out of memory in its
    # first forward: the estimate from it (26) gets a probe beside it (19).
    started = []
    search_max_batch(
        recorded("lightning").original,
        recorded("lightning").failing.device.capacity_bytes,
        [observe(recorded("lightning").failing, recorded("lightning").original)],
        recorded("lightning").trial,
        probe=recorded("lightning").original - 1,
        speculate=started.append,
    )
    assert started == [19]


@pytest.mark.parametrize("case", sorted(KNOWN_MAX))
def test_probes_that_ended_are_folded_in_before_the_next_trial(case):
    """With spare lanes, the batches started beside a trial near the limit
    that have ended by the time it ends (search.BatchProbes.finished) are
    folded into the bracket before the next trial: the search finds the
    same exact largest batch, never asks for a batch it already knows, and
    asks for no more trials than without them."""
    grid = recorded(case)
    failing = grid.failing
    for probe in (first_probe_for(failing, grid.original), grid.original - 1):
        found = []
        for harvesting in (False, True):
            asked: list[int] = []
            started: list[int] = []

            def trial(batch_size: int, asked=asked, started=started):
                asked.append(batch_size)
                if batch_size in started:
                    started.remove(batch_size)
                return grid.trial(batch_size)

            def harvest(lo: int, hi: int, started=started):
                inside = [batch_size for batch_size in started if lo < batch_size < hi]
                started.clear()
                return [grid.trial(batch_size) for batch_size in inside]

            result = search_grid(
                grid,
                trial,
                probe,
                speculate=started.append,
                lanes=4,
                harvest=harvest if harvesting else None,
            )
            tried = [run.batch_size for run in result.trials]
            assert len(tried) == len(set(tried)), tried
            assert result.exact and result.max_batch_size == KNOWN_MAX[case]
            found.append(len(asked))
        assert found[1] <= found[0]
