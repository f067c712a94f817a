"""fragmentation: the CUDA allocator holds memory it cannot use, in pieces
too small for the request."""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_BREAKDOWN, TIER_DECISIVE, Diagnosis, MiB
from oomdoc.fixes.allocator import EmptyCache, ExpandableSegments, cannot_fit_by_allocator
from oomdoc.model import Allocator, Oom, Snapshot
from oomdoc.sizes import format_bytes


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    if not snapshot.device.on_cuda:
        return None
    allocator = snapshot.allocator or Allocator()
    reserved = allocator.reserved_bytes
    allocated = allocator.allocated_bytes
    split_bytes = allocator.inactive_split_bytes
    split_blocks = allocator.inactive_split_blocks
    if reserved <= 0:
        return None
    unused = max(0, reserved - allocated)
    oom = snapshot.oom or Oom()
    requested = oom.requested_bytes
    device_free = oom.free_bytes
    # The allocator failed although what it had cached but unused, plus what
    # could still be allocated, would have covered the request: no single free
    # piece was large enough. oomdoc's own snapshots know the free memory under
    # the --device-memory cap; PyTorch's snapshots only have the driver's free
    # memory, which ignores a per-process memory fraction, so for them only
    # the cached pieces count.
    usable_free = 0 if snapshot.from_pytorch else device_free
    decisive = (
        snapshot.is_oom and requested > 0 and unused > 0 and requested <= unused + usable_free
    )
    large = split_bytes >= 32 * MiB and split_bytes >= 0.1 * reserved
    # The driver had room for the request, so a cap the PyTorch snapshot does
    # not record set the limit: large split pieces may have decided it.
    possibly_decisive = (
        snapshot.from_pytorch
        and not decisive
        and snapshot.is_oom
        and large
        and 0 < requested <= device_free
    )
    if not (decisive or large):
        return None
    evidence = [
        f"{format_bytes(reserved)} reserved by PyTorch's allocator, {format_bytes(allocated)} allocated: "
        f"{format_bytes(unused)} cached but unused",
    ]
    if split_bytes:
        evidence.append(
            f"{format_bytes(split_bytes)} in {split_blocks} inactive split block(s) (free pieces of partly used segments)"
        )
    if decisive:
        line = (
            f"the OOM asked for {format_bytes(requested)}; {format_bytes(unused)} cached plus {format_bytes(device_free)} "
            f"free on the device would have covered it"
        )
        if (
            allocator.largest_free_block_bytes is not None
            and allocator.largest_free_block_bytes >= 0
        ):
            line += f", but the largest free block was {format_bytes(allocator.largest_free_block_bytes)}"
        evidence.append(line)
    expandable = allocator.expandable_segments is True
    if expandable:
        evidence.append("expandable_segments is already on")
    allocator_fixes = (ExpandableSegments.name, EmptyCache.name)
    fixes = [EmptyCache.name] if expandable else list(allocator_fixes)
    if possibly_decisive:
        evidence.append(
            f"CUDA reported {format_bytes(device_free)} free on the device at the OOM: a per-process memory cap "
            f"(set_per_process_memory_fraction), which the snapshot does not record, set the limit"
        )
    summary = f"Fragmentation: {format_bytes(split_bytes or unused)} is reserved but split into pieces too small to use"
    # One story: the replays have the last word. A fragmentation fix that was
    # replayed and still ran out of memory means fragmentation did not decide
    # the OOM; it would only have added the cached bytes.
    replayed = [
        fix
        for fix in snapshot.fixes
        if fix.measured and any(part in allocator_fixes for part in fix.parts)
    ]
    if (decisive or possibly_decisive) and replayed and not any(fix.fits for fix in replayed):
        decisive = possibly_decisive = False
        evidence.append(
            f"but {', '.join(fix.name for fix in replayed)} still ran out of memory when replayed: "
            f"recovering the cached pieces would add at most {format_bytes(unused)}, not enough"
        )
    # The replays skipped the allocator fixes, the cached bytes being too
    # few to make the run fit (oomdoc.fixes.allocator): the same story.
    skipped = [
        entry.name
        for entry in (snapshot.replay.skipped if snapshot.replay else [])
        if entry.name in allocator_fixes
    ]
    if (decisive or possibly_decisive) and not replayed and skipped:
        reason = cannot_fit_by_allocator(snapshot)
        if reason:
            decisive = possibly_decisive = False
            evidence.append(
                f"but recovering the cached pieces would add at most {format_bytes(unused)}, "
                f"not enough: the replays did not try {', '.join(skipped)} ({reason})"
            )
    if decisive:
        summary += " (this decided the OOM)"
    elif possibly_decisive:
        summary += " (this may have decided the OOM under the process's memory cap)"
    return Diagnosis(
        "fragmentation",
        summary,
        evidence,
        split_bytes or unused,
        tier=TIER_DECISIVE if decisive or possibly_decisive else TIER_BREAKDOWN,
        fixes=fixes,
    )
