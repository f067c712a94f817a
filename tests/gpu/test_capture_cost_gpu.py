"""The capture's bounded per-step work on a real CUDA device (`make test-gpu`).

Step durations come from CUDA events rather than a synchronize per step;
they must still be the steps' real durations (close to what the script
measures itself after reading the loss). The feature-keeping leak is found
with few deep leak walks and few allocator snapshots.
"""

from __future__ import annotations

import re
import statistics

import pytest
import torch
from conftest import EXAMPLES, REPO_ROOT, load_json, run_oomdoc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEP_RE = re.compile(r"^step (\d+): loss \S+ \(([\d.]+) ms", re.M)


def test_event_step_durations_match_the_scripts_own(tmp_path):
    snapshot = tmp_path / "gpt.json"
    result = run_oomdoc(
        ["run", "--no-replay", "-o", snapshot, EXAMPLES / "gpt_train.py"]
        + ["--batch-size", "8", "--steps", "12"],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = load_json(snapshot)
    durations = [step["duration_s"] for step in document["steps"][3:-1]]
    assert all(duration > 0 for duration in durations)
    printed = [float(ms) / 1000 for step, ms in STEP_RE.findall(result.stdout) if int(step) >= 3]
    assert abs(statistics.median(durations) / statistics.median(printed) - 1) < 0.15
    assert document["capture_stats"]["site_samples"] <= 6


def test_feature_keeping_leak_on_cuda(tmp_path):
    snapshot = tmp_path / "keep.json"
    result = run_oomdoc(
        ["run", "--no-replay", "-o", snapshot, REPO_ROOT / "benchmarks/scripts/keep_features.py"]
        + ["--steps", "300", "--batch-size", "1024", "--width", "1024"],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = load_json(snapshot)
    stats = document["capture_stats"]
    assert 1 <= stats["leak_walks"] <= 12
    assert stats["site_samples"] <= 25  # allocator snapshots only at 25% higher peaks
    assert "1. leak: Memory leak: `kept`" in result.stderr
