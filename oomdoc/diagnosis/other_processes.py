"""other_processes: other processes hold memory of this GPU."""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_BREAKDOWN, TIER_DECISIVE, Diagnosis, MiB
from oomdoc.formatting import percent
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

REMEDY = "nvidia-smi   # find them; stop them, or run on a free GPU:\nCUDA_VISIBLE_DEVICES=1 python train.py"


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    processes = snapshot.device.other_processes
    if not processes:
        return None
    total_used = sum(process.used_bytes for process in processes)
    total = snapshot.device.total_bytes or snapshot.capacity_bytes
    requested = snapshot.oom.requested_bytes if snapshot.oom else 0
    decisive = snapshot.is_oom and requested > 0 and total_used >= requested
    if not decisive and total_used < max(256 * MiB, total // 50):
        return None
    largest = sorted(processes, key=lambda process: -process.used_bytes)[:5]
    shown = ", ".join(f"pid {p.pid}: {format_bytes(p.used_bytes)}" for p in largest)
    evidence = [f"{len(processes)} other process(es) on this GPU: {shown}"]
    if decisive:
        evidence.append(f"they hold more than the {format_bytes(requested)} the OOM asked for")
    if total:
        evidence.append(
            f"that is {percent(total_used, total, 0)} of the GPU's {format_bytes(total)}"
        )
    summary = f"Other processes hold {format_bytes(total_used)} of this GPU"
    return Diagnosis(
        "other_processes",
        summary,
        evidence,
        total_used,
        tier=TIER_DECISIVE if decisive else TIER_BREAKDOWN,
        remedy=REMEDY,
    )
