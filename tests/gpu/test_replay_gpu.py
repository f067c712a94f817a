"""Replays on a real GPU: the reference GPT on an H100 capped to 16 GiB.

    python -m pytest -q -m gpu tests/gpu/test_replay_gpu.py

The ranked list must hold smaller_batch with an exact max_batch_size (run at
max and max+1 without replays), autocast and checkpointing with peaks within
5% of the same fixes written by hand, at least six fixes measured, and the
whole run under 90 s (printed, not asserted: timings are for benchmarks/).
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import EXAMPLES, load_json, run_oomdoc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPT = EXAMPLES / "gpt_train.py"
CAP = "16GiB"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gpu-replay")
    snapshot = tmp_path / "gpt.json"
    started = time.perf_counter()
    result = run_oomdoc(
        ["run", "--device-memory", CAP, "-o", snapshot, GPT, "--batch-size", "32", "--steps", "4"],
        cwd=tmp_path,
        timeout=900,
    )
    wall_s = time.perf_counter() - started
    document = load_json(snapshot)
    print(
        f"\nwhole oomdoc run: {wall_s:.1f} s, {document['replay']['replays']} replays, "
        f"{len(document['fixes'])} fixes measured, batch trials {document['replay'].get('batch_search')}"
    )
    return result, document, wall_s


def peak_without_replay(tmp_path, name, script, *args):
    snapshot = tmp_path / f"{name}.json"
    result = run_oomdoc(
        ["run", "--device-memory", CAP, "--no-replay", "-o", snapshot, script, *args],
        cwd=tmp_path,
        timeout=600,
    )
    return result.returncode, load_json(snapshot)


def test_ranked_fixes_on_the_gpu(replayed):
    result, document, wall_s = replayed
    assert result.returncode == 1
    names = {fix["name"] for fix in document["fixes"]}
    assert {"smaller_batch", "autocast", "checkpointing"} <= names
    # Every single fix was either measured or skipped for a stated reason
    # (empty_cache when nothing was cached, a lighter optimizer before any
    # optimizer state existed...).
    skipped = {entry["name"]: entry["reason"] for entry in document["replay"]["skipped"]}
    assert all(skipped.values()), skipped
    assert len(document["fixes"]) + len(skipped) >= 6, (document["fixes"], skipped)
    assert len(document["replay"]["batch_search"]["trials"]) <= 3


def test_max_batch_size_is_exact_on_the_gpu(replayed, tmp_path):
    _, document, _ = replayed
    maximum = document["max_batch_size"]
    code, _ = peak_without_replay(
        tmp_path, "max", GPT, "--batch-size", str(maximum), "--steps", "4"
    )
    assert code == 0
    code, _ = peak_without_replay(
        tmp_path, "over", GPT, "--batch-size", str(maximum + 1), "--steps", "4"
    )
    assert code == 1


@pytest.mark.parametrize(
    "name,flags", [("autocast", ["--autocast", "bf16"]), ("checkpointing", ["--checkpointing"])]
)
def test_replayed_fix_matches_by_hand_on_the_gpu(replayed, tmp_path, name, flags):
    _, document, _ = replayed
    # gpt_train.py's --autocast/--checkpointing write the same fixes into the script by hand.
    code, by_hand = peak_without_replay(
        tmp_path, name, GPT, "--batch-size", "32", "--steps", "4", *flags
    )
    assert code == 0
    replayed_peak = next(f for f in document["fixes"] if f["name"] == name)["peak_allocated_bytes"]
    hand_peak = by_hand["peak"]["allocated_bytes"]
    assert abs(replayed_peak - hand_peak) <= 0.05 * hand_peak, (replayed_peak, hand_peak)
