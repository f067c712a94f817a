"""caught_oom: the script ran out of memory and went on, having caught the
error itself: a batch-size finder (accelerate's `find_executable_batch_size`,
the HF `Trainer`'s `auto_find_batch_size`, Lightning's `BatchSizeFinder`) or
a step it skips. The run may then fit, with nothing else to say that the
device ran out."""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_CONTEXT, TIER_DECISIVE, Diagnosis
from oomdoc.formatting import format_location
from oomdoc.model import Location, Snapshot
from oomdoc.sizes import format_bytes

# What oomdoc does better than a finder, said beside the evidence.
ADVICE = (
    "a finder keeps the first batch that fits as it shrinks (by 10% or by half a try); "
    "run the script at its starting batch without it under `oomdoc run`, whose replays "
    "measure the largest batch that fits, exactly, and the fastest configuration at the "
    "same effective batch"
)


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    seen, caught = snapshot.ooms_seen, snapshot.caught_ooms
    if seen is None or caught <= 0:
        return None
    times = "once" if caught == 1 else f"{caught} times"
    first = f"the first in step {seen.step}" if seen.step is not None else "the first"
    if seen.phase:
        first += f" during {seen.phase}"
    if seen.requested_bytes:
        first += f", asking for {format_bytes(seen.requested_bytes)}"
    if seen.file:
        location = Location(file=seen.file, line=seen.line, function=seen.function or "?")
        first += f", at {format_location(location, snapshot.cwd)}"
    ended = {
        "oom": ", then ran out of memory again and stopped",
        "error": ", then failed",  # (accelerate's finder: "reached zero")
    }.get(snapshot.outcome, " and went on")
    summary = (
        f"The script ran out of memory {times}, caught the error itself{ended}: "
        "a batch-size finder (accelerate's find_executable_batch_size, the HF Trainer's "
        "auto_find_batch_size, Lightning's BatchSizeFinder) or a step it skips"
    )
    return Diagnosis(
        "caught_oom",
        summary,
        [first, ADVICE],
        seen.requested_bytes,
        tier=TIER_CONTEXT if snapshot.outcome == "oom" else TIER_DECISIVE,
    )
