"""What the steps of a run say: which completed, steady growth, evaluation
passes under autograd. Shared by the leak and grad_in_eval rules."""

from __future__ import annotations

from typing import Optional

from oomdoc.model import Snapshot, Step


def incomplete_step_index(snapshot: Snapshot) -> Optional[int]:
    """The index of the step the run died in (its backward may never have
    come), or None when the run finished."""
    if not snapshot.steps or snapshot.outcome == "ok":
        return None
    return snapshot.steps[-1].index


def complete_steps(snapshot: Snapshot) -> list[Step]:
    """Steps that ran to their end: in optimizer units those with an
    optimizer step; otherwise every step but the one the run died in."""
    if snapshot.step_unit == "optimizer":
        return [step for step in snapshot.steps if step.optimizer_steps > 0]
    if snapshot.step_unit == "backward":
        return [step for step in snapshot.steps if step.backward_calls > 0]
    incomplete = incomplete_step_index(snapshot)
    return [step for step in snapshot.steps if incomplete is None or step.index != incomplete]


def steady_growth(snapshot: Snapshot) -> Optional[tuple[int, int, int, int]]:
    """(first, last, per_step, count) when allocated memory at the end of a
    step grows steadily across the complete steps; else None.

    The first step is left out: gradients and optimizer state appear there.
    """
    measured = [
        (step.index, step.end_allocated_bytes)
        for step in complete_steps(snapshot)[1:]
        if step.end_allocated_bytes is not None and step.end_allocated_bytes >= 0
    ]
    ends = [end for _, end in measured]
    if len(ends) < 3:
        return None
    deltas = [b - a for a, b in zip(ends, ends[1:])]
    grew = sum(1 for delta in deltas if delta > 0)
    shrank = sum(1 for delta in deltas if delta < 0)
    net = ends[-1] - ends[0]
    threshold = max(256 * 1024, snapshot.capacity_bytes // 500)
    if net < threshold or grew < 0.5 * len(deltas) or shrank > 0.25 * len(deltas):
        return None
    # Counted by step index: a long run's snapshot omits steps in between.
    span = max(len(deltas), measured[-1][0] - measured[0][0])
    return ends[0], ends[-1], net // span, span + 1


def eval_steps(snapshot: Snapshot) -> tuple[list[Step], int]:
    """Steps with forward passes under autograd that no backward used, and how
    many such passes there were in all."""
    steps = snapshot.steps
    incomplete = incomplete_step_index(snapshot)
    any_backward = any(step.backward_calls > 0 for step in steps)
    has_optimizer = bool(snapshot.optimizers)
    complete_training = [step for step in complete_steps(snapshot) if step.backward_calls > 0]
    # Some models are called twice per backward (two views, a GAN's
    # discriminator): the regular surplus of the training steps is not a bug.
    regular_surplus = min(
        (max(0, s.forward_calls_with_grad - s.backward_calls) for s in complete_training),
        default=0,
    )
    found, passes = [], 0
    # An OOM the script caught (a batch-size finder) cut a training forward
    # short of its backward: as many passes, from the step of the first, are
    # no evaluation.
    caught = snapshot.caught_ooms
    first_caught = snapshot.ooms_seen.step if snapshot.ooms_seen is not None else None
    for step in steps:
        surplus = step.forward_calls_with_grad - step.backward_calls
        if caught and (first_caught is None or step.index >= first_caught):
            cut_short = min(max(surplus, 0), caught)
            surplus, caught = surplus - cut_short, caught - cut_short
        if surplus <= 0:
            continue
        died_here = incomplete is not None and step.index == incomplete
        if step.eval_mode_forward_calls_with_grad > 0:
            # A module in eval mode under autograd without a backward for it.
            unused = min(surplus, step.eval_mode_forward_calls_with_grad)
        elif died_here:
            # The training step may simply not have reached its backward (a
            # script without an optimizer that dies in its first forward).
            continue
        elif not any_backward and not has_optimizer:
            unused = surplus  # a pure evaluation script
        elif step.backward_calls == 0 and any_backward:
            unused = surplus
        elif surplus > regular_surplus:
            unused = surplus - regular_surplus
        else:
            continue
        found.append(step)
        passes += unused
    return found, passes


def is_evaluation_only(snapshot: Snapshot) -> bool:
    """An evaluation under autograd: no backward ran and forward passes
    recorded graphs that none used."""
    steps = snapshot.steps
    return (
        bool(steps)
        and not any(step.backward_calls > 0 for step in steps)
        and bool(eval_steps(snapshot)[0])
    )
