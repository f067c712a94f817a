"""A DDP job on two GPUs (NCCL) that does not fit a capped memory per rank.

    python -m pytest -q -s -m gpu tests/gpu/test_distributed_gpu.py

tests/scripts/ddp_rank0_cache.py with --device cuda, 8 residual MLP blocks of
width 4096 (about 2.1 GiB of fp32 parameters), AdamW: per rank the
parameters, gradients, DDP's gradient buckets (the `communication`
category, one copy of the parameters) and the optimizer state need about
10.5 GiB, over the 8 GiB cap of each rank (--device-memory applies per
rank). FSDP2 over the 2 ranks halves parameters, gradients and state and has
no buckets: it must be measured to fit, and the same FSDP written by hand
(--fsdp) must peak within 5% of the measured replay. The job must end with
status 1, one snapshot entry per rank on its own GPU, and replays run as
2-rank jobs (the script refuses another world size). The per-rank table and
the fixes are printed for the closing note.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import SCRIPTS, run_oomdoc

from oomdoc.model import Snapshot
from oomdoc.reporters.ranks import rank_section_lines
from oomdoc.snapshot import read_snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices",
    ),
]

DDP = SCRIPTS / "ddp_rank0_cache.py"


CAP = "8GiB"
SCRIPT_ARGS = ["--device", "cuda", "--width", "4096", "--depth", "8", "--batch-size", "64", "--steps", "3", "--expect-world", "2"]  # fmt: skip


def test_ddp_job_that_does_not_fit_per_rank(tmp_path):
    snapshot = tmp_path / "ddp.json"
    started = time.perf_counter()
    result = run_oomdoc(
        ["run", "--device", "cuda", "--device-memory", CAP, "--nproc-per-node", "2", "-o", snapshot, DDP, *SCRIPT_ARGS],
        cwd=tmp_path,
        timeout=1800,
    )  # fmt: skip
    wall_s = time.perf_counter() - started
    assert result.returncode == 1, result.stderr[-4000:]
    document = read_snapshot(snapshot)
    print(f"\nwhole run: {wall_s:.1f} s")
    print("\n".join(rank_section_lines(Snapshot.from_dict(document))))
    for fix in document["fixes"]:
        print(fix["rank"], fix["name"], fix["fits"], fix["peak_allocated_bytes"], fix["detail"])
    assert document["world_size"] == 2 and document["outcome"] == "oom"
    assert document["device"]["kind"] == "cuda"
    assert sorted(entry["device"]["index"] for entry in document["ranks"]) == [0, 1]
    assert document["first_oom_rank"] in (0, 1)
    for entry in document["ranks"]:
        # DDP's gradient buckets (made in _ddp_init_helper, by allocation
        # stack on CUDA) are communication buffers: one copy of the parameters.
        peaks = entry["category_peaks"]
        print(entry["rank"], {name: round(value / 2**30, 2) for name, value in peaks.items()})
        assert peaks.get("communication", 0) == pytest.approx(peaks["parameters"], rel=0.05)
    fsdp = next(f for f in document["fixes"] if f["name"] == "fsdp")
    assert fsdp["measured"] is True and fsdp["fits"] is True, fsdp

    by_hand = tmp_path / "fsdp-by-hand.json"
    result = run_oomdoc(
        ["run", "--device", "cuda", "--device-memory", CAP, "--nproc-per-node", "2", "--no-replay", "-o", by_hand, DDP, *SCRIPT_ARGS, "--fsdp"],
        cwd=tmp_path,
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    hand = read_snapshot(by_hand)
    hand_peak = max(entry["peak"]["allocated_bytes"] for entry in hand["ranks"])
    print(f"fsdp replay peak {fsdp['peak_allocated_bytes']}, by hand {hand_peak}")
    assert abs(fsdp["peak_allocated_bytes"] - hand_peak) <= 0.05 * hand_peak
