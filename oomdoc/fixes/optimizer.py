"""lighter_optimizer: an optimizer with less state per parameter."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Optional

from oomdoc.fixes.base import Effect, Fix, FixRequest, SnippetContext
from oomdoc.model import Breakdown, FixResult, Snapshot
from oomdoc.sizes import format_bytes

# Full-size state tensors per parameter: the one table of heavy optimizers
# (planning, estimates and the replay's replacement all read it).
STATE_TENSORS_PER_PARAMETER = {
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Adadelta": 2,
    "FusedAdam": 2,
    "DeepSpeedCPUAdam": 2,
    "RMSprop": 1,
    "Adagrad": 1,
}
SHARE_OF_CAPACITY = 0.10
SHARE_OF_NEED = 0.25


def optimizer_state_estimate(snapshot: Snapshot) -> int:
    """The optimizer state measured, or, before the first optimizer step, the
    state the optimizers will allocate."""
    measured = snapshot.breakdown.bytes_of("optimizer_state")
    parameters = snapshot.breakdown.bytes_of("parameters") or sum(
        model.parameters_bytes for model in snapshot.models
    )
    factor = max(
        (STATE_TENSORS_PER_PARAMETER.get(name, 0) for name in snapshot.optimizers), default=0
    )
    return max(measured, factor * parameters)


def sharding_estimate(static: Breakdown) -> dict:
    """Per-rank bytes saved by sharding over 2, 4 and 8 GPUs, from the
    breakdown (an estimate: communication buffers and the gathered layer of
    FSDP are not counted)."""
    stages = {
        "zero1_optimizer_state": static.optimizer_state,
        "zero2_plus_gradients": static.optimizer_state + static.gradients,
        "fsdp_full_shard": static.optimizer_state + static.gradients + static.parameters,
    }
    return {
        stage: {str(n): int(total * (1 - 1 / n)) for n in (2, 4, 8)}
        for stage, total in stages.items()
    }


def oom_before_any_state(snapshot: Snapshot, fix: str) -> Optional[str]:
    """Why replaying a fix of the optimizer's state would change nothing:
    the OOM came in a forward or backward before the first optimizer step,
    so the optimizer held no state yet and the replay would fail at the
    same point."""
    oom = snapshot.oom
    if oom is None or oom.phase not in ("forward", "backward"):
        return None
    if any(step.optimizer_steps for step in snapshot.steps):
        return None
    if snapshot.breakdown.bytes_of("optimizer_state"):
        return None
    return (
        f"the OOM came in the {oom.phase} before the first optimizer step, when the "
        f"optimizer held no state yet: {fix} would fail at the same point"
    )


class LighterOptimizer(Fix):
    name = "lighter_optimizer"
    title = "An optimizer with less state per parameter"
    semantics_cost, speed_cost = 2, 0
    addresses = ("optimizer_state",)
    combines_with = ("autocast", "checkpointing", "expandable_segments")
    prescribable = True
    replay_priority = 5

    def skip_reason(self, snapshot: Snapshot, explicit: bool) -> Optional[str]:
        heavy = [name for name in snapshot.optimizers if name in STATE_TENSORS_PER_PARAMETER]
        if not heavy:
            optimizers = ", ".join(snapshot.optimizers) or "none"
            return f"the script's optimizers ({optimizers}) are not Adam-like optimizers with large state"
        before_state = oom_before_any_state(snapshot, "a lighter optimizer")
        if before_state and not explicit:
            return before_state
        state = optimizer_state_estimate(snapshot)
        need = snapshot.oom.needed_bytes if snapshot.oom else 0
        if (
            not explicit
            and state < SHARE_OF_CAPACITY * snapshot.capacity_bytes
            and state < SHARE_OF_NEED * need
        ):
            return f"optimizer state (about {format_bytes(state)}) is a small share of the memory"
        return None

    def annotate(self, result: FixResult, static: Breakdown, snapshot: Snapshot) -> None:
        if (snapshot.world_size or 1) >= 2:
            return  # a distributed job's replays measure sharding (fsdp, zero_optimizer)
        estimate = sharding_estimate(static)
        result.sharding_estimate = {
            "per_rank_saved_bytes": estimate,
            "basis": {
                "parameters": static.parameters,
                "gradients": static.gradients,
                "optimizer_state": static.optimizer_state,
            },
        }
        per_rank = {
            stage: "/".join(format_bytes(v) for v in values.values())
            for stage, values in estimate.items()
        }
        result.detail = (result.detail or "") + (
            "; ESTIMATE (not measured), per-rank saving of sharding over 2/4/8 GPUs: "
            f"ZeRO-1 {per_rank['zero1_optimizer_state']}, "
            f"ZeRO-2 {per_rank['zero2_plus_gradients']}, "
            f"FSDP/ZeRO-3 {per_rank['fsdp_full_shard']}"
        )

    def not_applied(self, applied: dict) -> Optional[str]:
        if not self.record_in(applied).get("replaced"):
            return "the script created no Adam-like optimizer"
        return None

    def describe(self, applied: dict, request: FixRequest) -> str:
        record = self.record_in(applied)
        request.context["optimizer"] = record.get("optimizer")
        replaced = sorted(set(record.get("replaced") or []))
        return f"measured torch.optim.{record.get('optimizer')} in place of {', '.join(replaced)}"

    def snippet(self, context: SnippetContext) -> str:
        """`context`: the optimizer measured; `parameters`, the expression for
        the model's parameters (default `model.parameters()`)."""
        parameters = context.get("parameters", "model.parameters()")
        if context.get("optimizer") == "Adafactor":
            return (
                f"optimizer = torch.optim.Adafactor({parameters}, lr=lr)  # factored second moments\n"
                f"# or torch.optim.SGD({parameters}, lr=lr, momentum=0.9): one tensor of state per parameter"
            )
        return (
            f"optimizer = torch.optim.SGD({parameters}, lr=lr, momentum=0.9)\n"
            f"# or torch.optim.Adafactor({parameters}, lr=lr) (torch>=2.5), or bitsandbytes' 8-bit AdamW"
        )

    def estimate(self, snapshot: Snapshot) -> Optional[Effect]:
        state = snapshot.breakdown.bytes_of("optimizer_state")
        # Only when state was allocated at this moment: an OOM before the first
        # optimizer step is not helped by a lighter optimizer.
        if state <= 0 or not any(
            STATE_TENSORS_PER_PARAMETER.get(name) == 2 for name in snapshot.optimizers
        ):
            return None
        return Effect(
            0.0,
            state // 2,
            f"SGD with momentum keeps one state tensor per parameter instead of two: about {format_bytes(state // 2)} saved",
        )

    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        """Replace every heavy torch.optim class with one built on Adafactor
        (SGD with momentum where torch has no Adafactor)."""
        import torch

        target = payload.get("optimizer") or (
            "Adafactor" if hasattr(torch.optim, "Adafactor") else "SGD"
        )
        record.update(replaced=[], optimizer=target)
        base = getattr(torch.optim, target)
        for name in STATE_TENSORS_PER_PARAMETER:
            heavy = getattr(torch.optim, name, None)
            if heavy is None:
                continue
            lighter = _lighter_class(heavy, base, record)
            setattr(torch.optim, name, lighter)
            module = sys.modules.get(heavy.__module__)
            if module is not None and getattr(module, name, None) is heavy:
                setattr(module, name, lighter)


def _lighter_class(heavy: type, base: Any, record: dict) -> type:
    import torch

    accepted = set(inspect.signature(base.__init__).parameters) - {"self", "params"}

    class Lighter(base):
        def __init__(
            self, params: Any, lr: Any = 1e-3, *args: Any, weight_decay: float = 0.0, **kwargs: Any
        ):
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
