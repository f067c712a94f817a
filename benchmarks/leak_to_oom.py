"""The feature-keeping leak run to its OOM, plainly and under oomdoc.

    python benchmarks/leak_to_oom.py --device cuda [--repeats 3]
    python benchmarks/leak_to_oom.py --device cuda --device-memory 16GiB
    python benchmarks/leak_to_oom.py --device cpu --steps 400

A leaking script is the one case where the capture runs for as long as the
user's whole run: every step keeps more tensors alive, so per-step work that
looks at what is alive grows with the run. The target is the whole run, not
a step: under oomdoc it ends at the same step, under 10% later, and its step
time grows no more than plainly.

On CUDA both run benchmarks/scripts/keep_features.py until the device runs
out (`--device-memory`: both capped alike, the plain run through
torch.cuda.set_per_process_memory_fraction, as oomdoc caps it). On the
simulated device the plain run has no capacity to run out of: both run
`--steps` steps, oomdoc's on a device large enough. Interleaved runs; each
row the median. `oomdoc run --no-replay` writes its snapshot and stops: no
replays, so the comparison is the capture alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "scripts" / "keep_features.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
from suite import STEP_RE  # noqa: E402

CUDA_ARGS = ["--batch-size", "4096", "--inputs", "1024", "--width", "2048"]

# The plain run under the same cap as oomdoc's --device-memory.
CAPPED = """
import runpy, sys, torch
from oomdoc.sizes import parse_size
cap = parse_size(sys.argv[1])
total = torch.cuda.get_device_properties(0).total_memory
if cap < total:
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def timed(command: list[str], env: dict) -> tuple[float, list[tuple[int, float, float]]]:
    """Wall seconds of the whole process, and its steps (index, wall ms, cpu ms)."""
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - started
    steps = [(int(s), float(w), float(c or 0)) for s, w, c in STEP_RE.findall(result.stdout)]
    if not steps:
        sys.exit(f"no steps printed by: {' '.join(command)}\n{result.stderr[-3000:]}")
    return wall, steps


def window(steps: list[float], first: bool) -> float:
    part = steps[1:51] if first else steps[-50:]
    return statistics.median(part)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--device-memory", help="cap both runs (CUDA)")
    parser.add_argument("--steps", type=int, default=400, help="steps on the simulated device")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("OOMDOC_REPLAY", None)
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        script = [str(SCRIPT), "--steps", str(args.steps)]
        plain = [sys.executable, *script]
        clock = 2  # CPU time per step: steadier on a shared machine
    else:
        script = [str(SCRIPT), "--steps", "1000000", *CUDA_ARGS]
        plain = [sys.executable, *script]
        if args.device_memory:
            plain = [sys.executable, "-c", CAPPED, args.device_memory, *script]
        clock = 1
    rows: dict[str, list] = {"plain": [], "oomdoc run --no-replay": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # interleaved
            rows["plain"].append(timed(plain, env))
            oomdoc = [sys.executable, "-m", "oomdoc", "run", "--device", args.device]
            oomdoc += ["--no-replay", "-o", str(Path(tmp) / f"leak{repeat}.json")]
            if args.device_memory:
                oomdoc += ["--device-memory", args.device_memory]
            rows["oomdoc run --no-replay"].append(timed([*oomdoc, *script], env))
    table = []
    plain_wall = statistics.median(wall for wall, _ in rows["plain"])
    plain_growth = statistics.median(
        window([s[clock] for s in steps], False) / window([s[clock] for s in steps], True)
        for _, steps in rows["plain"]
    )
    for name, runs in rows.items():
        wall = statistics.median(w for w, _ in runs)
        step_ms = statistics.median(s[clock] for _, steps in runs for s in steps[1:])
        growth = statistics.median(
            window([s[clock] for s in steps], False) / window([s[clock] for s in steps], True)
            for _, steps in runs
        )
        table.append(
            [
                name,
                "/".join(str(steps[-1][0] + 1) for _, steps in runs),
                f"{step_ms:.2f}",
                f"{growth:.2f} ({growth / plain_growth:.2f} of plain)",
                f"{wall:.1f}",
                f"{100 * (wall / plain_wall - 1):+.1f}%",
            ]
        )
    what = f"{args.device}" + (f", capped at {args.device_memory}" if args.device_memory else "")
    print(f"keep_features.py to its end, {args.repeats} interleaved runs ({what})")
    print(
        tabulate(
            table,
            headers=[
                "how",
                "steps run",
                f"median ms/step ({'cpu' if clock == 2 else 'wall'})",
                "last 50 / first 50",
                "whole process (s)",
                "vs plain",
            ],
            disable_numparse=True,
        )
    )


if __name__ == "__main__":
    main()
