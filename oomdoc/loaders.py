"""Loading any snapshot `oomdoc suggest` accepts, into one oomdoc-shaped document.

Three inputs are read:

* an oomdoc snapshot (JSON with `schema_version`), validated as written;
* PyTorch's own snapshot, the pickle from `torch.cuda.memory._dump_snapshot()`;
* the dict from `torch.cuda.memory._snapshot()` saved as JSON.

PyTorch's pickle is read by an unpickler that resolves no global at all, so a
pickle can only build dicts, lists, tuples, sets, strings, bytes and numbers:
one that asks for anything else (a class, a function: the only way a pickle
runs code) is refused before anything runs. Every other failure (truncated,
corrupt, neither JSON nor pickle, too large, an unexpected shape) becomes a
SnapshotError that names the file and the problem.

A PyTorch snapshot is converted into the fields the diagnosis rules read:
allocated vs reserved bytes, inactive split bytes (fragmentation), the largest
live blocks with their Python frames, and the allocator events just before an
OOM. PyTorch does not record what a block holds, so its category is inferred
from the frames that allocated it; the document says so in a note.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field

from oomdoc.categories import COMMUNICATION, is_communication_frame
from oomdoc.model import Snapshot
from oomdoc.snapshot import (
    CATEGORIES,
    SnapshotError,
    parse_json_bytes,
    read_limited_bytes,
    validate,
)

# Limits on what a PyTorch snapshot may contain; beyond them it is refused
# rather than walked. PyTorch keeps at most `max_entries` trace events (a
# million by default) and a block's stack is at most a few hundred frames.
MAX_PLAIN_NODES = 50_000_000
MAX_INT = 2**63
# A pickle can share one list among many parents, so a small file can
# describe segments x blocks x frames far beyond its size: cap the walk.
MAX_BLOCKS = 1_000_000
MAX_FRAMES = 64  # innermost frames kept per stack
MAX_FRAME_WORK = 20_000_000  # frames converted in all (a shared stack once)
MAX_DEVICES = 64

TRACE_BEFORE_OOM = 12
TOP_BLOCKS = 20

# Block states in PyTorch's snapshot that hold memory a tensor still uses.
ACTIVE_STATES = ("active_allocated", "active_awaiting_free", "active_pending_free")


@dataclass
class LoadedSnapshot:
    document: dict  # as read (a PyTorch snapshot converted to oomdoc's fields)
    # "oomdoc", "torch_pickle" or "torch_json"
    source_format: str

    @property
    def snapshot(self) -> Snapshot:
        """The typed snapshot: odd optional fields read as their defaults."""
        return Snapshot.from_dict(self.document)


# ----------------------------------------------------------------- entry point


def load_snapshot(path: str | os.PathLike) -> LoadedSnapshot:
    """Read `path` as any accepted snapshot; raise SnapshotError otherwise."""
    origin = str(path)
    raw = read_limited_bytes(path)
    return load_bytes(raw, origin)


def load_bytes(raw: bytes, origin: str = "<bytes>") -> LoadedSnapshot:
    """The same as load_snapshot, for bytes already in memory."""
    if not raw:
        raise SnapshotError(f"{origin}: empty file")
    if _looks_like_pickle(raw):
        data = restricted_unpickle(raw, origin)
        return LoadedSnapshot(torch_snapshot_document(data, origin, "torch_pickle"), "torch_pickle")
    stripped = raw.lstrip()
    if stripped[:1] in (b"{", b"[") or raw[:3] == b"\xef\xbb\xbf":
        data = parse_json_bytes(raw, origin)
        return _from_json_value(data, origin)
    if _maybe_old_protocol_pickle(raw):
        data = restricted_unpickle(raw, origin)
        return LoadedSnapshot(torch_snapshot_document(data, origin, "torch_pickle"), "torch_pickle")
    raise SnapshotError(
        f"{origin}: neither JSON nor a pickle (an oomdoc snapshot or PyTorch's memory snapshot was expected)"
    )


def _from_json_value(data, origin: str) -> LoadedSnapshot:
    if isinstance(data, dict) and "schema_version" in data:
        try:
            validate(data)
        except SnapshotError as exc:
            raise SnapshotError(f"{origin}: {exc}") from None
        return LoadedSnapshot(data, "oomdoc")
    if isinstance(data, dict) and "segments" in data:
        return LoadedSnapshot(torch_snapshot_document(data, origin, "torch_json"), "torch_json")
    raise SnapshotError(
        f"{origin}: JSON, but neither an oomdoc snapshot (no schema_version) "
        "nor PyTorch's memory snapshot (no segments)"
    )


def _looks_like_pickle(raw: bytes) -> bool:
    # Protocols 2 and later start with PROTO (0x80) and the version.
    return len(raw) >= 2 and raw[0] == 0x80 and 2 <= raw[1] <= 5


def _maybe_old_protocol_pickle(raw: bytes) -> bool:
    # Protocols 0 and 1 have no header but always end with STOP ('.').
    return raw.rstrip(b"\n")[-1:] == b"."


# ------------------------------------------------------------ restricted pickle


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes build (containers, strings,
    numbers); every global lookup, the one way a pickle runs code, is refused."""

    def find_class(self, module, name):
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("a persistent object")


class _Refused(Exception):
    pass


def restricted_unpickle(raw: bytes, origin: str):
    """Unpickle plain data only; a pickle that needs any class or function is
    refused without running it."""
    try:
        data = _PlainDataUnpickler(io.BytesIO(raw)).load()
    except _Refused as exc:
        raise SnapshotError(
            f"{origin}: refused: the pickle asks for {exc} (only plain data is read from a pickle; nothing in it was run)"
        ) from None
    except (EOFError, pickle.UnpicklingError) as exc:
        detail = str(exc)[:120] or exc.__class__.__name__
        raise SnapshotError(f"{origin}: truncated or corrupt pickle ({detail})") from None
    except MemoryError:
        raise SnapshotError(f"{origin}: the pickle needs more memory than is available") from None
    except Exception as exc:  # malformed opcodes surface as many error types
        raise SnapshotError(
            f"{origin}: corrupt pickle ({exc.__class__.__name__}: {str(exc)[:120]})"
        ) from None
    _check_plain(data, origin)
    return data


_PLAIN_LEAVES = (str, bytes, bytearray, int, float, bool, type(None))
_PLAIN_CONTAINERS = (dict, list, tuple, set, frozenset)


def _check_plain(data, origin: str) -> None:
    """Defence in depth: everything reachable is a plain container or scalar.
    Iterative, and each container is visited once, so shared or cyclic
    references cannot make the walk blow up."""
    stack = [data]
    seen: set[int] = set()
    nodes = 0
    while stack:
        item = stack.pop()
        nodes += 1
        if nodes > MAX_PLAIN_NODES:
            raise SnapshotError(
                f"{origin}: the pickle holds more than {MAX_PLAIN_NODES} values; refused"
            )
        if type(item) in _PLAIN_LEAVES:
            continue
        if type(item) not in _PLAIN_CONTAINERS:
            raise SnapshotError(
                f"{origin}: the pickle holds a {type(item).__name__}, not plain data; refused"
            )
        if id(item) in seen:
            continue
        seen.add(id(item))
        if type(item) is dict:
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            stack.extend(item)


# ---------------------------------------------------- PyTorch snapshot reading


class _Shape:
    """Typed access to untrusted nested data: wrong types become SnapshotError
    naming the field, never a TypeError or KeyError."""

    def __init__(self, origin: str):
        self.origin = origin
        # Converted stacks by the identity of the list they came from: a
        # stack shared by many blocks is converted (and stored) once.
        self._frames_cache: dict[int, tuple[object, list[dict]]] = {}
        self._frame_work = 0

    def fail(self, message: str):
        raise SnapshotError(f"{self.origin}: not a usable PyTorch memory snapshot ({message})")

    def dict_(self, value, where: str) -> dict:
        if not isinstance(value, dict):
            self.fail(f"{where} is a {type(value).__name__}, not a dict")
        return value

    def list_(self, value, where: str) -> list:
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            self.fail(f"{where} is a {type(value).__name__}, not a list")
        return value

    def int_(self, value, where: str, default: int | None = None) -> int:
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"{where} is a {type(value).__name__}, not an integer")
        if not -MAX_INT < value < MAX_INT:
            self.fail(f"{where} is out of range")
        return value

    def str_(self, value, where: str, default: str = "") -> str:
        if value is None:
            return default
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        if not isinstance(value, str):
            self.fail(f"{where} is a {type(value).__name__}, not a string")
        return value

    def frames(self, value, where: str) -> list[dict]:
        cached = self._frames_cache.get(id(value))
        if cached is not None and cached[0] is value:
            return cached[1]
        raw = self.list_(value, where)[:MAX_FRAMES]
        self._frame_work += len(raw)
        if self._frame_work > MAX_FRAME_WORK:
            self.fail(f"more than {MAX_FRAME_WORK} stack frames")
        result: list = []
        if value is not None:
            self._frames_cache[id(value)] = (
                value,
                result,
            )  # holds `value`, so its id is not reused
        for position, frame in enumerate(raw):
            frame = self.dict_(frame, f"{where}[{position}]")
            result.append(
                {
                    "filename": self.str_(
                        frame.get("filename"), f"{where}[{position}].filename", "?"
                    ),
                    "line": self.int_(frame.get("line"), f"{where}[{position}].line", 0),
                    "name": self.str_(frame.get("name"), f"{where}[{position}].name", "?"),
                }
            )
        return result


_LIBRARY_PATH = re.compile(
    r"(^<)|([/\\](site|dist)-packages[/\\])|([/\\]lib[/\\]python\d[\d.]*[/\\])|(^\?\?$)"
)


def foreign_user_frame(frames: list[dict]) -> dict | None:
    """The innermost frame of the user's code in a stack recorded on another
    machine: judged by the path's shape (site-packages, the standard library,
    `<frozen ...>`), since the paths need not exist here. Falls back to the
    innermost Python frame."""
    fallback = None
    for frame in frames:
        filename = frame.get("filename") or ""
        if not filename.endswith(".py"):
            continue  # C++ frames when stacks="all"
        location = {
            "file": filename,
            "line": int(frame.get("line") or 0),
            "function": frame.get("name") or "?",
        }
        if not _LIBRARY_PATH.search(filename):
            return location
        if fallback is None:
            fallback = location
    return fallback


def _frame_is(frame: dict, path_part: str, names: tuple[str, ...] = ()) -> bool:
    filename = (frame.get("filename") or "").replace("\\", "/")
    return path_part in filename and (not names or frame.get("name") in names)


def infer_category(frames: list[dict]) -> str:
    """What a block probably holds, from the stack that allocated it.

    Optimizer code allocates optimizer state; backward (or the autograd
    engine, whose allocations have no Python stack) gradients and their
    temporaries; Module.to/cuda/_apply parameters; any other code under a
    module's forward activations; code that makes buffers for collectives
    (DDP's buckets, FSDP2's, oomdoc.categories) communication, before any
    of these. Without a stack: "other"."""
    if not frames:
        return "other"
    if any(
        is_communication_frame(frame.get("filename") or "", frame.get("name")) for frame in frames
    ):
        return COMMUNICATION
    names = " ".join(str(frame.get("name") or "") for frame in frames)
    if any(_frame_is(frame, "torch/optim/") for frame in frames):
        return "optimizer_state"
    if (
        "autograd::Engine" in names
        or "AccumulateGrad" in names
        or any(
            _frame_is(frame, "torch/autograd/", ("backward", "grad", "_engine_run_backward"))
            or _frame_is(frame, "torch/_tensor.py", ("backward",))
            for frame in frames
        )
    ):
        return "gradients"
    if any(
        _frame_is(
            frame,
            "torch/nn/modules/module.py",
            ("_apply", "to", "cuda", "load_state_dict", "_load_from_state_dict"),
        )
        for frame in frames
    ):
        return "parameters"
    if any(
        frame.get("name") in ("forward", "_call_impl", "_wrapped_call_impl") for frame in frames
    ):
        return "activations"
    return "other"


def infer_phase(frames: list[dict]) -> str | None:
    category = infer_category(frames)
    return {
        "optimizer_state": "optimizer",
        "gradients": "backward",
        "activations": "forward",
        "parameters": "setup",
        COMMUNICATION: COMMUNICATION,
    }.get(category)


def _choose_device(shape: _Shape, segments: list, traces: list) -> int:
    """The device with an OOM in its trace, else the one with most reserved."""
    for device, trace in enumerate(traces[:MAX_DEVICES]):
        for entry in shape.list_(trace, f"device_traces[{device}]"):
            if isinstance(entry, dict) and entry.get("action") == "oom":
                return device
    reserved: dict[int, int] = {}
    for position, segment in enumerate(segments):
        segment = shape.dict_(segment, f"segments[{position}]")
        device = shape.int_(segment.get("device"), f"segments[{position}].device", 0)
        reserved[device] = reserved.get(device, 0) + shape.int_(
            segment.get("total_size"), f"segments[{position}].total_size", 0
        )
    return max(reserved, key=lambda d: (reserved[d], -d)) if reserved else 0


@dataclass
class _Segments:
    """What the allocator's segments on one device add up to."""

    reserved: int = 0
    allocated: int = 0
    requested_live: int = 0
    inactive_split_bytes: int = 0
    inactive_split_blocks: int = 0
    largest_free_block: int = 0
    count: int = 0
    expandable: bool = False
    # (size, requested size, address, frames) of each block a tensor uses.
    live_blocks: list = field(default_factory=list)


def _read_segments(shape: _Shape, segments: list, device: int) -> _Segments:
    totals = _Segments()
    blocks_seen = 0
    for s_pos, segment in enumerate(segments):
        where = f"segments[{s_pos}]"
        segment = shape.dict_(segment, where)
        if shape.int_(segment.get("device"), f"{where}.device", 0) != device:
            continue
        totals.count += 1
        totals.reserved += shape.int_(segment.get("total_size"), f"{where}.total_size", 0)
        totals.expandable = totals.expandable or segment.get("is_expandable") is True
        blocks = shape.list_(segment.get("blocks"), f"{where}.blocks")
        blocks_seen += len(blocks)
        if blocks_seen > MAX_BLOCKS:
            shape.fail(f"more than {MAX_BLOCKS} blocks")
        for b_pos, block in enumerate(blocks):
            b_where = f"{where}.blocks[{b_pos}]"
            block = shape.dict_(block, b_where)
            size = shape.int_(block.get("size"), f"{b_where}.size", 0)
            state = shape.str_(block.get("state"), f"{b_where}.state")
            if state in ACTIVE_STATES:
                totals.allocated += size
                wanted = shape.int_(block.get("requested_size"), f"{b_where}.requested_size", size)
                totals.requested_live += wanted
                totals.live_blocks.append(
                    (
                        size,
                        wanted,
                        shape.int_(block.get("address"), f"{b_where}.address", 0),
                        shape.frames(block.get("frames"), f"{b_where}.frames"),
                    )
                )
            elif state == "inactive":
                totals.largest_free_block = max(totals.largest_free_block, size)
                # An inactive block in a segment of several blocks is a
                # split-off remainder: cached, but only usable by requests
                # that fit in it (what PyTorch counts as inactive_split).
                if len(blocks) > 1:
                    totals.inactive_split_bytes += size
                    totals.inactive_split_blocks += 1
    return totals


def _read_trace(
    shape: _Shape, trace: list, device: int
) -> tuple[tuple[int, dict] | None, int, list[dict]]:
    """(position and entry of the last OOM, how many OOMs, the events just before it)."""
    oom_entry = None
    oom_count = 0
    for position, entry in enumerate(trace):
        entry = shape.dict_(entry, f"device_traces[{device}][{position}]")
        if entry.get("action") == "oom":
            oom_count += 1
            oom_entry = (position, entry)
    events_before = []
    if oom_entry is not None:
        position, _entry = oom_entry
        before = trace[max(0, position - TRACE_BEFORE_OOM) : position]
        for offset, event in enumerate(before):
            where = f"device_traces[{device}][{position - len(before) + offset}]"
            event_frames = shape.frames(event.get("frames"), f"{where}.frames")
            events_before.append(
                {
                    "action": shape.str_(event.get("action"), f"{where}.action", "?"),
                    "bytes": shape.int_(event.get("size"), f"{where}.size", 0),
                    "address": shape.int_(event.get("addr"), f"{where}.addr", 0),
                    "location": foreign_user_frame(event_frames),
                    "category": infer_category(event_frames),
                }
            )
    return oom_entry, oom_count, events_before


def _breakdown_and_sites(live_blocks: list) -> tuple[dict, list[dict]]:
    """Bytes per inferred category, and the largest sites (category, line)."""
    breakdown = {category: 0 for category in CATEGORIES}
    grouped: dict[tuple, dict] = {}
    judged: dict[int, tuple[str, dict | None]] = {}  # by stack: converted stacks are shared
    for size, _wanted, _address, block_frames in live_blocks:
        verdict = judged.get(id(block_frames))
        if verdict is None:
            verdict = judged[id(block_frames)] = (
                infer_category(block_frames),
                foreign_user_frame(block_frames),
            )
        category, location = verdict
        breakdown[category] += size
        key = (category, (location or {}).get("file"), (location or {}).get("line"))
        entry = grouped.get(key)
        if entry is None:
            entry = grouped[key] = {
                "bytes": 0,
                "count": 0,
                "category": category,
                "location": location,
                "shape": None,
                "dtype": None,
                "frames": block_frames[:8],
                "largest_block_bytes": 0,
            }
        entry["bytes"] += size
        entry["count"] += 1
        entry["largest_block_bytes"] = max(entry["largest_block_bytes"], size)
    top = sorted(grouped.values(), key=lambda e: e["bytes"], reverse=True)[:TOP_BLOCKS]
    return breakdown, top


def _oom_record(shape: _Shape, oom_entry: tuple[int, dict], device: int, totals: _Segments) -> dict:
    position, entry = oom_entry
    where = f"device_traces[{device}][{position}]"
    requested = shape.int_(entry.get("size"), f"{where}.size", 0)
    device_free = shape.int_(entry.get("device_free"), f"{where}.device_free", 0)
    oom_frames = shape.frames(entry.get("frames"), f"{where}.frames")
    return {
        "step": None,
        "phase": infer_phase(oom_frames),
        "requested_bytes": requested,
        "allocated_bytes": totals.allocated,
        "reserved_bytes": totals.reserved,
        "free_bytes": device_free,
        # What this process could have had: what it held plus what CUDA still had free.
        "capacity_bytes": totals.reserved + device_free,
        "message": f"CUDA out of memory: tried to allocate {requested} bytes with {device_free} bytes free on the device",
        "location": foreign_user_frame(oom_frames),
    }


def torch_snapshot_document(data, origin: str, source_format: str) -> dict:
    """An oomdoc-shaped document from PyTorch's snapshot dict: the allocator's
    totals from the segments, the events before the OOM from the trace, and
    categories and sites inferred from each live block's stack."""
    shape = _Shape(origin)
    data = shape.dict_(data, "the top level")
    if "segments" not in data:
        shape.fail("no segments")
    segments = shape.list_(data.get("segments"), "segments")
    traces = shape.list_(data.get("device_traces"), "device_traces")
    device = _choose_device(shape, segments, traces)
    totals = _read_segments(shape, segments, device)
    trace = (
        shape.list_(traces[device], f"device_traces[{device}]") if 0 <= device < len(traces) else []
    )
    oom_entry, oom_count, events_before = _read_trace(shape, trace, device)
    settings = data.get("allocator_settings")
    if isinstance(settings, dict) and settings.get("expandable_segments") is True:
        totals.expandable = True
    breakdown, top = _breakdown_and_sites(totals.live_blocks)

    notes = [
        "Read from PyTorch's own memory snapshot: categories are inferred from the stacks that "
        "allocated each block (allocations made by the autograd engine carry no Python stack).",
    ]
    oom = _oom_record(shape, oom_entry, device, totals) if oom_entry is not None else None
    if oom is not None:
        notes.append(
            "Capacity is taken as reserved memory plus what CUDA reported free at the OOM."
        )
    if not trace:
        notes.append(
            "The snapshot has no allocation trace (record with torch.cuda.memory._record_memory_history() to see the events before an OOM)."
        )

    return {
        "schema_version": None,
        "source": {"format": source_format, "path": origin},
        "torch_version": "unknown",
        "command": [],
        "cwd": None,
        "device": {
            "kind": "cuda",
            "name": f"CUDA device {device} (PyTorch memory snapshot)",
            "index": device,
            "capacity_bytes": oom["capacity_bytes"] if oom is not None else 0,
        },
        "host": {},
        "outcome": "oom" if oom is not None else "ok",
        "exit_code": 0,
        "error": None,
        "step_unit": None,
        "oom": oom,
        "breakdown": breakdown,
        "breakdown_at": "snapshot",
        "peak": {
            "allocated_bytes": totals.allocated,
            "reserved_bytes": totals.reserved,
            "step": None,
            "phase": None,
        },
        "steps": [],
        "top_allocations": top,
        "allocator": {
            "reserved_bytes": totals.reserved,
            "allocated_bytes": totals.allocated,
            "requested_bytes": totals.requested_live,
            "inactive_split_bytes": totals.inactive_split_bytes,
            "inactive_split_blocks": totals.inactive_split_blocks,
            "largest_free_block_bytes": totals.largest_free_block,
            "segments": totals.count,
            "num_ooms": oom_count,
            "expandable_segments": totals.expandable,
        },
        "trace_before_oom": events_before,
        "optimizers": [],
        "models": [],
        "fixes": [],
        "max_batch_size": None,
        "notes": notes,
    }
