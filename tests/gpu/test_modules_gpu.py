"""Module attribution on a real CUDA device (run on a GPU machine: `make test-gpu`).

The allocator knows blocks by address: modules come from the data pointers of
tensors saved for backward and of module outputs, joined with the allocator's
blocks at the OOM or the peak (oomdoc.capture.modules).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from conftest import EXAMPLES, SCRIPTS, load_json, run_oomdoc

from oomdoc.capture.backends import CudaBackend
from oomdoc.capture.modules import OUTSIDE
from oomdoc.capture.tracker import Tracker
from oomdoc.snapshot import CATEGORIES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GIB = 1024**3


def category_sums(modules) -> dict:
    return {category: sum(entry["bytes"][category] for entry in modules) for category in CATEGORIES}


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, blocks=6, width=256):
        super().__init__()
        self.h = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return self.head(x)


def test_in_process_modules_sum_to_the_breakdown_and_keep_nothing_alive():
    backend = CudaBackend(None)
    tracker = Tracker(backend)
    tracker.install()
    backend.install(tracker)
    try:
        model = Net().cuda()
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            batch = torch.randn(4096, 256, device="cuda")
            loss = model(batch).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        tracker.finish()
        peak = tracker.peak_sample
        modules = peak["modules"]
        assert modules, "no modules at the peak"
        assert category_sums(modules) == peak["breakdown"]
        # Classified from the allocator's blocks at that moment: all of it.
        assert sum(peak["breakdown"].values()) == peak["allocated_bytes"]
        folded = {entry["path"]: entry for entry in modules}
        assert folded["h"]["blocks"] == 6 and folded["h"]["class"] == "Block"
        # The activations the blocks saved for backward are theirs.
        assert folded["h"]["bytes"]["activations"] > 0.5 * peak["breakdown"]["activations"]
        assert folded["h"]["bytes"]["parameters"] == sum(
            backend.storage_bytes(p.untyped_storage().nbytes()) for p in model.h.parameters()
        )
        # The batch (made before the forward) is `other`, in the breakdown and the modules.
        assert folded[OUTSIDE]["bytes"]["other"] >= 4096 * 256 * 4
        # Nothing saved is kept alive by the map: with the graph gone, memory returns.
        del loss, batch
        gc.collect()
        before = torch.cuda.memory_allocated()
        x = torch.randn(4096, 256, device="cuda")
        model(x).sum().backward()
        del x
        gc.collect()
        optimizer.zero_grad(set_to_none=True)
        assert torch.cuda.memory_allocated() <= before
    finally:
        tracker.uninstall()
        backend.uninstall()
        backend.tracker = None  # the OOM observer stays attached: make it a no-op
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_gpt_oom_names_the_blocks_and_one_story(tmp_path):
    snapshot_path = tmp_path / "gpt.json"
    result = run_oomdoc(
        [
            "run",
            "--device-memory",
            "16GiB",
            "--no-replay",
            "-o",
            snapshot_path,
            EXAMPLES / "gpt_train.py",
            "--batch-size",
            "32",
            "--steps",
            "3",
        ],
        timeout=600,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    document = load_json(snapshot_path)
    breakdown = document["breakdown"]
    modules = document["modules"]
    assert category_sums(modules) == breakdown
    allocated = document["oom"]["allocated_bytes"]
    assert abs(sum(breakdown.values()) - allocated) <= 0.01 * allocated
    top = modules[0]
    assert (top["path"], top["class"], top["blocks"]) == ("blocks", "Block", 12)
    assert top["bytes"]["activations"] > 0.5 * breakdown["activations"]
    assert {inner["path"] for inner in top["inner"]} & {"attn.qkv", "mlp.0", "mlp.1", "attn"}
    # One story: the token batch is `other`, and tiny; the activations are not `other`.
    assert breakdown["other"] < 64 * 1024**2
    for site in document["top_allocations"]:
        if site["category"] == "other":
            assert site["bytes"] < 64 * 1024**2


def test_hugging_face_gpt2_on_cuda_folds_transformer_h(tmp_path):
    pytest.importorskip("transformers")

    snapshot_path = tmp_path / "hf.json"
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cuda",
            "--no-replay",
            "-o",
            snapshot_path,
            SCRIPTS / "hf_gpt2_tiny.py",
            "--batch-size",
            "64",
            "--steps",
            "2",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = load_json(snapshot_path)
    modules = document["modules"]
    assert category_sums(modules) == document["breakdown"]
    folded = {entry["path"]: entry for entry in modules}
    assert folded["transformer.h"]["blocks"] == 4
    assert folded["transformer.h"]["bytes"]["activations"] > 0
