"""The simulated device: a device of fixed capacity made of CPU memory.

`SimulatedBackend` counts every CPU tensor storage through a TorchDispatchMode
and raises a real `torch.OutOfMemoryError` when an allocation would exceed its
capacity, so that every oomdoc path can be exercised without a GPU.
"""

from __future__ import annotations

import os
import sys
from itertools import compress
from operator import attrgetter
from types import ModuleType
from typing import Iterator

import torch

from oomdoc.capture.backend_base import (
    AllocationObserver,
    Backend,
    OutOfMemoryError,
    StorageRecord,
    storage_sites,
)
from oomdoc.capture.modules import category_of
from oomdoc.capture.passthrough import PassThrough
from oomdoc.capture.simulated_dispatch import (
    _ENGINE_CALLERS,
    _IN_PLACE,
    _OP_ENTRIES,
    _VIEW,
    _CountingMode,
    _flat_tensors,
    _innermost_user_code,
    _is_user_code,
    _op_entry,
    _RuleLookup,
    _StorageRef,
    _Tensor,
)
from oomdoc.sizes import format_bytes
from oomdoc.snapshot import CATEGORIES

_FORWARD_BACKWARD = frozenset(("forward", "backward"))
_PHASE_CATEGORIES: dict = {}  # phase -> category_of(None, phase)
_IS_CPU = attrgetter("is_cpu")


class SimulatedBackend(Backend):
    """A device of fixed capacity made of CPU memory.

    Every CPU tensor storage counts, because on the CPU a script's model,
    data and temporaries all share the one memory; the report says so.
    Frees are seen through weak references to the storages.

    What a phase boundary reads is kept up to date as storages come and go,
    so reading it costs nothing per live storage: the bytes per category,
    the live bytes made in each step's forward/backward, and, after
    `mark_peak`, a log of what changed since the fullest moment, from which
    the storages live then are rebuilt once, when the snapshot is written.
    """

    kind = "simulated"
    per_storage = True

    def __init__(self, capacity_bytes: int, pass_through: bool = True, native: bool = True):
        self._capacity = int(capacity_bytes)
        # Let the ops that cannot make a storage skip the mode, and check the
        # others in C++ where the compiled check can be had
        # (oomdoc.capture.passthrough, oomdoc.capture.native); tests compare
        # with and without.
        self._use_pass_through = pass_through
        self._use_native = native and pass_through
        self._records: dict[int, StorageRecord] = {}
        self._finalizers: dict[int, _StorageRef] = {}
        self._freed_callback = self._on_storage_freed  # one bound method, made once
        # In a backward pass, the frame that runs the autograd engine, with the
        # user code above it: every storage the engine's own nodes make has the
        # same site. Held only while the tracker's backward wrapper runs.
        self._engine_frame: tuple | None = None
        self._live = 0
        self._peak = 0
        self._enabled = False
        self._mode: _CountingMode | None = None
        self._pass_through: PassThrough | None = None
        # The compiled ledger's module while it keeps the storages
        # (oomdoc.capture.native): `_records` and the bytes per category and
        # per step are then brought up to date from its log (`_sync`) before
        # they are read, and the live and peak bytes are its own.
        self._native: ModuleType | None = None
        self._rule_lookup: _RuleLookup | None = None
        self.tracker: AllocationObserver | None = None
        self._sequence = 0
        # Bytes per category. Parameters, gradients and optimizer state are
        # the storages the tracker names through apply_known (key -> category);
        # the rest are activations or other by the phase they were made in.
        self._category_bytes = dict.fromkeys(CATEGORIES, 0)
        self._known_applied: dict[int, str] = {}
        self._known_named: dict = {}  # the last apply_known's argument
        # Live bytes made in the forward or backward of each step.
        self._forward_backward_bytes: dict[int, int] = {}
        self._forward_backward_total = 0
        self._forward_backward_last_step = 0
        # The peak mark: what was added and freed since it, or, once that log
        # grew as large as the live set, the storages live at the mark.
        self._mark_added: set | None = None
        self._mark_freed: dict | None = None
        self._mark_known: dict | None = None
        self._mark_records: list | None = None
        self._mark_log_limit = 0
        self.stats = {"peak_marks": 0, "peak_log_rebuilds": 0}

    # lifecycle
    def storage_ledger(self) -> SimulatedBackend:
        return self

    def install(self, tracker: AllocationObserver) -> None:
        self.tracker = tracker
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        self._rule_lookup = _RuleLookup()
        if self._use_pass_through:
            self._pass_through = PassThrough(self._mode)
            self._pass_through.install()
            if self._use_native and self._pass_through.install_native(self):
                self._native = self._pass_through._native
        self.enabled = True
        # DataLoader workers fork from this process: they must not count (or
        # raise) against the parent's device.
        os.register_at_fork(after_in_child=self._disable_in_child)

    @property
    def enabled(self) -> bool:
        """Whether ops count now: off while oomdoc does its own work, and
        in processes forked from the script's (DataLoader workers)."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value
        if self._pass_through is not None:
            self._pass_through.set_native_enabled(value)

    @property
    def pass_through_active(self) -> bool:
        return self._pass_through is not None and self._pass_through.active

    @property
    def native_active(self) -> bool:
        """Whether the compiled check runs (oomdoc.capture.native)."""
        return self._pass_through is not None and self._pass_through.native_active

    @property
    def pass_through_ops(self) -> list[str]:
        return list(self._pass_through.ops) if self._pass_through is not None else []

    def _disable_in_child(self) -> None:
        if self._native is not None:
            self._native.after_fork_in_child()
        self.enabled = False

    # the compiled ledger (oomdoc.capture.native)
    def native_arguments(self) -> tuple:
        """What the compiled ledger is installed with: the capacity, the
        tracker (step, phase, module of a new storage), the user-code test
        of its site, the OOM and the read of its log (when the log is long)."""
        return (self._capacity, self.tracker, _is_user_code, self.raise_oom, self._sync)

    def _sync(self) -> None:
        """Bring `_records` and what is kept with it up to date from the
        compiled ledger's log: the storages made and freed since the last
        read cancel out there."""
        native = self._native
        if native is None:
            return
        events = native.read_events()
        if not events:
            return
        records = self._records
        scopes = self.tracker.scopes if self.tracker is not None else None
        for event in events:
            kind = event[0]
            if kind == 0:
                _, key, nbytes, sequence, step, phase, code, line, module, node, shape, dtype = (
                    event
                )
                if module is None and node >= 0 and scopes is not None:
                    module = scopes.path_at_sequence(node)
                category = _PHASE_CATEGORIES.get(phase)
                if category is None:
                    category = _PHASE_CATEGORIES[phase] = category_of(None, phase)
                record = StorageRecord(
                    nbytes, step, phase, category, code, line, shape, dtype, sequence, module
                )
                records[key] = record
                self._added(key, record)
            elif kind == 1:
                freed = records.pop(event[1], None)
                if freed is not None:
                    self._forget(event[1], freed)
            else:
                resized = records.get(event[1])
                if resized is not None:
                    self._resize(event[1], resized, event[2])

    def native_removed(self, native: ModuleType) -> None:
        """The compiled check goes (another dispatch mode or a tensor subclass
        came, or the device is uninstalled): the Python side takes the live
        storages over, watched from now on by weak references."""
        if self._native is not native:
            return
        self._sync()
        live = native.hand_over()
        _live, peak, self._sequence = native.totals()
        self._native = None
        self._peak = max(self._peak, peak)
        keys = set()
        for key, storage in live:
            keys.add(key)
            if key in self._records:
                reference = _StorageRef(storage, self._freed_callback)
                reference.key = key
                self._finalizers[key] = reference
        for key in [key for key in self._records if key not in keys]:
            self._forget(key, self._records.pop(key))

    def uninstall(self) -> None:
        self.enabled = False
        if self._rule_lookup is not None:
            self._rule_lookup.remove()
            self._rule_lookup = None
        if self._pass_through is not None:
            self._pass_through.remove()
            self._pass_through = None
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            except Exception:
                pass
            self._mode = None

    # bookkeeping: the dispatch hot path
    def dispatch(self, func, args, kwargs):
        """Run one op: count new input storages, then its new outputs."""
        entry = _OP_ENTRIES.get(id(func))  # OpOverload.__hash__ is Python code
        if entry is None:
            entry = _op_entry(func)
        call, kind, _func = entry
        if not self._enabled:
            return call(*args, **kwargs) if kwargs else call(*args)
        if self._native is not None:  # (its views end in the mode)
            return self._dispatch_native(call, kind, args, kwargs)
        records = self._records
        for item in args:
            if isinstance(item, _Tensor):
                # adopt(item), inline: it runs for every tensor argument.
                if item.is_cpu:
                    try:
                        storage = item.untyped_storage()
                    except Exception:  # sparse and other storage-less layouts
                        continue
                    key = storage._cdata
                    record = records.get(key)
                    if record is None:
                        if storage.nbytes():
                            self._register(key, storage, item, 3)
                    elif storage.nbytes() != record.nbytes:  # resized in place
                        self._resize(key, record, storage.nbytes())
            elif isinstance(item, (list, tuple)):
                self.adopt_inputs(item, None)
        if kwargs:
            for item in kwargs.values():
                if isinstance(item, _Tensor):
                    self.adopt(item)
                elif isinstance(item, (list, tuple)):
                    self.adopt_inputs(item, None)
            out = call(*args, **kwargs)
        else:
            out = call(*args)
        if kind is _VIEW or kind is _IN_PLACE or not self._enabled:
            return out  # its outputs are its inputs' storages, looked at above
        if isinstance(out, _Tensor):
            self.register_output(out)
        elif out is not None:
            self.register_outputs(out, func)
        return out

    def _dispatch_native(self, call, kind, args, kwargs):
        """An op the mode sees while the compiled ledger counts: it counts
        the op's tensors too."""
        native = self._native
        native.look((args, kwargs) if kwargs else args, False)
        out = call(*args, **kwargs) if kwargs else call(*args)
        if kind is _IN_PLACE or not self._enabled:  # (views end in the mode)
            return out
        native.look(out, True)
        return out

    def adopt(self, tensor: torch.Tensor, depth: int = 2) -> None:
        """Count a tensor made outside dispatch (torch.from_numpy, shared
        memory from DataLoader workers) the first time an op touches it.
        `depth`: as _register's, from here."""
        if not tensor.is_cpu:
            return
        try:
            storage = tensor.untyped_storage()
        except Exception:  # sparse and other storage-less layouts
            return
        key = storage._cdata
        record = self._records.get(key)
        if record is None:
            if storage.nbytes():
                self._register(key, storage, tensor, depth)
        else:
            nbytes = storage.nbytes()
            if nbytes != record.nbytes:  # resized in place (resize_, out=)
                self._resize(key, record, nbytes)

    def adopt_inputs(self, args, kwargs) -> None:
        for item in _flat_tensors((args, kwargs), []):
            self.adopt(item)

    def register_output(self, tensor: torch.Tensor) -> None:
        """One output tensor: the common case of register_outputs."""
        if not tensor.is_cpu:
            return
        try:
            storage = tensor.untyped_storage()
        except Exception:
            return
        key = storage._cdata
        nbytes = storage.nbytes()
        record = self._records.get(key)
        if record is not None:
            if nbytes != record.nbytes:
                self._resize(key, record, nbytes)
            return
        if not nbytes:
            return
        if self._live + nbytes > self._capacity:
            self.raise_oom(nbytes)
        self._register(key, storage, tensor, 4)

    def register_outputs(self, out, func=None, depth: int = 4) -> None:
        """An op's output storages: each new one counted (the OOM raised when
        together they do not fit), each resized one counted again. `depth`:
        as _register's, from here."""
        pending: dict = {}
        for item in _flat_tensors(out, []):
            if not item.is_cpu:
                continue
            try:
                storage = item.untyped_storage()
            except Exception:
                continue
            key = storage._cdata
            nbytes = storage.nbytes()
            record = self._records.get(key)
            if record is not None:
                if nbytes != record.nbytes:
                    self._resize(key, record, nbytes)
            elif nbytes and key not in pending:
                # Storages shared between several outputs are counted once.
                pending[key] = (storage, item)
        if not pending:
            return
        requested = sum(storage.nbytes() for storage, _ in pending.values())
        if self._live + requested > self._capacity:
            self.raise_oom(requested)
        for key, (storage, tensor) in pending.items():
            self._register(key, storage, tensor, depth)

    def _register(self, key, storage, tensor, depth: int = 1) -> None:
        """Count a new storage. `depth`: how many frames above this one are
        surely oomdoc's (the dispatch path's), skipped without a look: on
        Python 3.11+ each frame looked at is made into a frame object."""
        tracker = self.tracker
        nbytes = storage.nbytes()
        frame = sys._getframe(depth)
        if tracker is not None:
            step, phase = tracker.step_index, tracker.phase
            module = tracker.scopes.allocation_path()
            engine = self._engine_frame
            if engine is not None and engine[0] is frame:
                code, line = engine[1], engine[2]
            else:
                code, line = _innermost_user_code(frame)
                if tracker.in_backward and id(frame.f_code) in _ENGINE_CALLERS:
                    self._engine_frame = (frame, code, line)
        else:
            step, phase, module = 0, "setup", None
            code, line = _innermost_user_code(frame)
        # The one category rule (oomdoc.capture.modules), for the breakdown,
        # the sites and the modules alike.
        category = _PHASE_CATEGORIES.get(phase)
        if category is None:
            category = _PHASE_CATEGORIES[phase] = category_of(None, phase)
        sequence = self._sequence = self._sequence + 1
        record = self._records[key] = StorageRecord(
            nbytes, step, phase, category, code, line, tensor.shape, tensor.dtype, sequence, module
        )
        reference = _StorageRef(storage, self._freed_callback)
        reference.key = key
        self._finalizers[key] = reference
        self._added(key, record)

    def _added(self, key, record: StorageRecord) -> None:
        """What a new storage's record adds to the live bytes and the tables."""
        nbytes, phase, step, category = record.nbytes, record.phase, record.step, record.category
        live = self._live = self._live + nbytes
        if live > self._peak:
            self._peak = live
        self._category_bytes[category] += nbytes
        if phase in _FORWARD_BACKWARD:
            table = self._forward_backward_bytes
            table[step] = table.get(step, 0) + nbytes
            self._forward_backward_total += nbytes
            if step > self._forward_backward_last_step:
                self._forward_backward_last_step = step
        added = self._mark_added
        if added is not None:
            added.add(key)
            if len(added) + len(self._mark_freed or ()) > self._mark_log_limit:
                self._check_mark_log()

    def stop_counting(self) -> None:
        self.enabled = False

    def backward_ended(self) -> None:
        """The tracker's backward wrapper returns: let go of the engine frame."""
        self._engine_frame = None

    def _resize(self, key, record: StorageRecord, nbytes: int) -> None:
        grown = nbytes - record.nbytes
        self._records[key] = record.resized(nbytes)
        self._live += grown
        if self._live > self._peak:
            self._peak = self._live
        self._category_bytes[self._known_applied.get(key) or record.category] += grown
        if record.phase in _FORWARD_BACKWARD:
            table = self._forward_backward_bytes
            table[record.step] = table.get(record.step, 0) + grown
            self._forward_backward_total += grown
        added, freed = self._mark_added, self._mark_freed
        if added is not None and freed is not None and key not in added:
            # Live at the mark with its old size: the mark keeps that record.
            freed.setdefault(key, record)
            added.add(key)
            self._check_mark_log()

    def _on_storage_freed(self, reference: _StorageRef) -> None:
        key = reference.key
        if key is None or self._finalizers.get(key) is not reference:
            return  # detached, or a stale reference to a key in use again
        del self._finalizers[key]
        record = self._records.pop(key, None)
        if record is not None:
            self._forget(key, record)

    def _forget(self, key, record: StorageRecord) -> None:
        nbytes = record.nbytes
        self._live -= nbytes
        self._category_bytes[self._known_applied.pop(key, "") or record.category] -= nbytes
        if record.phase in _FORWARD_BACKWARD:
            table = self._forward_backward_bytes
            left = table.get(record.step, 0) - nbytes
            if left:
                table[record.step] = left
            else:
                table.pop(record.step, None)
            self._forward_backward_total -= nbytes
        added, freed = self._mark_added, self._mark_freed
        if added is not None and freed is not None:
            if key in added:
                added.discard(key)
            else:
                freed.setdefault(key, record)
                self._check_mark_log()

    # what the tracker reads at phase boundaries
    def apply_known(self, known: dict[int, str]) -> None:
        """Name the storages that are parameters, gradients or optimizer
        state now ({key: category}); every other storage falls back to the
        category of the phase it was made in. Costs O(len(known)), nothing
        when it names what the last call named and all of it is still live."""
        self._sync()
        applied = self._known_applied
        if (known is self._known_named or known == self._known_named) and len(applied) == len(
            known
        ):
            return  # applied holds exactly these keys (a free or a new one differs in size)
        self._known_named = known
        records = self._records
        counts = self._category_bytes
        for key, category in known.items():
            current = applied.get(key)
            if current == category:
                continue
            record = records.get(key)
            if record is None:
                continue  # not a storage of this device (yet)
            counts[current or record.category] -= record.nbytes
            counts[category] += record.nbytes
            applied[key] = category
        for key in [key for key in applied if key not in known]:
            record = records[key]
            counts[applied.pop(key)] -= record.nbytes
            counts[record.category] += record.nbytes

    def capture_stats(self) -> dict[str, int]:
        if self._native is not None:
            self._sequence = self._native.totals()[2]
        pass_through = self._pass_through
        native_ops = (
            pass_through.native_ops if pass_through is not None and self.native_active else 0
        )
        return {"storages_registered": self._sequence, "native_ops": native_ops, **self.stats}

    def known_categories(self) -> dict[int, str]:
        """{key: category} of the live storages named by the last apply_known."""
        self._sync()
        return dict(self._known_applied)

    def category_bytes(self) -> dict[str, int]:
        """Live bytes per category, as of the last apply_known."""
        self._sync()
        return dict(self._category_bytes)

    def retained_activation_bytes(self, step: int) -> int:
        """Live bytes made in the forward or backward of steps before `step`."""
        self._sync()
        total = self._forward_backward_total
        table = self._forward_backward_bytes
        for later in range(step, self._forward_backward_last_step + 1):
            total -= table.get(later, 0)
        return total

    def mark_peak(self) -> None:
        """Remember the storages live now (the fullest moment so far) so that
        marked_storages() can list them later. Costs O(params) now and O(1)
        per storage made or freed afterwards."""
        self._sync()
        self._mark_added = set()
        self._mark_freed = {}
        self._mark_records = None
        self._mark_known = dict(self._known_applied)
        self._mark_log_limit = max(4096, 2 * len(self._records))
        self.stats["peak_marks"] += 1

    def _check_mark_log(self) -> None:
        if len(self._mark_added or ()) + len(self._mark_freed or ()) > self._mark_log_limit:
            # The log would outgrow a plain copy of the live set: rebuild the
            # marked storages now and stop logging (amortised O(1) per change).
            self._mark_records = self._rebuild_marked()
            self._mark_added = self._mark_freed = None
            self.stats["peak_log_rebuilds"] += 1

    def _rebuild_marked(self) -> list:
        added, freed = self._mark_added or set(), self._mark_freed or {}
        items = [(key, record) for key, record in self._records.items() if key not in added]
        items.extend(freed.items())
        items.sort(key=lambda item: item[1].sequence)
        return items

    def marked_storages(self) -> tuple[list[tuple[int, StorageRecord]], dict[int, str]] | None:
        """[(key, record)] live at the last mark_peak, in registration order,
        and the parameters/gradients/state naming then; None without a mark."""
        self._sync()
        if self._mark_known is None:
            return None
        records = self._mark_records
        if records is None:
            records = self._rebuild_marked()
        return records, self._mark_known

    def raise_oom(self, requested: int) -> None:
        self._sync()
        live = self.allocated_bytes()
        free = max(0, self._capacity - live)
        message = (
            f"CUDA out of memory. Tried to allocate {format_bytes(requested)}. "
            f"Simulated device 0 (oomdoc) has a total capacity of {format_bytes(self._capacity)} of which "
            f"{format_bytes(free)} is free. Of the allocated memory {format_bytes(live)} is allocated "
            f"by PyTorch (every CPU tensor of this process counts), and 0 bytes is reserved by PyTorch "
            f"but unallocated."
        )
        if self.tracker is not None:
            self.enabled = False  # the tracker's own work must not count
            try:
                self.tracker.on_oom(requested_bytes=requested, message=message)
            finally:
                self.enabled = True
        raise OutOfMemoryError(message)

    # interface
    def device_info(self) -> dict:
        return {
            "kind": "simulated",
            "name": "simulated device (CPU tensors counted by oomdoc)",
            "capacity_bytes": self._capacity,
            "total_bytes": self._capacity,
            "supports_bf16": True,
            "notes": ["Every CPU tensor of the process counts against the simulated capacity."],
        }

    def allocated_bytes(self) -> int:
        if self._native is not None:
            return self._native.totals()[0]
        return self._live

    def reserved_bytes(self) -> int:
        return self.allocated_bytes()

    def capacity_bytes(self) -> int:
        return self._capacity

    def read_and_reset_peak(self) -> tuple[int, int]:
        if self._native is not None:
            peak = self._native.read_and_reset_peak()[0]
            return peak, peak
        peak = self._peak
        self._peak = self._live
        return peak, peak

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    def owned(self, tensors: list) -> list:
        return list(compress(tensors, map(_IS_CPU, tensors)))

    def storage_table(self, tensors) -> dict:
        if self._native is not None:
            # One C call, no Python storage object per tensor (the same table).
            return self._native.storage_table(tensors)
        return super().storage_table(tensors)

    def live_storages(self) -> Iterator[tuple[int, int, StorageRecord]]:
        self._sync()
        for key, record in list(self._records.items()):
            yield key, record.nbytes, record

    def allocation_sites(self) -> list[dict]:
        self._sync()
        return storage_sites(list(self._records.items()))
