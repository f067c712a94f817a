"""Step times a decision can rest on: the median of a replay's timed steps
and how far apart they were (its noise), and ratios with their noise.

A replay times only a few steps (the first is left out: warm-up, lazy
optimizer state), on a device other replays or the user's own processes may
share, so two replays of one configuration can differ by more than two
configurations do. Every ratio oomdoc prints carries the noise of the two
timings behind it, and a ratio that cannot be (a fix that only adds work
running faster than the same step without it) is flagged and not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from oomdoc.model import Step

# The noise assumed of a timing whose spread was not seen (one timed step).
UNSEEN_NOISE = 0.05
# Above this noise, a timing that decides the prescription against a close
# rival is taken again (one more replay of the same configuration).
RETIME_NOISE = 0.10


@dataclass(frozen=True)
class StepTiming:
    """The median of the timed steps and their relative spread."""

    step_s: float
    # The timed steps' median absolute deviation over their median: 0.1
    # means they typically lay within +-10% of it; one slow step (an epoch's
    # end, a checkpoint) does not make it large. None with one timed step.
    noise: Optional[float]
    steps: int

    @property
    def assumed_noise(self) -> float:
        return self.noise if self.noise is not None else UNSEEN_NOISE


def timed_steps(steps: Iterable[Step]) -> list[Step]:
    """The steps whose durations make a run's step time: all that have one,
    less the first step (warm-up, lazy optimizer state) when later ones exist,
    less the steps run sharing the device when others had it alone (a replay
    sharing it runs its first steady step so too: replayer.SHARED_STEPS),
    less the steps begun after the replay's steps were done (batches fetched
    ahead, the longest batch again after the evaluation: Step.after_timed_steps),
    less a step that also ran an evaluation loop (a replay reaches the
    script's evaluation after its steps) when others did not, and less the
    steps on input shapes met for the first time (Step.new_shapes) when
    others were on shapes met before: a run pays that warm-up once a shape,
    and a replay that orders its batches longest first meets a new length
    almost every step (on an H100, cuDNN attention in bf16 made a GPT-2
    step at a new length take 0.6 to 3.6 s, against 0.35 to 0.43 s at one
    met before, and the autocast prescription flip from run to run)."""
    timed = [step for step in steps if step.duration_s is not None]
    within = [step for step in timed if not step.after_timed_steps]
    if within and len(within) < len(timed):
        timed = within
    alone = [step for step in timed if not step.device_shared]
    if alone and len(alone) < len(timed):
        timed = alone
    training = [step for step in timed if not (step.evaluation_calls and step.forward_calls)]
    if training and len(training) < len(timed):
        timed = training
    settled = [step for step in timed if not step.new_shapes]
    if settled and len(settled) < len(timed):
        return settled
    if len(timed) > 1:
        return [step for step in timed if step.index > 0] or timed
    return timed


def step_timing(steps: Iterable[Step]) -> Optional[StepTiming]:
    """The timing of a run's timed steps, None when none was timed."""
    durations = sorted(
        float(step.duration_s) for step in timed_steps(steps) if step.duration_s is not None
    )
    if not durations:
        return None
    middle = len(durations) // 2
    median = (
        durations[middle] if len(durations) % 2 else (durations[middle - 1] + durations[middle]) / 2
    )
    noise = None
    if len(durations) > 1 and median > 0:
        deviations = sorted(abs(duration - median) for duration in durations)
        middle = len(deviations) // 2
        spread = (
            deviations[middle]
            if len(deviations) % 2
            else (deviations[middle - 1] + deviations[middle]) / 2
        )
        noise = round(spread / median, 4)
    return StepTiming(median, noise, len(durations))


# New shapes whose steps took this many times those on shapes met before
# are worth telling the user about (shape_warmup): their real run pays it too.
WARMUP_RATIO = 3.0


def shape_warmup(steps: Iterable[Step]) -> Optional[tuple[float, float]]:
    """(median seconds of the training steps on shapes met for the first
    time, median of those on shapes met before), leaving out the first step,
    the steps timed_steps leaves out for other reasons, and steps timed while
    other replays used the device (an untimed check's); None without both
    kinds."""
    steps = list(steps)
    training = [
        step
        for step in steps
        if step.index > 0
        and step.duration_s is not None
        and not step.after_timed_steps
        and not step.device_shared
        and not (step.evaluation_calls and step.forward_calls)
    ]
    new = sorted(float(step.duration_s or 0) for step in training if step.new_shapes)
    met = sorted(float(step.duration_s or 0) for step in training if not step.new_shapes)
    if not new or not met:
        return None
    return new[len(new) // 2], met[len(met) // 2]


def ratio_noise(*noises: Optional[float]) -> float:
    """The relative noise of a ratio (or product) of timings: their relative
    noises added in quadrature, each unseen one assumed UNSEEN_NOISE."""
    return round(
        math.sqrt(sum((UNSEEN_NOISE if noise is None else noise) ** 2 for noise in noises)), 4
    )


def cannot_be_faster(ratio: float, noise: float) -> bool:
    """A step-time ratio below 1 by more than its noise, for a change that
    only adds work: the timing, not the change, made it faster."""
    return ratio < 1.0 - max(noise, UNSEEN_NOISE)


def pooled(
    first_s: float, first_noise: Optional[float], second_s: float, second_noise: Optional[float]
) -> tuple[float, float]:
    """Two timings of one configuration as one: their mean, and a noise that
    is at least how far they disagree and at most the better one's."""
    mean = (first_s + second_s) / 2
    between = abs(first_s - second_s) / 2 / mean if mean else 0.0
    own = min(
        UNSEEN_NOISE if first_noise is None else first_noise,
        UNSEEN_NOISE if second_noise is None else second_noise,
    )
    return mean, round(max(between, own / math.sqrt(2)), 4)
