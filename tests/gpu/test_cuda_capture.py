"""oomdoc run on a real CUDA device (run on a GPU machine: `make test-gpu`).

The GPT example with the reference preset OOMs at batch 32 on a card capped
to 16 GiB and fits at batch 4.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import EXAMPLES, SCRIPTS, load_json, run_oomdoc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPT = EXAMPLES / "gpt_train.py"
GIB = 1024**3


def test_gpt_oom_is_caught_on_a_capped_card(tmp_path):
    snapshot_path = tmp_path / "gpt.json"
    result = run_oomdoc(
        [
            "run",
            "--device-memory",
            "16GiB",
            "--no-replay",
            "-o",
            snapshot_path,
            GPT,
            "--batch-size",
            "32",
            "--steps",
            "3",
        ],
        timeout=600,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "torch.OutOfMemoryError" in result.stderr
    assert "oomdoc: OOM in step 0 during" in result.stderr
    document = load_json(snapshot_path)
    assert document["device"]["kind"] == "cuda"
    assert abs(document["device"]["capacity_bytes"] - 16 * GIB) < 1024**2
    assert document["outcome"] == "oom" and document["exit_code"] == 1
    oom = document["oom"]
    assert oom["step"] == 0 and oom["phase"] in ("forward", "backward")
    assert oom["requested_bytes"] > 0
    assert oom["allocated_bytes"] + oom["requested_bytes"] > 14 * GIB
    assert oom["reserved_bytes"] >= oom["allocated_bytes"]
    assert "out of memory" in oom["message"].lower()
    assert oom["location"]["file"].endswith("gpt_train.py")
    breakdown = document["breakdown"]
    total = sum(breakdown.values())
    assert abs(total - oom["allocated_bytes"]) <= 0.05 * oom["allocated_bytes"]
    # 217M fp32 parameters and the activations of 32 sequences of 512 tokens.
    assert 0.8e9 < breakdown["parameters"] < 0.95e9
    assert breakdown["activations"] > breakdown["parameters"]
    assert document["top_allocations"], "allocation history gave no sites"
    assert any(
        (site.get("location") or {}).get("file", "").endswith("gpt_train.py")
        for site in document["top_allocations"]
    )
    assert document["device"].get("name", "").startswith("NVIDIA")
    torch_snapshot = document["artifacts"]["torch_snapshot_file"]
    with open(torch_snapshot, "rb") as handle:
        raw = pickle.load(handle)  # our own file, written by this very run
    assert raw["segments"]


def test_gpt_that_fits_reports_steps_and_phases(tmp_path):
    snapshot_path = tmp_path / "gpt.json"
    result = run_oomdoc(
        [
            "run",
            "--device-memory",
            "16GiB",
            "-o",
            snapshot_path,
            GPT,
            "--batch-size",
            "4",
            "--steps",
            "3",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = load_json(snapshot_path)
    assert document["outcome"] == "ok"
    assert document["step_unit"] == "optimizer"
    assert [s["index"] for s in document["steps"]] == [0, 1, 2]
    for step in document["steps"]:
        assert step["peak_phase"] in ("forward", "backward", "optimizer")
        assert step["peak_reserved_bytes"] >= step["peak_allocated_bytes"] > 0
    # At the end of each step (after optimizer.step, before zero_grad) the card
    # holds parameters, gradients and AdamW's two moments: four copies.
    parameter_bytes = document["models"][0]["parameters_bytes"]
    assert document["steps"][0]["end_allocated_bytes"] >= 3.9 * parameter_bytes
    assert document["breakdown"]["optimizer_state"] > 1.6e9
    assert "The run fit" in result.stderr


def test_max_steps_stops_cleanly_on_cuda(tmp_path):
    snapshot_path = tmp_path / "gpt.json"
    result = run_oomdoc(
        ["run", "--max-steps", "2", "-o", snapshot_path, GPT, "--batch-size", "2", "--steps", "10"],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = load_json(snapshot_path)
    assert len(document["steps"]) == 2
    assert "step 2:" not in result.stdout


def test_a_warm_child_handed_expandable_segments_allocates_expandable_segments(tmp_path):
    """The replays with expandable segments run in warm children that started
    (and imported torch) without PYTORCH_CUDA_ALLOC_CONF: the allocator itself,
    not only the environment, must then make expandable segments."""
    from oomdoc.runner import ChildRequest, run_child
    from oomdoc.warm import WarmPool

    script = tmp_path / "segments.py"
    script.write_text(
        "import json, sys, torch\n"
        "x = torch.empty(64 * 1024 * 1024, device='cuda')\n"
        "segments = torch.cuda.memory_snapshot()\n"
        "json.dump([bool(s.get('is_expandable')) for s in segments], open(sys.argv[1], 'w'))\n"
    )
    found = tmp_path / "segments.json"
    env = {"OOMDOC_REPLAY": "1", "OOMDOC_ALLOCATION_HISTORY": "0"}
    pool = WarmPool("cuda", env, size=1)
    try:
        pool.fill()
        for extra, expected in (
            ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
            ({}, False),
        ):
            result = run_child(
                ChildRequest(
                    target=str(script),
                    args=[str(found)],
                    device="cuda",
                    capacity_bytes=4 * GIB,
                    extra_env={**env, **extra},
                    output_path=str(tmp_path / "child.log"),
                    timeout_s=300,
                ),
                pool=pool,
            )
            assert result.warm and result.exit_code == 0, (tmp_path / "child.log").read_text()[
                -3000:
            ]
            segments = load_json(found)
            assert segments and all(flag is expected for flag in segments), segments
    finally:
        pool.close()


def test_allocation_stacks_stop_on_steady_steps_and_stay_on_under_a_leak(tmp_path):
    """The allocator's per-allocation Python stacks (13 to 17% of a bf16 step
    on an H200) are recorded until training is steady: the sites of the peak,
    read in the first steps, keep their locations; a leaking run keeps them."""
    steady = tmp_path / "steady.json"
    result = run_oomdoc(
        ["run", "--device-memory", "16GiB", "--no-replay", "-o", steady, GPT]
        + ["--batch-size", "4", "--steps", "8"],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = load_json(steady)
    assert document["capture_stats"]["steps_without_stacks"] >= 3
    assert any(
        (site.get("location") or {}).get("file", "").endswith("gpt_train.py")
        for site in document["top_allocations"]
    )
    leaking = tmp_path / "leak.json"
    result = run_oomdoc(
        ["run", "--device-memory", "16GiB", "--no-replay", "-o", leaking]
        + [SCRIPTS / "suggest_leak_total_loss.py", "--mode", "sum-retain", "--steps", "8"],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_json(leaking)["capture_stats"]["steps_without_stacks"] == 0


def test_a_model_moved_to_a_card_too_small_for_its_weights_is_a_model_load(tmp_path):
    """A 2.25 GiB float32 model built on the CPU and moved to a card capped at
    1 GiB: the OOM comes in `.to("cuda")`, before any step. The snapshot names
    the model with its weights on the card and in all, and the first
    diagnosis is model_load (not "a dataset moved to the device")."""
    script = tmp_path / "load.py"
    script.write_text(
        "import torch, torch.nn as nn\n"
        "model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(9)])\n"
        "model.to('cuda')\n"
        "print(model(torch.randn(2, 8192, device='cuda')).sum())\n"
    )
    snapshot_path = tmp_path / "load.json"
    result = run_oomdoc(
        ["run", "--device-memory", "1GiB", "-o", snapshot_path, script], timeout=600
    )
    assert result.returncode == 1, result.stderr[-3000:]
    document = load_json(snapshot_path)
    oom = document["oom"]
    assert oom["phase"] == "setup"
    [named] = oom["uncalled_models"]
    weights = 9 * (8192 * 8192 + 8192) * 4
    assert named["class"] == "Sequential" and named["weights_bytes"] == weights
    assert 0.5 * GIB < named["bytes"] <= GIB
    report = run_oomdoc(["suggest", snapshot_path])
    first = report.stdout.split("Diagnosis (most important first)")[1].split("\n")[1]
    assert first.startswith("1. model_load: The model does not fit"), report.stdout[-3000:]
