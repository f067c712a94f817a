"""The whole-run certificate (oomdoc.replay.certificate): what a replay's
capture covers, each gap named, and a margin measured from the allocator."""

from __future__ import annotations

import pytest

from oomdoc.model import Snapshot
from oomdoc.replay.certificate import (
    MARGIN_CEILING,
    MARGIN_FLOOR,
    allocator_drift,
    certificate_for,
    measured_margin_fraction,
)
from oomdoc.reporters.tables import certificate_lines

MIB = 1 << 20
CAPACITY = 100 * MIB


def step(index: int, allocated: int, reserved: int | None = None, evaluation: int = 0) -> dict:
    phase_peaks = {"forward": allocated}
    if evaluation:
        phase_peaks["evaluation"] = evaluation
    return {
        "index": index,
        "peak_allocated_bytes": allocated,
        "peak_reserved_bytes": allocated if reserved is None else reserved,
        "forward_calls": 1,
        "backward_calls": 1,
        "optimizer_steps": 1,
        "evaluation_calls": 2 if evaluation else 0,
        "phase_peaks": phase_peaks,
    }


def loader(role: str, **fields) -> dict:
    record = {"loader": 0 if role == "training" else 1, "dataset": "Texts", "role": role}
    record.update(iterations=1, batches_taken=2, samples=100, samples_read=100)
    record.update(fields)
    return record


LONGEST = {
    "longest_first": True,
    "first_batch": {"samples": 8, "longest_sample": 42, "longest_elements": 512},
}


def capture(steps: list[dict], loaders: list[dict], peak: int | None = None) -> Snapshot:
    return Snapshot.from_dict(
        {
            "outcome": "ok",
            "device": {"kind": "simulated", "capacity_bytes": CAPACITY},
            "optimizers": ["AdamW"],
            "steps": steps,
            "data_loaders": loaders,
            "peak": {"allocated_bytes": peak or max(s["peak_allocated_bytes"] for s in steps)},
        }
    )


FAILING = Snapshot.from_dict(
    {"outcome": "oom", "optimizers": ["AdamW"], "device": {"capacity_bytes": CAPACITY}}
)


def test_a_replay_with_the_longest_batch_its_evaluation_and_two_steps_is_certified():
    replayed = capture(
        [step(0, 60 * MIB), step(1, 62 * MIB), step(2, 61 * MIB, evaluation=30 * MIB)],
        [loader("training", **LONGEST), loader("evaluation", batch_size=16, **LONGEST)],
    )
    certificate = certificate_for(replayed, FAILING, CAPACITY)
    assert certificate is not None and certificate.certified, certificate
    assert certificate.gaps == []
    assert (certificate.longest_input_elements, certificate.longest_input_sample) == (512, 42)
    assert certificate.shapes == "longest_first"
    assert (certificate.evaluation_batch_size, certificate.evaluation_peak_bytes) == (16, 30 * MIB)
    assert certificate.optimizer_steps == 3
    assert certificate.training_peak_bytes == 62 * MIB
    # Nothing measured beyond the allocated bytes: the floor.
    assert certificate.margin_bytes == int(MARGIN_FLOOR * CAPACITY)


def test_each_thing_not_covered_is_a_gap():
    replayed = capture(
        [step(0, 60 * MIB)],
        [
            loader(
                "training", longest_first=True, samples_read=40, first_batch=LONGEST["first_batch"]
            )
        ],
    )
    failing = Snapshot.from_dict(
        {
            "outcome": "oom",
            "optimizers": ["AdamW"],
            "steps": [step(0, 10 * MIB, evaluation=5 * MIB)],
        }
    )
    certificate = certificate_for(replayed, failing, CAPACITY)
    assert certificate is not None and not certificate.certified
    text = " | ".join(certificate.gaps)
    assert "only 40 of 100 samples" in text
    assert "did not reach its evaluation" in text
    assert "1 optimizer step(s)" in text


def test_batches_not_from_a_dataloader_are_a_gap():
    certificate = certificate_for(
        capture([step(0, 1 * MIB), step(1, 1 * MIB)], []), FAILING, CAPACITY
    )
    assert certificate is not None and certificate.shapes == "as_they_came"
    assert any("DataLoader" in gap for gap in certificate.gaps)


def shaped(index: int, shapes: list[list[int]]) -> dict:
    return {**step(index, 1 * MIB), "input_shapes": shapes}


def test_batches_of_one_shape_without_a_dataloader_are_certified_as_seen():
    # nanoGPT's get_batch: (x, y) of batch x block, the failing run at 12,
    # the replay at 6 (only the batch's dimension differs).
    failing = Snapshot.from_dict(
        {
            "outcome": "oom",
            "optimizers": ["AdamW"],
            "steps": [shaped(0, [[12, 64], [12, 64]])],
        }
    )
    steps = [shaped(i, [[6, 64], [6, 64]]) for i in range(3)]
    # Its evaluation at iteration 0, reached by the replay.
    steps[0]["evaluation_calls"], steps[0]["phase_peaks"]["evaluation"] = 2, MIB // 2
    replayed = capture(steps, [])
    without_evaluation = certificate_for(
        capture([shaped(i, [[6, 64], [6, 64]]) for i in range(3)], []), failing, CAPACITY
    )
    assert without_evaluation is not None and not without_evaluation.certified
    assert without_evaluation.shapes == "fixed_as_seen"
    assert "reached no evaluation" in without_evaluation.gaps[0]
    certificate = certificate_for(replayed, failing, CAPACITY)
    assert certificate is not None and certificate.certified, certificate.gaps
    assert certificate.shapes == "fixed_as_seen"
    assert (certificate.input_shapes, certificate.shape_steps) == ([[6, 64], [6, 64]], 4)
    assert certificate.longest_input_elements == 64
    lines = certificate_lines(certificate)
    assert "batches of one shape (6x64, 6x64) in all 4 steps seen (taken as" in " ".join(lines)


@pytest.mark.parametrize(
    "failing_shapes, replay_shapes",
    [
        ([[12, 64]], [[6, 64], [6, 64], [6, 32]]),  # the replay's changed
        ([], [[6, 64], [6, 64]]),  # too few steps seen
    ],
)
def test_batches_whose_shapes_change_or_were_seen_too_little_stay_a_gap(
    failing_shapes, replay_shapes
):
    failing = Snapshot.from_dict(
        {
            "outcome": "oom",
            "optimizers": ["AdamW"],
            "steps": [shaped(0, [shape]) for shape in failing_shapes],
        }
    )
    replayed = capture([shaped(i, [shape]) for i, shape in enumerate(replay_shapes)], [])
    certificate = certificate_for(replayed, failing, CAPACITY)
    assert certificate is not None and not certificate.certified
    assert certificate.shapes == "as_they_came"
    assert any("tensors of one shape" in gap for gap in certificate.gaps)


def test_the_margin_is_the_allocators_overhead_its_drift_and_the_spread_between_replays():
    # Reserved over allocated at the highest peak: 6 MiB; the reserved
    # high-water mark grows by 2 MiB a step after the first.
    replayed = capture(
        [step(0, 70 * MIB, 74 * MIB), step(1, 71 * MIB, 76 * MIB), step(2, 72 * MIB, 78 * MIB)],
        [loader("training", **LONGEST)],
    )
    certificate = certificate_for(replayed, FAILING, CAPACITY, [72 * MIB, 70 * MIB])
    assert certificate is not None
    assert certificate.allocator_overhead_bytes == 6 * MIB
    assert certificate.drift_bytes_per_step == 2 * MIB
    assert certificate.spread_bytes == 2 * MIB
    assert certificate.margin_bytes == 6 * MIB + 3 * 2 * MIB + 2 * MIB
    assert certificate.certified  # 72 + 14 MiB is below 100
    # Smaller batches later, served from the cache: reserved stays, no drift.
    cached = capture(
        [step(0, 72 * MIB, 78 * MIB), step(1, 60 * MIB, 78 * MIB), step(2, 50 * MIB, 78 * MIB)],
        [loader("training", **LONGEST)],
    )
    flat = certificate_for(cached, FAILING, CAPACITY)
    assert flat is not None and flat.drift_bytes_per_step == 0
    tight = certificate_for(replayed, FAILING, 80 * MIB, [72 * MIB, 70 * MIB])
    assert tight is not None and not tight.certified
    assert any("above the capacity" in gap for gap in tight.gaps)


def test_the_search_margin_is_measured_from_the_failing_run_within_bounds():
    flat = Snapshot.from_dict(
        {"device": {"capacity_bytes": CAPACITY}, "steps": [step(0, 50 * MIB), step(1, 50 * MIB)]}
    )
    assert measured_margin_fraction(flat) == MARGIN_FLOOR
    overhead = Snapshot.from_dict(
        {
            "device": {"capacity_bytes": CAPACITY},
            "steps": [step(0, 50 * MIB, 54 * MIB), step(1, 50 * MIB, 54 * MIB)],
        }
    )
    assert measured_margin_fraction(overhead) == 0.04
    fragmented = Snapshot.from_dict(
        {
            "device": {"capacity_bytes": CAPACITY},
            "outcome": "oom",
            "oom": {"allocated_bytes": 60 * MIB, "reserved_bytes": 95 * MIB},
        }
    )
    assert measured_margin_fraction(fragmented) == MARGIN_CEILING


def test_of_two_steps_only_the_reserved_growth_beyond_the_allocated_is_drift():
    # The second step holds the optimizer's state (10 MiB more allocated):
    # that is in its peak; the reserved bytes grew 8 MiB beyond it.
    steps = Snapshot.from_dict(
        {"steps": [step(0, 60 * MIB, 62 * MIB), step(1, 70 * MIB, 80 * MIB)]}
    ).steps
    assert allocator_drift(steps) == (10 * MIB, 8 * MIB)
    # The simulated device reserves what it allocates: no drift.
    steady = Snapshot.from_dict({"steps": [step(0, 60 * MIB), step(1, 70 * MIB)]}).steps
    assert allocator_drift(steady) == (0, 0)


def test_under_expandable_segments_reserved_growth_with_the_allocations_is_no_drift():
    # A later step (the evaluation's) allocates 6 MiB more and reserves it:
    # at the defaults that is drift; expandable segments lose none of it.
    steps = Snapshot.from_dict(
        {
            "steps": [
                step(0, 60 * MIB, 61 * MIB),
                step(1, 60 * MIB, 61 * MIB),
                step(2, 66 * MIB, 67 * MIB),
                step(3, 60 * MIB, 67 * MIB),
            ]
        }
    ).steps
    assert allocator_drift(steps)[1] == 3 * MIB
    assert allocator_drift(steps, expandable=True) == (0, 0)
    # Reserved growing beyond the allocations is drift with them too.
    steps[3].peak_reserved_bytes = 73 * MIB
    assert allocator_drift(steps, expandable=True) == (0, 3 * MIB)


def test_an_iterable_dataset_of_one_shape_is_certified_as_seen():
    # Packed token streams (an IterableDataset): nothing to order, but
    # every batch the replay took had one shape; its evaluation was reached.
    steps = [shaped(i, [[8, 128]]) for i in range(3)]
    steps[2]["evaluation_calls"], steps[2]["phase_peaks"]["evaluation"] = 2, MIB // 2
    streamed = loader("training", not_ordered="an iterable dataset")
    certificate = certificate_for(capture(steps, [streamed]), FAILING, CAPACITY)
    assert certificate is not None and certificate.certified, certificate.gaps
    assert certificate.shapes == "fixed_as_seen" and certificate.input_shapes == [[8, 128]]
    varying = [shaped(i, [[8, 64 * (i + 1)]]) for i in range(3)]
    certificate = certificate_for(capture(varying, [streamed]), FAILING, CAPACITY)
    assert certificate is not None and certificate.shapes == "as_they_came"
    assert any("an iterable dataset" in gap for gap in certificate.gaps)
