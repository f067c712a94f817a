"""Steady steps hook only the outermost module calls (oomdoc.capture.module_calls)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_stack_recording import SteadyAfter

from oomdoc.capture import module_calls
from oomdoc.capture.tracker import Tracker

TORCH_CALL = nn.Module._wrapped_call_impl


@pytest.fixture(autouse=True)
def nothing_compiled_yet(monkeypatch):
    """Lean mode stays off once torch.compile compiled a graph in the process:
    as in a fresh process, whatever other tests compiled."""
    monkeypatch.setattr(module_calls, "compile_seen", lambda: False)


def hooked_tracker(steady_from: int = 2) -> tuple[Tracker, list]:
    """A tracker whose forward pre-hook notes (step, phase, module class) per
    call, after the tracker's own work (a training call may open a step), and
    ("push", phase, module class) per module scope pushed."""
    tracker = Tracker(SteadyAfter(steady_from))
    calls: list = []
    pre = tracker._on_forward_pre

    def noted_pre(module, inputs):
        pre(module, inputs)  # (an outermost call may open a step)
        calls.append((tracker.step_index, tracker.phase, type(module).__name__))

    tracker._on_forward_pre = noted_pre  # type: ignore[method-assign]
    push = tracker.scopes.push

    def noted_push(module, outermost_inputs=None):
        calls.append(("push", tracker.phase, type(module).__name__))
        return push(module, outermost_inputs)

    tracker.scopes.push = noted_push  # type: ignore[method-assign]
    tracker.install()
    return tracker, calls


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and its SGD after `steps` training steps."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optimizer, steps)
    return model, optimizer


def train(model, optimizer, steps: int, loss_module=None) -> None:
    loss_module = loss_module or nn.MSELoss()
    for _ in range(steps):
        loss = loss_module(model(torch.randn(4, 8)), torch.zeros(4, 2))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_steady_steps_hook_only_the_outermost_calls_and_evaluation_gets_them_all():
    tracker, calls = hooked_tracker(steady_from=2)
    try:
        model, optimizer = trained(5)
        lean_during_training = nn.Module.__call__ is not TORCH_CALL
        with torch.no_grad():
            model(torch.randn(4, 8))
        train(model, optimizer, 1)
        tracker.finish()
    finally:
        tracker.uninstall()
    assert lean_during_training
    assert nn.Module.__call__ is TORCH_CALL  # the script's own again
    training = [
        (step, name) for step, phase, name in calls if phase != "evaluation" and step != "push"
    ]
    per_step = [sum(1 for step, _ in training if step == index) for index in range(6)]
    # The model, its three layers and the loss module in the detailed steps
    # 0 and 1 and step 2 (lean from the end of its model call, the first
    # quiet point); then the model and the loss module, the outermost calls.
    assert per_step[:3] == [5, 5, 5]
    assert per_step[3:5] == [2, 2]
    evaluation = [name for step, phase, name in calls if phase == "evaluation" and step == "push"]
    # The evaluation's model call brought the hooks back from its pre-hook:
    # every call below it is hooked, that call itself once.
    assert evaluation == ["Sequential", "Linear", "ReLU", "Linear"]
    # No module scope in the steady training steps.
    assert not [name for step, phase, name in calls[-3:] if step == "push"]
    # The step model is the same as with the hooks on every call.
    assert [step["optimizer_steps"] for step in tracker.steps[:5]] == [1] * 5
    assert [step["forward_calls_with_grad"] for step in tracker.steps[:5]] == [1] * 5
    assert sum(step["evaluation_calls"] for step in tracker.steps) == 1
    assert tracker.capture_stats()["module_call_switches"] >= 2


def step_model(lean: bool, monkeypatch) -> list[tuple]:
    """What the tracker records per step for a run with a loss module, an
    EMA copy evaluated at the end, and a forward that raises once."""
    monkeypatch.setenv("OOMDOC_LEAN_MODULE_CALLS", "1" if lean else "0")
    tracker, _calls = hooked_tracker(steady_from=2)
    try:
        model = small_model()
        ema = copy.deepcopy(model)  # never called before its evaluation
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, optimizer, 4, loss_module=nn.SmoothL1Loss())
        with pytest.raises(RuntimeError):
            model(torch.randn(4, 3))  # the script's own mistake, caught
        train(model, optimizer, 2)
        ema.eval()
        with torch.no_grad():
            ema(torch.randn(4, 8))
        train(model, optimizer, 1)
        tracker.finish()
        depth = tracker._module_depth
        switches = tracker.capture_stats()["module_call_switches"]
    finally:
        tracker.uninstall()
    assert depth == 0
    assert (switches > 0) == lean
    keys = ("forward_calls", "evaluation_calls", "backward_calls", "optimizer_steps")
    return [tuple(step[key] for key in keys) for step in tracker.steps] + [
        ("models", len(tracker.models), tracker.evaluation_passes)
    ]


def test_the_step_model_is_the_same_with_lean_calls(monkeypatch):
    lean = step_model(True, monkeypatch)
    hooked = step_model(False, monkeypatch)
    assert lean == hooked
    # The EMA, called once in the steady steps, is a model and an evaluation.
    assert lean[-1] == ("models", 2, 1)


def test_a_compiled_graph_is_seen(monkeypatch):
    monkeypatch.undo()
    compiled = torch.compile(lambda x: x.relu() + 1, backend="eager")
    compiled(torch.randn(3))
    assert module_calls.compile_seen()


def test_a_model_compiled_in_lean_mode_brings_the_hooks_back_for_good():
    tracker, calls = hooked_tracker(steady_from=2)
    try:
        model, optimizer = trained(4)
        assert tracker.module_calls.lean
        compiled = torch.compile(model, backend="eager")
        train(compiled, optimizer, 3)
        still_lean = tracker.module_calls.lean
        tracker.finish()
    finally:
        tracker.uninstall()
    assert not still_lean and not tracker.module_calls.allowed
    assert nn.Module.__call__ is TORCH_CALL
    import torch._dynamo.utils as dynamo_utils

    assert dynamo_utils.unpatched_nn_module_call is TORCH_CALL
    # The compiled model's calls make steps as before.
    assert [step["optimizer_steps"] for step in tracker.steps] == [1] * 7


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_process_forked_in_lean_mode_gets_torchs_own_call():
    tracker, _calls = hooked_tracker(steady_from=1)
    try:
        trained(3)
        assert nn.Module.__call__ is not TORCH_CALL
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say
            os.write(write, b"1" if nn.Module.__call__ is TORCH_CALL else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"1"
        tracker.finish()
    finally:
        tracker.uninstall()


def test_the_lean_call_runs_the_post_hook_when_the_forward_raises():
    tracker, _calls = hooked_tracker(steady_from=1)
    try:
        model, optimizer = trained(3)
        assert tracker.module_calls.lean
        with pytest.raises(RuntimeError):
            F.mse_loss(model(torch.randn(4, 5)), torch.zeros(4, 2))
        assert tracker._module_depth == 0
        train(model, optimizer, 1)
        tracker.finish()
    finally:
        tracker.uninstall()
    assert [step["forward_calls"] for step in tracker.steps] == [1, 1, 1, 2]


def test_a_lean_call_put_back_by_another_patch_leaves_the_calls_to_the_hooks():
    """fx's tracer puts back the `__call__` it found when it began: the lean
    one, if the hooks came back meanwhile. Then each call is hooked once."""
    tracker, calls = hooked_tracker(steady_from=1)
    try:
        model, _optimizer = trained(3)
        lean_call = nn.Module.__call__
        tracker.module_calls.want_lean(False)  # an evaluation begins, say
        nn.Module.__call__ = lean_call  # type: ignore[method-assign]
        del calls[:]
        with torch.no_grad():
            model(torch.randn(4, 8))
        nn.Module.__call__ = TORCH_CALL  # type: ignore[method-assign]
        tracker.finish()
    finally:
        tracker.uninstall()
    called = [name for step, _phase, name in calls if step != "push"]
    assert called == ["Sequential", "Linear", "ReLU", "Linear"]


SCRIPTS = Path(__file__).parent / "scripts"


def lightning_with_validation() -> None:
    """A Lightning `Trainer` that validates every 4 steps (loss modules,
    the closure of automatic optimization, a validation loop under
    inference_mode)."""
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            blocks = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)]
            self.body = nn.Sequential(*blocks, nn.Linear(16, 4))
            self.loss = nn.CrossEntropyLoss()

        def forward(self, x):
            return self.body(x)

        def training_step(self, batch, index):
            x, y = batch
            return self.loss(self(x), y)

        def validation_step(self, batch, index):
            x, y = batch
            self.log("val", self.loss(self(x), y))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    trainer = L.Trainer(
        max_steps=12,
        val_check_interval=4,
        limit_val_batches=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))


def hf_trainer_with_evaluation(tmp_path: Path) -> None:
    """The HF `Trainer` (HfArgumentParser, GPT-2 with gradient checkpointing,
    whose layers override __call__) evaluating every 4 steps."""
    pytest.importorskip("transformers")
    import runpy
    import sys

    argv = sys.argv
    sys.argv = [
        "fw_hf_trainer.py",
        *("--output_dir", str(tmp_path), "--use_cpu", "True", "--max_steps", "10"),
        *("--per_device_train_batch_size", "2", "--eval_samples", "8"),
        *("--eval_strategy", "steps", "--eval_steps", "4", "--gradient_checkpointing", "True"),
        *("--report_to", "none", "--save_strategy", "no"),
    ]
    try:
        runpy.run_path(str(SCRIPTS / "fw_hf_trainer.py"), run_name="__main__")
    finally:
        sys.argv = argv


@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_frameworks_make_the_same_steps_with_lean_calls(framework, monkeypatch, tmp_path):
    def records(lean: bool) -> tuple:
        monkeypatch.setenv("OOMDOC_LEAN_MODULE_CALLS", "1" if lean else "0")
        tracker, _calls = hooked_tracker(steady_from=2)
        try:
            if framework == "lightning":
                lightning_with_validation()
            else:
                hf_trainer_with_evaluation(tmp_path)
            tracker.finish()
            switches = tracker.capture_stats()["module_call_switches"]
        finally:
            tracker.uninstall()
        keys = ("forward_calls", "evaluation_calls", "backward_calls", "optimizer_steps")
        steps = [tuple(step[key] for key in keys) for step in tracker.steps]
        return switches, steps, tracker.evaluation_passes, len(tracker.models)

    lean, hooked = records(True), records(False)
    # Lean between the evaluations (the hooks back for each), the same steps.
    assert lean[0] >= 6 and hooked[0] == 0
    assert lean[1:] == hooked[1:]
    assert lean[2] == 3 and sum(step[1] > 0 for step in lean[1]) == 3
    assert nn.Module.__call__ is TORCH_CALL
