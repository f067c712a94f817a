"""The script's own CUDA peak statistics under `oomdoc run` are those it reads
without oomdoc, although oomdoc resets the allocator's peaks at every phase
boundary (oomdoc.capture.peak_view); oomdoc's step peaks survive the script's
resets.

Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu/test_peak_view_gpu.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import SCRIPTS, load_json, oomdoc_env, run_oomdoc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = SCRIPTS / "cuda_peak_stats.py"


def test_the_script_reads_the_peaks_it_reads_without_oomdoc(tmp_path):
    plain_path, captured_path = tmp_path / "plain.json", tmp_path / "captured.json"
    plain = subprocess.run(
        [sys.executable, SCRIPT, plain_path],
        env=oomdoc_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    snapshot_path = tmp_path / "snapshot.json"
    result = run_oomdoc(
        ["run", "--device", "cuda", "--no-replay", "-o", snapshot_path, SCRIPT, captured_path]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = json.loads(plain_path.read_text())
    captured = json.loads(captured_path.read_text())
    print(json.dumps({"plain": expected, "oomdoc": captured}, indent=1))
    assert captured.keys() == expected.keys()
    for moment, values in expected.items():
        for name, value in values.items():
            assert captured[moment][name] == pytest.approx(value, rel=0.01), (moment, name)
    # The reset after the backward pass is below the step's peak, which
    # oomdoc's step still has: the same as the step before.
    assert expected["reset_after_backward"]["max_memory_allocated"] < (
        0.9 * expected["after_reset"]["max_memory_allocated"]
    )
    steps = load_json(snapshot_path)["steps"]
    assert len(steps) == 5, [step["index"] for step in steps]
    assert steps[4]["peak_allocated_bytes"] == pytest.approx(
        steps[3]["peak_allocated_bytes"], rel=0.01
    )
    assert steps[3]["peak_allocated_bytes"] == pytest.approx(
        expected["after_reset"]["max_memory_allocated"], rel=0.01
    )
