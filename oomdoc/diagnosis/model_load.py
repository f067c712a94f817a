"""model_load: the OOM came before any model call, while a model was built
or moved to the device: its weights are what did not fit.

Before the first call no step has run: there are no activations, gradients
or optimizer state to shrink, and a smaller batch changes nothing. What the
device held was the model's weights (Oom.uncalled_models names the modules
holding them, with all of their weights' bytes); what helps is fewer bytes
per weight, or the weights spread over devices or kept partly off them.
"""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_DECISIVE, Diagnosis
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

REMEDY = (
    "# the weights in bfloat16: half the bytes of float32\n"
    "model = Model(...).to(device=device, dtype=torch.bfloat16)\n"
    "# a Hugging Face model: from_pretrained(..., torch_dtype=torch.bfloat16)\n"
    "# too large for one device even so: spread it over several\n"
    "#   from_pretrained(..., device_map='auto')      (accelerate: layers on each GPU, the rest on the CPU)\n"
    "#   torch.distributed.fsdp.fully_shard(model)    (FSDP2: each rank holds a shard)"
)


# The weights must hold at least this share of the memory in use at the OOM
# (or be more than the device by themselves) for the OOM to be their load's.
WEIGHTS_SHARE = 0.5


def loading(snapshot: Snapshot) -> bool:
    """The OOM came before any model call, with modules holding weights on
    the device (the model being built or moved there)."""
    oom = snapshot.oom if snapshot.is_oom else None
    return bool(oom is not None and oom.uncalled_models and not snapshot.models)


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    if not loading(snapshot) or snapshot.oom is None:
        return None
    oom = snapshot.oom
    capacity = snapshot.capacity_bytes
    models = oom.uncalled_models
    on_device = sum(model.bytes for model in models)
    weights = sum(max(model.weights_bytes, model.bytes) for model in models)
    if not (capacity and weights > capacity) and on_device < WEIGHTS_SHARE * oom.allocated_bytes:
        return None  # the weights were not what filled it (a dataset moved there up front)
    names = ", ".join(dict.fromkeys(model.class_name for model in models))
    evidence = [
        f"{model.class_name}: {format_bytes(model.bytes)} of its weights on the device at the OOM"
        + (f", {format_bytes(model.weights_bytes)} in all" if model.weights_bytes else "")
        for model in models
    ]
    if capacity and weights > capacity:
        verdict = (
            f"its weights alone, {format_bytes(weights)}, are more than the device's "
            f"{format_bytes(capacity)}"
        )
    else:
        others = max(0, oom.allocated_bytes - on_device)
        verdict = (
            f"with {format_bytes(on_device)} of its weights on the device"
            + (f" and {format_bytes(others)} else" if others else "")
            + f", the next {format_bytes(oom.requested_bytes)} did not fit in its "
            f"{format_bytes(capacity)}"
        )
    evidence.append(
        "no step had run: no activations, gradients or optimizer state yet, "
        "so a smaller batch, autocast or checkpointing change nothing here"
    )
    return Diagnosis(
        "model_load",
        f"The model does not fit: the OOM came while {names} was built or moved to the "
        f"device, before any step; {verdict}",
        evidence,
        max(on_device, weights),
        tier=TIER_DECISIVE,
        remedy=REMEDY,
    )
