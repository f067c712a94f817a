"""Ranks the script starts itself with multiprocessing.Process, on two GPUs
(issue 25, item 4: fork-based launchers on CUDA).

    python -m pytest -q -s -m gpu tests/gpu/test_process_ranks_gpu.py

tests/scripts/mp_process_ddp.py --cuda: two Process ranks (fork or spawn;
the parent never initialises CUDA, as a fork launcher must not), NCCL, a
GPU each, beside a data-preparation process that never joins the group.
Each rank is capped and captured on its own GPU, the rank that ran out of
memory is named, no rank's peak is above the cap, and the data process is
named, not captured.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SCRIPTS, run_oomdoc

from oomdoc.model import Snapshot, parse
from oomdoc.reporters.ranks import rank_section_lines
from oomdoc.snapshot import read_snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices",
    ),
]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_process_ranks_on_two_gpus_are_captured_per_rank(tmp_path, start_method):
    snapshot = tmp_path / f"{start_method}.json"
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cuda",
            "--device-memory",
            "512MiB",
            "--no-replay",
            "-o",
            snapshot,
            SCRIPTS / "mp_process_ddp.py",
            "--cuda",
            "--batch-size",
            "1000000",
            "--start-method",
            start_method,
            "--port",
            "29517",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    document = read_snapshot(snapshot)
    print("\n".join(rank_section_lines(parse(Snapshot, document))))
    assert document["outcome"] == "oom", result.stderr[-4000:]
    assert document["world_size"] == 2 and len(document["ranks"]) == 2
    assert sorted(entry["device"]["index"] for entry in document["ranks"]) == [0, 1]
    for entry in document["ranks"]:
        held = (entry.get("peak") or {}).get("allocated_bytes") or 0
        assert held <= entry["device"]["capacity_bytes"], entry
    oom_rank = document["first_oom_rank"]
    assert f"Rank {oom_rank} ran out of memory first" in result.stderr
    assert any("prepare_data" in str(item) for item in document.get("uncaptured_processes", []))
