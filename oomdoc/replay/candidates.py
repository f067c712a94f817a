"""The choice among measured configurations (pure): each candidate is a set
of memory savers at a batch that a replay ran, with its peak and step time;
the prescription is the one with the highest throughput that leaves the
safety margin free, its micro-batch and gradient accumulation keeping the
user's effective batch. `considered` lists every configuration weighed, for
the report: measured, or why not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from oomdoc.model import ConsideredConfiguration, Prescription, Snapshot
from oomdoc.replay import batch as batch_model
from oomdoc.replay.timing import ratio_noise


@dataclass
class Candidate:
    """One measured configuration."""

    fixes: list[str]
    batch_size: int  # what the replay ran
    peak_allocated_bytes: int
    step_s: Optional[float]
    label: str = ""
    notes: list[str] = field(default_factory=list)
    # The largest micro-batch a prescription from this candidate may plan
    # (see plan_limits); None: the batch it ran.
    plan_limit: Optional[int] = None
    step_noise: Optional[float] = None  # oomdoc.replay.timing.StepTiming.noise
    # Measured exactly as it would be prescribed: this micro-batch with this
    # many accumulation steps (the prescription's own replay); `step_s` is
    # then per micro-batch. Otherwise its throughput at the micro-batch it
    # would be prescribed is only bounded by the one at the batch it ran.
    exact: bool = False
    accumulation_steps: int = 1
    # The replay with accumulation that measured an exact candidate, for the
    # snapshot (replay_record), and its label.
    accumulation_record: Optional[dict] = None
    accumulation_label: str = ""
    # Runs the replay that measured an exact candidate once more (its
    # timing taken again when it is noisy and a rival is close), and
    # whether it was.
    remeasure: Optional[Callable[[], Any]] = field(default=None, repr=False, compare=False)
    retimed: bool = False
    # A candidate planned below the batches measured (planned_below): the
    # batch whose run its step time and peak come from.
    planned_from: Optional[int] = None
    # Never ran fitting (a saver assumed to fit where no fix fits): its
    # throughput is unknown, so it may be the fastest; it is prescribed only
    # once measured.
    untimed: bool = False
    # The capture of the replay that measured it (the certificate reads it).
    capture: Optional[Snapshot] = field(default=None, repr=False, compare=False)
    # The samples a timed step trains on where the batch searched is not the
    # training's (an evaluation batch: the training batch stays, and the
    # evaluation's size must not count as training throughput); None: the
    # candidate's own batch.
    trained_per_step: Optional[int] = None
    # The candidate measured exactly as prescribed that took this one's place
    # (measured_choice): a later choice (flags_choice) weighs that one, with
    # its timing, not this bound again.
    measured_as: Optional[Candidate] = field(default=None, repr=False, compare=False)
    # Why its replay as prescribed did not count (measured_choice), for the
    # report: "" while it was not replayed so.
    rejected: str = ""

    def latest(self) -> Candidate:
        """This candidate as last measured (measured_as, followed)."""
        candidate = self
        while candidate.measured_as is not None:
            candidate = candidate.measured_as
        return candidate

    @property
    def samples_per_second(self) -> Optional[float]:
        if not self.step_s:
            return None
        return (self.trained_per_step or self.batch_size) / self.step_s


def plan_limits(
    candidates: list[Candidate], points: list[tuple[tuple, int, int]], limit_bytes: int
) -> None:
    """Set each candidate's `plan_limit`: between its batch and the next larger
    batch measured with the same fixes (`points`: (fixes, batch, peak, or the
    need a batch that ran out of memory showed)) whose peak goes past
    `limit_bytes`, the largest batch whose linearly interpolated peak stays
    within it. Peaks grow about linearly with the batch between two measured
    batches; the prescription's own replay checks the one planned."""
    for candidate in candidates:
        if candidate.peak_allocated_bytes > limit_bytes:
            continue
        larger = [
            (batch, peak)
            for fixes, batch, peak in points
            if tuple(fixes) == tuple(candidate.fixes) and batch > candidate.batch_size
        ]
        if not larger:
            continue
        batch, peak = min(larger)
        if peak <= limit_bytes or peak <= candidate.peak_allocated_bytes:
            continue  # that batch is a candidate of its own, or no slope to go by
        per_sample = (peak - candidate.peak_allocated_bytes) / (batch - candidate.batch_size)
        planned = candidate.batch_size + int(
            (limit_bytes - candidate.peak_allocated_bytes) // per_sample
        )
        candidate.plan_limit = max(candidate.batch_size, min(planned, batch - 1))


def planned_below(
    candidates: list[Candidate],
    points: list[tuple[tuple, int, int]],
    original: int,
    limit_bytes: int,
) -> list[Candidate]:
    """For each configuration whose every run went over `limit_bytes`, a
    smaller micro-batch to measure (plan_below its smallest run)."""
    planned = []
    groups: dict[tuple, list[Candidate]] = {}
    for candidate in candidates:
        groups.setdefault(tuple(candidate.fixes), []).append(candidate)
    for group in groups.values():
        if any(candidate.peak_allocated_bytes <= limit_bytes for candidate in group):
            continue
        smallest = min(group, key=lambda candidate: candidate.batch_size)
        below = plan_below(smallest, points, original, limit_bytes)
        if below is not None:
            planned.append(below)
    return planned


def plan_below(
    anchor: Candidate, points: list[tuple[tuple, int, int]], original: int, limit_bytes: int
) -> Optional[Candidate]:
    """The largest micro-batch of the accumulation grid below the batch of
    `anchor` (a run over `limit_bytes`) whose peak, down from the anchor's
    with the slope through the configuration's two smallest measured batches
    (`points`: (fixes, batch, peak)), stays within it: a candidate to be
    measured as prescribed. Its step time is the anchor's per sample, so its
    throughput is a bound from above, as a larger batch's is. None without
    a slope to go by."""
    fixes = tuple(anchor.fixes)
    measured = sorted({batch: peak for key, batch, peak in points if tuple(key) == fixes}.items())
    if len(measured) < 2:
        return None
    (b1, p1), (b2, p2) = measured[:2]
    slope = (p2 - p1) / (b2 - b1)
    if slope <= 0:
        return None
    largest = anchor.batch_size - 1
    while largest >= 1:
        micro, _steps = batch_model.accumulation_plan(original, largest)
        peak = anchor.peak_allocated_bytes - slope * (anchor.batch_size - micro)
        if peak <= limit_bytes:
            step_s = anchor.step_s * micro / anchor.batch_size if anchor.step_s else None
            return Candidate(
                list(fixes),
                micro,
                int(peak),
                step_s,
                f"planned below {anchor.label!r}",
                notes=[
                    f"batch {micro}'s peak estimated down from batch {anchor.batch_size}'s "
                    f"with the slope between batches {b1} and {b2}"
                ],
                step_noise=anchor.step_noise,
                planned_from=anchor.batch_size,
                trained_per_step=anchor.trained_per_step,
            )
        largest = micro - 1
    return None


def choose(
    candidates: list[Candidate],
    original_batch_size: int,
    capacity_bytes: int,
    margin_fraction: float,
    reference: Optional[Candidate],
) -> Optional[Prescription]:
    """The candidate with the highest throughput that leaves the margin free;
    without one, the fitting candidate with the lowest peak (said so)."""
    picked = pick(candidates, capacity_bytes, margin_fraction, original_batch_size)
    if picked is None:
        return None
    best, fits = picked
    return prescription_from(
        best, fits, original_batch_size, capacity_bytes, margin_fraction, reference
    )


# Throughputs closer than this share (or than their measured noise, up to
# TIE_NOISE_CAP) are not told apart: the configuration with fewer changes
# wins, so that the same script gets the same prescription run after run.
TIE_SHARE = 0.02
TIE_NOISE_CAP = 0.05


def throughput_bound(candidate: Candidate, micro: int) -> Optional[float]:
    """The most `candidate` can train per second at micro-batch `micro`,
    from the batch it ran: there, its throughput; at a larger micro-batch
    (planned up to its `plan_limit`), `micro` samples in no less than the
    step time it measured, since a step over more samples is never shorter.
    On the H200 pytorch/examples' ImageNet trainer ran batch 69 at 1234.5
    samples/s and 191 at 2099 (by hand): the throughput of the batch that ran
    is no bound for the larger micro-batch planned from it."""
    rate = candidate.samples_per_second
    if rate is None or candidate.exact or candidate.trained_per_step:
        return rate
    return rate * max(micro, candidate.batch_size) / candidate.batch_size


def pick(
    candidates: list[Candidate],
    capacity_bytes: int,
    margin_fraction: float,
    original: Optional[int] = None,
    accumulates: bool = True,
) -> Optional[tuple[Candidate, bool]]:
    """(the candidate to prescribe, whether it leaves the margin free).
    With the user's batch (`original`), a candidate planned above the batch
    it ran is weighed by what it could run there (throughput_bound)."""
    if not candidates:
        return None
    limit = capacity_bytes - int(margin_fraction * capacity_bytes)

    # Where the batch searched is the evaluation's, every candidate with the
    # same savers trains the same steps: one throughput for them all (the
    # median of their timings), so that timing noise does not pick the
    # evaluation batch; the largest evaluation batch then wins the tie.
    shared: dict[tuple, list[float]] = {}
    for candidate in candidates:
        if candidate.trained_per_step and candidate.samples_per_second:
            shared.setdefault(tuple(candidate.fixes), []).append(candidate.samples_per_second)

    def throughput(candidate: Candidate) -> float:
        if candidate.untimed:
            return math.inf  # unknown: it may be the fastest, so it is measured first
        rates = shared.get(tuple(candidate.fixes)) if candidate.trained_per_step else None
        if rates:
            return sorted(rates)[len(rates) // 2]
        if original:
            micro = planned_micro(candidate, original, accumulates)[0]
            return throughput_bound(candidate, micro) or 0.0
        return candidate.samples_per_second or 0.0

    within = [c for c in candidates if c.peak_allocated_bytes <= limit]
    if within:
        fastest = max(within, key=throughput)
        best = throughput(fastest)

        def tied(candidate: Candidate) -> bool:
            if math.isinf(best):
                return candidate.untimed
            noise = ratio_noise(candidate.step_noise, fastest.step_noise)
            share = min(max(TIE_SHARE, noise), TIE_NOISE_CAP)
            return best > 0 and throughput(candidate) >= best * (1 - share)

        # Highest throughput, within noise; then fewer changes; then measured
        # as prescribed; then the higher throughput and the lower peak.
        contenders = [c for c in within if tied(c)] or [fastest]

        def preference(c: Candidate) -> tuple:
            if c.trained_per_step:
                # The same training at any evaluation batch: the larger
                # evaluation batch runs the evaluation in fewer passes.
                largest = max(c.batch_size, c.plan_limit or 0)
                return (-len(c.fixes), throughput(c), largest, c.exact, -c.peak_allocated_bytes)
            return (-len(c.fixes), c.exact, throughput(c), -c.peak_allocated_bytes)

        chosen = max(contenders, key=preference)
        return chosen, True
    return min(candidates, key=lambda c: c.peak_allocated_bytes), False


def prescription_from(
    best: Candidate,
    fits: bool,
    original_batch_size: int,
    capacity_bytes: int,
    margin_fraction: float,
    reference: Optional[Candidate],
    accumulates: bool = True,
) -> Prescription:
    """The prescription of one candidate: its micro-batch and accumulation
    keep the user's effective batch (`accumulates`: else the batch that
    fits, an evaluation batch)."""
    margin = int(margin_fraction * capacity_bytes)
    largest = max(best.batch_size, best.plan_limit or 0)
    micro, steps = batch_model.accumulation_plan(
        original_batch_size, min(largest, original_batch_size), accumulates
    )
    ratio = None
    if reference is not None and best.samples_per_second and reference.samples_per_second:
        ratio = round(best.samples_per_second / reference.samples_per_second, 3)
    detail = f"measured in the replay {best.label!r}: peak at batch {best.batch_size}" + (
        f", {best.samples_per_second:.1f} samples/s" if best.samples_per_second else ""
    )
    if not fits:
        detail += f"; no measured configuration leaves the {margin_fraction:.0%} safety margin free"
    prescription = Prescription(
        fixes=list(best.fixes),
        batch_size=micro,
        accumulation_steps=steps,
        peak_allocated_bytes=best.peak_allocated_bytes,
        fits=fits,
        samples_per_second=round(best.samples_per_second, 3) if best.samples_per_second else None,
        measured=True,
        kind="config",
        headroom_bytes=capacity_bytes - best.peak_allocated_bytes,
        margin_bytes=margin,
        throughput_ratio=ratio,
        detail=detail + "".join(f"; {note}" for note in best.notes),
    )
    if best.samples_per_second and micro != best.batch_size:
        # The throughput is the batch the candidate ran, not the micro-batch.
        prescription.throughput_batch_size = best.batch_size
    if best.samples_per_second and best.step_noise is not None:
        prescription.samples_per_second_noise = best.step_noise
    return prescription


def planned_micro(candidate: Candidate, original: int, accumulates: bool) -> tuple[int, int]:
    """The micro-batch and accumulation steps `candidate` would be
    prescribed with: those it ran when measured exactly, else the plan of
    the largest batch it allows. (A configuration whose every batch left the
    margin short was listed at the batch it ran with 1 accumulation step:
    "autocast 8 x 1" for a user's batch of 64, on a Fabric script.)"""
    if candidate.exact:
        return candidate.batch_size, candidate.accumulation_steps
    largest = max(candidate.batch_size, candidate.plan_limit or 0)
    return batch_model.accumulation_plan(original, min(largest, original), accumulates)


def considered(
    configurations: list[tuple[str, ...]],
    candidates: list[Candidate],
    chosen: Prescription,
    not_searched: dict[tuple[str, ...], str],
    original: int,
    limit_bytes: int,
    accumulates: bool,
) -> list[ConsideredConfiguration]:
    """Every configuration weighed (`configurations`: no fix, and the
    savers'), at the micro-batch it would be prescribed with: the prescribed
    one first, then the others by throughput, each with what its replays
    measured or why it was not measured."""
    prescribed = chosen.samples_per_second or 0.0
    entries = []
    for fixes in dict.fromkeys(configurations):
        own = [candidate for candidate in candidates if tuple(candidate.fixes) == fixes]
        # An estimate at a micro-batch measured as prescribed (or larger
        # than one that was) is superseded by the measurement.
        smallest_measured = min(
            (candidate.batch_size for candidate in own if candidate.accumulation_record),
            default=None,
        )
        own = [
            candidate
            for candidate in own
            if candidate.exact
            or smallest_measured is None
            or candidate.batch_size < smallest_measured
        ]
        within = [candidate for candidate in own if candidate.peak_allocated_bytes <= limit_bytes]
        entry = ConsideredConfiguration(fixes=list(fixes))
        if not within:
            entry.verdict = "over_margin" if own else "does_not_fit"
            if own:
                lowest = min(own, key=lambda candidate: candidate.peak_allocated_bytes)
                entry.peak_allocated_bytes = lowest.peak_allocated_bytes
                entry.batch_size, entry.accumulation_steps = planned_micro(
                    lowest, original, accumulates
                )
                entry.measured = not all(candidate.untimed for candidate in own)
                entry.reason = (
                    "every batch it ran left the safety margin short "
                    "(a smaller micro-batch with more accumulation steps was not measured)"
                    if entry.measured
                    # untimed_savers: it ran no batch that fit, and is taken to need
                    # what no fix needed at the micro-batch no fix's largest batch gives
                    else f"not measured: no batch it ran fit, and at batch {entry.batch_size}, "
                    "taken to need no more than no fix did, it would leave the safety margin short"
                )
            else:
                entry.verdict = "not_measured" if fixes in not_searched else "does_not_fit"
                entry.reason = not_searched.get(fixes) or (
                    "no batch its replays tried fit (or it was not replayed at a smaller batch)"
                )
            entries.append(entry)
            continue
        best = max(
            within, key=lambda candidate: (candidate.exact, candidate.samples_per_second or 0.0)
        )
        micro, steps = planned_micro(best, original, accumulates)
        entry.batch_size, entry.accumulation_steps = micro, steps
        entry.peak_allocated_bytes = best.peak_allocated_bytes
        measured_rate = best.samples_per_second
        throughput = throughput_bound(best, micro)
        entry.samples_per_second = round(throughput, 3) if throughput else None
        entry.samples_per_second_noise = best.step_noise
        entry.measured = best.exact or (
            steps == 1 and micro == best.batch_size and not best.untimed
        )
        if best.untimed:
            entry.verdict = "not_measured"
            entry.peak_allocated_bytes = None
            entry.reason = (
                "no batch above no fix's largest fit under it, and its replay at that "
                + (
                    f"micro-batch did not count: {best.rejected}"
                    if best.rejected
                    else "micro-batch did not run (the replays for the prescription ran out)"
                )
            )
        elif list(fixes) == chosen.fixes and chosen.fits:
            entry.verdict, entry.reason = "prescribed", "the fastest that leaves the margin free"
        elif entry.measured:
            entry.verdict = "slower"
            entry.reason = (
                "measured as it would be prescribed"
                if not throughput or throughput < prescribed
                else "as fast within the timing noise, with more changes"
            )
        else:
            entry.verdict = "slower"
            ran = best.planned_from or best.batch_size
            bound = (
                f"{measured_rate:.1f} samples/s, and a step over {micro} samples is never "
                f"shorter: at most {throughput:.1f}"
                if measured_rate and throughput and micro > best.batch_size
                else (f"{throughput:.1f} samples/s" if throughput else "untimed")
                + ", which bounds it from above"
            )
            above = bool(prescribed and throughput and throughput > prescribed)
            entry.reason = f"not measured at batch {micro} x {steps}: batch {ran} ran {bound}" + (
                f", above the prescription's {prescribed:.1f}"
                if above
                else (f", below the prescription's {prescribed:.1f}" if prescribed else "")
            )
        entries.append(entry)
    order = {"prescribed": 0, "slower": 1, "over_margin": 2, "not_measured": 3, "does_not_fit": 4}
    return sorted(
        entries, key=lambda entry: (order.get(entry.verdict, 5), -(entry.samples_per_second or 0))
    )
