"""What any per-op Python hook costs on a model of small ops: the floor under
the simulated device's per-step overhead.

    python benchmarks/dispatch_floor.py [--steps 300] [--runs 3]

The simulated device counts storages at the Python dispatch key. This runs
benchmarks/scripts/keep_features.py (a small MLP and AdamW: about 2 ms and
130 ops per step on one CPU thread) four ways, interleaved:

  plain          python keep_features.py
  no-op mode     under a dispatch mode that does nothing but call the op
                 (`func._op(*args)`): the cost of seeing every op in Python
  oomdoc, mode   oomdoc run --device cpu --no-replay with OOMDOC_NATIVE=0:
                 every op but views, `.item()` and some in-place updates
                 goes through the dispatch mode in Python
  oomdoc         the same with the compiled ledger (oomdoc.capture.native):
                 storages are counted in C++, Python reads the ledger at
                 phase boundaries

and prints the median CPU time per step of each, relative to plain, and the
median of the last 50 steps over the first 50 (flat: the cost does not grow
with what is kept).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "scripts" / "keep_features.py"
CPU_RE = re.compile(r"cpu ([\d.]+) ms\)")

NO_OP_MODE = """
import runpy, sys
from torch.utils._python_dispatch import TorchDispatchMode

class NoOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func._op(*args, **kwargs) if kwargs else func._op(*args)

sys.argv = sys.argv[1:]
with NoOp():
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def step_cpu_ms(command: list[str], env: dict) -> list[float]:
    output = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=ROOT, check=False
    ).stdout
    return [float(value) for value in CPU_RE.findall(output)][5:]  # warm-up steps out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    script = [str(SCRIPT), "--steps", str(args.steps)]
    medians: dict[str, list[float]] = {
        "plain": [],
        "no-op mode": [],
        "oomdoc, mode": [],
        "oomdoc": [],
    }
    flat: list[float] = []
    plain_flat: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):  # interleaved
            steps = step_cpu_ms([sys.executable, *script], env)
            medians["plain"].append(statistics.median(steps))
            plain_flat.append(statistics.median(steps[-50:]) / statistics.median(steps[:50]))
            noop = [sys.executable, "-c", NO_OP_MODE, *script]
            medians["no-op mode"].append(statistics.median(step_cpu_ms(noop, env)))
            oomdoc = [sys.executable, "-m", "oomdoc", "run", "--device", "cpu", "--no-replay"]
            snapshot = Path(tmp) / f"mode{run}.json"
            mode_only = dict(env, OOMDOC_NATIVE="0")
            steps = step_cpu_ms([*oomdoc, "-o", str(snapshot), *script], mode_only)
            medians["oomdoc, mode"].append(statistics.median(steps))
            snapshot = Path(tmp) / f"run{run}.json"
            steps = step_cpu_ms([*oomdoc, "-o", str(snapshot), *script], env)
            medians["oomdoc"].append(statistics.median(steps))
            flat.append(statistics.median(steps[-50:]) / statistics.median(steps[:50]))
    plain = statistics.median(medians["plain"])
    rows = [
        [name, f"{statistics.median(values):.2f} ms", f"{statistics.median(values) / plain:.2f}x"]
        for name, values in medians.items()
    ]
    print(
        f"keep_features.py, {args.steps} steps, {args.runs} interleaved runs, "
        "median CPU time per step (one thread)"
    )
    print(tabulate(rows, headers=["how", "per step", "vs plain"]))
    print(
        "last 50 steps over the first 50: "
        f"plain {statistics.median(plain_flat):.2f}, oomdoc {statistics.median(flat):.2f}"
    )


if __name__ == "__main__":
    main()
