"""The largest batch that holds for the whole run, not only its replay.

The plain batch search finds the largest batch whose replay fits. On CUDA
that replay can fit with the allocator's reservations growing from step to
step: on the H100 (benchmarks/scripts/hf_trainer_varlen.py, HF Trainer,
16 GiB, 10 seeds by hand over 32 steps and two evaluations) the search's
largest batch, 9, ran out of memory on 3 of 10 seeds, 8 held on 10 of 10,
and with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` 10 held on 10 of
10. So the largest batch's own replay is certified (oomdoc.replay.certificate);
when only the allocator's drift refuses it, the batch above it is replayed
with expandable segments (started as soon as the search ends, beside the
savers' searches), then further up while the batch model leaves room, or
the largest batch itself with them when the one above does not fit. The
answer names the setting it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from oomdoc.fixes import fix_named
from oomdoc.fixes.allocator import CONF_ENV, EXPANDABLE
from oomdoc.model import Certificate, Snapshot
from oomdoc.replay.certificate import certificate_for
from oomdoc.replay.fragmentation import (
    EXPANDABLE_FIX,
    MARGIN_GAP,
    drift_refusal,
    expandable_left_out,
    replay_certificate,
)
from oomdoc.replay.plan import ReplayState
from oomdoc.replay.replayer import Replayer
from oomdoc.replay.search import saver_trial
from oomdoc.sizes import format_bytes

# Replays with expandable segments above the largest batch, at most.
MAX_TRIALS = 3


@dataclass
class WholeRunLargest:
    """The largest batch certified for the whole run (None: none was), the
    allocator setting it holds with, and what decided it."""

    batch_size: Optional[int]
    setting: Optional[str] = None
    note: str = ""


class LargestBatchCheck:
    """Certify the plain search's largest batch, with expandable segments
    when the allocator's drift alone refused it."""

    def __init__(self, replayer: Replayer, snapshot: Snapshot, state: ReplayState):
        self.replayer, self.snapshot, self.state = replayer, snapshot, state
        self.capacity = snapshot.device.capacity_bytes
        self.refused: Optional[Certificate] = None
        self.result: Optional[WholeRunLargest] = None
        self.fix = fix_named(EXPANDABLE_FIX)
        # What each replay with expandable segments that did not certify found.
        self.findings: list[str] = []

    def start(self) -> None:
        """Certify the largest batch's replay; when the drift alone refused
        it, start the replay one batch above with expandable segments."""
        search = self.state.search
        best = search.best_run if search is not None else None
        if (
            search is None
            or best is None
            or not search.exact
            or best.replay is None
            or not getattr(self.replayer.options, "whole_run", True)
        ):
            return
        certificate = certificate_for(
            best.replay.capture, self.snapshot, self.capacity, [best.peak_allocated_bytes or 0]
        )
        if certificate is None:
            return
        if certificate.certified:
            self.result = WholeRunLargest(best.batch_size, note="certified for the whole run")
            return
        requested = getattr(self.replayer.options, "fixes", None)
        if (
            self.fix is None
            or not drift_refusal(certificate, [], self.snapshot)
            or expandable_left_out(requested)
        ):
            # The largest batch leaves no margin by its nature: only what
            # else its replay did not cover is said.
            gaps = [gap for gap in certificate.gaps if MARGIN_GAP not in gap]
            if gaps:
                self.result = WholeRunLargest(None, note="; ".join(gaps))
            return
        self.refused = certificate
        self.state.defaults_drift_bytes = certificate.drift_bytes_per_step
        self.state.defaults_drift_peak_bytes = best.peak_allocated_bytes or 0
        if best.batch_size + 1 < search.original_batch_size:
            payload, label, args, env = self._trial(best.batch_size + 1)
            self.replayer.ahead(payload, label, args=args, extra_env=env)

    def _trial(self, batch_size: int) -> tuple[dict, str, Optional[list[str]], dict]:
        assert self.fix is not None
        return saver_trial(self.replayer, self.snapshot, self.state, self.fix, batch_size)

    def _certified(self, batch_size: int) -> bool:
        payload, label, args, env = self._trial(batch_size)
        replay = self.replayer.run(payload, label, args=args, extra_env=env)
        certificate, found = replay_certificate(replay, self.snapshot)
        if certificate is None or not certificate.certified:
            self.findings.append(f"batch {batch_size} with it: {found}")
            return False
        return True

    def settle(self) -> Optional[WholeRunLargest]:
        """The answer, running the replays with expandable segments it still
        needs (ReplaysInterrupted passes through)."""
        if self.refused is None or self.result is not None:
            return self.result
        search = self.state.search
        assert search is not None and search.max_batch_size is not None
        largest = search.max_batch_size
        setting = f"{CONF_ENV}={EXPANDABLE}"
        why = (
            f"at the allocator's defaults batch {largest}'s reserved memory grew "
            f"{format_bytes(self.refused.drift_bytes_per_step)} a step (fragmentation)"
        )
        found = None
        candidate = largest + 1
        for _ in range(MAX_TRIALS):
            if candidate >= search.original_batch_size:
                break
            if found is not None:
                # Expandable segments free no allocated byte: above what the
                # batch model puts past the capacity, no batch fits.
                need = search.model.need(candidate) if search.model is not None else None
                if need is None or need > self.capacity:
                    break
            if not self._certified(candidate):
                break
            found = candidate
            candidate += 1
        if found is None and self._certified(largest):
            found = largest
        found_above = "".join(f"; {finding}" for finding in self.findings)
        if found is None:
            self.result = WholeRunLargest(
                None,
                note=f"{why}; replayed with {setting}, batch {largest} was not certified either"
                + found_above,
            )
        else:
            self.result = WholeRunLargest(found, setting, note=why + found_above)
        return self.result
