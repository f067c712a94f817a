"""The per-rank section of a job's report, as text lines.

A table of the ranks (peak and the bytes of each category), then which rank
failed first and where the others were. The reporters place it after the
breakdown.
"""

from __future__ import annotations

import os

from tabulate import tabulate

from oomdoc.model import CATEGORIES
from oomdoc.sizes import format_bytes


def _location(location: dict | None, relative_to: str | None) -> str:
    if not location or not location.get("file"):
        return ""
    filename = location["file"]
    if relative_to:
        try:
            relative = os.path.relpath(filename, relative_to)
            if not relative.startswith(".."):
                filename = relative
        except ValueError:
            pass
    return f"{filename}:{location.get('line')} in {location.get('function')}"


def _peak(entry: dict) -> int | None:
    """The most the rank held: at an OOM, what it held then, never what it
    needed (that is above the capacity; the last column says how much more)."""
    if not entry.get("captured", True):
        return None
    peak = int((entry.get("peak") or {}).get("allocated_bytes") or 0)
    held_at_oom = int((entry.get("oom") or {}).get("allocated_bytes") or 0)
    return max(peak, held_at_oom)


def _outcome(entry: dict) -> str:
    outcome = entry.get("outcome") or "?"
    if outcome == "oom":
        oom = entry.get("oom") or {}
        return f"OOM (step {oom.get('step')}, {oom.get('phase')})"
    if outcome == "no_capture":
        return "no capture (killed?)"
    if outcome == "interrupted" and entry.get("stopped_by"):
        return f"stopped ({entry['stopped_by']})"
    return outcome


def rank_rows(document: dict) -> list[list[str]]:
    rows = []
    for entry in document.get("ranks") or []:
        breakdown = entry.get("breakdown") or {}
        peak = _peak(entry)
        oom = entry.get("oom") or {}
        rows.append(
            [
                str(entry.get("rank") if entry.get("rank") is not None else "?"),
                entry.get("host") or "",
                _outcome(entry),
                format_bytes(peak) if peak is not None else "",
                *(
                    format_bytes(int(breakdown.get(c) or 0)) if breakdown else ""
                    for c in CATEGORIES
                ),
                "needs " + format_bytes(int(oom.get("requested_bytes") or 0)) + " more"
                if entry.get("outcome") == "oom"
                else "",
            ]
        )
    return rows


def rank_section_lines(document: dict) -> list[str]:
    """The per-rank table and the sentence on which rank failed first; empty
    for a single-process snapshot."""
    ranks = document.get("ranks") or []
    if not ranks:
        return []
    world_size = document.get("world_size") or len(ranks)
    lines = [
        "",
        f"Ranks ({len(ranks)} of a world of {world_size}; breakdown at each rank's OOM or peak)",
    ]
    lines.append(
        tabulate(
            rank_rows(document),
            headers=["rank", "host", "outcome", "peak", *CATEGORIES, ""],
            colalign=("right", "left", "left", *("right",) * (len(CATEGORIES) + 1), "left"),
        )
    )
    lines.extend(failure_lines(document))
    return lines


def failure_lines(document: dict) -> list[str]:
    ranks = document.get("ranks") or []
    cwd = document.get("cwd")
    lines = []
    first = document.get("first_oom_rank")
    if first is not None:
        entry: dict = next((e for e in ranks if e.get("rank") == first), {})
        oom = entry.get("oom") or {}
        where = _location(oom.get("location"), cwd)
        lines.append(
            f"Rank {first} ran out of memory first"
            + (f", in step {oom.get('step')} during {oom.get('phase')}" if oom else "")
            + (f" at {where}" if where else "")
            + "."
        )
        others = [e for e in ranks if e.get("outcome") == "oom" and e.get("rank") != first]
        if others:
            lines.append(
                "Then also out of memory: "
                + ", ".join(f"rank {e.get('rank')}" for e in others)
                + "."
            )
    for entry in ranks:
        waiting = entry.get("waiting_at")
        if waiting and entry.get("outcome") != "oom":
            where = _location(waiting, cwd) or "outside the script's own code"
            collective = waiting.get("collective")
            lines.append(
                f"Rank {entry.get('rank')} was "
                + (f"waiting in {collective} at {where}" if collective else f"at {where}")
                + (
                    f" when it was stopped ({entry['stopped_by']})."
                    if entry.get("stopped_by")
                    else (
                        " when its peer failed."
                        if entry.get("outcome") == "error"
                        else " when it was stopped."
                    )
                )
            )
        elif not entry.get("captured", True):
            lines.append(
                f"Rank {entry.get('rank') if entry.get('rank') is not None else '?'} left no capture "
                "(killed with SIGKILL, e.g. by the kernel's OOM killer, or crashed)."
            )
    return lines
