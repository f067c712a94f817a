"""The largest batch size that fits: a per-phase memory model and its search.

Peak memory is not one straight line in the batch size. Each phase of a step
peaks separately: the forward and backward peaks grow with the batch (the
activations), the optimizer-step peak hardly does (parameters, gradients,
optimizer state and its temporaries). At small batches the optimizer peak is
the step's peak, so a line through the overall peak of two small batches has
almost no slope and predicts a far too large batch. Here every (step kind,
phase) gets its own line, and the step's need is the largest of them.

The first replay goes where the failing run puts the limit
(estimated_max_batch): near the limit a replay measures the most. One that
fits gives one point per phase. The slope of the first step's
forward/backward peak comes from what was alive when that step began
(parameters, the dataset: measured at two batch sizes, the failing run's and
the probe's); the steady steps' forward/backward peaks share that slope (the
same activations per sample) on top of their own static memory (with
optimizer state). One that runs out of memory in a later step gives the
first step's points and, on CUDA, the fragmentation at the limit (reserved
but unusable bytes, which no count of allocated bytes predicts). Later
replays add points, and a line through two measured points replaces the
estimate. The prediction is then verified: the largest batch that fits is
exact only when it ran and one more ran out of memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from oomdoc.model import Snapshot, Step
from oomdoc.replay.leaks import StillLeaks
from oomdoc.replay.limit_estimate import estimated_max_batch
from oomdoc.replay.timing import step_timing, timed_steps

FIRST, STEADY = "first", "steady"
FORWARD_BACKWARD = ("forward", "backward")
# Model-guided trials (once something fits) before the search falls back to bisection.
BISECT_AFTER = 4
# A prediction this close to a fit (in samples and in bytes) is within what
# CUDA's allocator loses to fragmentation near the limit (1 to 9% of the
# device on the H100 runs of benchmarks/batch_search.py --offline).
ENDGAME_SAMPLES = 3
ENDGAME_SHARE = 0.02


@dataclass
class BatchRun:
    """What one run at one batch size showed about memory."""

    batch_size: int
    fits: bool
    # Allocated bytes when the first step's work began (parameters, data...).
    start_bytes: int | None = None
    # (step kind, phase) -> the phase's peak, for phases that completed.
    exact: dict = field(default_factory=dict)
    # (step kind, phase) -> allocated + requested at the OOM: the phase
    # needed at least this much.
    lower_bounds: dict = field(default_factory=dict)
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    # (step, phase, requested, allocated) of an OOM, to notice OOMs the batch size does not change.
    oom_signature: tuple | None = None
    # At an OOM: reserved but unallocated bytes (CUDA fragmentation under
    # pressure): the allocator could not use them, so capacity is that much smaller.
    slack_bytes: int = 0
    step_s: float | None = None
    step_noise: float | None = None  # oomdoc.replay.timing.StepTiming.noise
    # An OOM in the first step: the largest batch estimated from it
    # (estimated_max_batch), as from the failing run.
    estimated_max: int | None = None
    # The same without the tensors still to come past the repeated blocks
    # (limit_estimate.copies_to_come): it errs large, so that a configuration
    # is ruled out (search.estimated_no_larger) only by what its OOM showed.
    estimated_max_bound: int | None = None
    inconclusive: bool = False  # timed out or failed otherwise: says nothing about memory
    wall_s: float = 0.0
    note: str = ""
    # Ran its steps without an OOM but still leaks (oomdoc.replay.leaks): no
    # fit, and a smaller batch would only delay the OOM.
    still_leaks: StillLeaks | None = None
    replay: Any = None  # the replay that measured it (oomdoc.replay.replayer.Replay)


def timed_on_a_shared_device(steps: list[Step]) -> bool:
    """Whether a step that makes the step time ran while other replays could
    use the device (a replay sharing it, oomdoc.capture.gate, that stopped
    before it took the device alone)."""
    return any(step.device_shared for step in timed_steps(steps))


def observe(capture: Snapshot, batch_size: int, still_leaks: StillLeaks | None = None) -> BatchRun:
    """Read a run (the failing one, or a replay's capture) into a BatchRun.
    `still_leaks`: the replay ran its steps but still leaks (its Replay's
    `leaks`): it does not fit."""
    outcome = capture.outcome
    oom = capture.oom if outcome == "oom" else None
    run = BatchRun(
        batch_size=int(batch_size),
        # (a script that caught an OOM and went on, a finder, did not fit)
        fits=outcome == "ok" and still_leaks is None and not capture.caught_ooms,
        inconclusive=outcome not in ("ok", "oom"),
        still_leaks=still_leaks,
    )
    # Steps per backward (no optimizer) are iterations as optimizer steps are.
    by_optimizer = capture.step_unit in ("optimizer", "backward")
    oom_step = oom.step if oom else None
    for step in capture.steps:
        index = max(step.index, 0)
        if index > 0 and not by_optimizer:
            # Steps counted per module call do not line up with the
            # optimizer steps of the replays: keep only the first.
            continue
        kind = FIRST if index == 0 else STEADY
        if index == 0 and step.start_allocated_bytes is not None:
            run.start_bytes = step.start_allocated_bytes
        failing = oom is not None and index == oom_step
        if failing and step.forward_calls > 1:
            continue  # micro-batches: the step's phases never completed
        for phase, value in step.phase_peaks.items():
            if failing and oom is not None and phase == oom.phase:
                continue
            key = (kind, phase)
            run.exact[key] = max(run.exact.get(key, 0), int(value))
    if oom is not None:
        step_index = oom_step if oom_step is not None else 0
        if step_index == 0 or by_optimizer:
            bound_key = (FIRST if step_index == 0 else STEADY, oom.phase or "")
            run.lower_bounds[bound_key] = max(run.lower_bounds.get(bound_key, 0), oom.needed_bytes)
        run.slack_bytes = max(0, oom.reserved_bytes - oom.allocated_bytes)
        run.oom_signature = (oom_step, oom.phase, oom.requested_bytes, oom.allocated_bytes)
        if (oom_step or 0) == 0:
            run.estimated_max = estimated_max_batch(capture, run.batch_size)
            run.estimated_max_bound = estimated_max_batch(capture, run.batch_size, to_come=False)
    if capture.peak is not None:
        run.peak_allocated_bytes = capture.peak.allocated_bytes
        run.peak_reserved_bytes = capture.peak.reserved_bytes
    timing = step_timing(capture.steps) if run.fits else None
    if timing is not None:
        run.step_s, run.step_noise = timing.step_s, timing.noise
    return run


@dataclass(frozen=True)
class Line:
    intercept: float
    slope: float

    def at(self, batch_size: float) -> float:
        return self.intercept + self.slope * batch_size

    @staticmethod
    def through_point(batch_size: float, value: float, slope: float) -> Line:
        return Line(value - slope * batch_size, slope)

    @staticmethod
    def through(b1: float, v1: float, b2: float, v2: float) -> Line:
        slope = (v2 - v1) / (b2 - b1)
        return Line(v1 - slope * b1, slope)


@dataclass
class BatchModel:
    """Peak memory against batch size: one line per (step kind, phase)."""

    lines: dict
    start: Line | None
    points: dict  # key -> number of measured points behind its line
    # The runs the lines were fitted to (need_far fits them again its way).
    runs: list = field(default_factory=list, repr=False)

    def need(self, batch_size: float) -> float | None:
        if not self.lines:
            return None
        return max(line.at(batch_size) for line in self.lines.values())

    def need_far(self, batch_size: float) -> float | None:
        """The need at a batch far from those replayed (the user's, to say
        what it would take): the lines that find the limit are drawn through
        the batches nearest it, where a fit and an OOM's need one batch apart
        make the slope whatever the fragmentation at the limit was. On
        pytorch/examples' DCGAN 500 fit at 7.63 GiB and 501 ran out of memory
        needing 6.56 GiB in a later step, and those lines put batch 1000 at
        264.8 GiB."""
        return fit_model(self.runs, far=True).need(batch_size) if self.runs else None

    def binding(self, batch_size: float):
        """The (step kind, phase) whose peak is the largest at this batch size."""
        if not self.lines:
            return None
        return max(self.lines, key=lambda key: self.lines[key].at(batch_size))

    def largest_fitting(self, capacity: float) -> int | None:
        """The largest batch size whose predicted need is within capacity
        (0 when not even 1 fits, None when nothing limits it)."""
        if not self.lines:
            return None
        limit = math.inf
        for line in self.lines.values():
            if line.slope > 0:
                limit = min(limit, math.floor((capacity - line.intercept) / line.slope + 1e-9))
            elif line.intercept > capacity:
                limit = 0
        if limit == math.inf:
            return None
        return max(0, int(limit))


def fit_model(runs: list[BatchRun], far: bool = False) -> BatchModel:
    """Fit the per-phase lines to every run seen so far, through the two
    batches nearest the limit, and raised through an OOM's need above them;
    with `far`, through the widest span of batches measured, with an OOM's
    need raising only a line nothing measured (BatchModel.need_far)."""
    starts = {}
    points: dict = {}
    bounds: dict = {}
    for run in runs:
        if run.inconclusive:
            continue
        if run.start_bytes is not None:
            starts[run.batch_size] = run.start_bytes
        for key, value in run.exact.items():
            points.setdefault(key, {})[run.batch_size] = value
        for key, value in run.lower_bounds.items():
            bounds.setdefault(key, []).append((run.batch_size, value))

    if far and _narrow(starts):
        starts = {max(starts): starts[max(starts)]}
    start = _line_from_points(starts, far=far) if starts else None
    lines: dict = {}
    # First-step lines first: steady lines with one point borrow their slope.
    for key in sorted(points, key=lambda key: key[0] != FIRST):
        kind, phase = key
        measured = points[key]
        if far and _narrow(measured):
            largest = max(measured)
            measured = {largest: measured[largest]}
        line = _line_from_points(measured, far=far)
        if len(measured) == 1:
            ((b1, v1),) = measured.items()
            slope = None
            if phase in FORWARD_BACKWARD:
                if kind == STEADY and (FIRST, phase) in lines:
                    slope = lines[(FIRST, phase)].slope
                elif start is not None:
                    # What the phase holds beyond what was alive at the step's start grows with the batch.
                    slope = start.slope + max(0.0, v1 - start.at(b1)) / b1
            elif start is not None:
                slope = start.slope
            line = Line(v1 - (slope or 0.0) * b1, slope or 0.0)
        lines[key] = line
    shifted = _steady_from_first(points, lines)
    for key, observed in bounds.items():
        if key not in lines and key in shifted:
            # The steady phase never completed: its first-step line moved up
            # by what the steady step holds more, or the bound, whichever is higher.
            lines[key] = max(
                [shifted[key]]
                + [Line.through_point(b, need, shifted[key].slope) for b, need in observed],
                key=lambda line: line.at(max(b for b, _need in observed)),
            )
            continue
        if key not in lines:
            # Only ever ran out of memory in this phase: a line through the
            # need at the OOM (a lower bound) with the phase's slope in the
            # first step, else the forward's of its own step kind.
            slope = next(
                (
                    lines[other].slope
                    for other in ((FIRST, key[1]), (key[0], "forward"), (FIRST, "forward"))
                    if other in lines
                ),
                None,
            )
            if slope is not None:
                lines[key] = max(
                    (Line.through_point(batch_size, need, slope) for batch_size, need in observed),
                    key=lambda line: line.intercept,
                )
            continue
        for batch_size, need in observed:
            if far:
                break
            known = lines.get(key)
            if known is None or known.at(batch_size) >= need:
                continue
            anchors = [b for b in points.get(key, {}) if b < batch_size]
            if not anchors:
                continue
            anchor = max(anchors)
            lines[key] = Line.through(anchor, points[key][anchor], batch_size, need)
    for key, line in shifted.items():
        lines.setdefault(key, line)
    return BatchModel(
        lines=lines,
        start=start,
        points={key: len(v) for key, v in points.items()},
        runs=list(runs),
    )


def _steady_from_first(points: dict, lines: dict) -> dict:
    """Lines for the steady forward/backward phases that never completed, from
    the first step's line of the same phase moved up by what the steady step
    holds more (optimizer state, kept gradients): measured as the difference
    between the steady and first peaks of the other phase at one batch size.
    (A replay that ran out of memory at the start of its second backward
    measured the second forward but not the backward, and the need at that
    OOM, its first request, says little about the backward's peak.)"""
    shifted = {}
    for phase in FORWARD_BACKWARD:
        key, first = (STEADY, phase), (FIRST, phase)
        if key in points or first not in lines:
            continue
        for other in FORWARD_BACKWARD:
            common = set(points.get((STEADY, other), {})) & set(points.get((FIRST, other), {}))
            if other == phase or not common:
                continue
            batch_size = max(common)
            offset = points[(STEADY, other)][batch_size] - points[(FIRST, other)][batch_size]
            shifted[key] = Line(lines[first].intercept + max(0.0, offset), lines[first].slope)
    return shifted


# Points closer than this share of the larger batch make no slope to
# extrapolate far with (a cuDNN workspace chosen differently at 501 than at
# 500 would be its whole slope): far lines then take one point's.
NARROW_SPAN = 0.25


def _narrow(measured: dict) -> bool:
    sizes = sorted(measured)
    return len(sizes) > 1 and sizes[-1] - sizes[0] < NARROW_SPAN * sizes[-1]


def _line_from_points(measured: dict, far: bool = False) -> Line:
    """Through the two largest batch sizes (nearest the limit being sought),
    or with `far` the smallest and the largest; flat through a single point."""
    sizes = sorted(measured)
    if len(sizes) == 1:
        return Line(float(measured[sizes[0]]), 0.0)
    b1, b2 = (sizes[0] if far else sizes[-2]), sizes[-1]
    return Line.through(b1, measured[b1], b2, measured[b2])


@dataclass
class SearchResult:
    original_batch_size: int
    max_batch_size: int | None  # the largest batch seen to fit
    exact: bool  # it fit and one more ran out of memory
    trials: list  # BatchRun per replay, in order
    predictions: list  # the model's prediction before each trial (None: no model yet)
    stopped: str = ""  # why the search ended early, if it did
    model: BatchModel | None = None
    # Replays one more batch size the same way (the prescription measures
    # the micro-batch it prescribes when the search did not).
    trial: Callable[[int], BatchRun] | None = field(default=None, repr=False, compare=False)

    @property
    def best_run(self) -> BatchRun | None:
        fitting = [run for run in self.trials if run.fits and run.batch_size == self.max_batch_size]
        return fitting[-1] if fitting else None


def search_max_batch(
    original_batch_size: int,
    capacity_bytes: int,
    runs: list[BatchRun],
    trial: Callable[[int], BatchRun],
    probe: int | None = None,
    max_trials: int = 10,
    enough: Callable[[int, int], str | None] | None = None,
    floor: int = 0,
    speculate: Callable[[int], None] | None = None,
    snap: Callable[[int, int, int], int] | None = None,
    lanes: int = 1,
    settles: Callable[[int, int], str | None] | None = None,
    on_settled: Callable[[SearchResult], None] | None = None,
    harvest: Callable[[int, int], list[BatchRun]] | None = None,
) -> SearchResult:
    """Find the largest batch size that fits, exactly when the trials allow.

    `runs` holds what is known already (the failing run at the original batch
    size, maybe a first probe); `trial(b)` replays at batch size b; `probe`
    is the first (first_probe_for). Each trial goes where the model predicts
    the limit (clamped inside the bracket of known fit and known OOM), or,
    within the allocator's fragmentation of a fit, halfway there; when the
    model stalls, the bracket is bisected. `enough(fit, oom)`: why a batch
    that fits and a larger one that does not already answer what the search
    is for (None: they do not), which ends it there. `floor`: a batch
    assumed to fit without a run (a memory saver's search above the plain
    largest batch): the search stays above it, and never reports it as found.
    `speculate(b)`: start the trial at b beside the next one (Replayer.ahead),
    for the search to take should it ask for b next (else the caller drops it
    once another is asked for): a quarter below an estimate from a first
    forward's OOM, where the model is least sure. `snap(b, lo, hi)`: the
    batch inside (lo, hi) to replay instead of b, that answers what the
    search is for at less memory (a saver's search: the smallest batch with
    b's prescription). `lanes`: replays that may run at once; once a fit
    and an OOM bracket the limit closely, the spare lanes run the batches
    next to each trial (bracket_fill), through `speculate`. `settles(fit,
    oom)`: like `enough`, but the search goes on: the first time it answers,
    `on_settled` gets the search as it stands (what the caller needed of it
    is known; the plain search's plan, oomdoc.replay.plain_search).
    `harvest(lo, hi)`: the probes started through `speculate` inside the
    bracket that have ended since (search.BatchProbes.finished): folded in
    before each trial,
    so that the search never replays a batch it already knows the answer
    for (on the H200 the ImageNet-style trainer replayed 167 after 163 had
    fit, though 164, started beside 163, had run out of memory a second earlier).
    """
    runs = list(runs)
    known = [run for run in runs if not run.inconclusive]
    measured_lo = max([run.batch_size for run in known if run.fits], default=0)
    lo = max(measured_lo, floor)
    hi = min([run.batch_size for run in known if not run.fits] + [original_batch_size])
    failing = next(
        (run for run in runs if run.batch_size == original_batch_size and not run.fits), None
    )
    result = SearchResult(original_batch_size, measured_lo or None, False, [], [], trial=trial)
    guided = 0
    optimistic = False
    # A batch halfway into the fragmentation ran out of memory: the allocator
    # does lose about that much here.
    halfway_failed = False
    settled = False

    def largest_fit() -> int:
        return max([run.batch_size for run in result.trials if run.fits] + [measured_lo])

    folded = 0

    def fold(ended: list[BatchRun]) -> None:
        nonlocal lo, hi, folded
        for run in ended:
            if not lo < run.batch_size < hi:
                continue  # started before the bracket closed past it: no news
            runs.append(run)
            result.trials.append(run)
            result.predictions.append(None)
            folded += 1
            if run.fits:
                lo = max(lo, run.batch_size)
            else:
                hi = min(hi, run.batch_size)

    while True:
        if harvest is not None:
            fold([run for run in harvest(lo, hi) if not run.inconclusive])
        # (Only the trials it asked for count: those folded in were free.)
        if hi - lo <= 1 or len(result.trials) - folded >= max_trials:
            break
        answer = settles(lo, hi) if settles is not None and not settled and lo > 0 else None
        if answer and on_settled is not None:
            settled = True
            on_settled(
                replace(
                    result,
                    max_batch_size=largest_fit() or None,
                    trials=list(result.trials),
                    predictions=list(result.predictions),
                    stopped=answer,
                    model=fit_model(runs),
                )
            )
        leaking = next((run for run in runs if run.still_leaks is not None), None)
        if leaking is not None:
            result.stopped = (
                f"the replay at batch size {leaking.batch_size} still leaks: "
                "a smaller batch would only delay the OOM"
            )
            break
        answered = enough(lo, hi) if enough is not None and lo > 0 else None
        if answered:
            result.stopped = answered
            break
        halfway = False
        model = fit_model(runs)
        # Fragmentation seen at the nearest OOM makes the device smaller
        # where that OOM's phase is the one that decides the limit, unless
        # a batch the model thought too large for that has just fit.
        slack = 0 if optimistic else _slack_near(runs, hi, model)
        prediction = model.largest_fitting(capacity_bytes - slack)
        if prediction is not None and prediction >= hi:
            # The model says a batch that ran out of memory fits: what it
            # measured misses what decides the limit here (DCGAN: the last
            # iteration's generator outputs alive into the next). Before,
            # its prediction, clamped under the OOM, walked down one batch
            # a replay (32, 31, ..., 22, then stopped, for a limit of 21).
            prediction = None
        if not any(run.batch_size < original_batch_size for run in runs) and probe is not None:
            candidate = min(max(1, probe), hi - 1)
        elif lo == 0 and prediction is not None and _measured_a_step(runs, hi):
            # Nothing fits yet, but the smallest OOM came in a later step:
            # the model has the first step's lines and the fragmentation. The
            # fragmentation at that OOM bounds what the allocator loses at the
            # limit from above (it lost nothing at a fit): go halfway, once.
            whole = model.largest_fitting(capacity_bytes)
            halfway = not halfway_failed and whole is not None and whole > prediction
            if halfway and whole is not None:
                prediction = (prediction + whole + 1) // 2
            candidate = min(max(prediction, 1), hi - 1)
        elif lo == 0:
            # Nothing fits yet, so the model knows no steady step.
            if any(run.batch_size == hi for run in result.trials):
                # The smallest OOM, a replay's, came in its first step:
                # estimate again from it (how far its forward got), at most
                # 3/4 of it (an estimate too large once tends to be again).
                again = _estimate_below(result.trials, hi)
                candidate = max(1, min(again or hi, hi * 3 // 4))
                # Such an estimate has been too large before (on the H100,
                # the HF Trainer's 12 for a limit of 9: the logits and the
                # loss, after the blocks, were never reached): the batch a
                # quarter below it starts beside it: the one the model
                # asked for next there, once this one ran out of memory.
                below = candidate * 3 // 4
                if speculate is not None and lo < below < candidate:
                    speculate(below)
            else:
                # Step well below the smallest OOM (far below when even its
                # first forward failed).
                divisor = 4 if _oom_in_first_forward(runs, hi) else 2
                candidate = max(
                    1, min(prediction, hi // 2) if prediction is not None else hi // divisor
                )
        elif prediction is None or guided >= BISECT_AFTER or lo == floor > measured_lo:
            # The model did not converge, or it knows only what ran out of
            # memory above an assumed floor (whose lower bounds put every
            # prediction just under the last OOM): bisect.
            candidate = (lo + hi) // 2
        elif (
            1 < prediction - lo <= ENDGAME_SAMPLES
            and slack == 0
            and _fragments(runs)
            and (model.need(prediction) or 0) - (model.need(lo) or 0)
            <= ENDGAME_SHARE * capacity_bytes
        ):
            # A fit a few samples and a percent or two of the device below
            # the prediction, on an allocator that fragments, with no OOM
            # here to say by how much: the limit is anywhere from the fit to
            # the prediction (which counts allocated bytes only), so take the middle.
            guided += 1
            candidate = min((lo + prediction + 1) // 2, hi - 1)
        else:
            guided += 1
            candidate = min(max(prediction, lo + 1), hi - 1)
        if snap is not None:
            candidate = snap(candidate, lo, hi)
        if speculate is not None and lo > 0:
            for beside in bracket_fill(lo, hi, candidate, lanes - 1, snap):
                speculate(beside)
        result.predictions.append(prediction)
        run = trial(candidate)
        runs.append(run)
        result.trials.append(run)
        if run.inconclusive:
            result.stopped = (
                f"the replay at batch size {candidate} did not finish ({run.note or 'no result'})"
            )
            break
        if run.fits:
            optimistic = optimistic or (prediction is not None and candidate > prediction)
            lo = max(lo, candidate)
        else:
            halfway_failed = halfway_failed or halfway
            if candidate < hi:
                optimistic = False  # a new OOM nearer the limit: its fragmentation counts
            hi = min(hi, candidate)
            if (
                failing is not None
                and 2 * candidate <= original_batch_size
                and _same_oom(run, failing)
            ):
                result.stopped = (
                    f"batch size {candidate} ran out of memory at the same point as batch size "
                    f"{original_batch_size}: the batch size does not decide this OOM"
                )
                break
    found = largest_fit()
    result.max_batch_size = found or None
    result.exact = found > 0 and hi - found == 1
    result.model = fit_model(runs)
    if not result.exact and not result.stopped and hi - lo > 1:
        result.stopped = f"stopped after {len(result.trials)} replays"
    return result


def bracket_fill(
    lo: int,
    hi: int,
    candidate: int,
    spare: int,
    snap: Callable[[int, int, int], int] | None = None,
) -> list[int]:
    """The batches to replay beside `candidate` in `spare` free lanes, once a
    fit (lo) and an OOM (hi) bracket the limit closely: those nearest the
    candidate (above first), when the bracket holds at most twice as many
    others. Whatever the candidate shows, the search's next trial is then
    likely among them and already running: near the limit an allocator that
    fragments takes several trials one batch apart (on the H200 the
    ImageNet-style trainer's exact search ran 162, 168, 163, 167, 165, 164
    one after another, about 6 s each, with three lanes idle). With `snap`
    (a saver's search), the others are the batches it would replay: one per
    prescription (the Lightning encoder's checkpointing search ran 128, 64
    and 32 one after another). Started again each trial, so that those left
    outside the bracket are stopped (search.BatchProbes)."""
    if spare < 1:
        return []
    sizes: list[int] | range = range(lo + 1, hi)
    if snap is not None:
        sizes = sorted({snap(size, lo, hi) for size in sizes})
    others = [size for size in sizes if size != candidate and lo < size < hi]
    if not others or len(others) > 2 * spare:
        return []
    return sorted(others, key=lambda size: (abs(size - candidate), -size))[:spare]


def _oom_in_first_forward(runs: list[BatchRun], hi: int) -> bool:
    for run in runs:
        if run.batch_size == hi and run.oom_signature is not None:
            return run.oom_signature[:2] == (0, "forward")
    return False


def _fragments(runs: list[BatchRun]) -> bool:
    """The allocator held more than was allocated at some peak or OOM (CUDA's
    caching allocator; never the simulated device)."""
    return any(
        run.slack_bytes > 0 or (run.peak_reserved_bytes or 0) > (run.peak_allocated_bytes or 0)
        for run in runs
        if not run.inconclusive
    )


def _measured_a_step(runs: list[BatchRun], hi: int) -> bool:
    """The OOM at `hi` came after its first step completed: the model has
    that step's lines, and the OOM's fragmentation is the limit's."""
    return any(
        run.batch_size == hi and not run.fits and (FIRST, "backward") in run.exact for run in runs
    )


def _estimate_below(trials: list[BatchRun], hi: int) -> int | None:
    """The largest batch estimated from a first-step OOM of the replay at
    `hi`, when it is below `hi`."""
    for run in trials:
        if run.batch_size == hi and run.estimated_max is not None:
            return run.estimated_max if run.estimated_max < hi else None
    return None


def _slack_near(runs: list[BatchRun], hi: int, model: BatchModel) -> int:
    """The fragmentation seen at the OOM nearest the limit (0 on the simulated
    device), where that OOM came in the phase that decides the limit: a
    first forward's OOM far above the limit says little about the allocator
    there."""
    at_limit = [
        run for run in runs if not run.fits and not run.inconclusive and run.batch_size == hi
    ]
    if not at_limit:
        return 0
    binding = model.binding(max(hi - 1, 1))
    run = at_limit[-1]
    return run.slack_bytes if binding is None or binding in run.lower_bounds else 0


def _same_oom(run: BatchRun, failing: BatchRun) -> bool:
    if run.oom_signature is None or failing.oom_signature is None:
        return False
    # The same request (an activation's size grows with the batch; a weight's
    # or an optimizer state's does not) with about the same memory in use.
    step, phase, requested, allocated = run.oom_signature
    failing_step, failing_phase, failing_requested, failing_allocated = failing.oom_signature
    return (step, phase, requested) == (failing_step, failing_phase, failing_requested) and abs(
        allocated - failing_allocated
    ) <= 0.01 * max(allocated, failing_allocated, 1)


def accumulation_plan(
    original_batch_size: int, max_batch_size: int, accumulates: bool = True
) -> tuple[int, int]:
    """(micro-batch, accumulation steps) that keep the effective batch at the
    original size where a divisor allows it, else just above it. Without
    accumulation (an evaluation batch: nothing to accumulate), the batch
    that fits, in one step."""
    if not accumulates:
        return min(original_batch_size, max_batch_size), 1
    steps = math.ceil(original_batch_size / max_batch_size)
    for candidate in range(steps, 2 * steps + 1):
        if (
            original_batch_size % candidate == 0
            and original_batch_size // candidate <= max_batch_size
        ):
            return original_batch_size // candidate, candidate
    return math.ceil(original_batch_size / steps), steps
