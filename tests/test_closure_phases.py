"""`optimizer.step(closure)`: the forward and backward run inside the step
(Lightning's automatic optimization, LBFGS). The capture labels them
forward and backward, and only the update after the closure returns
`optimizer`, on the simulated device through the real CLI."""

from __future__ import annotations

import pytest
from conftest import SCRIPTS, run_case

CLOSURE_LOOP = SCRIPTS / "closure_loop.py"


def capture(tmp_path, *script_args, capacity="64MiB"):
    return run_case(tmp_path, (CLOSURE_LOOP, capacity, list(script_args)))


@pytest.mark.parametrize(
    "script_args",
    [("--optimizer", "adamw"), ("--optimizer", "sgd", "--positional")],
    ids=["adamw-keyword", "sgd-positional"],
)
def test_closure_steps_have_forward_backward_and_optimizer_phases(tmp_path, script_args):
    result, document = capture(tmp_path, *script_args)
    assert document["outcome"] == "ok", result.stderr[-3000:]
    assert document["step_unit"] == "optimizer"
    peaks = document["category_peaks"]
    static = peaks["parameters"] + peaks["gradients"] + peaks["optimizer_state"]
    first, *steady = document["steps"]
    # In the order they ran: nothing is labelled optimizer before the closure's forward.
    assert list(first["phase_peaks"])[:4] == ["setup", "forward", "backward", "optimizer"]
    # The optimizer state only exists once the update ran: the backward
    # (which ended when the closure returned) never held it, the update did.
    assert first["phase_peaks"]["backward"] < static <= first["phase_peaks"]["optimizer"]
    assert steady
    for step in [first, *steady]:
        assert (step["forward_calls"], step["backward_calls"], step["optimizer_steps"]) == (1, 1, 1)
        assert {"forward", "backward", "optimizer"} <= set(step["phase_peaks"])
        assert step["phase_peaks"]["forward"] < step["phase_peaks"]["backward"]


def test_lbfgs_calls_its_closure_several_times_per_step(tmp_path):
    result, document = capture(
        tmp_path, "--optimizer", "lbfgs", "--steps", "1", "--batch-size", "16", capacity="128MiB"
    )
    assert document["outcome"] == "ok", result.stderr[-3000:]
    (step,) = document["steps"]
    assert step["optimizer_steps"] == 1
    assert step["forward_calls"] == step["backward_calls"] >= 2
    assert list(step["phase_peaks"])[:4] == ["setup", "forward", "backward", "optimizer"]
