"""The oomdoc snapshot: one versioned JSON document per run.

`oomdoc run` writes it, `oomdoc suggest` and `oomdoc check` read it. The
schema is documented in docs/snapshot.md; this module is the single place that
writes, reads and validates it. Sizes are always integer bytes.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from oomdoc.categories import CATEGORIES, REQUIRED

SCHEMA_VERSION = 1

OUTCOMES = ("oom", "ok", "error", "interrupted")
PHASES = ("setup", "forward", "backward", "optimizer", "idle", "evaluation", "communication")
DEVICE_KINDS = ("cuda", "simulated")

# Reading a snapshot never needs more than this; a larger file is refused
# before it is parsed so a stray multi-gigabyte file cannot hang the CLI.
MAX_SNAPSHOT_BYTES = 256 * 1024**2


class SnapshotError(ValueError):
    """A snapshot file that cannot be used; the message names the problem."""


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def default_snapshot_path(script: str, directory: str | os.PathLike = ".oomdoc") -> Path:
    """`.oomdoc/<script-stem>-<UTC timestamp>.json`, never an existing file."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(script).stem or "script")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    directory = Path(directory)
    candidate = directory / f"{stem}-{stamp}.json"
    counter = 1
    while candidate.exists():
        candidate = directory / f"{stem}-{stamp}-{counter}.json"
        counter += 1
    return candidate


def dumps(document: dict, *, sort_keys: bool = False) -> str:
    return json.dumps(document, indent=2, sort_keys=sort_keys, allow_nan=False) + "\n"


def write_atomic(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """Write `text` to `path` so that readers see the old file or the whole new
    one, never half. Without `overwrite`, an existing file is left alone and
    FileExistsError is raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(tmp_name, path)
        else:
            # link() fails if the target exists: no window in which we could
            # clobber a file that appeared after an exists() check.
            os.link(tmp_name, path)
            os.unlink(tmp_name)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return path


def write_snapshot(document: dict, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    validate(document)
    return write_atomic(path, dumps(document), overwrite=overwrite)


def read_limited_bytes(path: str | os.PathLike) -> bytes:
    """A snapshot file's bytes, with the checks every loader needs (exists, is
    a file, readable, not larger than MAX_SNAPSHOT_BYTES)."""
    path = Path(path)
    try:
        if not path.exists():
            raise SnapshotError(f"{path}: no such file")
        if path.is_dir():
            raise SnapshotError(f"{path}: is a directory, not a snapshot file")
        size = path.stat().st_size
        if size > MAX_SNAPSHOT_BYTES:
            raise SnapshotError(
                f"{path}: file is {size} bytes, larger than the {MAX_SNAPSHOT_BYTES} bytes a snapshot may be"
            )
        with open(path, "rb") as handle:
            # Read one byte past the limit: a file that grew after stat() is refused too.
            raw = handle.read(MAX_SNAPSHOT_BYTES + 1)
    except OSError as exc:
        raise SnapshotError(
            f"{path}: cannot read ({exc.strerror or exc.__class__.__name__})"
        ) from None
    if len(raw) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"{path}: larger than the {MAX_SNAPSHOT_BYTES} bytes a snapshot may be")
    return raw


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number a snapshot may hold")


def parse_json_bytes(raw: bytes, origin: str) -> Any:
    """Parse JSON text; NaN/Infinity and out-of-range numbers are refused."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (
        ValueError,
        RecursionError,
    ) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limits
        raise SnapshotError(
            f"{origin}: not valid JSON ({exc.__class__.__name__}: {str(exc)[:120]})"
        ) from None


def read_json_file(path: str | os.PathLike) -> Any:
    """Read a JSON file with the checks every loader needs (exists, size, UTF-8)."""
    return parse_json_bytes(read_limited_bytes(path), str(path))


def read_snapshot(path: str | os.PathLike) -> dict:
    document = read_json_file(path)
    try:
        validate(document)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    return document


# ---------------------------------------------------------------- validation


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise SnapshotError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(
    mapping: dict, key: str, where: str, *, optional: bool = False, minimum: int | None = None
) -> None:
    value = mapping.get(key)
    if value is None and optional:
        return
    _expect(_is_int(value), f"{where}.{key} must be an integer, got {type(value).__name__}")
    if minimum is not None and isinstance(value, int) and value < minimum:
        raise SnapshotError(f"{where}.{key} must be at least {minimum}, got {value}")


def _check_location(value: Any, where: str) -> None:
    if value is None:
        return
    _expect(isinstance(value, dict), f"{where} must be an object or null")
    _expect(isinstance(value.get("file"), str), f"{where}.file must be a string")
    _check_int(value, "line", where)
    _expect(isinstance(value.get("function"), str), f"{where}.function must be a string")


def validate(document: Any) -> None:
    """Check the fields that later commands rely on; raise SnapshotError."""
    _expect(isinstance(document, dict), "not an oomdoc snapshot (top level is not an object)")
    _expect("schema_version" in document, "not an oomdoc snapshot (no schema_version)")
    version = document["schema_version"]
    _expect(_is_int(version), "schema_version must be an integer")
    _expect(
        version == SCHEMA_VERSION,
        f"unknown schema_version {version} (this oomdoc reads version {SCHEMA_VERSION}; upgrade oomdoc or re-run the capture)",
    )
    for key in ("oomdoc_version", "created_at", "torch_version"):
        _expect(isinstance(document.get(key), str), f"{key} must be a string")
    command = document.get("command")
    _expect(
        isinstance(command, list) and all(isinstance(a, str) for a in command),
        "command must be a list of strings",
    )

    device = document.get("device")
    _expect(isinstance(device, dict), "device must be an object")
    _expect(
        device.get("kind") in DEVICE_KINDS, f"device.kind must be one of {', '.join(DEVICE_KINDS)}"
    )
    _expect(isinstance(device.get("name"), str), "device.name must be a string")
    _check_int(device, "capacity_bytes", "device", minimum=0)

    _expect(document.get("outcome") in OUTCOMES, f"outcome must be one of {', '.join(OUTCOMES)}")
    # Only a run whose process died before it wrote anything has no capacity.
    _expect(
        device["capacity_bytes"] > 0
        or (document["outcome"] in ("error", "interrupted") and not document.get("steps")),
        "device.capacity_bytes must be positive (a device of 0 bytes holds nothing)",
    )
    _check_int(document, "exit_code", "snapshot")

    oom = document.get("oom")
    if document["outcome"] == "oom":
        _expect(isinstance(oom, dict), "oom must be an object when outcome is oom")
    if oom is not None:
        _expect(isinstance(oom, dict), "oom must be an object or null")
        for key in ("requested_bytes", "allocated_bytes", "reserved_bytes"):
            _check_int(oom, key, "oom", minimum=0)
        _check_int(oom, "step", "oom", optional=True)
        _expect(oom.get("phase") in PHASES, f"oom.phase must be one of {', '.join(PHASES)}")
        _expect(isinstance(oom.get("message"), str), "oom.message must be a string")
        _check_location(oom.get("location"), "oom.location")

    breakdown = document.get("breakdown")
    _expect(isinstance(breakdown, dict), "breakdown must be an object")
    for category in CATEGORIES:
        _check_int(breakdown, category, "breakdown", optional=category not in REQUIRED, minimum=0)

    category_peaks = document.get("category_peaks")
    if category_peaks is not None:
        _expect(isinstance(category_peaks, dict), "category_peaks must be an object")
        for category in CATEGORIES:
            optional = category not in REQUIRED
            _check_int(category_peaks, category, "category_peaks", optional=optional, minimum=0)

    steps = document.get("steps")
    _expect(isinstance(steps, list), "steps must be a list")
    for position, step in enumerate(steps):
        where = f"steps[{position}]"
        _expect(isinstance(step, dict), f"{where} must be an object")
        _check_int(step, "index", where)
        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "end_allocated_bytes"):
            _check_int(step, key, where, minimum=0)
        _expect(
            step.get("peak_phase") in PHASES,
            f"{where}.peak_phase must be one of {', '.join(PHASES)}",
        )

    _check_int(document, "steps_omitted", "snapshot", optional=True, minimum=0)

    top = document.get("top_allocations")
    _expect(isinstance(top, list), "top_allocations must be a list")
    for position, site in enumerate(top):
        where = f"top_allocations[{position}]"
        _expect(isinstance(site, dict), f"{where} must be an object")
        _check_int(site, "bytes", where, minimum=0)
        _expect(
            site.get("category") in CATEGORIES,
            f"{where}.category must be one of {', '.join(CATEGORIES)}",
        )
        _check_location(site.get("location"), f"{where}.location")

    fixes = document.get("fixes", [])
    _expect(isinstance(fixes, list), "fixes must be a list")
    for position, fix in enumerate(fixes):
        where = f"fixes[{position}]"
        _expect(isinstance(fix, dict), f"{where} must be an object")
        _expect(isinstance(fix.get("name"), str), f"{where}.name must be a string")
        _check_int(fix, "peak_allocated_bytes", where, optional=True, minimum=0)
        _check_int(fix, "saved_bytes", where, optional=True)
        _expect(isinstance(fix.get("fits", False), bool), f"{where}.fits must be true or false")
        ratio = fix.get("step_time_ratio")
        _expect(
            ratio is None
            or (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio >= 0),
            f"{where}.step_time_ratio must be a non-negative number or null",
        )
        for key in ("detail", "snippet"):
            _expect(
                fix.get(key) is None or isinstance(fix.get(key), str),
                f"{where}.{key} must be a string",
            )
    _check_int(document, "max_batch_size", "snapshot", optional=True)
