"""torch.compile and the capture's module hooks.

Dynamo traces the global module hooks (and the saved-tensors hook) of the
modules a compiled model calls. The capture's hooks read and change its
state, so traced they broke the graph at every module and recompiled on its
counters: a nanoGPT-style trainer on an H200 compiled 15 graphs with 52 graph
breaks under oomdoc, against 2 and none without (tests/gpu/test_compiled_gpu.py).
Traced, they do nothing (`traced_by_compile`), so the compiled code is the
script's own; the steps are made where the compiled model is called:

- `torch.compile(model)` returns an OptimizedModule, itself a module called
  eagerly: the global hooks see that call;
- `model.compile()` compiles the module's own call, hooks included: the
  module's compiled call is wrapped (`hooked_compile`) so that the
  hooks see it from outside, eagerly;
- a model called inside a compiled function (`loss = compiled_step(x, y)`,
  Lightning's compiled `training_step`) is not seen: with no model call seen,
  a step begins at the first backward after the last one's optimizer step
  (the tracker's `_on_backward_start`), and the model is not named (no
  module table, no blocks for checkpointing).

AOTAutograd, compiling, calls torch.autograd.grad on fake tensors: that is
not a backward of the script's (`fake_tracing`).

The modules inside a compiled model are not seen one by one: its activations
are the model's as a whole (its parameters, gradients and optimizer state
keep their modules, found by identity).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

try:  # torch >= 2.3
    from torch.compiler import is_compiling as traced_by_compile
except ImportError:  # pragma: no cover - older torch
    from torch._dynamo import is_compiling as traced_by_compile


def fake_tracing() -> bool:
    """A fake-tensor mode is on: AOTAutograd traces a compiled model's
    backward (torch.autograd.grad on fake tensors) as it compiles, which is
    not a backward of the script's."""
    key = getattr(torch._C, "_TorchDispatchModeKey", None)
    return key is not None and torch._C._get_dispatch_mode(key.FAKE) is not None


class ModuleCallHooks(Protocol):
    """The tracker's global module hooks, as torch calls them."""

    def _on_forward_pre(self, module: nn.Module, inputs: tuple) -> Any: ...

    def _on_forward_post(self, module: nn.Module, inputs: tuple, *rest: Any) -> Any: ...


def hooked_compile(hooks: ModuleCallHooks, original: Callable) -> Callable:
    """nn.Module.compile, after which the module's compiled call runs between
    `hooks`' pre- and post-hook, eagerly (while this stays nn.Module.compile:
    once the capture is uninstalled, the compiled call runs alone)."""

    def compile(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(module, *args, **kwargs)
        compiled = getattr(module, "_compiled_call_impl", None)
        if compiled is not None:
            module._compiled_call_impl = _called_between_hooks(hooks, module, compiled, compile)

    compile.__wrapped__ = original  # type: ignore[attr-defined]
    compile.__doc__ = original.__doc__
    return compile


def _called_between_hooks(
    hooks: ModuleCallHooks, module: nn.Module, compiled: Callable, patch: Callable
) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        if nn.Module.compile is not patch or traced_by_compile():
            return compiled(*args, **kwargs)
        hooks._on_forward_pre(module, args)
        try:
            output = compiled(*args, **kwargs)
        except BaseException:
            hooks._on_forward_post(module, args, None)  # as torch calls always_call hooks
            raise
        hooks._on_forward_post(module, args, kwargs, output)
        return output

    return call
