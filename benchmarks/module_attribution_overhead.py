"""What module attribution costs per module call (CPU, no device needed).

    python benchmarks/module_attribution_overhead.py [--blocks 400] [--repeats 30]

A model of many tiny modules (each block: Linear(8, 8) -> ReLU, inside an
nn.Sequential, so the forward is almost all module-call overhead) runs its
forward under three sets of global module hooks:

  none       no hooks at all
  depth      the tracker's hooks before module attribution (a depth counter)
  scopes     the same plus ModuleScopes.push/pop (path stack + autograd timeline)

and, for the CUDA path, the cost of remembering one saved tensor's storage
(`ModuleScopes._remember_storage`: data pointer, weak reference), timed on CPU
tensors. Prints one table; the per-call cost is (scopes - depth) / calls.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from tabulate import tabulate  # noqa: E402

from oomdoc.capture.modules import ModuleScopes  # noqa: E402


def make_model(blocks: int) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(blocks)))


def time_forward(model, x, repeats: int, grad: bool) -> float:
    """The fastest of `repeats` forwards in CPU time of this thread (other
    processes on a busy machine only add, and do not count)."""
    samples = []
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            model(x)
        for _ in range(repeats):
            started = time.thread_time()
            model(x)
            samples.append(time.thread_time() - started)
    return min(samples)


class DepthHooks:
    """The tracker's hooks without module attribution: a depth counter."""

    def __init__(self):
        self.depth = 0

    def pre(self, module, inputs):
        self.depth += 1

    def post(self, module, inputs, output):
        self.depth = max(0, self.depth - 1)


class ScopeHooks(DepthHooks):
    def __init__(self, scopes):
        super().__init__()
        self.scopes = scopes

    def pre(self, module, inputs):
        self.depth += 1
        self.scopes.push(module, inputs if self.depth == 1 else None)

    def post(self, module, inputs, output):
        self.scopes.pop(output)
        self.depth = max(0, self.depth - 1)


def with_hooks(hooks, run):
    handles = []
    if hooks is not None:
        hooks_module = nn.modules.module
        handles.append(hooks_module.register_module_forward_pre_hook(hooks.pre))
        handles.append(hooks_module.register_module_forward_hook(hooks.post, always_call=True))
    try:
        return run()
    finally:
        for handle in handles:
            handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = make_model(args.blocks)
    calls = 1 + args.blocks * 3  # the root, each block and its two children
    x = torch.randn(4, 8)
    scopes = ModuleScopes()
    scopes.add_model(model)
    rows = []
    for grad in (False, True):
        times = {}
        for _ in range(5):  # interleaved, the fastest of all runs each
            for label, hooks in (
                ("none", None),
                ("depth", DepthHooks()),
                ("scopes", ScopeHooks(scopes)),
            ):
                seconds = with_hooks(
                    hooks, lambda grad=grad: time_forward(model, x, args.repeats, grad)
                )
                times[label] = min(times.get(label, seconds), seconds)
        per_call = (times["scopes"] - times["depth"]) / calls
        rows.append(
            [
                "grad" if grad else "no_grad",
                calls,
                f"{times['none'] * 1e3:.2f} ms",
                f"{times['depth'] * 1e3:.2f} ms",
                f"{times['scopes'] * 1e3:.2f} ms",
                f"{per_call * 1e6:.2f} us",
                f"{(times['scopes'] / times['depth'] - 1) * 100:+.1f}%",
            ]
        )
    print(
        tabulate(
            rows,
            headers=[
                "autograd",
                "module calls",
                "no hooks",
                "depth hooks",
                "+ scopes",
                "per module call",
                "vs depth hooks",
            ],
        )
    )

    # The CUDA path's per-saved-tensor cost, on CPU tensors; the garbage
    # collector off, as its passes over all of torch's objects would dominate.
    gc.collect()
    gc.disable()
    tensors = [torch.empty(16) for _ in range(20000)]
    scopes.path = "blocks.3.attn"
    started = time.perf_counter()
    for tensor in tensors:
        scopes._remember_storage(tensor)
    new = (time.perf_counter() - started) / len(tensors)
    started = time.perf_counter()
    for tensor in tensors:
        scopes._remember_storage(tensor)
    known = (time.perf_counter() - started) / len(tensors)
    # The whole pack hook: a storage already known, saved detached with its
    # version (so that a dropped graph keeps nothing alive).
    scopes.any_device = True
    started = time.perf_counter()
    packed = [scopes._pack(tensor) for tensor in tensors]
    pack = (time.perf_counter() - started) / len(tensors)
    del tensors, packed
    gc.enable()
    print()
    print(
        tabulate(
            [
                ["a new storage (pointer, weak reference)", f"{new * 1e6:.2f} us"],
                ["a storage already known", f"{known * 1e6:.2f} us"],
                ["the pack hook on one (detached, with its version)", f"{pack * 1e6:.2f} us"],
                ["entries left after the tensors died", len(scopes._saved)],
            ],
            headers=["CUDA path: remembering a saved tensor", "cost"],
        )
    )


if __name__ == "__main__":
    main()
