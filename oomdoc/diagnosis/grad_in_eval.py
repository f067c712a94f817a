"""grad_in_eval: evaluation passes that ran under autograd and kept their
activations for a backward that never came."""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_BUG, Diagnosis
from oomdoc.diagnosis.steps import eval_steps
from oomdoc.formatting import format_location, index_list
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

REMEDY = (
    "model.eval()\n"
    "with torch.no_grad():  # or torch.inference_mode()\n"
    "    for inputs, targets in val_loader:\n"
    "        logits = model(inputs)"
)


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    found, passes = eval_steps(snapshot)
    if not found:
        return None
    indices = [step.index for step in found]
    eval_mode = sum(step.eval_mode_forward_calls_with_grad for step in found)
    evidence = [
        f"{passes} forward pass(es) ran with autograd on and no backward used them "
        f"(step{'s' if len(indices) > 1 else ''} {index_list(indices)})",
    ]
    if eval_mode:
        evidence.append(
            f"{eval_mode} of them called a model in eval mode (model.eval()) with gradients enabled"
        )
    if not any(step.backward_calls > 0 for step in snapshot.steps):
        evidence.append("the run never called backward")
    index_set = set(indices)
    held = [
        graph
        for step in snapshot.steps
        for graph in step.retained_graphs
        if graph.from_step in index_set
    ]
    if held:
        graph = held[0]
        evidence.append(
            f"`{graph.variable}` ({format_location(graph.location)}) "
            f"keeps the graphs of these passes across steps, so their activations accumulate"
        )
    held_bytes = max((step.retained_activation_bytes for step in found), default=0)
    moment_step = snapshot.moment_step
    if moment_step in index_set:
        activations = snapshot.breakdown.bytes_of("activations")
        held_bytes = max(held_bytes, activations)
        evidence.append(
            f"activations were {format_bytes(activations)} {snapshot.moment_label}, "
            f"in step {moment_step}, one of these passes"
        )
    summary = (
        "Evaluation without torch.no_grad(): forward passes recorded autograd graphs and kept "
        "their activations for a backward that never came"
    )
    return Diagnosis("grad_in_eval", summary, evidence, held_bytes, tier=TIER_BUG, remedy=REMEDY)
