"""What does oomdoc's capture cost per training step?

Runs the GPT example plainly and under `oomdoc run` (same arguments, a batch
that fits), alternating several times, and compares the median step time the
script itself prints (it waits for the GPU each step). Prints a table.

    python benchmarks/instrumentation_overhead.py                 # CUDA, reference GPT
    python benchmarks/instrumentation_overhead.py --device cpu --preset tiny --batch-size 8
Target on CUDA: under 3% per step.
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
STEP_RE = re.compile(r"^step (\d+): loss \S+ \(([\d.]+) ms\)$", re.M)


def step_times(output: str, warmup: int) -> list[float]:
    return [float(ms) for step, ms in STEP_RE.findall(output) if int(step) >= warmup]


def run(command: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"command failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--device-memory", default=None, help="cap, as for oomdoc run")
    parser.add_argument("--preset", default="reference")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    script = [str(ROOT / "examples" / "gpt_train.py"), "--preset", args.preset,
              "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    plain_env_prefix = [] if args.device == "cuda" else ["env", "CUDA_VISIBLE_DEVICES="]
    plain_times, oomdoc_times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            plain_times += step_times(run(plain_env_prefix + [sys.executable, *script]), args.warmup)
            oomdoc_command = [sys.executable, "-m", "oomdoc", "run", "--device", args.device,
                              "-o", os.path.join(tmp, f"run{repeat}.json")]
            if args.device_memory:
                oomdoc_command += ["--device-memory", args.device_memory]
            oomdoc_times += step_times(run(oomdoc_command + script), args.warmup)

    plain = statistics.median(plain_times)
    instrumented = statistics.median(oomdoc_times)
    overhead = 100.0 * (instrumented - plain) / plain
    print(tabulate(
        [["python (plain)", len(plain_times), f"{plain:.2f}", ""],
         ["oomdoc run", len(oomdoc_times), f"{instrumented:.2f}", f"{overhead:+.2f}%"]],
        headers=["how", "steps timed", "median step (ms)", "overhead"],
    ))
    target = 3.0 if args.device == "cuda" else None
    if target is not None:
        print(f"target: < {target:.0f}% per step on CUDA -> {'met' if overhead < target else 'NOT met'}")


if __name__ == "__main__":
    main()
