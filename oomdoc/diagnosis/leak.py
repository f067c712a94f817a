"""leak: memory at the end of each step grows, or a variable keeps the
autograd graph of earlier steps alive (`total += loss`)."""

from __future__ import annotations

from typing import Optional

from oomdoc.diagnosis.base import TIER_BUG, Diagnosis
from oomdoc.diagnosis.steps import eval_steps, steady_growth
from oomdoc.model import RetainedGraph, Snapshot
from oomdoc.sizes import format_bytes


def rule(snapshot: Snapshot) -> Optional[Diagnosis]:
    growth = steady_growth(snapshot)
    holders: dict[tuple[str, str, str], dict] = {}
    for step in snapshot.steps:
        for graph in step.retained_graphs:
            key = (graph.variable, graph.file, graph.function)
            entry = holders.setdefault(
                key, {"graph": graph, "steps": 0, "from_step": graph.from_step}
            )
            entry["steps"] += 1
            entry["from_step"] = min(entry["from_step"], graph.from_step)
    if not holders and growth is None:
        return None
    retained = max((step.retained_activation_bytes for step in snapshot.steps), default=0)
    evidence = []
    held_bytes = retained
    if growth is not None:
        first, last, per_step, count = growth
        held_bytes = max(held_bytes, last - first)
        evidence.append(
            f"allocated memory at the end of a step grew from {format_bytes(first)} to {format_bytes(last)} "
            f"over {count} steps ({format_bytes(per_step)} per step)"
        )
    if retained:
        evidence.append(
            f"{format_bytes(retained)} made in the forward/backward of earlier steps was still alive at a step's end"
        )
    if holders:
        ranked = sorted(holders.values(), key=lambda entry: (-entry["steps"], entry["from_step"]))
        for entry in ranked[:3]:
            holder: RetainedGraph = entry["graph"]
            evidence.append(
                f"`{holder.variable}` in {holder.function}() "
                f"({holder.file}:{holder.line}) still reached the autograd graph of step "
                f"{entry['from_step']} at the end of {entry['steps']} later step(s)"
            )
        variable = ranked[0]["graph"].variable
        summary = (
            f"Memory leak: `{variable}` keeps the autograd graph of every step since step {ranked[0]['from_step']} alive: "
            f"it holds tensors with history (e.g. `{variable} += loss` without .item())"
        )
        remedy = (
            f"{variable} += loss.item()            # if it sums losses: a Python number keeps no graph\n"
            f"{variable}.append(output.detach())  # if it collects tensors: no graph (.cpu() frees the device)"
        )
    else:
        summary = (
            "Memory leak: allocated memory at the end of each step grows steadily; something keeps "
            "tensors from every step (a list of losses or outputs, a cache)"
        )
        remedy = (
            "losses.append(loss.item())      # numbers, not tensors\n"
            "outputs.append(logits.detach())  # no graph; .cpu() to keep them off the device"
        )
    tier = TIER_BUG
    # A leak of graphs made by evaluation passes is cured by no_grad: the
    # grad_in_eval diagnosis comes first and this one says so.
    eval_indices = {step.index for step in eval_steps(snapshot)[0]}
    if eval_indices and any(
        graph.from_step in eval_indices for step in snapshot.steps for graph in step.retained_graphs
    ):
        tier = TIER_BUG + 0.5
        evidence.append(
            "the leaked graphs come from the forward passes without torch.no_grad() (see grad_in_eval)"
        )
    return Diagnosis("leak", summary, evidence, held_bytes, tier=tier, remedy=remedy)
