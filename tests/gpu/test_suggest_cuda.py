"""`oomdoc suggest` on a real CUDA device (run on a GPU machine).

PyTorch's own snapshot of a fragmented OOM must agree with the allocator's
counters, and the leak and evaluation scripts run with `oomdoc run --device
cuda` must be diagnosed as on the simulated device.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import SCRIPTS, oomdoc_env, run_oomdoc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def suggest_json(path) -> dict:
    completed = run_oomdoc(["suggest", path, "--format", "json"])
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def test_torch_snapshot_agrees_with_the_allocator(tmp_path):
    snapshot, stats_path = tmp_path / "frag.pickle", tmp_path / "stats.json"
    made = subprocess.run(
        [sys.executable, SCRIPTS / "suggest_make_torch_snapshot.py", snapshot, stats_path],
        env=oomdoc_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    stats = json.loads(stats_path.read_text())
    result = suggest_json(snapshot)
    assert result["source_format"] == "torch_pickle"
    assert result["outcome"] == "oom"
    assert result["oom"]["requested_bytes"] == stats["requested"]
    from oomdoc.loaders import load_snapshot

    allocator = load_snapshot(snapshot).document["allocator"]
    for key in (
        "allocated_bytes",
        "reserved_bytes",
        "inactive_split_bytes",
        "inactive_split_blocks",
    ):
        assert allocator[key] == stats[key], key
    assert result["diagnoses"][0]["kind"] == "fragmentation"
    assert (
        "decided the OOM" in result["diagnoses"][0]["summary"]
    )  # "may have decided": the cap is not in the pickle
    assert any(fix["name"] == "expandable_segments" for fix in result["fixes"])


def test_leak_on_cuda(tmp_path):
    snapshot = tmp_path / "leak.json"
    completed = run_oomdoc(
        [
            "run",
            "--device",
            "cuda",
            "--device-memory",
            "2GiB",
            "--no-replay",
            "-o",
            snapshot,
            SCRIPTS / "suggest_leak_total_loss.py",
            "--mode",
            "sum-retain",
            "--steps",
            "200",
            "--width",
            "2048",
            "--batch-size",
            "2048",
        ],
        timeout=600,
    )
    assert completed.returncode == 1, completed.stderr[-3000:]
    assert "1. leak:" in completed.stderr
    assert suggest_json(snapshot)["diagnoses"][0]["kind"] == "leak"


def test_eval_without_no_grad_on_cuda(tmp_path):
    snapshot = tmp_path / "eval.json"
    args = ["--width", "2048", "--batch-size", "8192", "--batches", "4"]
    completed = run_oomdoc(
        [
            "run",
            "--device",
            "cuda",
            "--device-memory",
            "768MiB",
            "--no-replay",
            "-o",
            snapshot,
            SCRIPTS / "suggest_eval_no_grad.py",
            *args,
        ],
        timeout=600,
    )
    assert completed.returncode == 1, completed.stderr[-3000:]
    assert "1. grad_in_eval:" in completed.stderr
    assert suggest_json(snapshot)["diagnoses"][0]["kind"] == "grad_in_eval"
    fine = tmp_path / "eval_no_grad.json"
    completed = run_oomdoc(
        [
            "run",
            "--device",
            "cuda",
            "--device-memory",
            "768MiB",
            "--no-replay",
            "-o",
            fine,
            SCRIPTS / "suggest_eval_no_grad.py",
            *args,
            "--no-grad",
        ],
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "grad_in_eval" not in [d["kind"] for d in suggest_json(fine)["diagnoses"]]
