"""A DDP job on two GPUs (NCCL) that does not fit a capped memory per rank.

    python -m pytest -q -s -m gpu tests/gpu/test_distributed_gpu.py

tests/scripts/ddp_rank0_cache.py with --device cuda: 8 residual MLP blocks of
width 1024 at batch 8192 per rank need about 1.6 GiB of activations per rank;
each rank is capped at 1 GiB (--device-memory applies per rank). The job must
end with status 1, a snapshot entry per rank on its own GPU, replays run as
2-rank jobs (the script refuses another world size) that find the largest
batch per rank exactly, and checkpointing measured to fit. The per-rank
numbers are printed for the closing note.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import SCRIPTS, run_oomdoc

from oomdoc.distributed.report import rank_section_lines
from oomdoc.snapshot import read_snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices",
    ),
]

DDP = SCRIPTS / "ddp_rank0_cache.py"


def test_ddp_job_that_does_not_fit_per_rank(tmp_path):
    snapshot = tmp_path / "ddp.json"
    started = time.perf_counter()
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cuda",
            "--device-memory",
            "1GiB",
            "--nproc-per-node",
            "2",
            "--fixes",
            "smaller_batch,checkpointing",
            "-o",
            snapshot,
            DDP,
            "--device",
            "cuda",
            "--width",
            "1024",
            "--depth",
            "8",
            "--batch-size",
            "8192",
            "--steps",
            "3",
            "--expect-world",
            "2",
        ],
        cwd=tmp_path,
        timeout=900,
    )
    wall_s = time.perf_counter() - started
    assert result.returncode == 1, result.stderr[-4000:]
    document = read_snapshot(snapshot)
    print(f"\nwhole run: {wall_s:.1f} s")
    print("\n".join(rank_section_lines(document)))
    print(json.dumps(document["replay"]["batch_search"]))
    for fix in document["fixes"]:
        print(fix["name"], fix["fits"], fix["peak_allocated_bytes"], fix["detail"])
    assert document["world_size"] == 2 and document["outcome"] == "oom"
    assert document["device"]["kind"] == "cuda"
    assert sorted(entry["device"]["index"] for entry in document["ranks"]) == [0, 1]
    assert document["first_oom_rank"] in (0, 1)
    assert document["max_batch_size"] is not None and document["max_batch_size"] < 8192
    checkpointing = next(f for f in document["fixes"] if f["name"] == "checkpointing")
    assert checkpointing["fits"] is True
