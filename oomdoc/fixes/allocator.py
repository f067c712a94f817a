"""Fixes of the CUDA caching allocator: expandable segments and empty_cache."""

from __future__ import annotations

import os
from typing import Any, Optional

from oomdoc.fixes.base import Effect, Fix, FixRequest, SnippetContext
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

# Below this share of the capacity, reserved-but-unallocated memory is not worth a replay.
FRAGMENTATION_SHARE = 0.02
CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def cannot_fit_by_allocator(snapshot: Snapshot) -> Optional[str]:
    """Why no allocator setting (expandable segments, empty_cache) can make
    this run fit, from the failing run's own numbers; None when one might.

    Such a setting only changes how the cached memory is laid out: the most
    it can give back at the OOM is what was reserved but unallocated. When
    the allocated bytes plus the failed request exceed the capacity, or when
    the cached bytes are under FRAGMENTATION_SHARE of it (the run was short
    of far more: the OOM moment is the first allocation that failed, not
    the step's peak), a replay of either can only run out of memory again."""
    oom = snapshot.oom
    if oom is None or not snapshot.device.on_cuda or snapshot.from_pytorch:
        return None
    capacity = snapshot.capacity_bytes
    unused = oom.reserved_bytes - oom.allocated_bytes
    if capacity and oom.requested_bytes > 0 and oom.needed_bytes > capacity:
        return (
            f"at the OOM {format_bytes(oom.allocated_bytes)} was allocated and "
            f"{format_bytes(oom.requested_bytes)} requested, more than the capacity of "
            f"{format_bytes(capacity)}: no allocator setting returns that"
        )
    if capacity and unused < FRAGMENTATION_SHARE * capacity:
        return f"only {format_bytes(max(unused, 0))} was reserved but unallocated at the OOM"
    return None


class ExpandableSegments(Fix):
    name = "expandable_segments"
    title = "Let the CUDA allocator grow segments instead of splitting them"
    semantics_cost, speed_cost = 0, 0
    combines_with = ("autocast", "checkpointing", "lighter_optimizer")
    cuda_only = True
    replay_priority = 4
    by_environment = True
    rearranges_cache = True

    def skip_reason(self, snapshot: Snapshot, explicit: bool) -> Optional[str]:
        reason = super().skip_reason(snapshot, explicit)
        if reason:
            return reason
        conf = os.environ.get(CONF_ENV, "").replace(" ", "").lower()
        if EXPANDABLE.lower() in conf:
            return f"{CONF_ENV} already sets {EXPANDABLE}"
        oom = snapshot.oom
        unused = (oom.reserved_bytes - oom.allocated_bytes) if oom else 0
        if not explicit and unused < FRAGMENTATION_SHARE * snapshot.capacity_bytes:
            return f"only {format_bytes(max(unused, 0))} was reserved but unallocated at the OOM"
        return None if explicit else cannot_fit_by_allocator(snapshot)

    def request(self, snapshot: Snapshot) -> FixRequest:
        conf = os.environ.get(CONF_ENV, "")
        return FixRequest(
            payload={"name": self.name},
            env={CONF_ENV: ",".join(part for part in (conf, EXPANDABLE) if part)},
        )

    def describe(self, applied: dict, request: FixRequest) -> str:
        return f"{CONF_ENV}={EXPANDABLE}"

    def snippet(self, context: SnippetContext) -> str:
        return f"{CONF_ENV}={EXPANDABLE} python train.py"

    def estimate(self, snapshot: Snapshot) -> Optional[Effect]:
        allocator = snapshot.allocator
        if not snapshot.device.on_cuda or allocator is None:
            return None
        split_bytes = allocator.inactive_split_bytes
        if split_bytes <= 0 or allocator.expandable_segments is True:
            return None
        return Effect(
            0.0,
            split_bytes,
            f"segments that grow in place leave no split remainders: up to {format_bytes(split_bytes)} of inactive split blocks recovered",
        )

    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        # The parent set the environment (the allocator reads it at start-up).
        record["alloc_conf"] = os.environ.get(CONF_ENV, "")


class EmptyCache(Fix):
    name = "empty_cache"
    title = "Return cached blocks to the driver between steps"
    semantics_cost, speed_cost = 0, 1
    combines_with = ("autocast", "checkpointing")
    cuda_only = True
    replay_priority = 3
    rearranges_cache = True

    def skip_reason(self, snapshot: Snapshot, explicit: bool) -> Optional[str]:
        reason = super().skip_reason(snapshot, explicit)
        if reason or explicit:
            return reason
        return cannot_fit_by_allocator(snapshot)

    def not_applied(self, applied: dict) -> Optional[str]:
        if not self.record_in(applied).get("calls"):
            return "CUDA was never initialised in the replay"
        return None

    def describe(self, applied: dict, request: FixRequest) -> str:
        return "torch.cuda.empty_cache() before each forward pass"

    def snippet(self, context: SnippetContext) -> str:
        return "optimizer.step()\noptimizer.zero_grad(set_to_none=True)\ntorch.cuda.empty_cache()"

    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        import torch

        record["calls"] = 0

        def release(module: Any) -> None:
            # is_initialized alone: is_available would ask the CUDA runtime,
            # which keeps a process the script forks from using CUDA.
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
                record["calls"] += 1

        tracker.forward_start_callbacks.append(release)
