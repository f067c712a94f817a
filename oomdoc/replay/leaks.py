"""Whether a replay that ran its steps without an OOM still leaks: such a
replay does not fit, it only delays the OOM. Every replay is judged here
(oomdoc.replay.replayer.measure): the single fixes, the combinations, the
batch searches' trials and the prescription's replays.

Two kinds of evidence, read only from the typed fields of the replay's
capture (its steps' end_allocated_bytes and retained_graphs), the same on
CUDA and on the simulated device:

- under a leak diagnosed on the failing run, end-of-step memory that still
  grows, judged against that leak's own growth per step (still_grows): a fix
  changes how much each step keeps (autocast halves it), not that it keeps
  it. The leak diagnosis's run-wide threshold (at least 256 KiB over the
  whole run) misses the growth of a replay's few steps (LEAK_REPLAY_STEPS).
- whatever the failing run showed, the leak rule (oomdoc.diagnosis.leak)
  firing on the replay's own capture: a variable that keeps an earlier
  step's autograd graph alive, or steady growth over its steps. A failing
  run that ran out of memory in its first steps is too short to show its
  leak; the replay of a fix that lets it run on shows it. Replays without a
  diagnosed leak run 2 steps (3 on CUDA with an optimizer): too few for
  growth, so there it is the retained graph that shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from oomdoc.diagnosis.leak import rule as leak_rule
from oomdoc.diagnosis.steps import complete_steps, steady_growth
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

# A step still grows like the leak when its end-of-step memory rose by at
# least this share of the failing run's growth per step. A fix scales what a
# step keeps, never to nothing: autocast halves float32 tensors, checkpointing
# keeps a block's input of its activations, both together about a sixth at
# most. What else moves a step's end (a buffer made once, a scalar) neither
# comes in most steps nor, on its own, reaches an eighth of a growth the
# diagnosis saw over the whole failing run.
GROWTH_SHARE = 1 / 8
# Step-to-step deltas needed to call growth steady: most of them must grow
# (a one-off jump is not a leak). The first step is left out (gradients and
# optimizer state appear there), so a replay needs this many steps plus two.
MIN_DELTAS = 2


@dataclass(frozen=True)
class StillLeaks:
    """What a replay that ran without an OOM showed of a leak."""

    text: str  # for the fix's detail
    # Its end-of-step growth per step, when that is what showed the leak.
    per_step_bytes: Optional[int] = None
    # How many steps after the failing run's OOM step it would run out of
    # memory at that growth (negative: before it).
    delays_oom_by_steps: Optional[int] = None


def leak_growth_per_step(failing: Snapshot) -> Optional[int]:
    """The failing run's end-of-step growth per step, when it grew steadily
    (the growth the leak diagnosis reports)."""
    growth = steady_growth(failing)
    return growth[2] if growth is not None else None


def still_grows(capture: Snapshot, leak_per_step: int) -> Optional[int]:
    """The replay's end-of-step growth per step when it still grows like a
    leak of `leak_per_step` per step: most of its step-to-step deltas after
    the first step grew by at least GROWTH_SHARE of it, few fell by as much,
    and over its steps it grew by at least that much per step. Else None."""
    if leak_per_step <= 0:
        return None
    measured = [
        (step.index, step.end_allocated_bytes)
        for step in complete_steps(capture)[1:]
        if step.end_allocated_bytes is not None and step.end_allocated_bytes >= 0
    ]
    if len(measured) < MIN_DELTAS + 1:
        return None
    floor = max(1, int(leak_per_step * GROWTH_SHARE))
    ends = [end for _index, end in measured]
    deltas = [later - earlier for earlier, later in zip(ends, ends[1:])]
    grew = sum(1 for delta in deltas if delta >= floor)
    fell = sum(1 for delta in deltas if delta <= -floor)
    # Counted by step index: a long run's capture omits steps in between.
    span = max(len(deltas), measured[-1][0] - measured[0][0])
    per_step = (ends[-1] - ends[0]) // span
    if 2 * grew <= len(deltas) or 4 * fell > len(deltas) or per_step < floor:
        return None
    return per_step


def still_leaks(
    capture: Snapshot, failing: Snapshot, leak_per_step: Optional[int]
) -> Optional[StillLeaks]:
    """Why a replay whose capture ran its steps without an OOM still leaks,
    or None when it does not. `leak_per_step`: the failing run's growth per
    step under a diagnosed leak (leak_growth_per_step), else None."""
    per_step = still_grows(capture, leak_per_step) if leak_per_step else None
    if per_step is not None:
        text = (
            f"memory still grows by {format_bytes(per_step)} per step "
            f"(the leak: {format_bytes(leak_per_step)} per step in the failing run)"
        )
    else:
        if leak_rule(capture) is None:
            return None
        holder = next((graph for step in capture.steps for graph in step.retained_graphs), None)
        growth = steady_growth(capture)
        if holder is not None:
            text = (
                f"it leaks: `{holder.variable}` in {holder.function}() ({holder.file}:{holder.line}) "
                f"keeps the autograd graph of step {holder.from_step} alive"
            )
        else:
            text = "it leaks"  # the leak rule fired on its growth
        if growth is not None:
            per_step = growth[2]
            text += f": memory grows by {format_bytes(per_step)} per step"
    delay = None
    if per_step:
        delay, reaches, oom_step = oom_delay(capture, failing, per_step)
        if delay is not None:
            text += (
                f": it would run out of memory near step {reaches}, "
                f"{delay:+d} steps from the failing run's step {oom_step}"
            )
    return StillLeaks(text, per_step, delay)


def oom_delay(
    capture: Snapshot, failing: Snapshot, per_step: int
) -> tuple[Optional[int], int, int]:
    """(steps after the failing run's OOM step, the step it would reach, that
    OOM step) for a replay growing `per_step` per step from its last
    step's peak to the capacity; (None, 0, 0) when unknown."""
    capacity = failing.capacity_bytes
    if per_step <= 0 or not capture.steps or not capacity:
        return None, 0, 0
    last = capture.steps[-1]
    reaches = last.index + max(0, capacity - last.peak_allocated_bytes) // per_step
    oom_step = (failing.oom.step if failing.oom else None) or 0
    return int(reaches - oom_step), int(reaches), oom_step
