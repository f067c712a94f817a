"""Device backends behind one small interface.

`SimulatedBackend` counts every CPU tensor storage through a TorchDispatchMode
and raises a real `torch.OutOfMemoryError` when an allocation would exceed its
capacity, so that every oomdoc path can be exercised without a GPU.
`CudaBackend` reads the real caching allocator.
"""

from __future__ import annotations

import os
import sys
import weakref
from itertools import compress
from operator import attrgetter, methodcaller

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oomdoc import frames
from oomdoc.capture import nvml_handle
from oomdoc.capture.modules import category_of, phase_from_frames
from oomdoc.capture.passthrough import PassThrough
from oomdoc.capture.peak_view import PeakView
from oomdoc.sizes import format_bytes

OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


class StorageRecord:
    """What the simulated device knows about one live storage.

    Immutable once made (a storage resized in place gets a new record), so
    that a record list kept for the peak still says what it said then. The
    location is kept as (code object, line) and turned into a snapshot
    `location` only when sites are listed. `module` is the module whose
    forward (or backward) made it (oomdoc.capture.modules).
    """

    __slots__ = (
        "nbytes",
        "step",
        "phase",
        "category",
        "code",
        "line",
        "shape",
        "dtype_object",
        "sequence",
        "module",
    )

    def __init__(
        self, nbytes, step, phase, category, code, line, shape, dtype_object, sequence, module
    ):
        self.nbytes = nbytes
        self.step = step
        self.phase = phase
        # category_of(None, phase): "activations" (made during forward,
        # backward or the optimizer step) or "other"; the category unless the
        # storage is a parameter, a gradient or optimizer state (apply_known).
        self.category = category
        self.code = code
        self.line = line
        self.shape = shape
        self.dtype_object = dtype_object
        # Registration order: sites are grouped in it, as they always were.
        self.sequence = sequence
        self.module = module

    @property
    def location(self) -> dict | None:
        if self.code is None:
            return None
        return frames.location_dict(self.code.co_filename, self.line, self.code.co_name)

    @property
    def dtype(self) -> str:
        return _dtype_name(self.dtype_object)

    def resized(self, nbytes: int) -> StorageRecord:
        return StorageRecord(
            nbytes,
            self.step,
            self.phase,
            self.category,
            self.code,
            self.line,
            self.shape,
            self.dtype_object,
            self.sequence,
            self.module,
        )


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


class Backend:
    """The interface the tracker uses; byte counts are ints."""

    kind = "?"
    # True when live_storages() sees every allocation with its step and phase.
    per_storage = False

    def install(self, tracker) -> None: ...

    def uninstall(self) -> None: ...

    def device_info(self) -> dict:
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        raise NotImplementedError

    def reserved_bytes(self) -> int:
        raise NotImplementedError

    def capacity_bytes(self) -> int:
        raise NotImplementedError

    def read_and_reset_peak(self) -> tuple[int, int]:
        """Peak (allocated, reserved) since the last call, then start anew."""
        raise NotImplementedError

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when the tensor's memory lives on this device."""
        raise NotImplementedError

    def storage_bytes(self, nbytes: int) -> int:
        """Bytes the device really spends on a storage of `nbytes`."""
        return nbytes

    def owned(self, tensors: list) -> list:
        """The tensors this device holds (backends filter in C-level loops)."""
        return [tensor for tensor in tensors if self.owns(tensor)]

    def storage_table(self, tensors) -> dict:
        """{storage key: storage_bytes} of the tensors (None allowed) on this
        device, each storage once."""
        tensors = self.owned([tensor for tensor in tensors if tensor is not None])
        try:  # in C-level loops
            storages = list(map(_UNTYPED_STORAGE, tensors))
            sizes = map(_NBYTES, storages)
            if type(self).storage_bytes is not Backend.storage_bytes:
                sizes = map(self.storage_bytes, sizes)
            return dict(zip(map(_STORAGE_KEY, storages), sizes))
        except Exception:  # a sparse tensor: one by one
            pass
        table: dict = {}
        for tensor in tensors:
            try:
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in table:
                    table[key] = self.storage_bytes(storage.nbytes())
            except Exception:  # sparse and other storage-less layouts
                pass
        return table

    def live_storages(self):
        """Yield (key, bytes, StorageRecord|None) for each live allocation when
        the backend can see them one by one, else nothing."""
        return iter(())

    def allocation_sites(self) -> list[dict] | None:
        """Live allocations with frames as {bytes, location, shape, dtype, key},
        or None if the backend cannot tell."""
        return None

    def allocator_stats(self) -> dict:
        return {}

    def on_oom_extra(self, snapshot_dir: str | None) -> dict:
        """Backend-specific data to save at an OOM (files, allocator state)."""
        return {}


def storage_key(tensor: torch.Tensor):
    """A key identifying a tensor's storage while it lives, or None."""
    try:
        return tensor.untyped_storage()._cdata
    except Exception:
        return None


# --------------------------------------------------------------- simulated

_Tensor = torch.Tensor
_FORWARD_BACKWARD = frozenset(("forward", "backward"))
_PHASE_CATEGORIES: dict = {}  # phase -> category_of(None, phase)
_IS_CPU = attrgetter("is_cpu")
# Unbound methods: map() calls them twice as fast as methodcaller.
_UNTYPED_STORAGE = torch.Tensor.untyped_storage
_STORAGE_KEY = attrgetter("_cdata")
_NBYTES = torch.UntypedStorage.nbytes
_IS_CUDA = attrgetter("is_cuda")
_GET_DEVICE = methodcaller("get_device")

# id(code object) -> (code, is it the user's?). The innermost user frame is
# looked up for every new storage: a dict lookup per frame instead of a path
# check. Keyed by id, not by the code object, whose hash is computed anew
# from its bytecode and constants at every lookup; the entry keeps the code
# alive, so an id is never reused while it is in the table.
_USER_CODE: dict = {}
_USER_CODE_LIMIT = 1 << 16


def _innermost_user_code(frame) -> tuple:
    """(code, line) of the innermost user frame at or above `frame`, else (None, 0)."""
    cache = _USER_CODE
    while frame is not None:
        code = frame.f_code
        entry = cache.get(id(code))
        if entry is None:
            if len(cache) >= _USER_CODE_LIMIT:
                cache.clear()
            entry = cache[id(code)] = (code, frames.is_user_file(code.co_filename))
        if entry[1]:
            return code, frame.f_lineno
        frame = frame.f_back
    return None, 0


def _is_user_code(code) -> bool:
    """The compiled ledger's test of a frame (it keeps the answers)."""
    return frames.is_user_file(code.co_filename)


def _engine_callers() -> frozenset:
    """ids of the code objects of torch's functions that run the autograd
    engine: while one runs under the tracker's backward wrapper, it is alive."""
    found = set()
    try:
        from torch.autograd import graph

        found.add(id(graph._engine_run_backward.__code__))
    except Exception:
        pass
    return frozenset(found)


_ENGINE_CALLERS = _engine_callers()


class _StorageRef(weakref.ref):
    """A weak reference to a storage that names its key when the storage
    dies: cheaper than weakref.finalize, paid for every new storage."""

    __slots__ = ("key",)

    def detach(self) -> None:
        self.key = None


def _dynamo_guard():
    """(set_eval_frame, skip_code) from TorchDynamo's C extension, or None.

    Newer torch wraps every TorchDispatchMode's __torch_dispatch__ in
    torch._dynamo.disable, about a dozen Python calls per op, so that
    torch.compile never traces into the mode. The same guarantee costs two C
    calls: the frame itself is marked skipped, and the eval-frame callback is
    off while it runs. Without these APIs torch's own wrapping stays."""
    try:
        from torch._C._dynamo import eval_frame

        strategy = eval_frame._FrameExecStrategy(
            eval_frame._FrameAction.SKIP, eval_frame._FrameAction.DEFAULT
        )
        set_code_exec_strategy = eval_frame.set_code_exec_strategy

        def skip_code(code) -> None:
            set_code_exec_strategy(code, strategy)

        return eval_frame.set_eval_frame, skip_code
    except Exception:
        return None


_DYNAMO_GUARD = _dynamo_guard()


class _CountingMode(TorchDispatchMode):
    """Sees every op; registers each new storage it produces or consumes.

    The simulated device's hot path: arguments are scanned by hand (aten ops
    take tensors, lists of tensors and scalars) rather than with pytree.
    """

    if _DYNAMO_GUARD is not None:

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # __torch_dispatch__ keeps TorchDynamo out itself

    def __init__(self, backend: SimulatedBackend):
        super().__init__()
        self.backend = backend

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.backend._native is not None:
            # While the compiled ledger counts, a view op gets here only from
            # torch's Python interpreter hook (the autograd engine's detach of
            # each saved output and gradient): nothing new, and what it views
            # is looked at by the next op that computes with it, as with the
            # pass-through views. No Python frame TorchDynamo could trace.
            entry = _OP_ENTRIES.get(id(func)) or _op_entry(func)
            if entry[1] is _VIEW:
                call = entry[0]
                return call(*args, **kwargs) if kwargs else call(*args)
        if _DYNAMO_GUARD is None:
            return self.backend.dispatch(func, args, kwargs)
        set_eval_frame = _DYNAMO_GUARD[0]
        prior = set_eval_frame(None)
        try:
            return self.backend.dispatch(func, args, kwargs)
        finally:
            set_eval_frame(prior)


if _DYNAMO_GUARD is not None:
    try:
        _DYNAMO_GUARD[1](_CountingMode.__torch_dispatch__.__code__)
    except Exception:  # keep torch's own wrapping
        del _CountingMode._should_skip_dynamo
        _CountingMode.__torch_dispatch__ = torch._disable_dynamo(
            _CountingMode.__dict__["__torch_dispatch__"], recursive=True
        )


class _RuleLookup:
    """For every op a mode sees, torch asks in Python whether a dispatch rule
    was registered for the mode's class (torch.library.register_torch_dispatch):
    never for this private one. The lookup answers that first, for a tenth of
    the cost, and asks torch's for every other class."""

    def __init__(self) -> None:
        self._registry = sys.modules.get("torch._library.simple_registry")
        self._original = getattr(self._registry, "find_torch_dispatch_rule", None)
        self._installed = None
        if self._original is None:
            return
        original = self._original

        def find_torch_dispatch_rule(op, torch_dispatch_class):
            if torch_dispatch_class is _CountingMode:
                return None
            return original(op, torch_dispatch_class)

        self._installed = find_torch_dispatch_rule
        self._registry.find_torch_dispatch_rule = find_torch_dispatch_rule

    def remove(self) -> None:
        if self._installed is not None and (
            getattr(self._registry, "find_torch_dispatch_rule", None) is self._installed
        ):
            self._registry.find_torch_dispatch_rule = self._original
        self._installed = None


def _flat_tensors(value, found: list) -> list:
    """The tensors in nested lists, tuples and dicts, in pytree's order."""
    if isinstance(value, _Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _flat_tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _flat_tensors(item, found)
    return found


# What dispatch needs to know of an op, looked up once per OpOverload: how to
# call it (the C++ operator itself, without OpOverload.__call__'s frame) and
# its kind. After a view (every output aliases an input, nothing written) or
# an in-place update (every output is a written input: `add_`, `mul_`; not
# one that can resize or replace its storage: `resize_`, `set_`, `out=`
# variants) there is nothing new to count: the inputs were looked at before
# the op.
_COUNT, _VIEW, _IN_PLACE = "count", "view", "in-place"
_OP_ENTRIES: dict = {}
_PlainOverload = getattr(torch._ops, "OpOverload", None)


def _op_entry(func) -> tuple:
    call = func
    if _PlainOverload is not None and type(func) is _PlainOverload:
        call = getattr(func, "_op", func)
    try:
        kind = _kind_of(func)
    except Exception:
        kind = _COUNT
    # Keyed by id: an OpOverload lives as long as the process (torch caches
    # it, and so does the entry).
    entry = _OP_ENTRIES[id(func)] = (call, kind, func)
    return entry


def _kind_of(func) -> str:
    schema = func._schema
    returns = schema.returns
    if not returns or any(ret.alias_info is None for ret in returns):
        return _COUNT
    if all(not ret.alias_info.is_write for ret in returns):
        return _VIEW
    name = schema.name.split("::")[-1]
    if (
        len(returns) == 1
        and name.endswith("_")
        and not name.startswith("_")
        and "out" not in schema.overload_name
        and not any(word in name for word in ("resize", "set_", "sparse", "swap"))
        and schema.arguments
        and schema.arguments[0].alias_info is not None
        and schema.arguments[0].alias_info.is_write
        and all(
            argument.alias_info is None or argument is schema.arguments[0]
            for argument in schema.arguments
        )
    ):
        return _IN_PLACE
    return _COUNT


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
        self._mode = None
        self._pass_through: PassThrough | None = None
        # The compiled ledger's module while it keeps the storages
        # (oomdoc.capture.native): `_records` and the bytes per category and
        # per step are then brought up to date from its log (`_sync`) before
        # they are read, and the live and peak bytes are its own.
        self._native = None
        self._rule_lookup: _RuleLookup | None = None
        self.tracker = None
        self._sequence = 0
        # Bytes per category. Parameters, gradients and optimizer state are
        # the storages the tracker names through apply_known (key -> category);
        # the rest are activations or other by the phase they were made in.
        self._category_bytes = dict.fromkeys(
            ("parameters", "gradients", "optimizer_state", "activations", "other"), 0
        )
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
    def install(self, tracker) -> None:
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
                record = records.pop(event[1], None)
                if record is not None:
                    self._forget(event[1], record)
            else:
                record = records.get(event[1])
                if record is not None:
                    self._resize(event[1], record, event[2])

    def native_removed(self, native) -> None:
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
            if len(added) + len(self._mark_freed) > self._mark_log_limit:
                self._check_mark_log()

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
        added = self._mark_added
        if added is not None and key not in added:
            # Live at the mark with its old size: the mark keeps that record.
            self._mark_freed.setdefault(key, record)
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
        self._category_bytes[self._known_applied.pop(key, None) or record.category] -= nbytes
        if record.phase in _FORWARD_BACKWARD:
            table = self._forward_backward_bytes
            left = table.get(record.step, 0) - nbytes
            if left:
                table[record.step] = left
            else:
                table.pop(record.step, None)
            self._forward_backward_total -= nbytes
        added = self._mark_added
        if added is not None:
            if key in added:
                added.discard(key)
            else:
                self._mark_freed.setdefault(key, record)
                self._check_mark_log()

    # what the tracker reads at phase boundaries
    def apply_known(self, known: dict) -> None:
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

    def capture_stats(self) -> dict:
        if self._native is not None:
            self._sequence = self._native.totals()[2]
        native_ops = self._pass_through.native_ops if self.native_active else 0
        return {"storages_registered": self._sequence, "native_ops": native_ops, **self.stats}

    def known_categories(self) -> dict:
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
        if len(self._mark_added) + len(self._mark_freed) > self._mark_log_limit:
            # The log would outgrow a plain copy of the live set: rebuild the
            # marked storages now and stop logging (amortised O(1) per change).
            self._mark_records = self._rebuild_marked()
            self._mark_added = self._mark_freed = None
            self.stats["peak_log_rebuilds"] += 1

    def _rebuild_marked(self) -> list:
        added, freed = self._mark_added, self._mark_freed
        items = [(key, record) for key, record in self._records.items() if key not in added]
        items.extend(freed.items())
        items.sort(key=lambda item: item[1].sequence)
        return items

    def marked_storages(self) -> tuple[list, dict] | None:
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
            f"Simulated device out of memory (oomdoc). Tried to allocate {format_bytes(requested)}. "
            f"Simulated device 0 has a total capacity of {format_bytes(self._capacity)} of which "
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

    def live_storages(self):
        self._sync()
        for key, record in list(self._records.items()):
            yield key, record.nbytes, record

    def allocation_sites(self) -> list[dict]:
        self._sync()
        return storage_sites(list(self._records.items()))


def storage_sites(items) -> list[dict]:
    """allocation_sites() entries for [(key, StorageRecord)]."""
    locations: dict = {}
    sites = []
    for key, record in items:
        where = (id(record.code), record.line)  # the record keeps its code alive
        location = locations.get(where)
        if location is None and where not in locations:
            location = locations[where] = record.location
        sites.append(
            {
                "key": key,
                "bytes": record.nbytes,
                "location": location,
                "shape": list(record.shape),
                "dtype": record.dtype,
                "base_category": record.category,
                "module": record.module,
            }
        )
    return sites


# -------------------------------------------------------------------- cuda


class CudaBackend(Backend):
    """The real CUDA caching allocator, optionally capped to a smaller card."""

    kind = "cuda"
    # Enough trace entries to show what happened just before an OOM without
    # costing much host memory.
    HISTORY_ENTRIES = 20000

    def __init__(
        self, capacity_bytes: int | None, device_index: int | None = None, deferred: bool = False
    ):
        # `deferred` (replays side by side, oomdoc.capture.gate): nothing here
        # starts CUDA; the set-up in `install` runs when the script starts it.
        self.deferred = deferred and not torch.cuda.is_initialized()
        if device_index is None:
            # Before CUDA starts, the current device is 0.
            device_index = 0 if self.deferred else torch.cuda.current_device()
        self.device_index = device_index
        self._requested_capacity = int(capacity_bytes) if capacity_bytes else None
        self._total: int | None = None
        self._name = "?"
        if not self.deferred:
            self._read_properties()
        self.tracker = None
        self._recording = False
        self._torch_snapshot = None
        self._device_count: int | None = None
        # The script's max_memory_allocated() etc. despite the resets below.
        self._peaks = PeakView()

    @property
    def _one_device(self) -> bool:
        """This process sees one GPU: a tensor on CUDA is on this device."""
        if self._device_count is None:
            self._device_count = torch.cuda.device_count()
        return self._device_count == 1

    def _read_properties(self) -> None:
        properties = torch.cuda.get_device_properties(self.device_index)
        self._total = int(properties.total_memory)
        self._name = properties.name

    @property
    def _capacity(self) -> int:
        if self._total is None:
            self._read_properties()  # starts CUDA (after the device lock)
        assert self._total is not None
        return self._requested_capacity or self._total

    def install(self, tracker) -> None:
        self.tracker = tracker
        self._peaks.install()
        if self.deferred:
            torch.cuda._lazy_call(self._start_deferred)
        else:
            self._start()

    def _start_deferred(self) -> None:
        """The set-up, queued until CUDA starts (an error here must not
        become the script's: it would be raised at its first CUDA call)."""
        try:
            self._start()
        except Exception as exc:
            print(f"oomdoc: the CUDA capture could not be set up: {exc}", file=sys.stderr)

    def _start(self) -> None:
        if self._total is None:
            self._read_properties()
        assert self._total is not None
        if self._capacity < self._total:
            torch.cuda.set_per_process_memory_fraction(
                self._capacity / self._total, self.device_index
            )
        # OOMDOC_ALLOCATION_HISTORY=0 turns off the per-allocation Python
        # stacks (allocation sites then have no locations) for the last bit of speed.
        if os.environ.get("OOMDOC_ALLOCATION_HISTORY", "1") != "0":
            try:
                torch.cuda.memory._record_memory_history(
                    enabled="all",
                    context="alloc",
                    stacks="python",
                    max_entries=self.HISTORY_ENTRIES,
                )
                self._recording = True
            except Exception as exc:  # pragma: no cover - depends on the build
                print(f"oomdoc: allocation history unavailable: {exc}", file=sys.stderr)
        torch._C._cuda_attach_out_of_memory_observer(self._oom_observer)
        self._peaks.read_and_reset(self.device_index)

    def uninstall(self) -> None:
        self._peaks.uninstall()
        if self._recording:
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:
                pass
            self._recording = False

    def _oom_observer(self, device, requested, device_allocated, device_free) -> None:
        if self.tracker is None:
            return
        try:
            self._torch_snapshot = torch.cuda.memory._snapshot() if self._recording else None
            self.tracker.on_oom(requested_bytes=int(requested), message=None)
        except Exception as exc:  # never turn an OOM into a different error
            print(f"oomdoc: failed to record the OOM: {exc}", file=sys.stderr)

    def _stats(self) -> dict:
        return torch.cuda.memory_stats(self.device_index)

    def device_info(self) -> dict:
        capacity = self._capacity  # reads the properties if CUDA never started
        info = {
            "kind": "cuda",
            "name": self._name,
            "index": self.device_index,
            "capacity_bytes": capacity,
            "total_bytes": self._total,
            "supports_bf16": bool(torch.cuda.is_bf16_supported()),
        }
        info.update(_nvml_info(self.device_index))
        return info

    def _nested_stats(self) -> dict:
        # torch.cuda.memory_allocated() and memory_stats() flatten and sort
        # the allocator's ~150 counters in Python on every call; the nested
        # dict is what the allocator returns, read where it is needed (its
        # own peaks, not the script's view of them: oomdoc.capture.peak_view).
        return self._peaks.stats(self.device_index) if torch.cuda.is_initialized() else {}

    def allocated_bytes(self) -> int:
        stats = self._nested_stats()
        return int(stats["allocated_bytes"]["all"]["current"]) if stats else 0

    def reserved_bytes(self) -> int:
        stats = self._nested_stats()
        return int(stats["reserved_bytes"]["all"]["current"]) if stats else 0

    def capacity_bytes(self) -> int:
        return self._capacity

    def read_and_reset_peak(self) -> tuple[int, int]:
        if not torch.cuda.is_initialized():
            return 0, 0
        stats = self._peaks.read_and_reset(self.device_index)
        return (
            int(stats["allocated_bytes"]["all"]["peak"]),
            int(stats["reserved_bytes"]["all"]["peak"]),
        )

    def owns(self, tensor: torch.Tensor) -> bool:
        # is_cuda and get_device() cost a tenth of building a torch.device.
        return tensor.is_cuda and tensor.get_device() == self.device_index

    def storage_bytes(self, nbytes: int) -> int:
        # The caching allocator hands out multiples of 512 bytes.
        return ((nbytes + 511) // 512) * 512 if nbytes else 0

    def owned(self, tensors: list) -> list:
        # C-level loops: parameters, gradients and optimizer state at each
        # phase boundary, where on a step bound by the host each microsecond
        # is the step's. (Adam's `step` counters stay on the CPU.)
        on_cuda = list(compress(tensors, map(_IS_CUDA, tensors)))
        if self._one_device:
            return on_cuda
        return list(compress(on_cuda, map(self.device_index.__eq__, map(_GET_DEVICE, on_cuda))))

    def allocation_sites(self) -> list[dict] | None:
        snapshot = self._torch_snapshot
        if snapshot is None and self._recording:
            snapshot = torch.cuda.memory._snapshot()
        if snapshot is None:
            return None
        sites = []
        for segment in snapshot.get("segments", []):
            if segment.get("device", self.device_index) != self.device_index:
                continue
            for block in segment.get("blocks", []):
                if block.get("state") != "active_allocated":
                    continue
                sites.append(
                    {
                        "address": block.get("address"),
                        "bytes": int(block.get("requested_size") or block.get("size", 0)),
                        # What the allocator counts, and the phase the stack shows
                        # (oomdoc.capture.modules: one category rule for all tables).
                        "size": int(block.get("size", 0)),
                        "phase": phase_from_frames(block.get("frames")),
                        "location": frames.pick_user_location(block.get("frames", [])),
                        "shape": None,
                        "dtype": None,
                    }
                )
        return sites

    def allocator_stats(self) -> dict:
        stats = self._stats()
        return {
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
            "inactive_split_blocks": int(stats.get("inactive_split.all.current", 0)),
            "segments": int(stats.get("segment.all.current", 0)),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "num_ooms": int(stats.get("num_ooms", 0)),
            "expandable_segments": "expandable_segments:true"
            in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower(),
        }

    def on_oom_extra(self, snapshot_dir: str | None) -> dict:
        """Keep PyTorch's own snapshot of the OOM for pytorch.org/memory_viz."""
        if self._torch_snapshot is None or not snapshot_dir:
            return {}
        import pickle

        path = os.path.join(snapshot_dir, "torch_memory_snapshot.pickle")
        with open(path, "wb") as handle:
            pickle.dump(self._torch_snapshot, handle)
        return {"torch_snapshot_file": path}


def _nvml_info(device_index: int) -> dict:
    """Other processes on the GPU and the driver's view of memory, via pynvml."""
    try:
        import pynvml
    except Exception:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        handle = nvml_handle(pynvml, device_index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        others = []
        try:
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid():
                    continue
                used = process.usedGpuMemory
                others.append(
                    {"pid": int(process.pid), "used_bytes": int(used) if used is not None else None}
                )
        except Exception:
            pass
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
        except Exception:
            driver = None
        return {
            "driver_version": driver,
            "nvml_used_bytes": int(memory.used),
            "nvml_free_bytes": int(memory.free),
            "other_processes": others,
        }
    except Exception:
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
