"""evaluation: the run ran out of memory in an evaluation pass (model calls
under no_grad/inference_mode or in eval() mode), not in a training step.

No autograd graph is kept there, so activation checkpointing saves nothing;
what decides the memory is the evaluation batch and what the loop keeps
alive from one batch to the next (the previous batch's logits, collected
predictions).
"""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_DECISIVE, Diagnosis
from oomdoc.fixes.autocast import Autocast
from oomdoc.formatting import format_location
from oomdoc.model import Snapshot
from oomdoc.script_flags import EVAL_BATCH_FLAGS
from oomdoc.sizes import format_bytes

_TRAINING_PHASES = ("forward", "backward", "optimizer")

_LOOP_REMEDY = (
    "with torch.no_grad():  # or torch.inference_mode()\n"
    "    for inputs, targets in val_loader:\n"
    "        output = model(inputs)\n"
    "        total += loss_fn(output, targets).item()  # a number keeps no tensor alive\n"
    "        del output  # the next batch's forward runs without this batch's outputs"
)
# N: a placeholder, not advice (the fixes measured below give the batch).
_FRAMEWORK_REMEDY = {
    "transformers": (
        "TrainingArguments(per_device_eval_batch_size=N,  # a smaller evaluation batch\n"
        "                  eval_accumulation_steps=1)     # move predictions to the CPU every step"
    ),
    "lightning": (
        "def val_dataloader(self):\n"
        "    return DataLoader(val_set, batch_size=N)  # a smaller evaluation batch\n"
        "# and return numbers, not tensors, from validation_step (self.log(..., loss.item()))"
    ),
}


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    oom = snapshot.oom
    if not snapshot.is_oom or oom is None or not oom.in_evaluation:
        return None
    evidence = [
        f"the OOM came in evaluation pass {oom.evaluation_pass or '?'} (step {oom.step}): "
        "model calls without autograd or in eval() mode, not a training step",
    ]
    training_peak = max(
        (
            value
            for step in snapshot.steps
            for phase, value in step.phase_peaks.items()
            if phase in _TRAINING_PHASES
        ),
        default=0,
    )
    if training_peak:
        evidence.append(
            f"training steps peaked at {format_bytes(training_peak)}; the evaluation needed at "
            f"least {format_bytes(oom.needed_bytes)} of {format_bytes(snapshot.capacity_bytes)}"
        )
    held_bytes = 0
    held = oom.previous_outputs
    if held is not None and held.bytes > 0:
        held_bytes = held.bytes
        holder = (
            f"`{held.variable}` ({format_location(held.location)})" if held.variable else "the loop"
        )
        evidence.append(
            f"{holder} still held the previous evaluation batch's outputs, {format_bytes(held.bytes)}, "
            "while the next forward ran"
        )
    flag = next((flag for flag in EVAL_BATCH_FLAGS if flag in snapshot.script_options), None)
    remedy_lines = []
    if flag is not None:
        remedy_lines.append(f"{flag} <smaller>  # the script's own evaluation batch size")
    framework = snapshot.framework.name if snapshot.framework else "plain"
    remedy_lines.append(_FRAMEWORK_REMEDY.get(framework, _LOOP_REMEDY))
    summary = (
        "Out of memory in evaluation, not in training: no autograd graph is kept there, so "
        "checkpointing cannot help; the evaluation batch and what the loop keeps alive between "
        "batches decide its memory"
    )
    if held_bytes:
        summary += f" ({format_bytes(held_bytes)} of the previous batch's outputs were still alive)"
    return Diagnosis(
        "evaluation_oom",
        summary,
        evidence,
        held_bytes or snapshot.breakdown.bytes_of("activations"),
        fixes=[Autocast.name],
        remedy="\n".join(remedy_lines),
        tier=TIER_DECISIVE,
    )
