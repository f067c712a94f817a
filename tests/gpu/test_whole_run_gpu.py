"""Issue 28 on a real GPU: the HF Trainer on variable-length text with
evaluation (benchmarks/scripts/hf_trainer_varlen.py, GPT-2 12 x 768), batch
32 on an H100 capped to 16 GiB.

    python -m pytest -q -s -m gpu tests/gpu/test_whole_run_gpu.py

The caching allocator's drift breaks the largest batch later in the run
(by hand, 10 seeds over the whole run: 9 holds on 7 at the allocator's
defaults; with expandable segments 10 holds on 10 and 11 on 3). The largest
batch is certified for the whole run with expandable segments, above the
search's edge at the defaults; the prescription is certified, and by hand,
with its own flags, over the whole run, it fits with its peak within 5%.
The diagnosis time is printed (issue 28 asks for 60 s), not asserted.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import REPO_ROOT, load_json, run_oomdoc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HF_VARLEN = REPO_ROOT / "benchmarks" / "scripts" / "hf_trainer_varlen.py"
CAP = "16GiB"
ARGS = ["--n_layer", "12", "--n_embd", "768", "--max_steps", "32", "--eval_steps", "16"]
ARGS += ["--use_cpu", "False"]


def test_the_largest_batch_and_the_prescription_hold_for_the_whole_run(tmp_path):
    snapshot = tmp_path / "hf.json"
    started = time.perf_counter()
    run_oomdoc(
        ["run", "--device-memory", CAP, "-o", snapshot, HF_VARLEN]
        + [*ARGS, "--per_device_train_batch_size", "32"],
        cwd=tmp_path,
        timeout=900,
    )
    wall_s = time.perf_counter() - started
    document = load_json(snapshot)
    replay = document["replay"]
    print(f"\nwhole diagnosis {wall_s:.1f} s: {replay['replays']} replays in {replay['total_s']} s")
    search = replay["batch_search"]
    assert search["exact"], search
    # Certified for the whole run with expandable segments, at least the
    # search's own edge at the defaults.
    assert search.get("whole_run_setting") == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert (search.get("whole_run_batch_size") or 0) >= search["max_batch_size"], search
    prescription = document["prescription"]
    certificate = prescription["certificate"]
    assert certificate["certified"], certificate["gaps"]
    assert certificate["shapes"] == "longest_first" and certificate["evaluation_peak_bytes"]
    # By hand, the prescription in the script's own flags, the whole run
    # (32 steps, two evaluations), with the variable when it is prescribed.
    flags = prescription["verified_by_flags"]["args"]
    env = {}
    if "expandable_segments" in prescription["fixes"]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    by_hand_path = tmp_path / "by-hand.json"
    run_oomdoc(
        ["run", "--device-memory", CAP, "--no-replay", "-o", by_hand_path, HF_VARLEN, *flags],
        cwd=tmp_path,
        timeout=600,
        env=env,
    )
    by_hand = load_json(by_hand_path)
    assert by_hand["outcome"] == "ok", by_hand.get("oom")
    assert len(by_hand["steps"]) + by_hand.get("steps_omitted", 0) >= 32
    assert any(step["evaluation_calls"] for step in by_hand["steps"])
    assert by_hand["peak"]["allocated_bytes"] == pytest.approx(
        prescription["peak_allocated_bytes"], rel=0.05
    )
