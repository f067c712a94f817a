"""The catalogue of fixes: one module (one Fix subclass) per fix, registered
in `FIXES`, one line each. Replays measure them (oomdoc.replay), `oomdoc
suggest` estimates them from a breakdown; both read names, snippets and
costs from here, so a fix reads the same wherever it is shown.

Adding a fix: a new module with a Fix subclass (see base.py) and one line
in FIXES.
"""

from __future__ import annotations

from typing import Optional

from oomdoc.fixes.allocator import EmptyCache, ExpandableSegments
from oomdoc.fixes.autocast import Autocast
from oomdoc.fixes.base import Combination, Effect, Fix, FixRequest
from oomdoc.fixes.checkpointing import Checkpointing
from oomdoc.fixes.optimizer import LighterOptimizer
from oomdoc.fixes.sharding import Fsdp, ZeroOptimizer
from oomdoc.fixes.smaller_batch import SmallerBatch

__all__ = [
    "FIXES",
    "Combination",
    "Effect",
    "Fix",
    "FixRequest",
    "batch_fix",
    "fix_named",
    "compatible",
]

# Catalogue order: estimates and diagnoses list fixes in this order.
FIXES: tuple[Fix, ...] = (
    ExpandableSegments(),
    EmptyCache(),
    Checkpointing(),
    Autocast(),
    LighterOptimizer(),
    SmallerBatch(),
    Fsdp(),
    ZeroOptimizer(),
)

_BY_NAME = {fix.name: fix for fix in FIXES}


def compatible(first: Fix, second: Fix) -> bool:
    """Two different fixes that can be measured together."""
    return first.name != second.name and (
        second.name in first.combines_with or first.name in second.combines_with
    )


def fix_named(name: str) -> Optional[Fix]:
    """The fix called `name`, or for `a+b` (`a+b+c`) the combination of
    pairwise compatible fixes, in that order; None when there is none."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    parts = name.split("+")
    if len(parts) < 2 or not all(part in _BY_NAME for part in parts):
        return None
    fixes = [_BY_NAME[part] for part in parts]
    if not all(compatible(a, b) for i, a in enumerate(fixes) for b in fixes[i + 1 :]):
        return None
    return Combination(*fixes)


def batch_fix() -> Fix:
    """The fix that changes the batch (`changes_batch`): the batch searches'
    replays and the prescription's accumulation are it, alone or `also`."""
    return next(fix for fix in FIXES if fix.changes_batch)


def replay_order() -> list[Fix]:
    """The fixes in the order replays try them."""
    return sorted(FIXES, key=lambda fix: getattr(fix, "replay_priority", 9))
