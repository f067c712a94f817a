"""A prescription the certificate refused for the CUDA allocator's drift,
replayed once more with expandable segments.

On the H100 (benchmarks/scripts/hf_trainer_varlen.py, HF Trainer, 16 GiB,
10 seeds by hand over the whole run) the batches near the limit ran out of
memory late in the run with far less allocated than the capacity: the
caching allocator's segments, split by batches of other lengths and by the
evaluation, left no block large enough (batch 10 held on 3 of 10 seeds, 9 on
7, the prescription 8 x 4 on 8). With
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` every one of them held on
10 of 10. A replay sees that drift as reserved memory growing from step to
step; the certificate names it a gap when it is more than a tolerance a step
(oomdoc.replay.certificate.UNBOUNDED_DRIFT_SHARE), else carries it in the
margin; when that is what refused it, the same configuration is replayed
with expandable segments,
and certified with them (its snippet then sets the variable) if that replay's
own certificate has no gap. Otherwise the refusal stands, and says what the
extra replay found.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from oomdoc.fixes import fix_named
from oomdoc.fixes.allocator import CONF_ENV, EXPANDABLE, ExpandableSegments
from oomdoc.model import Certificate, Prescription, Snapshot
from oomdoc.replay.certificate import DRIFT_GAP, certificate_for
from oomdoc.replay.replayer import Replay, ReplaysInterrupted
from oomdoc.sizes import format_bytes

EXPANDABLE_FIX = ExpandableSegments.name
# The certificate's own gap for a peak plus its margin above the capacity.
MARGIN_GAP = "are above the capacity"


def fix_parts(fixes: list[str]) -> list[str]:
    """Single fix names, combinations (`a+b`) taken apart."""
    return [part for fix in fixes for part in fix.split("+")]


def refused_for_drift(prescription: Prescription, snapshot: Snapshot) -> bool:
    """Whether the prescription's certificate was refused for the
    allocator's drift alone (drift_refusal)."""
    return drift_refusal(prescription.certificate, prescription.fixes, snapshot)


def drift_refusal(certificate: Optional[Certificate], fixes: list[str], snapshot: Snapshot) -> bool:
    """Whether a certificate's only gaps are the margin and the drift, on
    CUDA, with a measured growth of the allocator's reservations, and expandable
    segments not yet in use (by `fixes`, the script's environment, or the
    failing run's allocator)."""
    if certificate is None or certificate.certified or not expandable_applies(fixes, snapshot):
        return False
    if certificate.drift_bytes_per_step <= 0:
        return False
    return all(MARGIN_GAP in gap or DRIFT_GAP in gap for gap in certificate.gaps)


def expandable_applies(fixes: list[str], snapshot: Snapshot) -> bool:
    """Whether expandable segments could be added to `fixes`: on CUDA, not
    yet in use (by `fixes`, the script's environment, or the failing run's
    allocator), with a fix that combines them."""
    if not snapshot.device.on_cuda:
        return False
    parts = fix_parts(fixes)
    if EXPANDABLE_FIX in parts or fix_named("+".join([*parts, EXPANDABLE_FIX])) is None:
        return False
    if EXPANDABLE.lower() in os.environ.get(CONF_ENV, "").replace(" ", "").lower():
        return False
    return not (snapshot.allocator is not None and snapshot.allocator.expandable_segments)


def expandable_left_out(requested: Optional[list[str]]) -> bool:
    """Whether the user's `--fixes` leave expandable segments out (none
    given: every fix may be replayed)."""
    return bool(requested) and EXPANDABLE_FIX not in fix_parts(requested or [])


def with_expandable_segments(prescription: Prescription) -> Prescription:
    """The same configuration with expandable segments added."""
    return Prescription(
        fixes=[*prescription.fixes, EXPANDABLE_FIX],
        batch_size=prescription.batch_size,
        accumulation_steps=prescription.accumulation_steps,
    )


def replay_certificate(replay: Replay, snapshot: Snapshot) -> tuple[Optional[Certificate], str]:
    """The certificate of one replay of a configuration (None when it did
    not fit), and what kept it from being certified ('' when it is)."""
    certificate = (
        certificate_for(
            replay.capture,
            snapshot,
            snapshot.device.capacity_bytes,
            [replay.peak_allocated_bytes or 0],
        )
        if replay.fits
        else None
    )
    if certificate is None:
        oom = replay.outcome == "oom"
        return None, f"ran out of memory ({replay.message})" if oom else replay.outcome
    return certificate, "" if certificate.certified else "; ".join(certificate.gaps)


def certify_with_expandable_segments(
    prescription: Prescription,
    snapshot: Snapshot,
    replay_with: Callable[[Prescription], Replay],
    requested: Optional[list[str]] = None,
    ahead: Optional[Callable[[Prescription], object]] = None,
) -> Optional[Replay]:
    """Replay `prescription` with expandable segments when its certificate
    was refused for the allocator's drift (refused_for_drift), and adopt
    them when that replay is certified; the replay, or None when none ran.
    `requested`: the user's `--fixes`; without expandable_segments among
    them, the refusal stands and says what would take the drift away.
    `ahead(trial)`: starts what a certified trial is checked with next (the
    script's own flags) beside its replay."""
    if not refused_for_drift(prescription, snapshot):
        return None
    assert prescription.certificate is not None
    if expandable_left_out(requested):
        prescription.certificate.gaps.append(
            f"{CONF_ENV}={EXPANDABLE} may take the drift away: --fixes left it out"
        )
        return None
    trial = with_expandable_segments(prescription)
    if ahead is not None:
        ahead(trial)
    try:
        replay = replay_with(trial)
    except ReplaysInterrupted:
        return None  # Ctrl-C or stopped: the refusal stands as measured
    capacity = snapshot.device.capacity_bytes
    certificate, found = replay_certificate(replay, snapshot)
    if certificate is not None and certificate.certified:
        refused = prescription.certificate
        certificate.allocator_setting = (
            f"{CONF_ENV}={EXPANDABLE}: replayed without it, the reserved memory grew "
            f"{format_bytes(refused.drift_bytes_per_step)} a step (fragmentation): "
            + "; ".join(DRIFT_GAP if DRIFT_GAP in gap else gap for gap in refused.gaps)
        )
        prescription.fixes = trial.fixes
        prescription.certificate = certificate
        prescription.accumulation_replay = trial.accumulation_replay
        if replay.peak_allocated_bytes:
            prescription.peak_allocated_bytes = replay.peak_allocated_bytes
            if prescription.headroom_bytes is not None:
                prescription.headroom_bytes = capacity - replay.peak_allocated_bytes
        return replay
    prescription.certificate.gaps.append(
        f"replayed with {CONF_ENV}={EXPANDABLE} to take the drift away: {found}"
    )
    return replay
