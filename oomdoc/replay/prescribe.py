"""The prescription: the configuration to use instead, chosen among measured
ones.

A configuration is a set of memory-saving fixes (those that save memory at
any batch size: autocast, checkpointing, a lighter optimizer) and a
micro-batch, with gradient accumulation making up the user's effective
batch. Every candidate was replayed: the failing configuration at the
batches the batch search tried, each fix at the failing batch, the combined
savers at the failing batch and, when that does not fit, at the batches a
second search tried. The prescription is the candidate with the highest
measured training throughput (samples per second at the user's effective
batch) whose peak leaves the safety margin free.

Its micro-batch may be larger than the batch the candidate ran: up to the
largest batch that the candidate's peak and the next batch measured with the
same fixes predict to leave the margin free (`plan_limit`). The replay of the
prescription with its gradient accumulation then measures exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from oomdoc.model import Prescription
from oomdoc.replay import batch as batch_model

# A fix that saves less than this share of the failing run's need is a no-op:
# it is never combined with another.
NO_OP_SHARE = 0.01


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

    @property
    def samples_per_second(self) -> Optional[float]:
        if not self.step_s:
            return None
        return self.batch_size / self.step_s


def is_no_op(
    peak_bytes: Optional[int], fits: bool, oom_signature, failing_signature, need: int
) -> bool:
    """A fix that changed (almost) nothing: it saved under 1% of the need when
    it fit, or ran out of memory at the same point, with the same memory in
    use, as the failing run."""
    if fits:
        return peak_bytes is None or need - peak_bytes < NO_OP_SHARE * need
    if oom_signature is None or failing_signature is None:
        return False
    step, phase, requested, allocated = oom_signature
    f_step, f_phase, f_requested, f_allocated = failing_signature
    return (step, phase, requested) == (f_step, f_phase, f_requested) and abs(
        allocated - f_allocated
    ) <= NO_OP_SHARE * max(allocated, f_allocated, 1)


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


def choose(
    candidates: list[Candidate],
    original_batch_size: int,
    capacity_bytes: int,
    margin_fraction: float,
    reference: Optional[Candidate],
) -> Optional[Prescription]:
    """The candidate with the highest throughput that leaves the margin free;
    without one, the fitting candidate with the lowest peak (said so)."""
    picked = pick(candidates, capacity_bytes, margin_fraction)
    if picked is None:
        return None
    best, fits = picked
    return prescription_from(
        best, fits, original_batch_size, capacity_bytes, margin_fraction, reference
    )


def pick(
    candidates: list[Candidate], capacity_bytes: int, margin_fraction: float
) -> Optional[tuple[Candidate, bool]]:
    """(the candidate to prescribe, whether it leaves the margin free)."""
    if not candidates:
        return None
    limit = capacity_bytes - int(margin_fraction * capacity_bytes)

    def throughput(candidate: Candidate) -> float:
        return candidate.samples_per_second or 0.0

    within = [c for c in candidates if c.peak_allocated_bytes <= limit]
    if within:
        # Highest throughput; then fewer changes; then the lower peak.
        best = max(within, key=lambda c: (throughput(c), -len(c.fixes), -c.peak_allocated_bytes))
        return best, True
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
        prescription.extra["throughput_batch_size"] = best.batch_size
    return prescription
