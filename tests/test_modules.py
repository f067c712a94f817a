"""Module attribution (oomdoc.capture.modules): paths, folding, exact sums,
one category rule for the breakdown, the sites and the modules.

In-process tests on the simulated device, a fake "CUDA" backend that lists
CPU storages as allocator blocks (to exercise the address join without a
GPU), and two end-to-end runs of the real CLI.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from conftest import SCRIPTS, load_json, run_oomdoc

from oomdoc.capture.backends import Backend, OutOfMemoryError, SimulatedBackend
from oomdoc.capture.modules import (
    OUTSIDE,
    REMAINDER,
    ModuleScopes,
    module_table,
    phase_from_frames,
)
from oomdoc.capture.tracker import StopRun, Tracker
from oomdoc.snapshot import CATEGORIES


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, blocks=3, width=32):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.h = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 10))
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x):
        x = self.embed(x) * self.scale
        for block in self.h:
            x = block(x)
        return self.head(x)


def category_sums(modules) -> dict:
    return {category: sum(entry["bytes"][category] for entry in modules) for category in CATEGORIES}


# ---------------------------------------------------------------- naming and folding


def test_paths_and_folding_of_repeated_blocks():
    scopes = ModuleScopes()
    model = Net(blocks=3)
    scopes.add_model(model)
    assert scopes.path_of(model.h[2].fc1) == "h.2.fc1"
    assert scopes.path_of(model) == "(root)"
    # Same-class children of the ModuleList fold into one entry with the
    # path inside the block kept; the Sequential head has two classes: no fold.
    assert scopes.fold("h.2.fc1") == ("h", "Block", 3, "fc1")
    assert scopes.fold("h.0") == ("h", "Block", 3, "")
    assert scopes.fold("head.1") == ("head.1", "Linear", 1, None)
    assert scopes.fold(None)[0] == OUTSIDE
    # An allocation site shows the same folding as a path.
    assert scopes.site_label("h.2.fc1") == "h.*.fc1"
    assert scopes.site_label("h.0") == "h.*"
    assert scopes.site_label("head.1") == "head.1"
    assert scopes.site_label(None) is None
    # A module not under any known model is named by its class.
    assert scopes.path_of(nn.Dropout()) == "Dropout"


def test_outermost_container_wins_and_root_sequential_folds():
    scopes = ModuleScopes()
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)) for _ in range(4))
    )
    scopes.add_model(model)
    assert scopes.fold("2.0") == ("(root)", "Sequential", 4, "0")
    assert scopes.fold("3") == ("(root)", "Sequential", 4, "")
    other = ModuleScopes()
    other.add_model(inner)
    # Linear x2 in the root Sequential: folded; the single ReLU is not.
    assert other.fold("2") == ("(root)", "Linear", 2, "")
    assert other.fold("1") == ("1", "ReLU", 1, None)


def test_a_second_model_is_prefixed_and_a_part_called_first_is_renamed():
    scopes = ModuleScopes()
    model = Net(blocks=2)
    scopes.add_model(model.h[0])  # called on its own first
    assert scopes.path_of(model.h[0].fc1) == "fc1"
    scopes.add_model(model)
    assert scopes.path_of(model.h[0].fc1) == "h.0.fc1"
    loss = nn.CrossEntropyLoss()
    scopes.add_model(loss)
    assert scopes.path_of(loss) == "CrossEntropyLoss"
    scopes.add_model(model.h[1])  # already named as part of the model
    assert scopes.path_of(model.h[1]) == "h.1"
    # A second network whose paths would clash is prefixed with its class.
    twin = Net(blocks=2)
    scopes.add_model(twin)
    assert scopes.path_of(twin.h[1].fc2) == "Net.h.1.fc2"
    assert scopes.fold("Net.h.1.fc2") == ("Net.h", "Block", 2, "fc2")


def test_module_table_caps_with_a_remainder_that_keeps_the_sums():
    attributed = [(f"m{i}", "activations", 100 * (i + 1)) for i in range(6)]
    attributed += [("m5", "parameters", 7), (None, "other", 3), ("m0", "activations", 0)]
    table = module_table(attributed, lambda path: (path or OUTSIDE, "X", 1, None), limit=3)
    assert [entry["path"] for entry in table] == ["m5", "m4", "m3", REMAINDER]
    assert table[-1]["blocks"] == 4  # m2, m1, m0 and the outside entry
    sums = category_sums(table)
    assert sums["activations"] == sum(100 * (i + 1) for i in range(6))
    assert sums["parameters"] == 7 and sums["other"] == 3


def test_phase_from_allocation_frames():
    module_frame = {"filename": "/x/torch/nn/modules/module.py", "name": "_call_impl", "line": 1}
    user = {"filename": "/home/me/train.py", "name": "main", "line": 3}
    optim = {"filename": "/x/torch/optim/adamw.py", "name": "step", "line": 9}
    assert phase_from_frames([]) == "backward"  # the autograd engine's thread
    assert phase_from_frames([user, module_frame]) == "forward"
    assert phase_from_frames([optim, user]) == "optimizer"
    assert phase_from_frames([user]) is None


# ---------------------------------------------------------------- simulated device


def run_steps(tracker, model, steps=2, batch=64):
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(steps):
        x = torch.randn(batch, 16)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


@pytest.fixture
def simulated():
    installed = []

    def make(capacity=1 << 30):
        backend = SimulatedBackend(capacity)
        tracker = Tracker(backend)
        tracker.install()
        backend.install(tracker)
        installed.append((tracker, backend))
        return tracker, backend

    yield make
    for tracker, backend in installed:
        backend.uninstall()
        tracker.uninstall()


def test_modules_sum_exactly_to_the_breakdown_and_sites_agree(simulated):
    tracker, backend = simulated()
    torch.manual_seed(0)
    model = Net(blocks=3)
    run_steps(tracker, model)
    tracker.finish()
    peak = tracker.peak_sample
    modules = peak["modules"]
    assert category_sums(modules) == peak["breakdown"]
    folded = next(entry for entry in modules if entry["path"] == "h")
    assert folded["class"] == "Block" and folded["blocks"] == 3
    assert folded["bytes"]["activations"] > 0
    # Parameters and optimizer state belong to the parameter's module.
    block_parameters = sum(p.numel() * 4 for p in model.h.parameters())
    assert folded["bytes"]["parameters"] == block_parameters
    assert folded["bytes"]["optimizer_state"] >= 2 * block_parameters
    # The buffer is `other` of the root module.
    root = next(entry for entry in modules if entry["path"] == "(root)")
    assert root["bytes"]["other"] == model.scale.numel() * 4
    # Now: every site (no cap) has the breakdown's category for its bytes.
    breakdown, sites = tracker.breakdown_and_sites(limit=10**6)
    by_site = {category: 0 for category in CATEGORIES}
    for site in sites:
        by_site[site["category"]] += site["bytes"]
    assert by_site == breakdown
    assert category_sums(tracker.last_modules) == breakdown


def test_backward_allocations_go_to_the_module_whose_backward_runs(simulated):
    tracker, backend = simulated()
    model = Net(blocks=2)
    seen = []

    def spy(grad):
        seen.extend(
            record.module
            for _key, _nbytes, record in backend.live_storages()
            if record.phase == "backward"
        )

    x = torch.randn(32, 16)
    out = model(x)
    model.h[0].fc1.weight.register_hook(spy)
    out.square().mean().backward()
    assert {"h.0.fc1", "h.1.fc2", "head.1"} <= set(seen)


def test_the_oom_names_the_module_and_the_modules_sum_at_the_oom(simulated):
    tracker, backend = simulated(capacity=3 << 20)
    model = Net(blocks=4, width=64)
    with pytest.raises(OutOfMemoryError):
        run_steps(tracker, model, steps=2, batch=2048)
    oom = tracker.oom
    assert oom is not None and oom["module"] is not None
    assert category_sums(oom["modules"]) == oom["breakdown"]
    assert any(entry["path"] == "h" and entry["blocks"] == 4 for entry in oom["modules"])


# ---------------------------------------------------------------- the CUDA join, faked


class BlockListingBackend(Backend):
    """CPU storages presented as CUDA allocator blocks (address, size, frames)."""

    kind = "cuda"
    per_storage = False

    def __init__(self):
        self.blocks = {}

    def owns(self, tensor):
        return tensor.device.type == "cpu"

    def allocated_bytes(self):
        return sum(size for size, _frames in self.blocks.values())

    def reserved_bytes(self):
        return self.allocated_bytes()

    def capacity_bytes(self):
        return 1 << 30

    def read_and_reset_peak(self):
        return self.allocated_bytes(), self.allocated_bytes()

    def add(self, tensor, frames):
        storage = tensor.untyped_storage()
        self.blocks[storage.data_ptr()] = (storage.nbytes(), frames)

    def allocation_sites(self):
        return [
            {
                "address": address,
                "bytes": size,
                "size": size,
                "phase": phase_from_frames(frames),
                "location": None,
                "shape": None,
                "dtype": None,
            }
            for address, (size, frames) in self.blocks.items()
        ]


def test_cuda_join_one_category_per_block_and_no_tensor_kept_alive():
    backend = BlockListingBackend()
    tracker = Tracker(backend)
    tracker.install()
    tracker.scopes.any_device = True
    try:
        model = Net(blocks=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        batch = torch.randn(8, 16)
        out = model(batch)  # tensors saved for backward are remembered by address
        for parameter in model.parameters():
            backend.add(parameter, [])
        for buffer in model.buffers():
            backend.add(buffer, [{"filename": "/me/train.py", "name": "main"}])
        backend.add(batch, [{"filename": "/me/train.py", "name": "main"}])
        backend.add(out, [])
        stray = torch.empty(1000)  # a backward temporary: no Python frames
        backend.add(stray, [])
        breakdown, sites = tracker.breakdown_and_sites(limit=10**6)
        modules = tracker.last_modules
        assert category_sums(modules) == breakdown
        assert sum(breakdown.values()) == backend.allocated_bytes()
        by_site = {category: 0 for category in CATEGORIES}
        for site in sites:
            by_site[site["category"]] += site["bytes"]
        assert by_site == breakdown
        by_module: dict = {}
        for site in sites:
            by_module[site["module"]] = by_module.get(site["module"], 0) + site["bytes"]
        # The batch and the backward temporary: no module (a buffer has its owner).
        assert by_module[None] == batch.untyped_storage().nbytes() + stray.nbytes
        assert by_module["head.1"] == out.untyped_storage().nbytes() + sum(
            p.untyped_storage().nbytes() for p in model.head[1].parameters()
        )
        # The input batch is not an activation (made before the forward), even
        # though the first Linear saved it; the output is head.1's activation.
        assert breakdown["other"] == batch.untyped_storage().nbytes() + model.scale.nbytes
        head = next(entry for entry in modules if entry["path"] == "head.1")
        assert head["bytes"]["activations"] == out.untyped_storage().nbytes()
        assert head["bytes"]["parameters"] == sum(p.nbytes for p in model.head[1].parameters())
        outside = next(entry for entry in modules if entry["path"] == OUTSIDE)
        assert outside["bytes"]["activations"] == stray.nbytes
        # The map holds no tensor: once backward frees the graph, the storages
        # it saved die and their entries go.
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        inside = [
            ref
            for pointer, (path, ref) in tracker.scopes._saved.items()
            if path.startswith("h.") and pointer not in parameters
        ]
        assert len(inside) >= 4
        out.square().sum().backward()
        optimizer.step()
        del out
        gc.collect()
        assert all(ref() is None for ref in inside)
        assert not any(
            path.startswith("h.") and pointer not in parameters
            for pointer, (path, _ref) in tracker.scopes._saved.items()
        )
    finally:
        tracker.uninstall()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def penalty_gradients(model, batch):
    """The gradient of a WGAN-GP-style penalty on the input's gradient norm
    with respect to the first layer's weight."""
    batch = batch.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(batch).sum(), batch, create_graph=True)
    penalty = (gradient.norm(2, dim=1) - 1).square().mean()
    (weight_gradient,) = torch.autograd.grad(penalty, model[0].weight)
    return weight_gradient


def test_the_cuda_pack_hook_keeps_no_graph_alive_and_leaves_gradients_as_they_are():
    # Autograd hands a pack hook an op's output with its grad_fn: kept as it
    # is, the node holds itself, and a graph dropped without a backward (a
    # sample image made without no_grad) keeps its saved outputs for good.
    model = nn.Sequential(nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 16), nn.Tanh())
    batch = torch.randn(8, 16)
    expected = torch.autograd.grad(model(batch).square().sum(), list(model.parameters()))
    expected_penalty = penalty_gradients(model, batch)
    backend = BlockListingBackend()
    tracker = Tracker(backend)
    tracker.install()
    tracker.scopes.any_device = True
    enabled = gc.isenabled()
    gc.disable()  # no collector to break a cycle: freed when dropped, or never
    try:
        saved = model[:2](batch)  # Sigmoid saves its output
        dropped = weakref.ref(saved.untyped_storage())
        assert saved.untyped_storage().data_ptr() in tracker.scopes._saved
        del saved
        assert dropped() is None
        got = torch.autograd.grad(model(batch).square().sum(), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        # A gradient penalty (WGAN-GP): a backward through the saved tensors
        # of a graph made by a backward.
        assert torch.equal(penalty_gradients(model, batch), expected_penalty)
        out = torch.sigmoid(model[0](batch))
        out.mul_(2)  # modifies the saved output: backward must still refuse
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    finally:
        if enabled:
            gc.enable()
        tracker.uninstall()


def test_torch_func_grad_runs_under_the_cuda_pack_hook():
    backend = BlockListingBackend()
    tracker = Tracker(backend)
    tracker.install()
    try:
        # torch.func refuses to run while default saved-tensor hooks are set;
        # the capture steps aside for it.
        x = torch.randn(3, 4)
        result = torch.func.grad(lambda value: (value * value).sum())(x)
        assert torch.allclose(result, 2 * x)
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    finally:
        tracker.uninstall()


# ---------------------------------------------------------------- end to end


def test_cli_gpt_tiny_names_the_folded_blocks(tiny_gpt_oom_run):
    result, snapshot = tiny_gpt_oom_run
    assert result.returncode == 1, result.stderr[-2000:]
    document = load_json(snapshot)
    assert document["breakdown_at"] == "oom"
    modules = document["modules"]
    assert category_sums(modules) == document["breakdown"]
    blocks = modules[0]
    assert (blocks["path"], blocks["class"], blocks["blocks"]) == ("blocks", "Block", 4)
    assert blocks["bytes"]["activations"] > 0.5 * document["breakdown"]["activations"]
    assert {inner["path"] for inner in blocks["inner"]} & {"attn.qkv", "mlp.0", "attn"}


def test_cli_hugging_face_gpt2_names_transformer_h(tmp_path):
    pytest.importorskip("transformers")
    snapshot = tmp_path / "hf.json"
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "256MiB",
            "--no-replay",
            "-o",
            snapshot,
            SCRIPTS / "hf_gpt2_tiny.py",
            "--batch-size",
            "8",
            "--steps",
            "2",
        ]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    document = load_json(snapshot)
    assert document["breakdown_at"] == "peak"
    modules = document["modules"]
    assert category_sums(modules) == document["breakdown"]
    folded = {entry["path"]: entry for entry in modules}
    assert folded["transformer.h"]["blocks"] == 4
    assert folded["transformer.h"]["class"] == "GPT2Block"
    assert modules[0]["path"] == "transformer.h"
    # The sites name the layer that allocated, its blocks folded.
    site_modules = {site["module"] for site in document["top_allocations"]}
    assert any(module and module.startswith("transformer.h.*.") for module in site_modules)
    assert not any(module and ".h.0" in module for module in site_modules)
    # Tied input and output embeddings count once, with the first owner.
    assert folded["transformer.wte"]["bytes"]["parameters"] > 0


def test_a_model_called_with_keyword_tensors_records_their_shapes(simulated):
    """`model(**batch)` (the HF Trainer's call) passes the batch by keyword:
    the step's input shapes list those tensors after the positional ones, for
    the step's first training call only, so that batches of one shape made
    without a DataLoader are certified as seen, whichever way they are passed."""
    tracker, _backend = simulated()

    class Keyed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, scale, input_ids=None, labels=None, note=None):
            return ((self.linear(input_ids) - labels) * scale).square().mean()

    model = Keyed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for micro in (8, 4):  # a second, smaller micro-batch: not recorded
            batch = {"input_ids": torch.randn(micro, 16), "labels": torch.randn(micro, 16)}
            model(torch.ones(1), **batch, note="text").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tracker.finish()
    shapes = [step.get("input_shapes") for step in tracker.steps]
    assert shapes == [[[1], [8, 16], [8, 16]]] * 3


def test_a_step_whose_training_calls_meet_new_input_shapes_is_marked(simulated):
    """A step is `new_shapes` when one of its training calls has input
    shapes (positional or by keyword) no earlier training call had: per-shape
    warm-up (cuDNN attention's plan per sequence length) is in its time. An
    evaluation call at a new shape does not mark the step."""
    tracker, _backend = simulated()
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for rows, keyed, evaluated in (
        (8, False, 0),
        (8, False, 5),
        (4, False, 0),
        (8, True, 0),
        (8, True, 0),
    ):
        batch = torch.randn(rows, 16)
        loss = (model(input=batch) if keyed else model(batch)).square().mean()
        loss.backward()
        if evaluated:
            with torch.no_grad():
                model(torch.randn(evaluated, 16))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tracker.finish()
    assert [bool(step.get("new_shapes")) for step in tracker.steps] == [
        True,
        False,
        True,
        True,
        False,
    ]


def test_an_evaluation_in_the_replays_last_step_gives_the_device_back_first(simulated):
    """Replays side by side hold the device alone for their timed steps. An
    evaluation the replay's last step runs (the HF Trainer asked to evaluate
    at its end) is never timed: the device is given back before it, so its
    warm-up (cuDNN plans for each new length, seconds in bf16) does not keep
    the other replays waiting."""
    tracker, _backend = simulated()
    tracker.max_steps = 3
    events = []
    tracker.share_device(
        lambda: events.append(("alone", tracker.step_index)),
        lambda: events.append(("done", tracker.step_index, tracker._current["evaluation_calls"])),
        lambda: False,
    )
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(StopRun):
        for index in range(5):
            model(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if index in (0, 2):  # an evaluation mid-run, then in the last step
                with torch.no_grad():
                    model(torch.randn(4, 16))
    assert events == [("alone", 0), ("done", 2, 0)]
    tracker.finish()
    assert [bool(step.get("after_timed_steps")) for step in tracker.steps] == [False] * 3


def test_a_forward_that_raises_leaves_the_tracking_as_it_was(simulated):
    """torch calls an always-called forward hook without the call's keyword
    arguments when the forward raised (an OOM a script catches, the HF
    batch-size finder): the hook takes both forms, so nothing warns and the
    steps after it are counted as before."""
    import warnings

    tracker, _backend = simulated()

    class Failing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.fail = False

        def forward(self, x):
            if self.fail:
                raise RuntimeError("out of memory (simulated by the test)")
            return self.linear(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Failing()

        def forward(self, x, scale=None):
            return self.inner(x) * scale

    model = Outer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.inner.fail = True
        with pytest.raises(RuntimeError, match="simulated"):
            model(torch.randn(4, 16), scale=torch.ones(1))
        model.inner.fail = False
        for _ in range(2):
            model(torch.randn(4, 16), scale=torch.ones(1)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    tracker.finish()
    assert not [str(warning.message) for warning in caught if "hook" in str(warning.message)]
    # The call that raised is the first step's, beside the one that trained.
    assert [step["forward_calls"] for step in tracker.steps] == [2, 1]
    assert tracker.steps[-1].get("input_shapes") == [[4, 16], [1]]
