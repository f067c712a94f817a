"""A torch.compile'd model under the capture's hooks compiles as it does
without them (oomdoc.capture.modules.traced_by_compile): traced by Dynamo,
the global module hooks and the saved-tensors hook do nothing, and the
compiled model's outermost call, which runs eagerly, still makes the steps."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT, benchmark_module

from oomdoc.capture.tracker import StopRun, Tracker

sys.path.insert(0, str(REPO_ROOT / "examples"))
from gpt_train import GPT  # type: ignore[import-not-found]  # noqa: E402

# CPU tensors as the device: the tracker's CUDA code path (pack hook included).
HostBackend = benchmark_module("host_overhead").HostBackend


def compiled_training(tracker: Tracker | None, in_place: bool = False) -> dict:
    """Dynamo's counts for 4 steps of a compiled 2-layer GPT (aot_eager: no
    C++ compiler needed), under `tracker` when given; `in_place`:
    `model.compile()` rather than `torch.compile(model)`."""
    from torch._dynamo import reset
    from torch._dynamo.utils import counters

    reset()
    counters.clear()
    if tracker is not None:
        tracker.install()
        tracker.scopes.any_device = True
    try:
        torch.manual_seed(0)
        model = GPT(layers=2, width=32, heads=2, seq_len=8, vocab=64)
        if in_place:
            model.compile(backend="aot_eager")
            compiled = model
        else:
            compiled = torch.compile(model, backend="aot_eager")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 64, (2, 8))
        for _ in range(4):
            logits = compiled(ids)
            loss = F.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if tracker is not None:
            tracker.finish()
    finally:
        if tracker is not None:
            tracker.uninstall()
        graph_breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        reset()
    return {"graphs": graphs, "graph_breaks": graph_breaks}


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`")
@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_compiles_as_without_the_capture_and_makes_steps(in_place):
    plain = compiled_training(None, in_place)
    assert plain == {"graphs": 1, "graph_breaks": 0}
    tracker = Tracker(HostBackend())
    assert compiled_training(tracker, in_place) == plain
    steps = tracker.steps
    assert len(steps) == 4
    assert [step["forward_calls_with_grad"] for step in steps] == [1] * 4
    # AOTAutograd's own autograd.grad on fake tensors, compiling, is no backward.
    assert [step["backward_calls"] for step in steps] == [1] * 4
    assert [step["optimizer_steps"] for step in steps] == [1] * 4
    assert [model["class"] for model in tracker.models] == [
        "GPT" if in_place else "OptimizedModule"
    ]
    assert tracker.models[0]["repeated_blocks"]
    assert tracker._module_depth == 0


def test_a_model_compiled_in_place_runs_alone_once_the_capture_is_gone():
    tracker = Tracker(HostBackend())
    tracker.install()
    try:
        model = GPT(layers=1, width=16, heads=2, seq_len=4, vocab=32)
        model.compile(backend="eager")
    finally:
        tracker.uninstall()
    ids = torch.randint(0, 32, (1, 4))
    assert model(ids).shape == (1, 4, 32)
    assert tracker.steps == [] and tracker._current["forward_calls"] == 0


def test_a_compiled_step_function_makes_steps_at_its_backwards_and_stops_at_the_limit():
    """`loss = compiled_step(x, y); loss.backward()`: the model call is inside
    the compiled function (traced, unseen, as Lightning's compiled
    training_step): each backward after an optimizer step begins the next
    step, and a replay's step limit stops the run there."""
    from torch._dynamo import reset

    reset()
    tracker = Tracker(HostBackend(), max_steps=2)
    tracker.install()
    tracker.scopes.any_device = True
    stopped = False
    backwards = 0
    try:
        torch.manual_seed(0)
        model = GPT(layers=1, width=16, heads=2, seq_len=4, vocab=32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        @torch.compile(backend="aot_eager")
        def loss_of(ids):
            logits = model(ids)
            return F.cross_entropy(logits.reshape(-1, 32), ids.reshape(-1))

        ids = torch.randint(0, 32, (2, 4))
        try:
            for _ in range(4):
                loss = loss_of(ids)
                loss.backward()
                backwards += 1
                optimizer.step()
                optimizer.zero_grad()
        except StopRun:
            stopped = True
    finally:
        tracker.uninstall()
        reset()
    assert stopped and backwards == 2
    steps = tracker.steps
    assert [(s["backward_calls"], s["optimizer_steps"]) for s in steps] == [(1, 1)] * 2
    assert not any(step["forward_calls"] for step in steps)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_given_a_compiled_module_makes_a_step_per_optimizer_step(tmp_path):
    """Lightning's Trainer given `torch.compile(module)` compiles the module's
    training_step (lightning.pytorch.utilities.compile.from_compiled): the
    model call is inside it, unseen; the steps still follow the optimizer."""
    lightning = pytest.importorskip("lightning")
    from torch._dynamo import reset

    class Classifier(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)
            )

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_index):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    reset()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 2, (64,)))
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    tracker = Tracker(HostBackend())
    tracker.install()
    tracker.scopes.any_device = True
    try:
        compiled = torch.compile(Classifier(), backend="aot_eager")
        trainer.fit(compiled, torch.utils.data.DataLoader(data, batch_size=8))
        tracker.finish()
    finally:
        tracker.uninstall()
        reset()
    steps = tracker.steps
    assert [(s["backward_calls"], s["optimizer_steps"]) for s in steps] == [(1, 1)] * 5
