"""The per-rank section of a job's report, as text lines.

A table of the ranks (peak and the bytes of each category), then which rank
failed first and where the others were. The reporters place it after the
breakdown.
"""

from __future__ import annotations

from typing import Optional

from tabulate import tabulate

from oomdoc.categories import shown
from oomdoc.formatting import relative_path
from oomdoc.model import RankEntry, Snapshot
from oomdoc.sizes import format_bytes


def _where(
    file: Optional[str], line: Optional[int], function: Optional[str], cwd: Optional[str]
) -> str:
    if not file:
        return ""
    return f"{relative_path(file, cwd)}:{line} in {function}"


def _rank_name(entry: RankEntry) -> str:
    return str(entry.rank) if entry.rank is not None else "?"


def _outcome(entry: RankEntry) -> str:
    outcome = entry.outcome or "?"
    if outcome == "oom":
        oom = entry.oom
        return f"OOM (step {oom.step if oom else None}, {oom.phase if oom else None})"
    if outcome == "no_capture":
        return "no capture (killed?)"
    if outcome == "interrupted" and entry.stopped_by:
        return f"stopped ({entry.stopped_by})"
    return outcome


def rank_categories(snapshot: Snapshot) -> list[str]:
    """The categories the rank table shows (oomdoc.categories.shown)."""
    return shown(*(dict(e.breakdown.items()) for e in snapshot.ranks if e.breakdown))


def rank_rows(snapshot: Snapshot) -> list[list[str]]:
    categories = rank_categories(snapshot)
    rows = []
    for entry in snapshot.ranks:
        breakdown = entry.breakdown
        peak = entry.held_bytes
        requested = entry.oom.requested_bytes if entry.oom else 0
        rows.append(
            [
                _rank_name(entry),
                entry.host or "",
                _outcome(entry),
                format_bytes(peak) if peak is not None else "",
                *(format_bytes(breakdown.bytes_of(c)) if breakdown else "" for c in categories),
                "needs " + format_bytes(requested) + " more" if entry.outcome == "oom" else "",
            ]
        )
    return rows


def rank_section_lines(snapshot: Snapshot) -> list[str]:
    """The per-rank table and the sentence on which rank failed first; empty
    for a single-process snapshot."""
    ranks = snapshot.ranks
    if not ranks:
        return []
    world_size = snapshot.world_size or len(ranks)
    lines = [
        "",
        f"Ranks ({len(ranks)} of a world of {world_size}; breakdown at each rank's OOM or peak)",
    ]
    categories = rank_categories(snapshot)
    lines.append(
        tabulate(
            rank_rows(snapshot),
            headers=["rank", "host", "outcome", "peak", *categories, ""],
            colalign=("right", "left", "left", *("right",) * (len(categories) + 1), "left"),
        )
    )
    lines.extend(failure_lines(snapshot))
    return lines


def failure_lines(snapshot: Snapshot) -> list[str]:
    ranks = snapshot.ranks
    cwd = snapshot.cwd
    lines = []
    first = snapshot.first_oom_rank
    if first is not None:
        entry = next((e for e in ranks if e.rank == first), RankEntry())
        oom = entry.oom
        location = oom.location if oom else None
        where = _where(location.file, location.line, location.function, cwd) if location else ""
        lines.append(
            f"Rank {first} ran out of memory first"
            + (f", in step {oom.step} during {oom.phase}" if oom else "")
            + (f" at {where}" if where else "")
            + "."
        )
        others = [e for e in ranks if e.outcome == "oom" and e.rank != first]
        if others:
            lines.append(
                "Then also out of memory: " + ", ".join(f"rank {e.rank}" for e in others) + "."
            )
    for entry in ranks:
        waiting = entry.waiting_at
        if waiting and entry.outcome != "oom":
            where = (
                _where(waiting.file, waiting.line, waiting.function, cwd)
                or "outside the script's own code"
            )
            collective = waiting.collective
            lines.append(
                f"Rank {entry.rank} was "
                + (f"waiting in {collective} at {where}" if collective else f"at {where}")
                + (
                    f" when it was stopped ({entry.stopped_by})."
                    if entry.stopped_by
                    else (
                        " when its peer failed."
                        if entry.outcome == "error"
                        else " when it was stopped."
                    )
                )
            )
        elif not entry.captured:
            lines.append(
                f"Rank {_rank_name(entry)} left no capture "
                "(killed with SIGKILL, e.g. by the kernel's OOM killer, or crashed)."
            )
    return lines
