"""Ops the simulated device lets through without a Python call.

The simulated device counts storages in a TorchDispatchMode, which costs a
Python round trip per op: on a model of small ops (an optimizer step of
single-tensor updates) that alone is about the whole step again. Most of
those ops cannot make a storage: views, reading a number, in-place updates.
For them a fallthrough kernel is registered at the Python dispatch key, so
the dispatcher goes straight to the CPU kernel and the mode never sees them.

What the device counts does not change: an op of PASS_THROUGH_OPS neither
makes nor resizes a storage, and its CPU kernel (dense tensors of one dtype)
dispatches nothing the mode would count (views). One difference: a storage
made outside torch's ops (torch.from_numpy, a DataLoader worker's shared
memory) is counted from the first counted op that touches it, as before, but
a pass-through op no longer counts as touching it.

The registrations are global to the process, and would also skip the
`__torch_dispatch__` of any other mode or tensor subclass (torch.compile's
fake tensors, DTensor): they are removed for good the moment another
dispatch mode is pushed or a tensor subclass with its own
`__torch_dispatch__` is made, and the mode sees every op from then on.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.utils._python_dispatch as python_dispatch

# Ops that neither make nor resize a storage, and whose CPU kernels dispatch
# nothing else (or only views). In-place ops that take a tensor operand
# (`add_`, `mul_(0.9)`: a Python number becomes a tensor) are left out:
# given two dtypes, their kernels cast it through ops that allocate
# (aten.to, aten.empty_like), which the mode would then count.
PASS_THROUGH_OPS = (
    # Views: the output shares the input's storage.
    "aten::view",
    "aten::_unsafe_view",
    "aten::_reshape_alias",
    "aten::alias",
    "aten::t",
    "aten::transpose.int",
    "aten::permute",
    "aten::expand",
    "aten::as_strided",
    "aten::select.int",
    "aten::slice.Tensor",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::squeeze.dim",
    "aten::squeeze.dims",
    "aten::split.Tensor",
    "aten::split_with_sizes",
    "aten::unbind.int",
    "aten::diagonal",
    "aten::unfold",
    # Reading one number (`.item()`).
    "aten::_local_scalar_dense",
    # In-place updates of one tensor, or with a Python number or one dtype.
    "aten::lerp_.Scalar",
    "aten::zero_",
    "aten::fill_.Scalar",
    "aten::sqrt_",
    "aten::neg_",
    # torch.autograd.profiler.record_function (every optimizer step).
    "profiler::_record_function_enter_new",
    "profiler::_record_function_exit._RecordFunction",
)

_Tensor = torch.Tensor


class PassThrough:
    """The fallthrough registrations of one simulated device, and the hooks
    that remove them once anything else uses Python dispatch."""

    def __init__(self, mode) -> None:
        self._mode = mode
        self._libraries: list = []
        self._patched: list[tuple[object, str, object, bool]] = []
        self.ops: list[str] = []
        self._native: ModuleType | None = (
            None  # the compiled check's module while its kernels are in
        )
        self._ledger = None  # the device it counts for
        self.native_ops = 0

    @property
    def active(self) -> bool:
        return bool(self._libraries) or self._native is not None

    @property
    def native_active(self) -> bool:
        return self._native is not None

    def install(self) -> None:
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
        libraries: dict = {}
        for name in PASS_THROUGH_OPS:
            namespace, op = name.split("::", 1)
            try:
                if has_kernel(name, "Python"):
                    continue  # someone else's Python kernel: leave it
                library = libraries.get(namespace)
                if library is None:
                    library = libraries[namespace] = torch.library.Library(namespace, "IMPL")
                library.impl(op, torch.library.fallthrough_kernel, "Python")
            except Exception:
                continue  # an op this torch does not have
            self.ops.append(name)
        self._libraries = list(libraries.values())
        if self._libraries:
            self._install_watch()

    def install_native(self, ledger) -> bool:
        """Give every other op that reaches the Python key (none made of
        others: CompositeImplicitAutograd ops never get there with autograd
        on) the compiled check of oomdoc.capture.native, where it can be had.
        `ledger` (the device) gives `native_arguments()`, what the compiled
        ledger calls back, and `native_removed(module)`, called before the
        kernels go while the device still counts."""
        from oomdoc.capture import native

        module = native.load()
        if module is None:
            return False
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
        names = [
            name
            for name in torch._C._dispatch_get_all_op_names()
            if not has_kernel(name, "Python") and not has_kernel(name, "CompositeImplicitAutograd")
        ]
        # torch's Python fallback reads a snapshot taken at the
        # PythonTLSSnapshot key; ops with the compiled kernel skip it.
        snapshot_names = {name for name in names if not has_kernel(name, "PythonTLSSnapshot")}
        try:
            self.native_ops = len(module.install(*ledger.native_arguments(), names, snapshot_names))
        except Exception:  # the mode alone still counts every op
            module.uninstall()
            return False
        self._native = module
        self._ledger = ledger
        if not self._patched:
            self._install_watch()
        return True

    def set_native_enabled(self, enabled: bool) -> None:
        if self._native is not None:
            self._native.set_enabled(enabled)

    def remove(self) -> None:
        """Let every op reach the mode again (for good)."""
        native, self._native = self._native, None
        if native is not None:
            ledger, self._ledger = self._ledger, None
            try:
                if ledger is not None:
                    ledger.native_removed(native)
            finally:
                native.uninstall()
        libraries, self._libraries = self._libraries, []
        for owner, name, original, own in reversed(self._patched):
            if own:
                setattr(owner, name, original)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
        self._patched.clear()
        for library in libraries:
            try:
                library._destroy()
            except Exception:
                pass

    # ------------------------------------------------------------ the watch
    def _install_watch(self) -> None:
        """Wrap what pushes a dispatch mode, what makes an instance of a
        tensor subclass, and torch.compile: the first call that is not for
        this device's own mode or a subclass without `__torch_dispatch__`
        (nn.Parameter) removes the fallthroughs before it takes effect."""
        passthrough = self

        def watch_mode(original):
            def pushed(mode, *args, **kwargs):
                if mode is not passthrough._mode:
                    passthrough.remove()
                return original(mode, *args, **kwargs)

            return pushed

        # (*args, **kwargs): TorchDynamo, imported later, checks that the
        # signature of torch.Tensor._make_subclass matches its own stand-in.
        def watch_subclass(original):
            def made(*args, **kwargs):
                if _has_own_dispatch(args[0] if args else kwargs.get("cls")):
                    passthrough.remove()
                return original(*args, **kwargs)

            return staticmethod(made)

        def watch_as_subclass(original):
            def as_subclass(self, cls):
                if _has_own_dispatch(cls):
                    passthrough.remove()
                return original(self, cls)

            return as_subclass

        def watch_compile(original):
            def compile(*args, **kwargs):
                passthrough.remove()
                return original(*args, **kwargs)

            return compile

        for owner, name, watch in (
            (torch._C, "_push_on_torch_dispatch_stack", watch_mode),
            (python_dispatch, "_push_on_torch_dispatch_stack", watch_mode),
            (torch._C, "_set_dispatch_mode", watch_mode),
            (_Tensor, "_make_subclass", watch_subclass),
            (_Tensor, "_make_wrapper_subclass", watch_subclass),
            (_Tensor, "as_subclass", watch_as_subclass),
            (torch, "compile", watch_compile),
        ):
            original = getattr(owner, name, None)
            if original is not None:
                self._patch(owner, name, watch(original))

    def _patch(self, owner, name, replacement) -> None:
        own = name in vars(owner)
        self._patched.append((owner, name, getattr(owner, name), own))
        setattr(owner, name, replacement)


_NO_DISPATCH = getattr(_Tensor, "__torch_dispatch__", None)


def _has_own_dispatch(cls) -> bool:
    return isinstance(cls, type) and getattr(cls, "__torch_dispatch__", None) is not _NO_DISPATCH
