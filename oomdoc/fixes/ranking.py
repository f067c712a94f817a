"""Ranking fixes, measured or estimated alike."""

from __future__ import annotations

import math

from oomdoc.fixes import fix_named
from oomdoc.model import FixResult


def rank_key(fix: FixResult) -> tuple:
    """Fits first; then the smaller cost to training semantics, then to speed
    (the catalogue's costs); then the larger saving (the lower peak)."""
    unit = fix_named(fix.name)
    return (
        not fix.fits,
        unit.semantics_cost if unit else 9,
        unit.speed_cost if unit else 9,
        -fix.saved_bytes if fix.saved_bytes is not None else math.inf,
        fix.peak_allocated_bytes if fix.peak_allocated_bytes is not None else math.inf,
        fix.name,
    )


def rank_fixes(fixes: list[FixResult]) -> list[FixResult]:
    """The fixes best first, each with its `rank` (1-based)."""
    ranked = sorted(fixes, key=rank_key)
    for position, fix in enumerate(ranked, start=1):
        fix.rank = position
    return ranked
