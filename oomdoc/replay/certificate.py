"""The whole-run certificate: what the prescription's own replay measured
it to hold for, and what it does not cover.

Batch-size finders are blamed for one thing above all: the batch they find
runs out of memory later, on a longer input, in the evaluation loop, after
a few steps of fragmentation, on one rank. A replay here runs the data's
longest batches first and reaches the script's own evaluation
(oomdoc.capture.whole_run); the certificate reads that replay's capture and
says, field by field, what was covered, and names each gap. The margin is
measured rather than fixed: the allocator's overhead at the peak (reserved
over allocated), its growth over the replay's optimizer steps carried as far
again, and the spread of the peak between replays of the same configuration.
Pure: it reads snapshots, runs nothing.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from oomdoc.model import Certificate, DataLoaderRecord, Prescription, Snapshot, Step
from oomdoc.replay.candidates import Candidate
from oomdoc.sizes import format_bytes

# What no replay measures (the CUDA context's own growth, a library's
# workspace chosen later): the least margin, as a share of the capacity.
MARGIN_FLOOR = 0.02
# The most a measured margin asks for before the search (a failing run whose
# allocator held far more than it allocated: that is the OOM's own story).
MARGIN_CEILING = 0.10
# Optimizer steps a certificate needs: the optimizer's state is allocated
# at the first, and the second runs with it alive.
CERTIFIED_OPTIMIZER_STEPS = 2
# On CUDA at the allocator's defaults, reserved memory growing more than
# this share of the capacity per step over the replay is not carried a few
# steps: on the H100 (benchmarks/scripts/hf_trainer_varlen.py, 16 GiB), a
# prescription certified with its drift (390 MB a step) carried over its 6
# replayed steps ran out of memory by hand at steps 28 and 29 of 32 on 2 of
# 10 seeds, with no more allocated than the replay had measured.
UNBOUNDED_DRIFT_SHARE = 0.0025
DRIFT_GAP = "nothing measured says where it stops"
# Steps of the failing run and the replay whose batches (a script's own, no
# DataLoader, or an iterable dataset's) must have had one shape (each run its
# own: their batch sizes differ) for the shapes to count as fixed.
FIXED_AS_SEEN_STEPS = 3


def training_steps(capture: Snapshot) -> list[Step]:
    """The replay's training steps (a backward or an optimizer step), in order."""
    return [step for step in capture.steps if step.optimizer_steps or step.backward_calls]


def evaluation_peak(capture: Snapshot) -> Optional[int]:
    """The most allocated during an evaluation pass, if one ran."""
    peaks = [
        step.phase_peaks["evaluation"] for step in capture.steps if "evaluation" in step.phase_peaks
    ]
    return max(peaks) if peaks else None


def allocator_drift(steps: list[Step], expandable: bool = False) -> tuple[int, int]:
    """(the allocator's overhead at the highest peak, its growth per step):
    reserved over allocated at the step that allocated the most, and how
    much the reserved high-water mark grew per step after the first (the
    first step's own growth is the run's start, the optimizer's state; of
    two steps only, the growth of reserved beyond allocated):
    batches of other sizes later in a run are served from what is cached,
    and what keeps growing is fragmentation."""
    measured = [step for step in steps if step.peak_reserved_bytes >= step.peak_allocated_bytes]
    if not measured or all(
        step.peak_reserved_bytes == step.peak_allocated_bytes for step in measured
    ):
        # No caching allocator (the simulated device): nothing is held
        # beyond what is allocated, so nothing fragments; the high-water
        # mark growing there is the batches' own (longer inputs later),
        # which the replays measure at the longest batch.
        return 0, 0
    highest = max(measured, key=lambda step: step.peak_allocated_bytes)
    overhead = highest.peak_reserved_bytes - highest.peak_allocated_bytes
    if expandable:
        # Expandable segments reserve what the allocations reach and serve
        # any size from what they hold: only reserved growth beyond the
        # allocated high-water mark (already in the peak) is lost.
        settled = measured[1:] if len(measured) > 2 else measured
        first, last = settled[0], settled[-1]
        high = max(step.peak_allocated_bytes for step in settled)
        beyond = (last.peak_reserved_bytes - first.peak_reserved_bytes) - (
            high - first.peak_allocated_bytes
        )
        return 0, max(0, beyond // max(1, len(settled) - 1))
    if len(measured) == 2:
        # Two steps: the second's growth is mostly what the first step made
        # (the optimizer's state, gradients alive), which its peak already
        # holds; only the reserved bytes' growth beyond it is drift.
        first, second = measured
        grew = second.peak_reserved_bytes - first.peak_reserved_bytes
        return overhead, max(0, grew - (second.peak_allocated_bytes - first.peak_allocated_bytes))
    settled = measured[1:] if len(measured) > 2 else measured
    reserved = [step.peak_reserved_bytes for step in settled]
    drift = 0
    if len(reserved) > 1:
        drift = max(0, (reserved[-1] - reserved[0]) // (len(reserved) - 1))
    return overhead, drift


def measured_margin_fraction(failing: Snapshot) -> float:
    """The margin the search leaves free when `--margin` is not given
    (`auto`): the failing run's allocator overhead at its highest step and
    its growth per step carried over as many steps again, as a share of the
    capacity, between MARGIN_FLOOR and MARGIN_CEILING. A run that failed
    before closing a step gives its overhead at the OOM."""
    capacity = failing.capacity_bytes
    if not capacity:
        return MARGIN_FLOOR
    steps = training_steps(failing)
    overhead, drift = allocator_drift([step for step in steps if step.optimizer_steps] or steps)
    if not steps and failing.oom is not None:
        overhead = max(0, failing.oom.reserved_bytes - failing.oom.allocated_bytes)
    measured = (overhead + drift * len(steps)) / capacity
    return min(MARGIN_CEILING, max(MARGIN_FLOOR, measured))


def _fixed_as_seen(runs: Iterable[Snapshot]) -> Optional[tuple[list[list[int]], int]]:
    """(the last run's shapes, how many steps showed them) when every
    training step of each run passed its model tensors of one shape, and at
    least FIXED_AS_SEEN_STEPS steps did. Runs are not compared with each
    other: at another batch size, the batch's dimension (first, or second in
    a sequence-first loop) differs."""
    seen = 0
    shapes: Optional[list[list[int]]] = None
    for run in runs:
        own = {
            tuple(tuple(shape) for shape in step.input_shapes)
            for step in run.steps
            if step.input_shapes
        }
        if len(own) > 1:
            return None
        if own:
            shapes = [list(shape) for shape in next(iter(own))]
            seen += sum(1 for step in run.steps if step.input_shapes)
    if shapes is None or seen < FIXED_AS_SEEN_STEPS:
        return None
    return shapes, seen


def _shapes(
    certificate: Certificate, training: Optional[DataLoaderRecord], runs: list[Snapshot]
) -> None:
    if training is None:
        if _as_seen(certificate, runs):
            return  # no DataLoader (nanoGPT's get_batch), every batch one shape
        certificate.shapes = "as_they_came"
        certificate.gaps.append(
            "the training batches do not come from a DataLoader over a map-style dataset "
            f"and not every step seen (at least {FIXED_AS_SEEN_STEPS}) passed the model "
            "tensors of one shape: the replay ran them as they came, not the longest first"
        )
        return
    certificate.samples, certificate.samples_read = training.samples, training.samples_read
    certificate.median_input_elements = training.median_elements
    if training.longest_first and training.first_batch is not None:
        certificate.shapes = "longest_first"
        certificate.longest_input_elements = training.first_batch.longest_elements
        certificate.longest_input_sample = training.first_batch.longest_sample
        if not training.complete:
            certificate.gaps.append(
                f"only {training.samples_read} of {training.samples} samples' sizes were read "
                "in the time allowed: a longer one may come later"
            )
    elif training.fixed_elements is not None:
        certificate.shapes = "fixed"
        certificate.longest_input_elements = training.fixed_elements
        if not training.complete:
            certificate.gaps.append(
                f"every sample read had {training.fixed_elements} elements, but only "
                f"{training.samples_read} of {training.samples} were read"
            )
    elif not _as_seen(certificate, runs):  # an iterable dataset of one shape is covered
        certificate.shapes = "as_they_came"
        certificate.gaps.append(
            f"the training batches came as the data gave them: {training.not_ordered or 'not ordered'}"
        )


def _as_seen(certificate: Certificate, runs: list[Snapshot]) -> bool:
    """Certify the shapes as seen (`fixed_as_seen`) when every step's batch
    had one shape (_fixed_as_seen); whether it did."""
    fixed = _fixed_as_seen(runs)
    if fixed is None:
        return False
    shapes, steps = fixed
    certificate.shapes = "fixed_as_seen"
    certificate.input_shapes, certificate.shape_steps = shapes, steps
    certificate.longest_input_elements = math.prod(shapes[0][1:]) if shapes[0] else 1
    return True


def _evaluation(
    certificate: Certificate, capture: Snapshot, failing: Snapshot, loaders: list[DataLoaderRecord]
) -> None:
    evaluating = [loader for loader in loaders if loader.role == "evaluation"]
    certificate.evaluation_peak_bytes = evaluation_peak(capture)
    if evaluating:
        certificate.evaluation_batch_size = max(
            (loader.batch_size for loader in evaluating if loader.batch_size), default=None
        )
        for loader in evaluating:
            if not loader.longest_first and loader.fixed_elements is None:
                certificate.gaps.append(
                    f"the evaluation batches came as the data gave them: "
                    f"{loader.not_ordered or 'not ordered'}"
                )
    failing_evaluates = any(step.evaluation_calls for step in failing.steps)
    if certificate.evaluation_peak_bytes is None and failing_evaluates:
        certificate.gaps.append("the run evaluates, but the replay did not reach its evaluation")
    never = [loader for loader in loaders if not loader.iterations and loader.role is None]
    if certificate.evaluation_peak_bytes is None and never:
        names = ", ".join(f"{loader.dataset} (batch {loader.batch_size})" for loader in never)
        certificate.gaps.append(
            f"DataLoaders the replay never iterated: {names}; an evaluation that runs later "
            "than one shortened epoch (every N steps) is not covered"
        )


def certificate_for(
    capture: Optional[Snapshot],
    failing: Snapshot,
    capacity_bytes: int,
    same_configuration_peaks: Iterable[int] = (),
    part_of_the_run: bool = True,
) -> Optional[Certificate]:
    """The certificate of the configuration whose replay wrote `capture`
    (None without one); `same_configuration_peaks`: the peaks of every
    replay of that same configuration, whose spread the margin covers;
    `part_of_the_run`: the capture is a replay's few steps (False: a whole
    run, `oomdoc check --whole-run`, whose drift is carried, not a gap)."""
    if capture is None or not capture.steps:
        return None
    certificate = Certificate()
    loaders = capture.data_loaders
    training = next((loader for loader in loaders if loader.role == "training"), None)
    _shapes(certificate, training, [failing, capture])
    certificate.trained_after_evaluation = bool(training and training.trained_after_evaluation)
    _evaluation(certificate, capture, failing, loaders)
    if (
        certificate.shapes == "fixed_as_seen"
        and training is None
        and certificate.evaluation_peak_bytes is None
    ):
        # Without DataLoaders, no unused one tells of an evaluation to come.
        certificate.gaps.append(
            "the batches come without a DataLoader and the replay reached no evaluation: "
            "one later in the run (after an epoch, every N steps) is not covered"
        )
    steps = training_steps(capture)
    certificate.training_peak_bytes = max(
        (step.peak_allocated_bytes for step in steps), default=None
    )
    if failing.optimizers:
        certificate.optimizer_steps = sum(step.optimizer_steps for step in steps)
        if certificate.optimizer_steps < CERTIFIED_OPTIMIZER_STEPS:
            certificate.gaps.append(
                f"{certificate.optimizer_steps} optimizer step(s) measured: the state's "
                "second step was not seen"
            )
    certificate.ranks = max(1, len(capture.ranks) or int(capture.world_size or 1))
    # Under expandable segments what they hold unallocated serves a request
    # of any size (they grow and shrink in pages): no overhead, and only
    # reserved growth beyond the allocations' is drift.
    expandable = capture.allocator is not None and bool(capture.allocator.expandable_segments)
    overhead, drift = allocator_drift(
        [step for step in steps if step.optimizer_steps] or steps, expandable
    )
    on_cuda = capture.device.on_cuda or failing.device.on_cuda
    if (
        part_of_the_run
        and on_cuda
        and not expandable
        and drift > UNBOUNDED_DRIFT_SHARE * capacity_bytes
    ):
        certificate.gaps.append(
            f"the allocator's reserved memory grew {format_bytes(drift)} a step over the "
            f"replay's {len(steps)} steps (fragmentation at its defaults): {DRIFT_GAP}"
        )
    peaks = [peak for peak in same_configuration_peaks if peak]
    spread = max(peaks) - min(peaks) if len(peaks) > 1 else 0
    certificate.allocator_overhead_bytes, certificate.drift_bytes_per_step = overhead, drift
    certificate.spread_bytes = spread
    measured_margin = overhead + drift * max(1, len(steps)) + spread
    certificate.margin_bytes = max(measured_margin, int(MARGIN_FLOOR * capacity_bytes))
    peak = max(
        [value for value in (capture.peak.allocated_bytes if capture.peak else None,) if value]
        or [0]
    )
    if peak + certificate.margin_bytes > capacity_bytes:
        certificate.gaps.append(
            f"its peak {format_bytes(peak)} and the margin {format_bytes(certificate.margin_bytes)} "
            f"are above the capacity {format_bytes(capacity_bytes)}"
        )
    if capture.outcome != "ok":
        certificate.gaps.append(f"its replay did not end well ({capture.outcome})")
    certificate.certified = not certificate.gaps
    return certificate


def certify_choice(
    chosen: Prescription, weighed: list[Candidate], failing: Snapshot, capacity_bytes: int
) -> Optional[Certificate]:
    """The certificate of the prescription: from the replay that measured it
    as prescribed (else the one at its batch), the spread over every replay
    of that same configuration."""
    same = [
        candidate
        for candidate in weighed
        if candidate.capture is not None
        and list(candidate.fixes) == list(chosen.fixes)
        and candidate.batch_size == chosen.batch_size
        and candidate.accumulation_steps == max(1, chosen.accumulation_steps)
    ]
    if not same:
        return None
    source = ([candidate for candidate in same if candidate.exact] or same)[-1]
    return certificate_for(
        source.capture,
        failing,
        capacity_bytes,
        [candidate.peak_allocated_bytes for candidate in same],
    )
