"""When the CUDA capture records a Python stack for each allocation, and
keeps the module scopes.

The stacks give the OOM's allocation sites their file and line (and PyTorch's
memory snapshot for memory_viz its frames). Gathering one costs the host a few
microseconds per allocation: on a step of thousands of small allocations
(bf16 autocast's casts, checkpointing's recompute) that was 13 to 17% of a
GPU step (H200, HF `Trainer` GPT-2 and a Lightning encoder). A steady
training step allocates what the steps before it allocated, from the same
lines, so its stacks add nothing those steps did not record: they are
recorded until the run is steady, and again as soon as it is not. The module
scopes (oomdoc.capture.modules: the path of the running module at every
module call, the storages of module outputs and saved tensors) follow the
same decision (the tracker pauses them when the backend says so): on the HF
`Trainer` they are 583 module calls per step, about 7 ms of host time. The
step model (training calls, backward, optimizer steps, evaluation, peaks per
phase) does not depend on them.

A block allocated while the stacks were on keeps its frames after they are
turned off (the allocator stores them with the block), so parameters,
optimizer state and anything a leak keeps hold their sites. A block
allocated while they were off has neither frames nor module: no location,
and its phase reads as backward's (oomdoc.capture.modules.phase_from_frames:
no Python frame), so it counts as activations unless it is a parameter,
gradient or optimizer state, which are found by identity. Turning the stacks
off turns off the allocator's whole history, its event trace too (a trace
without stacks still costs an entry per allocation and per free; torch
clears the trace when the history goes off): PyTorch's memory snapshot of
an OOM in such a step, saved for memory_viz, has the blocks and their
frames but only the events since the stacks came back on (none, if they
did not).

Recorded:
- every step until `STEADY_STEPS` training steps in a row were steady: a
  peak within `TOLERANCE` of the highest so far, and not the last of
  `GROWTH_STEPS` steps in a row that left more allocated at their end
  (variable-length batches, a leak, a growing cache keep the stacks on);
- every step once the run's highest peak, allocated or reserved, is within
  `NEAR_CAPACITY` of the device's capacity (an OOM may come at any step);
- every evaluation phase (its allocations are not the training step's).
"""

from __future__ import annotations

import os
from typing import Any, Protocol


class DetailPolicy(Protocol):
    """When the CUDA capture records detail (stacks where it records any,
    module scopes): asked at each step's close and phase change."""

    def step_closed(self, step: dict[str, Any], recorded: bool) -> bool: ...

    def phase_started(self, phase: str) -> bool: ...

    def stats(self) -> dict[str, int]: ...


class _TrainingAndEvaluation:
    """What both policies share: every evaluation phase in detail (its
    allocations are not the training step's), training as the policy decides
    at each step's close (`_training_wants`), and a count of the steps closed
    without detail for capture_stats (under `STEPS_WITHOUT`)."""

    STEPS_WITHOUT = ""

    def __init__(self) -> None:
        self.training_wants = True
        self.in_evaluation = False
        self.steps_without = 0

    @property
    def wanted(self) -> bool:
        return self.training_wants or self.in_evaluation

    def _training_wants(self, step: dict[str, Any]) -> bool:
        raise NotImplementedError

    def step_closed(self, step: dict[str, Any], recorded: bool) -> bool:
        """Notes a closed step (`recorded`: whether it ran in detail);
        returns whether the next one does."""
        if not recorded:
            self.steps_without += 1
        self.training_wants = self._training_wants(step)
        return self.wanted

    def phase_started(self, phase: str) -> bool:
        """Returns whether `phase` runs in detail."""
        self.in_evaluation = phase == "evaluation"
        return self.wanted

    def stats(self) -> dict[str, int]:
        return {self.STEPS_WITHOUT: self.steps_without}


class StackRecording(_TrainingAndEvaluation):
    """Decides, at each step's close and phase change, whether the next
    allocations record their stacks (and the module scopes run). Holds no
    device state: the backend applies the decision."""

    STEADY_STEPS = 2
    GROWTH_STEPS = 2
    TOLERANCE = 0.01
    NEAR_CAPACITY = 0.85
    # Steps closed without stacks: capture_stats, so a snapshot says
    # whether its allocation sites can miss the locations of a late step.
    STEPS_WITHOUT = "steps_without_stacks"

    def __init__(self, capacity_bytes: int):
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.highest_peak = 0
        self.highest_reserved = 0
        self.last_end: int | None = None
        self.steady_steps = 0
        self.growth_streak = 0

    def _training_wants(self, step: dict[str, Any]) -> bool:
        peak = int(step.get("peak_allocated_bytes") or 0)
        end = int(step.get("end_allocated_bytes") or 0)
        trained = bool(step.get("optimizer_steps") or step.get("backward_calls"))
        # Memory that grew at the end of two steps in a row is a leak or a
        # cache filling up; one step's growth is noise (a Lightning step's
        # end moves by hundreds of KiB either way over 3.5 GB).
        grew = self.last_end is not None and end > self.last_end
        self.growth_streak = self.growth_streak + 1 if grew else 0
        steady = (
            trained
            and self.highest_peak > 0
            and abs(peak - self.highest_peak) <= self.TOLERANCE * self.highest_peak
            and self.growth_streak < self.GROWTH_STEPS
        )
        self.highest_peak = max(self.highest_peak, peak)
        # Reserved too: an OOM from fragmentation comes with the allocated
        # peak well below the cap and the reserved memory at it.
        reserved = int(step.get("peak_reserved_bytes") or 0)
        self.highest_reserved = max(self.highest_reserved, reserved)
        self.last_end = end
        self.steady_steps = self.steady_steps + 1 if steady else 0
        fullest = max(self.highest_peak, self.highest_reserved)
        near = fullest >= self.NEAR_CAPACITY * self.capacity_bytes
        return near or self.steady_steps < self.STEADY_STEPS


class FirstStepDetail(_TrainingAndEvaluation):
    """A replay's detail (it records no allocation history: only the module
    scopes): until its first training step has closed, and in evaluation.

    A replay needs its module scopes only for an OOM in that first step
    (the module the forward had reached estimates the largest batch:
    oomdoc.replay.limit_estimate.forward_progress). Its timed steps come after it;
    without the scopes (a Python call per module call and per saved tensor)
    they cost the same little whatever the configuration, where with them a
    configuration that makes more module calls and saves more tensors
    (checkpointing's recompute, autocast's casts) paid more, and the
    ranking of configurations by step time with it (an HF `Trainer` replay
    with the scopes on: 99.5 samples/s, the same run plain 116.3, H200)."""

    STEPS_WITHOUT = "steps_without_module_scopes"

    def _training_wants(self, step: dict[str, Any]) -> bool:
        trained = step.get("optimizer_steps") or step.get("backward_calls")
        return self.training_wants and not trained


def detail_policy(recording_stacks: bool, capacity_bytes: int) -> DetailPolicy | None:
    """The CUDA capture's policy: StackRecording where the allocator records
    stacks; FirstStepDetail in a replay (OOMDOC_MODULE_SCOPES=first-step,
    oomdoc.replay.replayer.REPLAY_ENV); else none (detail all along)."""
    if recording_stacks:
        return StackRecording(capacity_bytes)
    if os.environ.get("OOMDOC_MODULE_SCOPES") == "first-step":
        return FirstStepDetail()
    return None
