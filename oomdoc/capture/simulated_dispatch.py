"""The simulated device's dispatch mode and the lookups it makes per op:
which ops make, resize or only view storages, the innermost user frame of
a new storage, and the weak references that see storages die.
"""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any, Protocol, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oomdoc import frames


class Dispatcher(Protocol):
    """What the dispatch mode calls (oomdoc.capture.simulated's
    SimulatedBackend, which imports this module: a protocol, not an import)."""

    _native: ModuleType | None

    def dispatch(self, func: Any, args: Any, kwargs: Any) -> Any: ...


_Tensor = torch.Tensor

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

    def __init__(self, backend: Dispatcher):
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
        # Replaced on the class, as torch's own wrapping does.
        _CountingMode.__torch_dispatch__ = torch._disable_dynamo(  # type: ignore[method-assign]
            _CountingMode.__dict__["__torch_dispatch__"], recursive=True
        )


class _RuleLookup:
    """For every op a mode sees, torch asks in Python whether a dispatch rule
    was registered for the mode's class (torch.library.register_torch_dispatch):
    never for this private one. The lookup answers that first, for a tenth of
    the cost, and asks torch's for every other class."""

    def __init__(self) -> None:
        # A private torch module: what it holds varies with torch's version.
        self._registry = cast(Any, sys.modules.get("torch._library.simple_registry"))
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
