"""Sharding fixes applied inside a replay rank, before the user's script starts.

Same signature as the appliers of oomdoc.replay.apply, `(fix, record,
tracker)`, and the same idea: patch the library the way a user would write
the fix by hand, and record what was done.

* `fsdp`: DistributedDataParallel(model, ...) becomes FSDP2: `fully_shard`
  over each repeated block (same-class children of an nn.ModuleList /
  nn.Sequential, the blocks checkpointing wraps) and then the root, returning
  the sharded model (torch.distributed.fsdp.fully_shard in newer torch,
  torch.distributed._composable.fsdp in 2.4-2.5). The optimizer the script
  creates next sees the sharded parameters.
* `zero_optimizer`: every torch.optim optimizer the script creates becomes
  torch.distributed.optim.ZeroRedundancyOptimizer around it (ZeRO-1: each
  rank keeps the optimizer state of its shard of the parameters).
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn as nn

from oomdoc.capture.tracker import checkpoint_targets

SHARDING_FIXES = ("fsdp", "zero_optimizer")


def fully_shard_function():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4-2.5
    return fully_shard


def _replace(owner_module, name: str, original, replacement) -> None:
    """Replace `name` in torch's namespace and in the module defining it."""
    setattr(owner_module, name, replacement)
    defining = sys.modules.get(getattr(original, "__module__", ""), None)
    if defining is not None and getattr(defining, name, None) is original:
        setattr(defining, name, replacement)


def _fsdp(fix: dict, record: dict, tracker) -> None:
    fully_shard = fully_shard_function()
    record.update(api=f"{fully_shard.__module__}.fully_shard", sharded=[], models=0)
    original = nn.parallel.DistributedDataParallel

    def shard_instead_of_ddp(module, *args, **kwargs):
        """FSDP2 in place of DDP: the blocks first, then the root."""
        for path, _container, class_name, blocks, _composite in checkpoint_targets(module):
            for block in blocks:
                fully_shard(block)
            record["sharded"].append(
                {"path": path or "(root)", "class": class_name, "count": len(blocks)}
            )
        fully_shard(module)
        record["models"] += 1
        return module

    shard_instead_of_ddp.__wrapped__ = original  # type: ignore[attr-defined]
    _replace(nn.parallel, "DistributedDataParallel", original, shard_instead_of_ddp)


def _zero_optimizer(fix: dict, record: dict, tracker) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    record.update(wrapped=[])
    for name in dir(torch.optim):
        original = getattr(torch.optim, name)
        if (
            not isinstance(original, type)
            or not issubclass(original, torch.optim.Optimizer)
            or original is torch.optim.Optimizer
            or name in ("LBFGS", "SparseAdam")
        ):
            continue
        _replace(
            torch.optim, name, original, _zero_factory(original, ZeroRedundancyOptimizer, record)
        )


def _zero_factory(original: type, zero: type, record: dict):
    signature = inspect.signature(original.__init__)

    def make(params, *args, **kwargs):
        bound = signature.bind(None, params, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self", None)
        params = arguments.pop("params")
        for key, value in list(arguments.items()):
            if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
                arguments.pop(key)
                arguments.update(value)
        record["wrapped"].append(original.__name__)
        return zero(params, optimizer_class=original, **arguments)

    make.__name__ = make.__qualname__ = original.__name__
    return make


APPLIERS = {"fsdp": _fsdp, "zero_optimizer": _zero_optimizer}


def apply_sharding_fix(fix: dict, tracker) -> None:
    """Apply every part of `fix["name"]` that is a sharding fix; the others
    go to oomdoc.replay.apply (see child.py)."""
    applied = getattr(tracker, "fix_applied", None)
    if applied is None:
        applied = tracker.fix_applied = {}
    for part in fix["name"].split("+"):
        if part in APPLIERS:
            APPLIERS[part](fix, applied.setdefault(part, {}), tracker)


def is_sharding_fix(fix: dict) -> bool:
    return any(part in APPLIERS for part in fix["name"].split("+"))
