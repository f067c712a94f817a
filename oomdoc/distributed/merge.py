"""One document per job: the ranks' captures merged.

The job document is an ordinary snapshot whose top-level fields (outcome,
oom, breakdown, steps, top_allocations, ...) are those of one rank, the
`primary_rank`: the first rank to run out of memory (by the wall-clock time
of its OOM), else the first rank that failed otherwise, else the rank with
the highest peak. So every single-process reader keeps working. Beside them:
`ranks` (one summary per rank), `world_size` and `first_oom_rank`.

Also used by `oomdoc suggest` with several snapshot files or a directory:
each node of a multi-node job writes a document for its own ranks, and the
documents merge into one job (a node's document carries the full fields of
its primary rank, and the job's primary is always some node's primary).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from oomdoc.snapshot import SnapshotError, read_snapshot

# Per-rank fields of a rank's capture that do not belong at the job's top level.
RANK_ONLY_FIELDS = (
    "rank",
    "ended_at",
    "oom_time",
    "waiting_at",
    "stopped_by",
    "ended_with_peers",
)
JOB_FIELDS = ("ranks", "world_size", "first_oom_rank", "primary_rank", "launch")
DEVICE_FIELDS = (
    "kind",
    "name",
    "index",
    "capacity_bytes",
    "total_bytes",
    "nvml_used_bytes",
    "nvml_free_bytes",
    "other_processes",
)
NO_CAPTURE = "no_capture"


def read_captures(workdir: str, pattern: re.Pattern, group: int = 1) -> dict[int, dict]:
    """The whole captures in `workdir` whose names match `pattern`, by the
    number in its `group` (a rank). A capture is written atomically, so a
    file that is there is whole; one that says only the device its process
    chose (`partial`) is left out: its capture is still to come."""
    found = {}
    for name in os.listdir(workdir):
        match = pattern.match(name)
        if match is None:
            continue
        try:
            with open(os.path.join(workdir, name), encoding="utf-8") as handle:
                capture = json.load(handle)
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(capture, dict) and not capture.get("partial"):
            found[int(match.group(group))] = capture
    return found


def ended_with_the_replay(capture: dict) -> None:
    """A replay's rank that ended only because a peer had finished its steps
    (stopped by oomdoc or the launcher, or failed in a collective whose peer
    had gone): its steps are the replay's, so it counts as finished."""
    capture.update(outcome="ok", exit_code=0, error=None, ended_with_peers=True)


def ended_only_with_peers(capture: dict) -> bool:
    """In a replay where a rank finished: whether this rank ended without
    finishing only because of that, stopped by oomdoc or the launcher
    (`interrupted`) or failed in a collective whose peer had gone (gloo
    raises at once)."""
    outcome = capture.get("outcome")
    in_collective = bool((capture.get("waiting_at") or {}).get("collective"))
    return outcome == "interrupted" or (outcome == "error" and in_collective)


def rank_entry(capture: dict) -> dict:
    """A rank's summary in the job document's `ranks`."""
    rank = capture.get("rank") or {}
    device = capture.get("device") or {}
    oom = capture.get("oom")
    if isinstance(oom, dict):
        oom = {key: value for key, value in oom.items() if key != "top_allocations"}
        oom.setdefault("time", capture.get("oom_time"))
    allocator = capture.get("allocator") or {}
    return {
        "rank": rank.get("rank"),
        "local_rank": rank.get("local_rank"),
        "node_rank": rank.get("node_rank"),
        "host": rank.get("host"),
        "pid": rank.get("pid"),
        "backend": rank.get("backend"),
        "device": {key: device[key] for key in DEVICE_FIELDS if key in device},
        "captured": True,
        "outcome": capture.get("outcome"),
        "exit_code": capture.get("exit_code"),
        "error": capture.get("error"),
        "oom": oom,
        "breakdown": capture.get("breakdown"),
        "breakdown_at": capture.get("breakdown_at"),
        "category_peaks": capture.get("category_peaks"),
        "peak": capture.get("peak"),
        "allocator_reserved_bytes": allocator.get("reserved_bytes"),
        "steps": capture.get("steps") or [],
        "ended_at": capture.get("ended_at"),
        "waiting_at": capture.get("waiting_at"),
        "stopped_by": capture.get("stopped_by"),
        "ended_with_peers": bool(capture.get("ended_with_peers")),
        "parallel": capture.get("parallel"),
        "optimizers": capture.get("optimizers"),
    }


def missing_entry(missing: dict) -> dict:
    return {
        "rank": missing.get("rank"),
        "local_rank": missing.get("local_rank"),
        "node_rank": missing.get("node_rank"),
        "host": missing.get("host"),
        "device": None,
        "captured": False,
        "outcome": NO_CAPTURE,
        "exit_code": None,
        "oom": None,
        "breakdown": None,
        "peak": None,
        "steps": [],
        "note": "no capture: the rank's process was killed (SIGKILL, e.g. by the kernel's OOM killer) or crashed before it could write one",
    }


def peak_of(entry: dict) -> int:
    peak = (entry.get("peak") or {}).get("allocated_bytes")
    if peak is None and entry.get("oom"):
        oom = entry["oom"]
        peak = int(oom.get("allocated_bytes") or 0) + int(oom.get("requested_bytes") or 0)
    return int(peak or 0)


def first_oom(entries: list[dict]) -> dict | None:
    ooms = [e for e in entries if e.get("outcome") == "oom"]
    if not ooms:
        return None
    return min(
        ooms,
        key=lambda e: (
            (e.get("oom") or {}).get("time") or float("inf"),
            e.get("rank") if e.get("rank") is not None else 1 << 30,
        ),
    )


def choose_primary(entries: list[dict]) -> tuple[dict | None, str]:
    """The rank whose fields lead the job document, and why."""
    captured = [e for e in entries if e.get("captured")]
    if not captured:
        return None, ""
    oom = first_oom(captured)
    if oom is not None:
        return oom, "the first rank to run out of memory"
    errors = [e for e in captured if e.get("outcome") == "error"]
    if errors:
        # A rank whose collective failed because a peer died is a symptom:
        # the rank that failed on its own comes first.
        return min(
            errors,
            key=lambda e: (
                bool((e.get("waiting_at") or {}).get("collective")),
                e.get("ended_at") or float("inf"),
            ),
        ), "the first rank to fail"
    return max(captured, key=peak_of), "the rank with the highest peak"


def _sort_key(entry: dict):
    rank = entry.get("rank")
    return (rank is None, rank if rank is not None else 0, entry.get("local_rank") or 0)


def merge_rank_captures(
    captures: list[dict], missing: list[dict] | tuple = (), launch: dict | None = None
) -> dict:
    """One job document (capture-level fields) from the ranks' captures.

    `captures`: each rank's capture, or documents of a job already merged
    (one per node; their `ranks` are taken over). `missing`: {rank,
    local_rank, node_rank} of the ranks that left no capture."""
    entries: list[dict] = []
    full: dict = {}  # id(entry) -> the full capture behind it
    notes: list[str] = []
    seen: set = set()
    world_sizes = set()
    for position, capture in enumerate(captures):
        if isinstance(capture.get("world_size"), int):
            world_sizes.add(capture["world_size"])
        if isinstance(capture.get("ranks"), list) and capture["ranks"]:
            primary = capture.get("primary_rank")
            sub = [dict(entry) for entry in capture["ranks"] if isinstance(entry, dict)]
        else:
            if not capture.get("rank"):
                capture = {**capture, "rank": {"rank": position, "local_rank": None}}
                notes.append(
                    f"Snapshot {position + 1} has no rank information: taken as rank {position}."
                )
            primary = capture["rank"].get("rank")
            sub = [rank_entry(capture)]
            world = capture["rank"].get("world_size")
            if isinstance(world, int):
                world_sizes.add(world)
        for entry in sub:
            key = (entry.get("rank"), entry.get("node_rank"), entry.get("local_rank"))
            if entry.get("rank") is not None and entry.get("rank") in seen:
                notes.append(f"Rank {entry['rank']} was given twice: the first one is kept.")
                continue
            if entry.get("rank") is not None:
                seen.add(entry["rank"])
            elif key in seen:
                continue
            else:
                seen.add(key)
            entries.append(entry)
            if entry.get("captured") and entry.get("rank") == primary:
                full[id(entry)] = capture
    for item in missing:
        entry = missing_entry(item)
        if entry["rank"] is not None and entry["rank"] in seen:
            continue
        entries.append(entry)
    entries.sort(key=_sort_key)

    primary_entry, why = choose_primary([e for e in entries if id(e) in full] or entries)
    oom_entry = first_oom(entries)
    if primary_entry is None or id(primary_entry) not in full:
        raise ValueError("no rank left a capture to merge")
    base = full[id(primary_entry)]
    document = {
        key: value for key, value in base.items() if key not in RANK_ONLY_FIELDS + JOB_FIELDS
    }
    world_size = max(world_sizes) if world_sizes else None
    if world_size is None or world_size < len(entries):
        world_size = max(world_size or 0, len(entries))
    document["ranks"] = entries
    document["world_size"] = world_size
    document["first_oom_rank"] = oom_entry.get("rank") if oom_entry else None
    document["primary_rank"] = primary_entry.get("rank")
    if launch is not None:
        document["launch"] = launch
    elif isinstance(base.get("launch"), dict):
        document["launch"] = base["launch"]

    not_ok = [e for e in entries if e.get("outcome") != "ok"]
    if document.get("outcome") == "ok" and not_ok:
        # The rank with the highest peak fit, but the job did not end well.
        worst = not_ok[0]["outcome"]
        document["outcome"] = "error" if worst == NO_CAPTURE else worst
        document["exit_code"] = int(not_ok[0].get("exit_code") or 1)
    notes = list(base.get("notes") or []) + notes
    notes.append(
        f"A job of {world_size} ranks: the fields above the per-rank table are rank "
        f"{primary_entry.get('rank')}'s ({why})."
    )
    for entry in entries:
        if not entry.get("captured"):
            notes.append(
                f"Rank {entry.get('rank') if entry.get('rank') is not None else '?'} "
                f"(local rank {entry.get('local_rank')}) left no capture: killed with SIGKILL or crashed."
            )
    document["notes"] = list(dict.fromkeys(notes))
    return document


# ---------------------------------------------------------------- suggest


def snapshot_paths(paths: list[str]) -> list[Path]:
    """The snapshot files named, a directory standing for its *.json files."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            inside = sorted(p for p in path.iterdir() if p.suffix == ".json" and p.is_file())
            if not inside:
                raise SnapshotError(f"{path}: is a directory with no snapshot (.json) files in it")
            found.extend(inside)
        else:
            found.append(path)
    return found


def load_job(paths: list[str]) -> dict:
    """Read the snapshots of one job (files, or directories of them) and
    merge them into one job document; SnapshotError on bad input."""
    files = snapshot_paths(paths)
    documents = [read_snapshot(path) for path in files]
    commands = {tuple(document.get("command") or ()) for document in documents}
    if len(commands) > 1:
        raise SnapshotError(
            f"{', '.join(str(p) for p in files[:4])}: not one job (the snapshots ran different commands)"
        )
    try:
        merged = merge_rank_captures(documents)
    except ValueError as exc:
        raise SnapshotError(f"{os.fspath(files[0])}: {exc}") from None
    return merged
