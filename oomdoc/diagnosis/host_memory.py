"""host_memory: the machine's RAM, not the device's, ran out."""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_CONTEXT, TIER_DECISIVE, Diagnosis, MiB
from oomdoc.formatting import percent
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

REMEDY = (
    "DataLoader(..., num_workers=2)        # each worker holds its own copy of the dataset state\n"
    "torch.load(path, map_location='cpu', mmap=True)  # map checkpoints instead of reading them into RAM"
)


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    host = snapshot.host
    if (
        host is None
        or host.total_bytes <= 0
        or host.available_bytes is None
        or host.available_bytes < 0
    ):
        return None
    total, available = host.total_bytes, host.available_bytes
    if available >= 0.1 * total and available >= 1024 * MiB:
        return None
    killed = snapshot.exit_code in (137, -9)
    evidence = [
        f"{format_bytes(available)} of {format_bytes(total)} host RAM available ({percent(available, total, 0)})"
    ]
    if host.process_rss_bytes:
        evidence.append(f"the script's process used {format_bytes(host.process_rss_bytes)}")
    if killed:
        evidence.append(
            "the script was killed (exit status 137): the kernel's OOM killer ends a process when RAM runs out"
        )
    summary = "Host memory is nearly exhausted" + (" and the script was killed" if killed else "")
    return Diagnosis(
        "host_memory",
        summary,
        evidence,
        total - available,
        tier=TIER_DECISIVE if killed else TIER_CONTEXT,
        remedy=REMEDY,
    )
