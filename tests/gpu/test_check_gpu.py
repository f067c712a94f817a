"""`oomdoc check` and the pytest marker on a real CUDA device.

Run by the lead on a GPU machine: `python -m pytest -q -m gpu tests/gpu/test_check_gpu.py`.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import REPO_ROOT, SCRIPTS, run_oomdoc
from test_pytest_plugin import plugin_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest_plugins = ["pytester"]


def test_check_on_cuda_passes_at_the_same_batch_and_fails_when_activations_grow(tmp_path):
    shutil.copy(SCRIPTS / "check_mlp.py", tmp_path / "train.py")
    common = ["check", "--device", "cuda", "--baseline", tmp_path / "baseline.json"]
    made = run_oomdoc(
        [*common, "--update-baseline", "train.py", "--batch-size", "512"], cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr
    same = run_oomdoc([*common, "train.py", "--batch-size", "512"], cwd=tmp_path)
    assert same.returncode == 0, same.stderr
    grown = run_oomdoc([*common, "train.py", "--batch-size", "2048"], cwd=tmp_path)
    assert grown.returncode == 1, grown.stderr
    verdict = next(line for line in grown.stderr.splitlines() if line.startswith("oomdoc check:"))
    assert "activations" in verdict, grown.stderr


def test_the_marker_on_cuda(pytester, monkeypatch):
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    pytester.makepyfile(
        test_cuda_memory="""
import pytest
import torch


@pytest.mark.oomdoc_limit("16MiB")
def test_over():
    kept = [torch.empty(8 * 1024**2, dtype=torch.uint8, device="cuda") for _ in range(4)]
    del kept


@pytest.mark.oomdoc_limit("64MiB")
def test_under():
    torch.empty(8 * 1024**2, dtype=torch.uint8, device="cuda")
"""
    )
    result = pytester.runpytest_subprocess(*plugin_args("cuda"), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_over was limited to 16.00 MiB of tensor memory but its peak was 32.00 MiB (CUDA)*",
            "*32.00 MiB*test_cuda_memory.py:7 in test_over*",
        ]
    )
