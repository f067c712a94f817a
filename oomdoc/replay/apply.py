"""Applying a fix inside a replay child, before the user's script starts.

The script is unmodified: each fix patches the library the way a user would
write it by hand (autocast around forward and loss, checkpoint() around each
repeated block, a smaller DataLoader batch, a lighter optimizer class).
What each fix actually did is recorded in `tracker.fix_applied`, which the
child writes into the capture, so the parent can tell "did not help" from
"could not be applied" (no DataLoader, no repeated blocks, no Adam).
"""

from __future__ import annotations

import inspect
import os
import sys
import weakref

import torch
import torch.nn as nn

from oomdoc.capture.tracker import checkpoint_targets  # noqa: F401 (the blocks checkpointing wraps)


def apply_fix(fix: dict, tracker) -> None:
    """Apply every part of `fix["name"]` (`a+b` applies both)."""
    applied: dict = {}
    tracker.fix_applied = applied
    for part in fix["name"].split("+"):
        applier = APPLIERS.get(part)
        if applier is None:
            raise ValueError(f"oomdoc: unknown fix {part!r}")
        applier(fix, applied.setdefault(part, {}), tracker)


# ---------------------------------------------------------------- smaller batch


def _smaller_batch(fix: dict, record: dict, tracker) -> None:
    """On the command line the parent has already rewritten the batch flag;
    otherwise the DataLoader that carries the failing batch size gets the new
    one (the first DataLoader with a batch size above 1, when the parent does
    not know the original size yet and asks for a fraction)."""
    record["mode"] = fix.get("batch_mode", "dataloader")
    record["batch_size"] = fix.get("batch_size")
    if record["mode"] != "dataloader":
        return
    record["original_batch_size"] = fix.get("original_batch_size")
    record["patched"] = 0
    divisor = fix.get("batch_divisor")
    loader_class = torch.utils.data.DataLoader
    original_init = loader_class.__init__
    signature = inspect.signature(original_init)

    def init(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original_init(self, *args, **kwargs)
        current = bound.arguments.get("batch_size", 1)
        if (
            isinstance(current, int)
            and current > 1
            and bound.arguments.get("batch_sampler") is None
        ):
            if record["original_batch_size"] is None:
                record["original_batch_size"] = current
                if record["batch_size"] is None and divisor:
                    record["batch_size"] = max(1, current // int(divisor))
            if current == record["original_batch_size"] and record["batch_size"]:
                bound.arguments["batch_size"] = int(record["batch_size"])
                record["patched"] += 1
        return original_init(*bound.args, **bound.kwargs)

    init.__wrapped__ = original_init
    loader_class.__init__ = init


# ---------------------------------------------------------------- autocast


def _autocast(fix: dict, record: dict, tracker) -> None:
    """Autocast from the start of each model call until its backward starts:
    the region `with torch.autocast(...): loss = loss_fn(model(x), y)` covers."""
    device_type = fix.get("device_type", "cpu")
    dtype = getattr(torch, fix.get("dtype", "bfloat16"))
    record.update(
        device_type=device_type,
        dtype=str(dtype).replace("torch.", ""),
        regions=0,
        already_enabled=False,
    )
    state: dict = {"context": None}

    def leave(*_args) -> None:
        context, state["context"] = state["context"], None
        if context is not None:
            context.__exit__(None, None, None)

    def enter(module) -> None:
        leave()
        if torch.is_autocast_enabled(device_type):
            record["already_enabled"] = True  # the script autocasts already
            return
        context = torch.autocast(device_type, dtype=dtype)
        context.__enter__()
        state["context"] = context
        record["regions"] += 1

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    # The tracker's own step boundaries: the outermost model call begins, a backward begins.
    tracker.forward_start_callbacks.append(enter)
    tracker.backward_start_callbacks.append(leave)
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: leave())


# ---------------------------------------------------------------- checkpointing

_CHECKPOINTED = "_oomdoc_checkpointed"


def _checkpointed_forward(forward):
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


_segmented: weakref.WeakKeyDictionary[nn.Sequential, list] = weakref.WeakKeyDictionary()


def _segmented_sequential_forward(original_forward):
    """nn.Sequential.forward, run in checkpointed segments for the containers
    chosen (patched on the class so it also takes effect for a call that has
    already started its hooks)."""
    from torch.utils.checkpoint import checkpoint

    def forward(self, input):
        segments = _segmented.get(self)
        if segments is None or not torch.is_grad_enabled():
            return original_forward(self, input)
        for checkpointed, modules in segments:

            def run(x, modules=modules):
                for module in modules:
                    x = module(x)
                return x

            input = checkpoint(run, input, use_reentrant=False) if checkpointed else run(input)
        return input

    return forward


def _checkpointing(fix: dict, record: dict, tracker) -> None:
    record.update(wrapped=[], models=0)
    roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    if not getattr(nn.Sequential.forward, "_oomdoc", False):
        patched = _segmented_sequential_forward(nn.Sequential.forward)
        patched._oomdoc = True
        nn.Sequential.forward = patched

    def wrap(module) -> None:
        if module in roots:
            return
        roots.add(module)
        record["models"] += 1
        for path, container, class_name, blocks, composite in checkpoint_targets(module):
            if composite:
                for block in blocks:
                    if not getattr(block, _CHECKPOINTED, False):
                        block.forward = _checkpointed_forward(block.forward)
                        setattr(block, _CHECKPOINTED, True)
            else:
                segments, current = [], None
                for child in container.children():
                    if isinstance(child, type(blocks[0])) or current is None:
                        current = (isinstance(child, type(blocks[0])), [])
                        segments.append(current)
                    current[1].append(child)
                _segmented[container] = segments
            record["wrapped"].append(
                {
                    "path": path or "(root)",
                    "class": class_name,
                    "count": len(blocks),
                    "segments": not composite,
                }
            )

    tracker.forward_start_callbacks.append(wrap)


# ---------------------------------------------------------------- allocator


def _empty_cache(fix: dict, record: dict, tracker) -> None:
    record["calls"] = 0

    def release(module) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
            record["calls"] += 1

    tracker.forward_start_callbacks.append(release)


def _expandable_segments(fix: dict, record: dict, tracker) -> None:
    # The parent sets PYTORCH_CUDA_ALLOC_CONF; record what the allocator read.
    record["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


# ---------------------------------------------------------------- optimizer

# Optimizers keeping one or two full-size tensors of state per parameter.
HEAVY_OPTIMIZERS = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "RMSprop", "Adagrad", "Adadelta")


def lighter_optimizer_name() -> str:
    return "Adafactor" if hasattr(torch.optim, "Adafactor") else "SGD"


def _lighter_optimizer(fix: dict, record: dict, tracker) -> None:
    target = fix.get("optimizer") or lighter_optimizer_name()
    record.update(replaced=[], optimizer=target)
    for name in HEAVY_OPTIMIZERS:
        heavy = getattr(torch.optim, name, None)
        if heavy is None:
            continue
        lighter = _lighter_class(heavy, getattr(torch.optim, target), record)
        setattr(torch.optim, name, lighter)
        module = sys.modules.get(heavy.__module__)
        if module is not None and getattr(module, name, None) is heavy:
            setattr(module, name, lighter)


def _lighter_class(heavy: type, base: type, record: dict) -> type:
    accepted = set(inspect.signature(base.__init__).parameters) - {"self", "params"}

    class Lighter(base):
        def __init__(self, params, lr=1e-3, *args, weight_decay=0.0, **kwargs):
            record["replaced"].append(heavy.__name__)
            params = list(params)
            if params and isinstance(params[0], dict):
                # Parameter groups may carry the heavy optimizer's settings
                # (an `eps` float where Adafactor wants a pair): keep only the
                # learning rate and weight decay.
                params = [
                    {
                        k: v
                        for k, v in group.items()
                        if k in ("params", "lr", "weight_decay") or k not in accepted
                    }
                    for group in params
                ]
            options = {"lr": lr, "weight_decay": weight_decay}
            if base is torch.optim.SGD:
                options["momentum"] = 0.9
            super().__init__(params, **options)

    Lighter.__name__ = Lighter.__qualname__ = f"{base.__name__}InsteadOf{heavy.__name__}"
    return Lighter


APPLIERS = {
    "smaller_batch": _smaller_batch,
    "autocast": _autocast,
    "checkpointing": _checkpointing,
    "empty_cache": _empty_cache,
    "expandable_segments": _expandable_segments,
    "lighter_optimizer": _lighter_optimizer,
}
