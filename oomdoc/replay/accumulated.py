"""What a replay of a prescription with gradient accumulation measured.

oomdoc's accumulation holds back all but every K-th optimizer step
(oomdoc.fixes.smaller_batch.accumulate), so in a replay of a script with an
optimizer one step is K micro-batches, and after the first update the later
micro-batches' forward runs with the gradients alive: its peak is the
prescription's. A script that updates its parameters by hand (no optimizer:
pytorch/examples' word language model) has nothing to hold back: its replay
at the micro-batch updates after each one, each of its steps (a backward) is
one micro-batch, and the gradients the user's accumulation keeps alive
through the later micro-batches were not. That replay still bounds the
prescription: its own peak plus the gradients' peak.
"""

from __future__ import annotations

from typing import Optional

from oomdoc.model import Prescription, Snapshot
from oomdoc.replay.candidates import Candidate
from oomdoc.replay.replayer import Replay
from oomdoc.sizes import format_bytes


def updates_by_hand(capture: Optional[Snapshot]) -> bool:
    """Whether a replay's steps were backwards: no optimizer stepped, so
    oomdoc's accumulation held nothing back."""
    return capture is not None and capture.step_unit == "backward"


def held_gradients_peak(replay: Replay) -> Optional[int]:
    """For a script that updates by hand, the most its accumulation can
    peak at the micro-batch replayed: the replay's peak with the gradients
    kept alive on top (counted twice where they already were); None for
    any other script."""
    capture = replay.capture
    if not updates_by_hand(capture) or replay.peak_allocated_bytes is None:
        return None
    assert capture is not None
    peaks = capture.category_peaks
    if peaks is None:
        return None
    return replay.peak_allocated_bytes + peaks.gradients


def measured_as_prescribed(
    bound: Candidate, prescription: Prescription, replay: Replay
) -> Candidate:
    """The candidate `bound` as its prescription's replay measured it: the
    micro-batch with its accumulation, the peak with the accumulation
    running, and the step time per micro-batch (an optimizer step of the
    replay runs `accumulation_steps` of them; a backward of a script that
    updates by hand, one: counted as K, a word language model's autocast at
    64 x 2 came out at 3700 samples/s where its steps ran 1850)."""
    assert replay.peak_allocated_bytes is not None
    steps = max(1, prescription.accumulation_steps)
    per_step = 1 if updates_by_hand(replay.capture) else steps
    return Candidate(
        list(bound.fixes),
        int(prescription.batch_size or bound.batch_size),
        claimed_peak(bound, prescription, replay),
        replay.step_s / per_step if replay.step_s else None,
        replay.label,
        notes=list(bound.notes),
        step_noise=replay.step_noise,
        exact=True,
        accumulation_steps=steps,
        accumulation_record=prescription.accumulation_replay,
        capture=replay.capture,
        trained_per_step=bound.trained_per_step,
        accumulation_label=(
            f"batch {bound.batch_size} without accumulation in {bound.label!r}: peak "
            f"{format_bytes(bound.peak_allocated_bytes)}"
            + (f", {bound.samples_per_second:.1f} samples/s" if bound.samples_per_second else "")
        ),
    )


def claimed_peak(bound: Candidate, prescription: Prescription, replay: Replay) -> int:
    """The peak a replay with accumulation measured, unless it ended before
    an optimizer step and two more micro-batches (a script that updates by
    hand, or one that stopped too soon): then the later micro-batches'
    forward with the gradients alive was not seen. For a script that updates
    by hand the gradients are added (held_gradients_peak); and a larger
    batch the configuration ran, `bound`, bounds what is claimed, unless it
    never ran (an untimed candidate's peak is no fix's, a placeholder)."""
    assert replay.peak_allocated_bytes is not None
    covered = (prescription.accumulation_replay or {}).get("accumulation_covered")
    if prescription.accumulation_steps > 1 and covered is False:
        held = held_gradients_peak(replay)
        if held is not None and bound.untimed:
            return held
        return max(held or replay.peak_allocated_bytes, bound.peak_allocated_bytes)
    return replay.peak_allocated_bytes


def uncovered_note(capture: Optional[Snapshot]) -> str:
    """Why a replay with accumulation did not show the later micro-batches'
    peak, for the prescription's detail."""
    if updates_by_hand(capture):
        return (
            "the script updates by hand, so its replay updated after each micro-batch: "
            "the peak claimed adds the gradients, which the accumulation keeps alive"
        )
    return (
        "the replay ended before an optimizer step and two more micro-batches: the peak may be low"
    )
