"""What the script's first training model call already does that a fix
would do: the autocast it runs under, and the modules it runs under
`torch.utils.checkpoint`. A fix already in effect changes nothing when
replayed (nanoGPT's forward runs under bf16 autocast by default, the HF
`Trainer`'s `--gradient_checkpointing` checkpoints every block), so the
snapshot records both (`framework.autocast`, `framework.checkpointed`) and
such a fix is neither replayed nor offered.

Read in the child, at the first training call (a module in training mode,
gradients on) and, unless torch.compile compiles the model or a module in
it, at each module call inside it until its backward:
accelerate, and the HF `Trainer` through it, enters autocast inside the
model's own forward, after the call begins; a checkpointed block is called
from inside `torch.utils.checkpoint`.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional

_MODULE_FILE = os.path.join("torch", "nn", "modules", "module.py")
_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")
# Frames walked up from a module's pre-hook to find a checkpoint region.
_MAX_FRAMES = 64


class FirstTrainingCall:
    """Watches the first training model call (`start`) and the module calls
    inside it, until the first backward (`stop`) or the model's next call."""

    def __init__(self) -> None:
        # Device type -> autocast dtype ({}: none; None: no training call yet).
        self.autocast: Optional[dict[str, str]] = None
        # Class name -> calls that began a checkpoint region (None: no training call yet).
        self.checkpointed: Optional[dict[str, int]] = None
        self._regions: set[int] = set()  # ids of the modules counted in `checkpointed`
        self._remove: Callable[[], None] = lambda: None

    def start(self, module) -> None:
        """At each outermost model call: the first in training mode with
        gradients on is read, and watched inside."""
        if self.autocast is not None or not getattr(module, "training", False):
            return
        if not _grad_enabled():
            return
        self.autocast = autocast_in_effect()
        if compiled_inside(module):
            return  # (checkpointing not known: None)
        self.checkpointed = {}
        self._watch_inside(module)

    def stop(self) -> None:
        self._remove()
        self._remove = lambda: None

    def _watch_inside(self, outer) -> None:
        """One global module pre-hook for the calls inside `outer`'s first
        training call (under DDP, the inner model's call is one of them)."""
        from torch.nn.modules import module as module_hooks

        from oomdoc.capture.compiled_models import traced_by_compile

        def inside(module, _inputs):
            if traced_by_compile():
                return  # (the compiled code stays the script's own)
            if module is outer:
                self.stop()  # called again: the first call is over
                return
            region = checkpoint_region(sys._getframe(1), module)
            if region is not None and self.checkpointed is not None:
                if region is not False and id(region) not in self._regions:
                    self._regions.add(id(region))
                    name = type(region).__name__
                    self.checkpointed[name] = self.checkpointed.get(name, 0) + 1
            if not self.autocast and (region is not None or _grad_enabled()):
                self.autocast = autocast_in_effect()

        self._remove = module_hooks.register_module_forward_pre_hook(inside).remove


def compiled_inside(module) -> bool:
    """Whether torch.compile compiles `module` or a module in it: its
    compiled code would trace the watch's global hook, and the hook's
    removal would make it compile again (a recompile the script does not
    have without oomdoc)."""
    if "torch._dynamo" not in sys.modules:
        return False
    return any(
        type(inner).__name__ == "OptimizedModule"
        or getattr(inner, "_compiled_call_impl", None) is not None
        for inner in module.modules()
    )


def checkpoint_region(frame, module) -> Any:
    """The module a `torch.utils.checkpoint` region checkpoints, where
    `module`'s call (its `_call_impl` is `frame`) is one of the first module
    calls inside one: the module checkpointed (`checkpoint(block, x)`,
    `checkpoint(block.forward, x)`, the HF `Trainer`'s partial of the block's
    forward), else `module` itself. False inside a region below those
    first calls; None outside every region (within _MAX_FRAMES)."""
    calls = 0
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_filename.endswith(_CHECKPOINT_FILE):
            if calls > 1:
                return False
            checkpointed = frame.f_locals
            function = checkpointed.get("function", checkpointed.get("run_function"))
            owner = _module_of(function)  # (an empty Sequential is falsy)
            return module if owner is None else owner
        if code.co_name == "_call_impl" and code.co_filename.endswith(_MODULE_FILE):
            calls += 1
        frame = frame.f_back
    return None


def _module_of(function) -> Any:
    """The module a checkpointed callable runs: the module itself, a bound
    method's owner, or a partial's (of either, or of an unbound forward
    given the module first)."""
    from torch import nn

    for _ in range(4):
        if isinstance(function, nn.Module):
            return function
        owner = getattr(function, "__self__", None)
        if isinstance(owner, nn.Module):
            return owner
        if not isinstance(function, functools.partial):
            return None
        if function.args and isinstance(function.args[0], nn.Module):
            return function.args[0]
        function = function.func
    return None


def autocast_in_effect() -> dict[str, str]:
    """The device types autocast is on for right now, each to its dtype
    (`{"cuda": "bfloat16"}`)."""
    import torch

    found: dict[str, str] = {}
    for device_type in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device_type):
                dtype = torch.get_autocast_dtype(device_type)
                found[device_type] = str(dtype).replace("torch.", "")
        except (AttributeError, RuntimeError, TypeError):
            pass  # an older torch without the device-type forms
    return found


def _grad_enabled() -> bool:
    """Whether this model call can train (not a validation under no_grad)."""
    import torch

    return torch.is_grad_enabled()
