"""autocast: mixed precision from each model call until its backward."""

from __future__ import annotations

from typing import Any, Optional

from oomdoc.fixes.base import Effect, Fix, FixRequest, SnippetContext
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

ACTIVATION_SAVING = 0.4  # matmul/conv outputs halve; norms, softmax, losses stay fp32
WEIGHT_COPY = 0.5  # autocast caches a 16-bit copy of each fp32 weight it uses


def running_autocast(snapshot: Snapshot) -> Optional[str]:
    """The dtype of the autocast the script's training forward already ran
    under on the snapshot's device, or None (none, or not known)."""
    framework = snapshot.framework
    autocast = framework.autocast if framework is not None else None
    return (autocast or {}).get("cuda" if snapshot.device.on_cuda else "cpu")


class Autocast(Fix):
    name = "autocast"
    title = "Mixed precision with torch.autocast"
    semantics_cost, speed_cost = 1, 0
    speeds_up = True
    addresses = ("activations",)
    combines_with = (
        "checkpointing",
        "lighter_optimizer",
        "expandable_segments",
        "empty_cache",
        "smaller_batch",
    )
    prescribable = True
    replay_priority = 1

    def skip_reason(self, snapshot: Snapshot, explicit: bool) -> Optional[str]:
        if not snapshot.models:
            return "no model ran a forward pass before the OOM"
        return super().skip_reason(snapshot, explicit)

    def in_effect(self, snapshot: Snapshot) -> Optional[str]:
        running = running_autocast(snapshot)
        if running is None:
            return None
        return f"the script already runs its forward pass under {running} autocast"

    def request(self, snapshot: Snapshot) -> FixRequest:
        on_cuda = snapshot.device.on_cuda
        dtype = "bfloat16" if (not on_cuda or snapshot.device.supports_bf16) else "float16"
        device_type = "cuda" if on_cuda else "cpu"
        settings = {"device_type": device_type, "dtype": dtype}
        context = SnippetContext(device_type=device_type, dtype=dtype)
        return FixRequest(payload={"name": self.name, **settings}, context=context)

    def not_applied(self, applied: dict) -> Optional[str]:
        record = self.record_in(applied)
        if record.get("already_enabled") and not record.get("regions"):
            return "the script already runs its forward pass under autocast"
        if not record.get("regions"):
            return "no model forward pass ran"
        return None

    def describe(self, applied: dict, request: FixRequest) -> str:
        record = self.record_in(applied)
        payload = request.payload
        detail = f"{record.get('dtype', payload.get('dtype'))} autocast on {record.get('device_type', payload.get('device_type'))}"
        if payload.get("dtype") == "float16":
            detail += "; float16 needs torch.amp.GradScaler (loss scaling)"
        return detail

    def snippet(self, context: SnippetContext) -> str:
        device_type = context.get("device_type", "cuda")
        dtype = context.get("dtype", "bfloat16")
        snippet = (
            f"with torch.autocast(device_type={device_type!r}, dtype=torch.{dtype}):\n"
            "    loss = loss_fn(model(inputs), targets)\n"
        )
        if dtype == "float16":
            return (
                "scaler = torch.amp.GradScaler()  # float16 needs loss scaling\n"
                + snippet
                + "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()"
            )
        return snippet + "loss.backward()"

    def estimate(self, snapshot: Snapshot) -> Optional[Effect]:
        activations = snapshot.breakdown.bytes_of("activations")
        if activations <= 0:
            return None
        dtypes = {
            site.dtype
            for site in snapshot.top_allocations
            if site.category == "activations" and site.dtype
        }
        if dtypes and "float32" not in dtypes:
            return None  # already in 16 bits
        weight_copy = int(WEIGHT_COPY * snapshot.breakdown.bytes_of("parameters"))
        return Effect(
            ACTIVATION_SAVING,
            -weight_copy,
            f"about {ACTIVATION_SAVING:.0%} of {format_bytes(activations)} of activations saved "
            f"(matmul outputs in 16 bits), less {format_bytes(weight_copy)} for the 16-bit weight copies autocast caches",
        )

    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        """Autocast from the start of each model call until its backward
        starts: the region `with torch.autocast(...): loss = loss_fn(model(x), y)`
        covers. Entered and left at the tracker's own step boundaries."""
        import torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        device_type = payload.get("device_type", "cpu")
        dtype = getattr(torch, payload.get("dtype", "bfloat16"))
        record.update(
            device_type=device_type,
            dtype=str(dtype).replace("torch.", ""),
            regions=0,
            already_enabled=False,
        )
        state: dict = {"context": None}

        def leave(*_args: Any) -> None:
            context, state["context"] = state["context"], None
            if context is not None:
                context.__exit__(None, None, None)

        def enter(module: Any) -> None:
            leave()
            if torch.is_autocast_enabled(device_type):
                record["already_enabled"] = True  # the script autocasts already
                return
            context = torch.autocast(device_type, dtype=dtype)
            context.__enter__()
            state["context"] = context
            record["regions"] += 1

        tracker.forward_start_callbacks.append(enter)
        tracker.backward_start_callbacks.append(leave)
        register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: leave())
