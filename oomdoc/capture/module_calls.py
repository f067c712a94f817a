"""How the tracker sees module calls: global hooks, or only the outermost calls.

The step model needs the outermost module calls (a training call opens a
step, a model call under no_grad is evaluation); the module scopes need every
call. With a global module hook set, torch takes its slow path for every
module call (a closure, the hook tuples, `is_compiling`) and calls both hooks:
6 to 7 us per call on the CPU, 2 to 3 ms of host time per step on a 24-layer
GPT-2 (295 calls; 583 under activation checkpointing), which a step bound by
its host pays in full (benchmarks/host_overhead.py).

So while the module scopes are paused (steady steps, oomdoc.capture.
stack_recording) the global hooks come off and `nn.Module.__call__` is
replaced by `_LeanCall`, which hands the outermost call (module depth 0, not
in a backward) to the tracker's same two hooks and every other call straight
to torch's own `__call__`, whose fast path then applies: about 0.25 us per
call. Every outermost call is still seen, a model the run has not called
before included (an EMA evaluated at an epoch's end), so evaluation still
starts its phase, and that phase, like any boundary that wants the scopes
back, restores the hooks at once.

Switching is only safe where no call that expects the global post hook is
under way: back to the hooks at any time (a call under way in lean mode has
the lean call's post, and calls below it then get both hooks), to lean only
at a quiet point (`settle`: the end of an outermost call, an optimizer step,
a backward) with no module call under way.

Lean mode stays off where it cannot be told apart from the script's own
code: once torch.compile has compiled anything (Dynamo inlines
`nn.Module.__call__` and would recompile on every switch), a model compiled
with `model.compile()`, or when something else has replaced
`nn.Module.__call__`. `OOMDOC_LEAN_MODULE_CALLS=0` turns it off.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

import torch.nn as nn

from oomdoc.capture.compiled_models import traced_by_compile


class OutermostCalls(Protocol):
    """What the tracker gives: its module hooks and the depths they keep."""

    _module_depth: int
    _backward_depth: int
    _lean_entry: nn.Module | None

    def _on_forward_pre(self, module: nn.Module, inputs: tuple) -> Any: ...

    def _on_forward_post(self, module: nn.Module, inputs: tuple, *rest: Any) -> Any: ...


class ModuleCalls:
    """The tracker's module hooks, global or lean (module docstring)."""

    def __init__(self, tracker: OutermostCalls) -> None:
        self.tracker = tracker
        self.allowed = os.environ.get("OOMDOC_LEAN_MODULE_CALLS", "1") != "0"
        self.lean = False
        self.switches = 0  # to lean and back (capture_stats)
        self._wanted = False
        self._handles: list = []
        self._original_call = nn.Module.__call__
        self._lean_call = _lean_call(tracker, self._original_call, self)

    # ------------------------------------------------------------ modes
    def install(self) -> None:
        """The global hooks, as at the start of every run."""
        module_hooks = nn.modules.module
        tracker = self.tracker
        self._handles.append(module_hooks.register_module_forward_pre_hook(tracker._on_forward_pre))
        try:
            # With the call's keyword arguments: a model called as
            # `model(**batch)` (the HF Trainer) passes its tensors there.
            handle = module_hooks.register_module_forward_hook(
                tracker._on_forward_post, always_call=True, with_kwargs=True
            )
        except TypeError:  # torch without always_call or with_kwargs
            handle = module_hooks.register_module_forward_hook(tracker._on_forward_post)
        self._handles.append(handle)

    def uninstall(self) -> None:
        if self.lean:
            self._restore_call()
            self.lean = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def installed(self) -> bool:
        return self.lean or bool(self._handles)

    def want_lean(self, lean: bool) -> None:
        """The scopes paused (`lean`) or resumed: the hooks come back now;
        lean mode waits for the next quiet point."""
        self._wanted = lean
        if not lean and self.lean:
            self._restore_call()
            self.lean = False
            self.install()
            self.switches += 1

    def settle(self) -> None:
        """At a quiet point: go lean if wanted and no module call is under way."""
        tracker = self.tracker
        if (
            self._wanted
            and not self.lean
            and self._handles
            and tracker._module_depth == 0
            and tracker._backward_depth == 0
            and self.allowed
        ):
            if compile_seen() or nn.Module.__call__ is not self._original_call:
                self.allowed = False
                return
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            nn.Module.__call__ = self._lean_call  # type: ignore[method-assign]
            self.lean = True
            self.switches += 1

    def compiled(self) -> None:
        """A compiled model was met in lean mode: the hooks, for good."""
        self.allowed = False
        self.want_lean(False)

    def _restore_call(self) -> None:
        if nn.Module.__call__ is self._lean_call:
            nn.Module.__call__ = self._original_call  # type: ignore[method-assign]
        # Dynamo, imported while lean, took the lean call for torch's own.
        dynamo_utils = sys.modules.get("torch._dynamo.utils")
        if getattr(dynamo_utils, "unpatched_nn_module_call", None) is self._lean_call:
            for name in ("torch._dynamo.utils", "torch._dynamo.variables.nn_module"):
                module = sys.modules.get(name)
                if getattr(module, "unpatched_nn_module_call", None) is self._lean_call:
                    module.unpatched_nn_module_call = self._original_call  # type: ignore[union-attr]


def registration_hooks(callback: Any) -> list:
    """Handles of `callback` as the global parameter and module registration
    hook (torch >= 2.0 has both): a module's parameters change only then."""
    module_hooks = nn.modules.module
    handles = []
    for name in (
        "register_module_parameter_registration_hook",
        "register_module_module_registration_hook",
    ):
        register = getattr(module_hooks, name, None)
        if register is not None:
            handles.append(register(callback))
    return handles


def compile_seen() -> bool:
    """Whether torch.compile has compiled a graph in this process."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return False
    try:
        return bool(dynamo_utils.counters["stats"]["unique_graphs"])
    except Exception:
        return True  # a torch whose counters we cannot read: assume so


def _lean_call(tracker: OutermostCalls, original: Any, calls: ModuleCalls) -> Any:
    """nn.Module.__call__ in lean mode: the tracker's hooks around the
    outermost call only, as torch calls them (the post hook also when the
    forward raises, without its keyword arguments)."""

    def __call__(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if tracker._module_depth or tracker._backward_depth or not calls.lean:
            # (not lean: put back by another's patch of __call__, fx's say,
            # after the hooks came back; they see the call)
            return original(module, *args, **kwargs)
        if traced_by_compile():
            return original(module, *args, **kwargs)
        if (
            getattr(module, "_compiled_call_impl", None) is not None
            or type(module).__name__ == "OptimizedModule"
        ):
            calls.compiled()  # the global hooks see this call
            return original(module, *args, **kwargs)
        try:
            tracker._on_forward_pre(module, args)
            if not calls.lean:
                # The pre-hook brought the global hooks back (an evaluation
                # starts): they skip this call, which is the lean call's.
                tracker._lean_entry = module
            output = original(module, *args, **kwargs)
        except Exception:  # as torch: not StopRun, not KeyboardInterrupt
            tracker._lean_entry = None
            tracker._on_forward_post(module, args, None)
            raise
        finally:
            tracker._lean_entry = None
        tracker._on_forward_post(module, args, kwargs, output)
        return output

    __call__.__qualname__ = "Module.__call__"
    return __call__
