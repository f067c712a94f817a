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


def planned_batch(candidate: Candidate, original_batch_size: int) -> int:
    """The micro-batch prescribed for a candidate: the accumulation plan that
    keeps the effective batch, from the batch it ran at."""
    return batch_model.accumulation_plan(
        original_batch_size, min(candidate.batch_size, original_batch_size)
    )[0]


def choose(
    candidates: list[Candidate],
    original_batch_size: int,
    capacity_bytes: int,
    margin_fraction: float,
    reference: Optional[Candidate],
) -> Optional[Prescription]:
    """The candidate with the highest throughput that leaves the margin free;
    without one, the fitting candidate with the lowest peak (said so)."""
    # A candidate that ran at another batch than the micro-batch it
    # prescribes (the accumulation plan for its batch) gives way to one
    # that ran at that micro-batch with the same fixes: that one measured it.
    ran = {(tuple(c.fixes), c.batch_size) for c in candidates}
    candidates = [
        c
        for c in candidates
        if planned_batch(c, original_batch_size) == c.batch_size
        or (tuple(c.fixes), planned_batch(c, original_batch_size)) not in ran
    ]
    if not candidates:
        return None
    margin = int(margin_fraction * capacity_bytes)
    limit = capacity_bytes - margin

    def throughput(candidate: Candidate) -> float:
        return candidate.samples_per_second or 0.0

    within = [c for c in candidates if c.peak_allocated_bytes <= limit]
    if within:
        # Highest throughput; then fewer changes; then the lower peak.
        best = max(within, key=lambda c: (throughput(c), -len(c.fixes), -c.peak_allocated_bytes))
        fits = True
    else:
        best = min(candidates, key=lambda c: c.peak_allocated_bytes)
        fits = False
    micro = planned_batch(best, original_batch_size)
    steps = batch_model.accumulation_plan(original_batch_size, micro)[1]
    ratio = None
    if reference is not None and best.samples_per_second and reference.samples_per_second:
        ratio = round(best.samples_per_second / reference.samples_per_second, 3)
    detail = f"measured in the replay {best.label!r}: peak at batch {best.batch_size}" + (
        f", {best.samples_per_second:.1f} samples/s" if best.samples_per_second else ""
    )
    if not fits:
        detail += f"; no measured configuration leaves the {margin_fraction:.0%} safety margin free"
    return Prescription(
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
