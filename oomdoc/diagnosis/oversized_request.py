"""oversized_request: one request larger than the whole device.

No fix that frees memory makes it fit: even an empty device cannot hold it,
so the advice about what else filled the device does not apply to it. What
helps is to make that one tensor smaller (chunks, a smaller shape or dtype)
or to keep it off the device, at the line where it was asked for.
"""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_BUG, Diagnosis
from oomdoc.formatting import format_location
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

REMEDY = (
    "# make that one tensor smaller, or keep it off the device:\n"
    "for chunk in torch.split(inputs, chunk_size):   # process it in pieces\n"
    "    ...\n"
    "big = torch.empty(shape, device='cpu')         # or keep it in host memory"
)


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    oom = snapshot.oom if snapshot.is_oom else None
    capacity = snapshot.capacity_bytes
    if oom is None or capacity <= 0 or oom.requested_bytes <= capacity:
        return None
    where = format_location(oom.location, snapshot.cwd) if oom.location else None
    evidence = [
        f"the failing request alone is {format_bytes(oom.requested_bytes)}, "
        f"more than the device's whole {format_bytes(capacity)}",
        f"it was made at {where}" if where else "",
        f"only {format_bytes(oom.allocated_bytes)} was in use when it was made: "
        "freeing memory (fewer parameters, lighter optimizer state, smaller activations) cannot make it fit",
    ]
    return Diagnosis(
        "oversized_request",
        f"One request of {format_bytes(oom.requested_bytes)} is larger than the whole "
        f"{format_bytes(capacity)} device"
        + (f" ({where})" if where else "")
        + ": it cannot fit, whatever else is freed",
        evidence,
        oom.requested_bytes,
        tier=TIER_BUG,
        remedy=REMEDY,
    )
