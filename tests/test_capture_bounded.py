"""The capture's per-step work stays bounded on a long leaking run.

A script that keeps each step's features with their autograd history runs
400 steps on the simulated device. Nothing here is timed (the overhead is a
benchmark row, benchmarks/suite.py); what is checked is the work the capture
counted: deep leak walks and full site listings stay far below the step
count, the graph nodes walked grow with the steps (what each step added),
not with what was kept, and the leak is still found, with exact bytes.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, load_json, run_oomdoc

KEEP_FEATURES = REPO_ROOT / "benchmarks" / "scripts" / "keep_features.py"
STEPS = 400
BATCH, WIDTH = 32, 128
FEATURE_BYTES = BATCH * WIDTH * 4  # one step's kept float32 features


@pytest.fixture(scope="module")
def keep_features_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bounded")
    snapshot = directory / "keep_features.json"
    completed = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "64MiB",
            "--no-replay",
            "-o",
            snapshot,
            KEEP_FEATURES,
            "--steps",
            STEPS,
            "--batch-size",
            BATCH,
            "--width",
            WIDTH,
        ],
        cwd=directory,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    return load_json(snapshot), completed


def test_leak_walks_and_site_listings_are_few(keep_features_run):
    document, _ = keep_features_run
    # Step records are bounded too (oomdoc.capture.step_records); every step counts.
    assert len(document["steps"]) + document["steps_omitted"] == STEPS
    stats = document["capture_stats"]
    # Memory grows every step, so deep walks run, but with doubling gaps.
    assert 1 <= stats["leak_walks"] <= 12
    assert stats["leak_checks"] == STEPS - 1  # the cheap check: every step but the first
    # A new high every step, yet the allocation sites are listed once, at the end.
    assert stats["peak_marks"] >= STEPS
    assert stats["site_samples"] <= 2
    # What each step's check walks is what the step added, not what was kept:
    # the newest features' few nodes (older ones remember what lies below).
    assert stats["graph_nodes_walked"] <= 8 * STEPS


def test_the_leak_is_still_found(keep_features_run, tmp_path):
    document, completed = keep_features_run
    holders = {graph["variable"] for step in document["steps"] for graph in step["retained_graphs"]}
    assert holders == {"kept"}
    assert "1. leak: Memory leak: `kept`" in completed.stderr
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(json.dumps(document))
    result = run_oomdoc(["suggest", snapshot, "--format", "json"])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["diagnoses"][0]["kind"] == "leak"


def test_byte_counts_are_exact(keep_features_run):
    document, _ = keep_features_run
    steps = document["steps"]
    # Closed by its own optimizer step: what earlier steps' forwards left
    # alive is exactly the features kept so far, and the end of each step
    # grows by exactly one step's features.
    for step in steps[1:-1]:
        assert step["retained_activation_bytes"] == step["index"] * FEATURE_BYTES
    ends = [(step["index"], step["end_allocated_bytes"]) for step in steps[:-1]]
    assert all(
        b - a == (j - i) * FEATURE_BYTES for (i, a), (j, b) in zip(ends[2:], ends[3:])
    )  # records in between may be omitted: by step index
    top = document["top_allocations"][0]
    # At the fullest boundary (the last optimizer step): the kept features
    # and the step's own, listed from the peak log when the snapshot is written.
    assert (top["bytes"], top["count"], top["shape"]) == (STEPS * FEATURE_BYTES, STEPS, [32, 128])
