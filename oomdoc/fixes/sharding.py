"""Sharding fixes of a distributed job, measured per rank through the same
launcher and world size: FSDP2 in place of DDP, and ZeRO-1 (the optimizer's
state sharded across the ranks)."""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Iterator, Optional

from oomdoc.fixes.base import Fix, FixRequest, SnippetContext
from oomdoc.fixes.optimizer import oom_before_any_state
from oomdoc.model import Snapshot

NOT_DISTRIBUTED = "needs a distributed job (oomdoc run --nproc-per-node N)"


def _replace(owner_module: Any, name: str, original: Any, replacement: Any) -> None:
    """Replace `name` in torch's namespace and in the module defining it."""
    setattr(owner_module, name, replacement)
    defining = sys.modules.get(getattr(original, "__module__", ""), None)
    if defining is not None and getattr(defining, name, None) is original:
        setattr(defining, name, replacement)


class Fsdp(Fix):
    name = "fsdp"
    title = "Shard parameters, gradients and optimizer state with FSDP2"
    semantics_cost, speed_cost = 0, 1
    addresses = ("parameters", "gradients", "optimizer_state")
    replay_priority = 6

    def applies_to(self, snapshot: Snapshot) -> bool:
        return (snapshot.world_size or 1) >= 2

    def skip_reason(self, snapshot: Snapshot, explicit: bool) -> Optional[str]:
        if (snapshot.world_size or 1) < 2:
            return NOT_DISTRIBUTED
        if not snapshot.device.on_cuda:
            return (
                "CUDA only: FSDP2 frees its gathered parameters by resizing their storage, "
                "which the simulated device does not see"
            )
        if not (snapshot.parallel and snapshot.parallel.ddp):
            return "the script wraps no model in DistributedDataParallel"
        return None

    def not_applied(self, applied: dict) -> Optional[str]:
        if not self.record_in(applied).get("models"):
            return "no model was wrapped in DistributedDataParallel in the replay"
        return None

    def describe(self, applied: dict, request: FixRequest) -> str:
        record = self.record_in(applied)
        sharded = record.get("sharded") or []
        if sharded:
            request.context["blocks_path"] = sharded[0]["path"]
        blocks = ", ".join(f"{s['count']} x {s['class']} in {s['path']}" for s in sharded)
        return f"FSDP2 ({record.get('api')}) in place of DDP: {blocks or 'the root only'}; measured per rank"

    def snippet(self, context: SnippetContext) -> str:
        path = context.get("blocks_path", "blocks")
        loop = "for block in model:" if path == "(root)" else f"for block in model.{path}:"
        return (
            "from torch.distributed.fsdp import fully_shard   # torch 2.4-2.5: torch.distributed._composable.fsdp\n"
            f"{loop}                 # instead of DistributedDataParallel(model)\n"
            "    fully_shard(block)\n"
            "fully_shard(model)\n"
            "optimizer = torch.optim.AdamW(model.parameters(), lr=lr)   # after sharding\n"
            "# FSDP2 shards the model in place: where the script used DDP's attributes,\n"
            "#   model.module                          -> model\n"
            "#   model.require_backward_grad_sync = x  -> model.set_requires_gradient_sync(x)\n"
            "#   with model.no_sync(): ...             -> model.set_requires_gradient_sync(False), then True"
        )

    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        """DistributedDataParallel(model, ...) becomes FSDP2: fully_shard over
        each repeated block, then the root; the optimizer the script creates
        next sees the sharded parameters."""
        import torch.nn as nn

        try:
            from torch.distributed.fsdp import fully_shard  # torch >= 2.6
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard  # torch 2.4-2.5
        record.update(api=f"{fully_shard.__module__}.fully_shard", sharded=[], models=0)
        original = nn.parallel.DistributedDataParallel

        def shard_instead_of_ddp(module: Any, *args: Any, **kwargs: Any) -> Any:
            for path, _container, class_name, blocks, _composite in tracker.checkpoint_targets(
                module
            ):
                for block in blocks:
                    fully_shard(block)
                record["sharded"].append(
                    {"path": path or "(root)", "class": class_name, "count": len(blocks)}
                )
            fully_shard(module)
            keep_ddp_attributes(module)
            record["models"] += 1
            return module

        shard_instead_of_ddp.__wrapped__ = original  # type: ignore[attr-defined]
        _replace(nn.parallel, "DistributedDataParallel", original, shard_instead_of_ddp)


class _AsDistributedDataParallel:
    """What scripts written for DDP read from the model they wrapped, on the
    FSDP2 module that replaces it (a class of its own, mixed in front of
    FSDP2's): `model.module` (nanoGPT's `raw_model`, checkpoint code),
    `model.no_sync()` and `model.require_backward_grad_sync = ...`
    (gradient accumulation), the last two through FSDP2's
    `set_requires_gradient_sync`."""

    @property
    def module(self) -> Any:
        return self

    @property
    def require_backward_grad_sync(self) -> bool:
        return bool(getattr(self, "_oomdoc_gradient_sync", True))

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        object.__setattr__(self, "_oomdoc_gradient_sync", bool(value))
        self.set_requires_gradient_sync(bool(value))  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before


DDP_ATTRIBUTES = ("module", "no_sync", "require_backward_grad_sync")


def keep_ddp_attributes(module: Any) -> None:
    """Give the sharded root the DDP attributes its own class does not have
    (a model with a submodule or method of such a name keeps its own)."""
    own = [name for name in DDP_ATTRIBUTES if hasattr(module, name)]
    if own:
        return
    cls = type(module)
    module.__class__ = type(cls.__name__, (_AsDistributedDataParallel, cls), {})


class ZeroOptimizer(Fix):
    name = "zero_optimizer"
    title = "Shard the optimizer state across the ranks (ZeRO-1)"
    semantics_cost, speed_cost = 0, 1
    addresses = ("optimizer_state",)
    replay_priority = 7

    def applies_to(self, snapshot: Snapshot) -> bool:
        return (snapshot.world_size or 1) >= 2

    def skip_reason(self, snapshot: Snapshot, explicit: bool) -> Optional[str]:
        if (snapshot.world_size or 1) < 2:
            return NOT_DISTRIBUTED
        if not snapshot.optimizers:
            return "the script creates no optimizer"
        before_state = oom_before_any_state(snapshot, "sharding the optimizer state")
        if before_state and not explicit:
            return before_state
        return None

    def not_applied(self, applied: dict) -> Optional[str]:
        if not self.record_in(applied).get("wrapped"):
            return "the script created no optimizer in the replay"
        return None

    def describe(self, applied: dict, request: FixRequest) -> str:
        wrapped = sorted(set(self.record_in(applied).get("wrapped") or []))
        if wrapped:
            request.context["optimizer"] = f"torch.optim.{wrapped[0]}"
        return f"ZeroRedundancyOptimizer around {', '.join(wrapped) or 'no optimizer'}; measured per rank"

    def snippet(self, context: SnippetContext) -> str:
        optimizer = context.get("optimizer", "torch.optim.AdamW")
        return (
            "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
            f"optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class={optimizer}, lr=lr)"
        )

    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        """Every torch.optim optimizer the script creates becomes a
        ZeroRedundancyOptimizer around it."""
        import torch
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
                torch.optim,
                name,
                original,
                _zero_factory(original, ZeroRedundancyOptimizer, record),
            )


def _zero_factory(original: type, zero: type, record: dict) -> Any:
    signature = inspect.signature(original)  # the class: its __init__ without self

    def make(params: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(params, *args, **kwargs)
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
