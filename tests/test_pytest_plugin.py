"""The pytest plugin's @pytest.mark.oomdoc_limit, driven through pytester
(in-process runs of a generated test file) on the simulated device."""

from __future__ import annotations

import gc
import importlib.metadata
import os

import pytest
import torch
from conftest import REPO_ROOT

from oomdoc import pytest_plugin

pytest_plugins = ["pytester"]


def plugin_args(device: str = "cpu") -> list[str]:
    """Load the plugin by module unless its pytest11 entry point (an installed
    oomdoc) already does; loading it twice under two names is an error."""
    installed = any(
        ep.value == "oomdoc.pytest_plugin"
        for ep in importlib.metadata.entry_points(group="pytest11")
    )
    return ["--oomdoc-device", device] + ([] if installed else ["-p", "oomdoc.pytest_plugin"])


@pytest.fixture
def pytester(pytester, monkeypatch):
    """pytester whose runs see this checkout's oomdoc."""
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    return pytester


def run(pytester, *args):
    """A separate pytest process: torch cannot be imported twice in one, as
    pytester's in-process runs would do after restoring sys.modules."""
    return pytester.runpytest_subprocess(*args)


TESTS = """
import pytest
import torch
import torch.nn as nn


def make_activations(batch):
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    output = model(torch.randn(batch, 256))
    output.sum().backward()
    return model


@pytest.mark.oomdoc_limit("4MiB")
def test_over_the_limit():
    big = torch.zeros(2048, 1024)  # 8 MiB in one tensor
    del big


@pytest.mark.oomdoc_limit("64MiB")
def test_under_the_limit():
    make_activations(64)


@pytest.mark.oomdoc_limit("3MiB")
def test_model_over_the_limit():
    make_activations(1024)


def test_unmarked():
    torch.zeros(4096, 4096)
"""


def test_over_the_limit_fails_with_sites_and_under_passes(pytester):
    pytester.makepyfile(test_memory=TESTS)
    result = run(pytester, *plugin_args(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        ["test_memory.py M.M.*"]
    )  # memory failures show as M, as with pytest-memray
    result.stdout.fnmatch_lines(
        [
            "*test_memory.py::test_over_the_limit was limited to 4.00 MiB of tensor memory but its peak was 8.00 MiB*",
            "*Top * allocation sites at the peak*",
            "*8.00 MiB*test_memory.py:15 in test_over_the_limit*2048x1024 float32*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*test_model_over_the_limit was limited to 3.00 MiB*",
            "At the peak: parameters *activations*",
            # The two 1024x1024 activations of one line, each with its module:
            # the first Linear's (the root Sequential's two Linears fold) and the ReLU's.
            "4.00 MiB  activations  (root).*  test_memory.py:9 in make_activations  1024x1024 float32",
            "4.00 MiB  activations  1         test_memory.py:9 in make_activations  1024x1024 float32",
        ]
    )
    assert "test_under_the_limit was limited" not in result.stdout.str()
    assert "test_unmarked was limited" not in result.stdout.str()


def test_a_bad_limit_is_a_setup_error(pytester):
    pytester.makepyfile(
        test_bad="""
import pytest

@pytest.mark.oomdoc_limit("lots")
def test_bad():
    pass

@pytest.mark.oomdoc_limit()
def test_no_size():
    pass
"""
    )
    result = run(pytester, *plugin_args(), "-p", "no:cacheprovider")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        ["*oomdoc_limit: invalid size 'lots'*", "*oomdoc_limit takes one size*"]
    )


def test_the_cpu_meter_counts_repeatably_and_uninstalls_everything():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    forward_hooks = dict(torch.nn.modules.module._global_forward_hooks)
    backward = torch.autograd.backward
    optimizer_init = torch.optim.Optimizer.__init__

    def measure():
        meter = pytest_plugin.SimulatedMeter(limit_bytes=1024**2)
        meter.start()
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)
        )
        model(torch.randn(256, 64)).sum().backward()
        del model
        return meter.stop()

    first, second = measure(), measure()
    assert first.peak_bytes == second.peak_bytes > 256 * 512 * 4  # the hidden activations alone
    assert first.over_limit and first.sites and first.breakdown["parameters"] > 0
    assert torch.autograd.backward is backward
    assert torch.optim.Optimizer.__init__ is optimizer_init
    assert dict(torch.nn.modules.module._global_forward_hooks) == forward_hooks
    assert _get_current_dispatch_mode() is None
    gc.collect()
    assert not list(pytest_plugin._active_backends)


def test_sites_at_the_peak_of_a_cuda_trace():
    """The CUDA path's trace replay, on a trace written out here."""

    def frames(line):
        return [
            {
                "filename": os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py"),
                "line": 1,
                "name": "linear",
            },
            {"filename": "/project/test_model.py", "line": line, "name": "test_model"},
        ]

    trace = [
        {"action": "free_requested", "addr": 99, "size": 512},  # allocated before recording began
        {"action": "alloc", "addr": 1, "size": 1000, "frames": frames(10)},
        {"action": "alloc", "addr": 2, "size": 3000, "frames": frames(11)},
        {"action": "alloc", "addr": 3, "size": 3000, "frames": frames(11)},
        {"action": "free_requested", "addr": 2, "size": 3000},
        {"action": "free_completed", "addr": 2, "size": 3000},
        {"action": "alloc", "addr": 4, "size": 500, "frames": frames(12)},
        {"action": "free_requested", "addr": 3, "size": 3000},
    ]
    sites = pytest_plugin.sites_at_trace_peak(trace)
    # The peak is after the third alloc: 1000 + 3000 + 3000 live.
    assert [(site["location"]["line"], site["bytes"], site["count"]) for site in sites] == [
        (11, 6000, 2),
        (10, 1000, 1),
    ]
    assert pytest_plugin.sites_at_trace_peak([]) == []
