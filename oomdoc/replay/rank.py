"""Ranking measured fixes, and choosing the pair worth measuring together."""

from __future__ import annotations

import math

from oomdoc.fixes import COMPATIBLE_PAIRS, fix_info


def rank_key(fix: dict) -> tuple:
    """Fits first; then the smaller cost to training semantics, then to speed
    (the catalogue's costs); then the larger saving (the lower peak)."""
    info = fix_info(fix["name"])
    semantics = info.semantics_cost if info else 9
    speed = info.speed_cost if info else 9
    saved = fix.get("saved_bytes")
    peak = fix.get("peak_allocated_bytes")
    return (
        not fix.get("fits"),
        semantics,
        speed,
        -saved if saved is not None else math.inf,
        peak if peak is not None else math.inf,
        fix["name"],
    )


def rank_fixes(fixes: list[dict]) -> list[dict]:
    ranked = sorted(fixes, key=rank_key)
    for position, fix in enumerate(ranked, start=1):
        fix["rank"] = position
    return ranked


def best_pair(candidates: list[dict]) -> tuple[str, str] | None:
    """The two compatible fixes with the lowest peaks (a fix that ran out of
    memory counts with what it needed when it did), among fixes that applied."""
    usable = [
        fix
        for fix in candidates
        if fix.get("peak_allocated_bytes") is not None and "+" not in fix["name"]
    ]
    usable.sort(key=lambda fix: fix["peak_allocated_bytes"])
    pairs = []
    for i, first in enumerate(usable):
        for j in range(i + 1, len(usable)):
            second = usable[j]
            if frozenset((first["name"], second["name"])) in COMPATIBLE_PAIRS:
                pairs.append((i + j, first["name"], second["name"]))
    if not pairs:
        return None
    _, first, second = min(pairs)
    return first, second
