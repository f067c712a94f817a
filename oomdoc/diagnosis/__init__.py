"""Diagnosis: from a snapshot to an ordered list of findings.

Each rule is one module in this package with a `rule(snapshot)` function
that returns a Diagnosis, a list of them, or None; `RULES` registers them,
one line each. Order, most important first: bugs (grad_in_eval, leak), then
causes that decided the OOM on their own (fragmentation, other processes, a
host that ran out of RAM), then what filled the device, largest first.

Kinds: oversized_request (one request larger than the device), model_load
(the OOM came while a model was built or moved to the device), caught_oom
(the script caught an OOM and went on), leak, grad_in_eval, evaluation_oom, fragmentation, other_processes, host_memory,
activations, optimizer_state, parameters, gradients, communication,
unattributed (the breakdown's `other`: tensors made outside the model and
optimizer): one per category, named in oomdoc.categories.
"""

from __future__ import annotations

from typing import Callable, Union

from oomdoc.diagnosis import (
    breakdown,
    caught_oom,
    distributed,
    evaluation,
    fragmentation,
    grad_in_eval,
    host_memory,
    leak,
    model_load,
    other_processes,
    oversized_request,
)
from oomdoc.diagnosis.base import (
    BUG_KINDS,
    TIER_BREAKDOWN,
    TIER_BUG,
    TIER_CONTEXT,
    TIER_DECISIVE,
    Diagnosis,
)
from oomdoc.model import Snapshot

__all__ = [
    "BUG_KINDS",
    "RULES",
    "TIER_BREAKDOWN",
    "TIER_BUG",
    "TIER_CONTEXT",
    "TIER_DECISIVE",
    "Diagnosis",
    "diagnose",
]

RuleResult = Union[Diagnosis, "list[Diagnosis]", None]

RULES: tuple[Callable[[Snapshot], RuleResult], ...] = (
    oversized_request.rule,
    model_load.rule,
    grad_in_eval.rule,
    leak.rule,
    evaluation.rule,
    fragmentation.rule,
    other_processes.rule,
    host_memory.rule,
    breakdown.rule,
    distributed.rule,
    caught_oom.rule,
)


def diagnose(snapshot: Snapshot) -> list[Diagnosis]:
    """All diagnoses for a snapshot, the most important first."""
    found: list[Diagnosis] = []
    for rule in RULES:
        result = rule(snapshot)
        if isinstance(result, list):
            found.extend(result)
        elif result is not None:
            found.append(result)
    if fit_with_headroom(snapshot):
        # What filled a device that was mostly free is no finding.
        found = [diagnosis for diagnosis in found if diagnosis.tier != TIER_BREAKDOWN]
    found.sort(key=lambda diagnosis: (diagnosis.tier, -diagnosis.bytes))
    return found


# A run that fit using less than this share of the capacity gets no
# diagnoses of what filled the device (bugs are still said).
QUIET_BELOW_SHARE = 0.5


def fit_with_headroom(snapshot: Snapshot) -> bool:
    capacity = snapshot.capacity_bytes
    if snapshot.outcome != "ok" or capacity <= 0 or snapshot.ranks:
        return False
    return snapshot.needed_bytes < QUIET_BELOW_SHARE * capacity
