"""Choosing the pair of fixes worth measuring together."""

from __future__ import annotations

from oomdoc.fixes import compatible, fix_named
from oomdoc.model import FixResult


def best_pair(candidates: list[FixResult]) -> tuple[str, str] | None:
    """The two compatible fixes with the lowest peaks (a fix that ran out of
    memory counts with what it needed when it did), among fixes that applied."""
    usable = [
        fix for fix in candidates if fix.peak_allocated_bytes is not None and "+" not in fix.name
    ]
    usable.sort(key=lambda fix: fix.peak_allocated_bytes or 0)
    pairs = []
    for i, first in enumerate(usable):
        for j in range(i + 1, len(usable)):
            second = usable[j]
            first_fix, second_fix = fix_named(first.name), fix_named(second.name)
            if first_fix and second_fix and compatible(first_fix, second_fix):
                pairs.append((i + j, first.name, second.name))
    if not pairs:
        return None
    _, first_name, second_name = min(pairs)
    return first_name, second_name
