"""What does oomdoc's capture cost per training step?

Runs the GPT example plainly and under `oomdoc run` (same arguments, a batch
that fits), alternating several times, and compares the median step time the
script itself prints (it waits for the GPU each step, or every N steps with
--sync-every N, as scripts that do not read the loss each step). Prints a table.

    python benchmarks/instrumentation_overhead.py                 # CUDA, reference GPT
    python benchmarks/instrumentation_overhead.py --sync-every 10 --steps 100 --warmup 10
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
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(
            f"command failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}"
        )
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
    parser.add_argument(
        "--sync-every",
        type=int,
        default=1,
        help="the script waits for the GPU every N steps only (each sample is then an N-step mean)",
    )
    args = parser.parse_args()

    script = [
        str(ROOT / "examples" / "gpt_train.py"),
        "--preset",
        args.preset,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--sync-every",
        str(args.sync_every),
    ]
    plain_env_prefix = [] if args.device == "cuda" else ["env", "CUDA_VISIBLE_DEVICES="]
    variants = {
        "python (plain)": (plain_env_prefix, None),
        "oomdoc run": ([], {}),
        "oomdoc run, no allocation history": (["env", "OOMDOC_ALLOCATION_HISTORY=0"], {}),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # interleaved, so drift hits all alike
            for position, (name, (prefix, oomdoc_options)) in enumerate(variants.items()):
                command = prefix + [sys.executable]
                if oomdoc_options is not None:
                    command += [
                        "-m",
                        "oomdoc",
                        "run",
                        "--device",
                        args.device,
                        "-o",
                        os.path.join(tmp, f"run{repeat}-{position}.json"),
                    ]
                    if args.device_memory:
                        command += ["--device-memory", args.device_memory]
                times[name] += step_times(run(command + script), args.warmup)

    plain = statistics.median(times["python (plain)"])
    rows = []
    for name, samples in times.items():
        median = statistics.median(samples)
        overhead = "" if name == "python (plain)" else f"{100.0 * (median - plain) / plain:+.2f}%"
        rows.append([name, len(samples), f"{median:.2f}", overhead])
    print(tabulate(rows, headers=["how", "steps timed", "median step (ms)", "overhead"]))
    overhead = 100.0 * (statistics.median(times["oomdoc run"]) - plain) / plain
    target = 3.0 if args.device == "cuda" else None
    if target is not None:
        print(
            f"target: < {target:.0f}% per step on CUDA -> {'met' if overhead < target else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
