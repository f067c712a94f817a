"""What oomdoc's CUDA capture costs the host per training step, without a GPU.

    python benchmarks/host_overhead.py [--model hf|gpt|mlp] [--steps 40] [--rounds 5]
    python benchmarks/host_overhead.py --device cuda      # on a GPU: the real backend

On a GPU a training step whose kernels are small is bound by the host: the
Python that launches them. Every microsecond the capture adds to the host's
step then adds to the step. This runs the CUDA code path of the tracker (the
global module hooks, the module scopes with their saved-tensor pack hook, the
phase boundaries that name parameters, gradients and optimizer state, the
per-step leak check) on CPU tensors through a backend that presents them as
the device, so the Python work is the same as on CUDA; what is left out is
the allocator's own work (its statistics, its allocation history). With
`--device cuda` the same models run on the GPU under the real CUDA backend,
allocation history included (and a row without it); there the backend pauses
the stacks and the module scopes itself once the steps are steady
(oomdoc.capture.stack_recording), as the warm-up steps make them. On the CPU
the row `oomdoc, steady steps` times that paused state, the row `oomdoc` the
detailed one (the first steps of a run, evaluation, a run that is not steady).

The models are tiny (their arithmetic is a few percent of a step), so a step
is almost all framework Python, like a launch-bound GPU step:

  hf   a 24-layer GPT-2 built from a transformers config (n_embd 64), AdamW
  gpt  oomdoc's reference GPT (examples/gpt_train.py), 12 layers, AdamW
  mlp  24 residual MLP blocks (nn.Linear, nn.GELU, nn.LayerNorm), SGD momentum

Prints per configuration the host time per step (CPU time of this thread,
median of interleaved rounds), what the capture adds per step, and that as a
share of the plain step: the overhead of a step fully bound by the host, the
worst case on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from itertools import compress  # noqa: E402
from operator import attrgetter  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from oomdoc.capture.backends import Backend, CudaBackend  # noqa: E402
from oomdoc.capture.tracker import Tracker  # noqa: E402

_IS_CPU = attrgetter("is_cpu")


class HostBackend(Backend):
    """CPU tensors presented as the device: the tracker takes its CUDA path
    (no per-storage counters, storages rounded as the caching allocator
    rounds them), and its allocator reads cost nothing. The tests of that
    path use it too (tests/test_known_tables.py)."""

    kind = "cuda"
    per_storage = False
    storage_bytes = CudaBackend.storage_bytes

    def owns(self, tensor) -> bool:
        return tensor.is_cpu

    def owned(self, tensors: list) -> list:
        return list(compress(tensors, map(_IS_CPU, tensors)))

    def allocated_bytes(self) -> int:
        return 0

    def reserved_bytes(self) -> int:
        return 0

    def capacity_bytes(self) -> int:
        return 1 << 40

    def read_and_reset_peak(self) -> tuple[int, int]:
        return 0, 0


class SteadyHostBackend(HostBackend):
    """HostBackend that answers, once `steady` is set, what the CUDA backend
    answers on a steady run (oomdoc.capture.stack_recording): no detail for
    training steps, so the module scopes pause (its allocator, here none,
    would stop recording stacks)."""

    steady = False

    def step_closed(self, step: dict) -> bool:
        return not self.steady

    def phase_started(self, phase: str) -> bool:
        return not self.steady or phase == "evaluation"


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def build(name: str, device: str = "cpu"):
    """(model, optimizer, step function) of a tiny model of that kind."""
    torch.manual_seed(0)
    if name == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=24,
            n_embd=64,
            n_head=4,
            n_positions=64,
            vocab_size=256,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = GPT2LMHeadModel(config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 256, (2, 16), device=device)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

    elif name == "gpt":
        sys.path.insert(0, str(ROOT / "examples"))
        from gpt_train import GPT  # type: ignore[import-not-found]

        model = GPT(layers=12, width=64, heads=4, seq_len=16, vocab=256).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 256, (2, 16), device=device)

        def step():
            logits = model(ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

    else:
        model = nn.Sequential(*(Block(32) for _ in range(24)), nn.Linear(32, 10)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x, y = torch.randn(4, 32, device=device), torch.randint(0, 10, (4,), device=device)

        def step():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

    return model, optimizer, step


def time_steps(step, steps: int) -> float:
    """Median CPU time of this thread per step (other processes on a busy
    machine do not count)."""
    samples = []
    for _ in range(steps):
        started = time.thread_time()
        step()
        samples.append(time.thread_time() - started)
    return statistics.median(samples)


def under_tracker(
    step,
    steps: int,
    device: str,
    pack_hook: bool,
    history: bool = True,
    steady: bool = False,
    lean: bool = True,
):
    """(host seconds per step, capture stats) of `steps` steps under a tracker.
    `steady` (CPU): the steps timed run as the CUDA backend runs steady steps;
    on CUDA the backend itself decides (the warm-up steps make the run steady).
    `lean`: steady steps hook only the outermost module calls
    (oomdoc.capture.module_calls), as oomdoc does; False keeps the global hooks."""
    switches = {
        "OOMDOC_MODULE_HOOKS": "1" if pack_hook else "0",
        "OOMDOC_ALLOCATION_HISTORY": "1" if history else "0",
        "OOMDOC_LEAN_MODULE_CALLS": "1" if lean else "0",
    }
    previous = {name: os.environ.get(name) for name in switches}
    os.environ.update(switches)
    if device == "cuda":
        from oomdoc.capture.backends import CudaBackend

        backend: Backend = CudaBackend(None)
    else:
        backend = SteadyHostBackend() if steady else HostBackend()
    tracker = Tracker(backend)
    backend.install(tracker)
    tracker.install()
    tracker.scopes.any_device = device != "cuda"
    try:
        for _ in range(5):  # the first steps name the model and build the tables
            step()
        if isinstance(backend, SteadyHostBackend):
            backend.steady = True
            step()
        seconds = time_steps(step, steps)
        return seconds, tracker.capture_stats()
    finally:
        tracker.uninstall()
        backend.uninstall()
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("hf", "gpt", "mlp"), default="hf")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the real CUDA backend (allocator statistics and history included)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _optimizer, step = build(args.model, args.device)
    calls = [0]
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda *_: calls.__setitem__(0, calls[0] + 1)
    )
    step()
    handle.remove()
    module_calls = calls[0]
    gc.collect()
    configurations = {
        "oomdoc": {"pack_hook": True},
        "oomdoc, no pack hook": {"pack_hook": False},
    }
    if args.device == "cuda":
        configurations["oomdoc, no allocation history"] = {"pack_hook": True, "history": False}
        configurations["oomdoc, global hooks"] = {"pack_hook": True, "lean": False}
    else:
        configurations["oomdoc, steady steps"] = {"pack_hook": True, "steady": True}
        configurations["oomdoc, steady steps, global hooks"] = {
            "pack_hook": True,
            "steady": True,
            "lean": False,
        }
    samples: dict[str, list[float]] = {"plain": [], **{name: [] for name in configurations}}
    for _ in range(args.rounds):  # interleaved
        for _ in range(3):
            step()
        samples["plain"].append(time_steps(step, args.steps))
        for name, switches in configurations.items():
            samples[name].append(under_tracker(step, args.steps, args.device, **switches)[0])
    plain = statistics.median(samples["plain"])
    rows = []
    for label, values in samples.items():
        seconds = statistics.median(values)
        added = seconds - plain
        rows.append(
            [
                label,
                f"{seconds * 1e3:.2f} ms",
                "" if label == "plain" else f"{added * 1e6:+.0f} us",
                "" if label == "plain" else f"{added / module_calls * 1e6:+.2f} us",
                "" if label == "plain" else f"{added / plain * 100:+.1f}%",
            ]
        )
    print(
        f"{args.model}: {module_calls} module calls per step, "
        f"{sum(p.numel() > 0 for p in model.parameters())} parameter tensors, "
        f"torch {torch.__version__}, median of {args.rounds} rounds x {args.steps} steps"
    )
    print(
        tabulate(
            rows,
            headers=[
                "how",
                "host time per step",
                "capture adds",
                "per module call",
                "if the step is host-bound",
            ],
        )
    )


if __name__ == "__main__":
    main()
