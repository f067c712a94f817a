"""Step records kept bounded, whatever the run's length.

A run of 470,000 steps used to keep one record per step: a 279 MB snapshot
(3 GB in the child) that `oomdoc suggest` then refused. What the diagnoses
and the replays read is the first steps (the start, the warm-up), the steps
that peaked (what ran out of memory, or nearly), and the last ones (the
trend before the end, and the OOM's step, always the last one closed). Those
are kept exactly; the steps in between that peaked lower are dropped, and
the snapshot says how many (`steps_omitted`).
"""

from __future__ import annotations

# Kept exactly: this many first steps, last steps, and highest peaks between.
KEEP_FIRST = 32
KEEP_LAST = 64
KEEP_PEAKS = 32


class BoundedSteps:
    """Trims a list of step records in place (`trim`, called after each new
    record). The list grows to twice its bound between trims, so that the
    work per step stays constant; the highest peaks of the whole run are
    never dropped, since a step is dropped only when at least KEEP_PEAKS
    steps between the first and last ones peaked higher."""

    def __init__(
        self, keep_first: int = KEEP_FIRST, keep_last: int = KEEP_LAST, keep_peaks: int = KEEP_PEAKS
    ):
        self.keep_first, self.keep_last, self.keep_peaks = keep_first, keep_last, keep_peaks

    @property
    def bound(self) -> int:
        """The most records `trim` leaves."""
        return self.keep_first + self.keep_last + self.keep_peaks

    def trim(self, steps: list[dict]) -> None:
        if len(steps) <= 2 * self.bound:
            return
        end = len(steps) - self.keep_last
        between = steps[self.keep_first : end]
        highest = sorted(
            range(len(between)),
            key=lambda position: (
                between[position]["peak_allocated_bytes"],
                between[position]["peak_reserved_bytes"],
            ),
            reverse=True,
        )[: self.keep_peaks]
        steps[self.keep_first : end] = [between[position] for position in sorted(highest)]
