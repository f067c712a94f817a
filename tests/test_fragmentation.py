"""A prescription refused for the CUDA allocator's drift is replayed once with
expandable segments (oomdoc.replay.fragmentation), and adopts them only when
that replay is certified."""

from __future__ import annotations

import pytest
from test_certificate import LONGEST, MIB, loader, step

from oomdoc.analysis import analyse
from oomdoc.model import Allocator, Prescription, Snapshot
from oomdoc.replay.certificate import certificate_for
from oomdoc.replay.fragmentation import certify_with_expandable_segments, refused_for_drift
from oomdoc.replay.replayer import Replay, ReplaysInterrupted
from oomdoc.reporters.tables import replay_summary_lines

CAPACITY = 100 * MIB


def cuda_capture(steps: list[dict]) -> Snapshot:
    return Snapshot.from_dict(
        {
            "outcome": "ok",
            "device": {"kind": "cuda", "capacity_bytes": CAPACITY},
            "optimizers": ["AdamW"],
            "steps": steps,
            "data_loaders": [loader("training", **LONGEST)],
            "peak": {"allocated_bytes": max(s["peak_allocated_bytes"] for s in steps)},
        }
    )


FAILING = Snapshot.from_dict(
    {
        "outcome": "oom",
        "optimizers": ["AdamW"],
        "device": {"kind": "cuda", "capacity_bytes": CAPACITY},
        "allocator": {"expandable_segments": False},
    }
)
# Reserved grows 8 MiB a step over 3 steps: 80 MiB + 2 MiB + 3 x 8 MiB is above 100.
DRIFTING = cuda_capture(
    [
        step(0, 78 * MIB, 80 * MIB),
        step(1, 80 * MIB, 82 * MIB),
        step(2, 79 * MIB, 90 * MIB),
        step(3, 79 * MIB, 98 * MIB),
    ]
)
# With expandable segments: reserved follows allocated.
STEADY = cuda_capture(
    [
        step(0, 78 * MIB, 79 * MIB),
        step(1, 80 * MIB, 81 * MIB),
        step(2, 79 * MIB, 81 * MIB),
        step(3, 79 * MIB, 81 * MIB),
    ]
)


def refused() -> Prescription:
    prescription = Prescription(
        fixes=[], batch_size=8, accumulation_steps=4, peak_allocated_bytes=80 * MIB, fits=True
    )
    prescription.certificate = certificate_for(DRIFTING, FAILING, CAPACITY)
    assert prescription.certificate is not None and not prescription.certificate.certified
    return prescription


def test_a_drift_refusal_is_replayed_with_expandable_segments_and_certified_with_them():
    prescription = refused()
    asked: list[Prescription] = []

    def replay_with(trial: Prescription) -> Replay:
        asked.append(trial)
        return Replay("trial", outcome="fits", peak_allocated_bytes=81 * MIB, capture=STEADY)

    assert certify_with_expandable_segments(prescription, FAILING, replay_with) is not None
    assert [trial.fixes for trial in asked] == [["expandable_segments"]]
    assert (asked[0].batch_size, asked[0].accumulation_steps) == (8, 4)
    assert prescription.fixes == ["expandable_segments"]
    assert prescription.certificate is not None and prescription.certificate.certified
    assert prescription.peak_allocated_bytes == 81 * MIB
    setting = prescription.certificate.allocator_setting
    assert setting is not None and setting.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments")
    assert "grew 8.00 MiB a step (fragmentation): nothing measured says where it stops" in setting
    assert setting.count("grew") == 1


def test_the_refusal_stands_and_says_what_the_replay_found_when_it_still_drifts():
    prescription = refused()

    def replay_with(trial: Prescription) -> Replay:
        return Replay("trial", outcome="fits", peak_allocated_bytes=80 * MIB, capture=DRIFTING)

    certify_with_expandable_segments(prescription, FAILING, replay_with)
    assert prescription.fixes == []
    assert prescription.certificate is not None and not prescription.certificate.certified
    assert "expandable_segments:True" in prescription.certificate.gaps[-1]


@pytest.mark.parametrize(
    "why",
    ["simulated device", "already set", "another gap", "no drift", "--fixes without it"],
)
def test_no_replay_where_expandable_segments_cannot_be_the_answer(why, monkeypatch):
    prescription = refused()
    failing = FAILING
    requested = None
    if why == "simulated device":
        failing = Snapshot.from_dict(
            {"outcome": "oom", "device": {"kind": "simulated", "capacity_bytes": CAPACITY}}
        )
    elif why == "already set":
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    elif why == "another gap":
        assert prescription.certificate is not None
        prescription.certificate.gaps.append("the run evaluates, but the replay did not reach it")
    elif why == "--fixes without it":
        requested = ["smaller_batch", "autocast"]
    else:  # too close to the capacity for the floor, with nothing growing
        prescription.certificate = certificate_for(
            cuda_capture([step(0, 99 * MIB, 99 * MIB), step(1, 99 * MIB, 99 * MIB)]),
            FAILING,
            CAPACITY,
        )
        assert prescription.certificate is not None and not prescription.certificate.certified

    def replay_with(trial: Prescription) -> Replay:
        raise AssertionError("no replay expected")

    assert certify_with_expandable_segments(prescription, failing, replay_with, requested) is None
    assert prescription.fixes == []
    if requested:
        assert prescription.certificate is not None
        assert "--fixes left it out" in prescription.certificate.gaps[-1]


def test_the_largest_batch_line_says_it_is_an_edge_when_the_prescription_needed_the_setting():
    prescription = refused()

    def replay_with(trial: Prescription) -> Replay:
        return Replay("trial", outcome="fits", peak_allocated_bytes=81 * MIB, capture=STEADY)

    certify_with_expandable_segments(prescription, FAILING, replay_with)
    snapshot = Snapshot.from_dict(
        {
            "outcome": "oom",
            "device": {"kind": "cuda", "capacity_bytes": CAPACITY},
            "max_batch_size": 9,
        }
    )
    snapshot.prescription = prescription
    line = next(
        line for line in replay_summary_lines(analyse(snapshot)) if line.startswith("Largest")
    )
    assert "fragmentation can break it" in line


def test_reserved_growth_at_the_defaults_is_not_carried_a_few_steps():
    # 1 MiB a step (1% of the capacity): refused though the carried margin
    # (2 MiB) would fit, and the refusal sends it to expandable segments.
    steps = [step(0, 60 * MIB, 60 * MIB), step(1, 60 * MIB, 61 * MIB), step(2, 60 * MIB, 62 * MIB)]
    certificate = certificate_for(cuda_capture(steps), FAILING, CAPACITY)
    assert certificate is not None and not certificate.certified
    assert [gap for gap in certificate.gaps if "where it stops" in gap] == certificate.gaps
    prescription = Prescription(fixes=[], batch_size=8, fits=True)
    prescription.certificate = certificate
    assert refused_for_drift(prescription, FAILING)
    # A whole run measured (oomdoc check --whole-run) carries its drift.
    whole = certificate_for(cuda_capture(steps), FAILING, CAPACITY, part_of_the_run=False)
    assert whole is not None and whole.certified, whole.gaps
    # A tenth of a MiB a step is under the tolerance: carried, certified.
    tenth = MIB // 10
    steps = [step(i, 60 * MIB, 60 * MIB + i * tenth) for i in range(3)]
    certificate = certificate_for(cuda_capture(steps), FAILING, CAPACITY)
    assert certificate is not None and certificate.certified, certificate.gaps


def test_under_expandable_segments_what_they_hold_unallocated_is_no_overhead():
    # 17 MiB reserved over allocated at the peak, and a spread of 10 MiB
    # between two replays: at the defaults 82 + 17 + 10 is above the 100.
    capture = cuda_capture([step(i, 82 * MIB, 99 * MIB) for i in range(3)])
    at_defaults = certificate_for(capture, FAILING, CAPACITY, [82 * MIB, 72 * MIB])
    assert at_defaults is not None and not at_defaults.certified
    assert at_defaults.allocator_overhead_bytes == 17 * MIB
    capture.allocator = Allocator(expandable_segments=True)
    expandable = certificate_for(capture, FAILING, CAPACITY, [82 * MIB, 72 * MIB])
    assert expandable is not None and expandable.certified, expandable.gaps
    assert expandable.allocator_overhead_bytes == 0


def test_an_interrupted_replay_leaves_the_refusal_as_measured():
    prescription = refused()

    def replay_with(trial: Prescription) -> Replay:
        raise ReplaysInterrupted()

    assert certify_with_expandable_segments(prescription, FAILING, replay_with) is None
    assert prescription.fixes == [] and prescription.certificate is not None
    assert not prescription.certificate.certified
