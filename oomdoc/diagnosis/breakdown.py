"""What filled the device: the largest category, and any other holding a
large share, each with the fixes that shrink it."""

from __future__ import annotations

from oomdoc.categories import BY_NAME
from oomdoc.diagnosis import model_load
from oomdoc.diagnosis.base import TIER_BREAKDOWN, Diagnosis
from oomdoc.fixes import FIXES
from oomdoc.fixes.autocast import running_autocast
from oomdoc.fixes.checkpointing import checkpointed_blocks
from oomdoc.formatting import format_location, percent, tensor_description
from oomdoc.model import CATEGORIES, Snapshot
from oomdoc.sizes import format_bytes

# Where the forward already runs under autocast, the fix left for activations.
AUTOCAST_ACTIVATIONS_ADVICE = (
    "activation checkpointing of the repeated blocks, or a smaller batch with gradient "
    "accumulation (the forward already runs under autocast)"
)

# ... where the blocks are already checkpointed, and where both are so.
CHECKPOINTED_ACTIVATIONS_ADVICE = (
    "autocast to bf16, or a smaller batch with gradient accumulation (the blocks are "
    "already checkpointed)"
)
CHECKPOINTED_AUTOCAST_ACTIVATIONS_ADVICE = (
    "a smaller batch with gradient accumulation (the forward already runs under autocast, "
    "and its blocks are checkpointed)"
)

# A category is diagnosed when it holds at least this share of the memory in
# use (the largest category always is).
CATEGORY_SHARE = 0.2

# At an OOM in evaluation no autograd graph is kept: activations are the
# evaluation batch's own and what the loop keeps between batches.
EVALUATION_ACTIVATIONS_ADVICE = "a smaller evaluation batch, autocast to bf16, or free each batch's outputs before the next forward (see evaluation_oom)"


# Weights outside every called model and optimizer (Oom.uncalled_models,
# Oom.weight_copies).
UNCALLED_MODELS_ADVICE = (
    "copies of the model's weights kept on the device (an EMA, a saved state_dict): keep them "
    "on the CPU (AveragedModel(model, device='cpu'), timm's ModelEmaV2(model, device='cpu'), "
    "diffusers' EMAModel left on the CPU or its training scripts' --offload_ema, "
    "{k: v.to('cpu') for k, v in model.state_dict().items()}) or in bfloat16, or free them "
    "where they are not needed"
)

# ... and before any model call, those of the model being built or moved.
LOADING_ADVICE = "weights of the model being built or moved to the device (see model_load)"


def rule(snapshot: Snapshot) -> list[Diagnosis]:
    breakdown = snapshot.breakdown
    total = breakdown.total
    if total <= 0:
        return []
    largest = breakdown.largest()
    capacity = snapshot.capacity_bytes
    in_evaluation = snapshot.is_oom and snapshot.oom is not None and snapshot.oom.in_evaluation
    found = []
    for category in CATEGORIES:
        nbytes = breakdown.bytes_of(category)
        if nbytes <= 0 or (category != largest and nbytes < CATEGORY_SHARE * total):
            continue
        evidence = [
            f"{format_bytes(nbytes)} of {format_bytes(total)} in use {snapshot.moment_label}"
            + (
                f" ({percent(nbytes, capacity, 0)} of the {format_bytes(capacity)} capacity)"
                if capacity
                else ""
            )
        ]
        evidence += _category_evidence(snapshot, category)
        entry = BY_NAME[category]
        name, advice = entry.title, entry.advice
        if category == "activations" and in_evaluation:
            advice = EVALUATION_ACTIVATIONS_ADVICE
        elif category == "activations" and checkpointed_blocks(snapshot):
            advice = (
                CHECKPOINTED_AUTOCAST_ACTIVATIONS_ADVICE
                if running_autocast(snapshot)
                else CHECKPOINTED_ACTIVATIONS_ADVICE
            )
        elif category == "activations" and running_autocast(snapshot):
            advice = AUTOCAST_ACTIVATIONS_ADVICE
        oom = snapshot.oom
        if category == "other" and oom is not None and (oom.uncalled_models or oom.weight_copies):
            named = LOADING_ADVICE if model_load.loading(snapshot) else UNCALLED_MODELS_ADVICE
            advice = f"{named}; for the rest, {advice}"
        summary = (
            f"{name}: {'the largest' if category == largest else 'a large'} share, "
            f"{percent(nbytes, total, 0)} of the memory in use {snapshot.moment_label}; {advice}"
        )
        fixes = [
            fix.name
            for fix in FIXES
            if category in fix.addresses
            and fix.applies_to(snapshot)
            and (fix.helps_in_evaluation or not in_evaluation)
            and fix.in_effect(snapshot) is None
        ]
        found.append(
            Diagnosis(
                entry.kind,
                summary,
                evidence,
                nbytes,
                tier=TIER_BREAKDOWN,
                fixes=fixes,
            )
        )
    return found


def _category_evidence(snapshot: Snapshot, category: str) -> list[str]:
    evidence = []
    sites = [site for site in snapshot.top_allocations if site.category == category]
    for site in sites[:2]:
        description = tensor_description(site)
        where = format_location(site.location, snapshot.cwd)
        if site.module:
            where = f"{where}, in `{site.module}`"
        evidence.append(
            f"{format_bytes(site.bytes)} allocated at {where}"
            + (f" ({description})" if description else "")
        )
    if category == "activations":
        checkpointed = checkpointed_blocks(snapshot)
        if snapshot.is_oom and snapshot.oom and snapshot.oom.phase:
            evidence.append(f"the OOM came during {snapshot.oom.phase}")
        for model in snapshot.models[:2]:
            blocks = model.blocks_outermost_first()
            if blocks and not (snapshot.oom is not None and snapshot.oom.in_evaluation):
                block = blocks[0]
                evidence.append(
                    f"{model.class_name} repeats {block.count} x {block.class_name} in "
                    f"`{block.path}`: "
                    + ("already checkpointed" if checkpointed else "checkpointing candidates")
                )
    elif category == "optimizer_state":
        from oomdoc.fixes.optimizer import STATE_TENSORS_PER_PARAMETER

        optimizers = snapshot.optimizers
        if optimizers:
            line = f"optimizer{'s' if len(optimizers) > 1 else ''}: {', '.join(optimizers)}"
            if any(STATE_TENSORS_PER_PARAMETER.get(name) == 2 for name in optimizers):
                line += " (two state tensors per parameter: exp_avg and exp_avg_sq)"
            evidence.append(line)
    elif category == "other":
        for uncalled in snapshot.oom.uncalled_models if snapshot.oom else []:
            held = f" in {' and '.join(uncalled.held_by)}" if uncalled.held_by else ""
            evidence.append(
                f"{format_bytes(uncalled.bytes)} are the weights of {uncalled.class_name}{held}, "
                + (
                    "being built or moved to the device"
                    if model_load.loading(snapshot)
                    else "a model the run never called nor optimised (an EMA copy, a model kept for later)"
                )
            )
        for copy in snapshot.oom.weight_copies if snapshot.oom else []:
            plural = "copies" if copy.copies > 1 else "a copy"
            where = (
                f"in {', '.join(copy.held_by)}"
                if copy.held_by
                else "a saved state_dict, an EMA's shadow weights"
            )
            evidence.append(
                f"{format_bytes(copy.bytes)} are {copy.tensors} tensors shaped like "
                f"{copy.of}'s parameters ({plural} of its weights: {where})"
            )
    elif category == "parameters":
        for model in snapshot.models[:3]:
            if model.parameters_bytes:
                evidence.append(
                    f"{model.class_name} has {format_bytes(model.parameters_bytes)} of parameters"
                )
    return evidence
