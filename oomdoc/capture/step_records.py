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

import time
from collections import deque
from typing import Any

import torch

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


class CudaStepTimer:
    """CUDA step durations without waiting for the GPU at every step.

    An event is recorded on the current stream at each step boundary; a
    step's duration is the GPU time between its two events (in steady state
    the step's wall time, whether the GPU or the host is the bottleneck),
    read once the later event has completed. The first step, which has no
    event before it, is timed on the host after one synchronize. Until an
    event is read the host-measured duration stands."""

    def __init__(self):
        self._last_event = None
        self._pending: deque = deque()

    def mark(self) -> Any:
        """An event recorded now (where a step's work ends), or None."""
        try:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        except Exception:
            return None

    def close(
        self, step: dict, started: float, ended_at: float | None = None, mark: Any = None
    ) -> None:
        """The step ends now, or at `mark` (an event from mark(), recorded
        at host time `ended_at`)."""
        try:
            first = self._last_event is None
            if mark is None:
                if first:
                    torch.cuda.synchronize()
                    ended_at = time.perf_counter()
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            else:
                event = mark
                if first:
                    event.synchronize()
            if first:
                step["duration_s"] = round(float(ended_at or time.perf_counter()) - started, 6)
            else:
                self._pending.append((step, self._last_event, event))
            self._last_event = event
            self.collect(block=False)
        except Exception:  # a broken context: keep the host-measured duration
            self._last_event = None

    def collect(self, block: bool) -> None:
        pending = self._pending
        while pending:
            step, start, end = pending[0]
            try:
                if block:
                    end.synchronize()
                elif not end.query():
                    return
                step["duration_s"] = round(start.elapsed_time(end) / 1000.0, 6)
            except Exception:
                pass
            pending.popleft()
