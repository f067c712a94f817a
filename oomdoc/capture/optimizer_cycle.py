"""Which optimizer step ends a training iteration, when several optimizers
step in turn (a GAN's discriminator and generator, pytorch/examples'
DCGAN): one iteration is one step of each, not a step per optimizer.

A step closes after an optimizer step (at the next training call). With one
optimizer every step of it ends an iteration. With several, the order they
step in is learned from the first iteration: once an optimizer steps a
second time, the optimizers that stepped before it are one iteration, and
from then on only the last of them ends a step. The first iteration's steps,
closed before that was known, are merged into one (merge_steps). Before,
DCGAN's discriminator and generator updates were two steps: the batch
search's model read the discriminator's step as the whole iteration, and
the discriminator's loss, alive across the "step" boundary, read as a leak.
An optimizer not in the learned order (a new phase of training with a new
optimizer, one that steps only now and then) starts the learning again,
without merging. A step an optimizer ends stays ended whatever steps after
it in the same iteration.
"""

from __future__ import annotations

from typing import Any

# Counters a merged step sums; peaks it takes the largest of.
SUMMED = (
    "forward_calls",
    "evaluation_calls",
    "forward_calls_with_grad",
    "eval_mode_forward_calls_with_grad",
    "backward_calls",
    "optimizer_steps",
)


class OptimizerCycle:
    """The order the script's optimizers step in, learned as they step."""

    def __init__(self) -> None:
        self.order: list[int] | None = None  # learned: ids, in stepping order
        self._seen: list[int] = []  # stepped since the learning began
        self._first_step = 0  # the step index the learning began in
        # Learning again (a new optimizer mid-run): the steps closed meanwhile
        # are not merged, since the iteration they began in was another's.
        self._again = False

    def before_step(self, optimizer: object, step_index: int) -> int | None:
        """Called before each optimizer step (in step `step_index`). Returns
        the index of the first step of the first iteration when this step
        shows that several optimizers make one iteration: the steps closed
        from there on are that iteration's, to merge. Else None."""
        key = id(optimizer)
        if self.order is not None:
            if key in self.order:
                return None
            self.order, self._seen, self._again = None, [], True  # a new optimizer: learn again
        if key in self._seen:
            self.order, self._seen = self._seen, []
            return self._first_step if len(self.order) > 1 and not self._again else None
        if not self._seen:
            self._first_step = step_index
        self._seen.append(key)
        return None

    def ends_iteration(self, optimizer: object) -> bool:
        """Whether this optimizer's step (just done) ends the iteration."""
        return self.order is None or len(self.order) == 1 or id(optimizer) == self.order[-1]

    @property
    def learning(self) -> bool:
        """Several optimizers have stepped and none twice: where an iteration
        ends is not known yet (a replay's step limit waits for it)."""
        return self.order is None and len(self._seen) > 1


def merge_steps(steps: list[dict]) -> dict:
    """One step record of `steps` (closed one after another): the first's
    index and start, the last's end, the largest peaks, summed counts and
    durations, every retained graph once."""
    merged = dict(steps[0])
    last = steps[-1]
    merged["end_allocated_bytes"] = last.get("end_allocated_bytes")
    peak = max(steps, key=lambda step: step.get("peak_allocated_bytes", 0))
    merged["peak_allocated_bytes"] = peak.get("peak_allocated_bytes", 0)
    merged["peak_phase"] = peak.get("peak_phase")
    merged["peak_reserved_bytes"] = max(step.get("peak_reserved_bytes", 0) for step in steps)
    phase_peaks: dict = {}
    for step in steps:
        for phase, value in step.get("phase_peaks", {}).items():
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), value)
    merged["phase_peaks"] = phase_peaks
    for key in SUMMED:
        merged[key] = sum(step.get(key, 0) for step in steps)
    for timed in ("duration_s", "cpu_wait_s"):
        durations = [step.get(timed) for step in steps]
        if all(isinstance(value, (int, float)) for value in durations):
            merged[timed] = round(sum(durations), 6)  # type: ignore[arg-type]
        elif timed == "cpu_wait_s":
            merged.pop(timed, None)  # not the whole step's wait
    # A graph made inside the merged steps is the iteration's own, not retained.
    retained: list = []
    known = set()
    for step in steps:
        for entry in step.get("retained_graphs") or []:
            if entry.get("from_step", -1) >= merged.get("index", 0):
                continue
            if (entry.get("variable"), entry.get("file")) not in known:
                known.add((entry.get("variable"), entry.get("file")))
                retained.append(entry)
    merged["retained_graphs"] = retained
    if any("retained_activation_bytes" in step for step in steps):
        merged["retained_activation_bytes"] = last.get("retained_activation_bytes", 0)
    shapes = [shape for step in steps for shape in step.get("input_shapes", [])]
    if shapes:
        merged["input_shapes"] = shapes
    for flag in ("new_shapes", "device_shared", "after_timed_steps"):
        if any(step.get(flag) for step in steps):
            merged[flag] = True
    return merged


class IterationSteps:
    """The Tracker's side of it (a mixin): learn the order before each
    optimizer step, and merge the first iteration's steps once it is known."""

    steps: list[dict]
    step_index: int
    _current: dict[str, Any]
    _step_timer: Any
    optimizer_cycle: OptimizerCycle

    def _optimizer_about_to_step(self, optimizer: object) -> None:
        first = self.optimizer_cycle.before_step(optimizer, self.step_index)
        if first is None:
            return
        closed = [step for step in self.steps if step["index"] >= first]
        if len(closed) < 2 or len(closed) != self.step_index - first:
            return  # one step already, or some no longer kept: nothing to merge
        if self._step_timer is not None:
            self._step_timer.collect(block=True)  # their durations, before they are summed
        self.steps[len(self.steps) - len(closed) :] = [merge_steps(closed)]
        self.step_index = first + 1
        self._current["index"] = self.step_index
