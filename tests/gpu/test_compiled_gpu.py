"""A torch.compile'd model (Inductor) under `oomdoc run` on CUDA compiles
what it compiles without oomdoc (the capture's hooks do nothing where Dynamo
traces them: oomdoc.capture.modules.traced_by_compile), peaks where it peaks
without it, and makes the steps and evaluations it runs."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from conftest import SCRIPTS, load_json, oomdoc_env, run_oomdoc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = SCRIPTS / "compiled_gpt.py"
COMPILED = re.compile(r"compiled: graphs (\d+) breaks (\d+) recompiles (\d+) peak (\d+)")


def compiled_line(output: str) -> tuple[int, int, int, int]:
    match = COMPILED.search(output)
    assert match, output[-3000:]
    graphs, breaks, recompiles, peak = map(int, match.groups())
    return graphs, breaks, recompiles, peak


def test_a_compiled_nanogpt_style_trainer_runs_as_without_oomdoc(tmp_path):
    plain = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=oomdoc_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    graphs, breaks, recompiles, plain_peak = compiled_line(plain.stdout)
    snapshot_path = tmp_path / "compiled.json"
    result = run_oomdoc(
        ["run", "--device-memory", "16GiB", "--no-replay", "-o", snapshot_path, SCRIPT],
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    under = compiled_line(result.stdout)
    # The same graphs, no graph break or recompile the hooks would add, and
    # the script's own peak (the peak view folds oomdoc's resets back in).
    assert under[:3] == (graphs, breaks, recompiles)
    assert abs(under[3] - plain_peak) <= 0.05 * plain_peak
    document = load_json(snapshot_path)
    steps = document["steps"]
    assert [step["optimizer_steps"] for step in steps] == [1] * 6
    assert [step["forward_calls_with_grad"] for step in steps] == [2] * 6
    assert [step["backward_calls"] for step in steps] == [2] * 6  # none of AOTAutograd's
    # estimate_loss() before iterations 0 and 3 (2 splits x 2 batches): a step
    # ends at the next training call, so the second is step 2's, after its update.
    assert [step["evaluation_calls"] for step in steps] == [4, 0, 4, 0, 0, 0]
    peak = max(step["peak_allocated_bytes"] for step in steps)
    assert abs(peak - plain_peak) <= 0.05 * plain_peak
