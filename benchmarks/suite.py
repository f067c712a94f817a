"""oomdoc's benchmark suite: one table per device.

For each model: what the capture costs per training step (the same script
run plainly and under `oomdoc run --no-replay`, interleaved, median step time
as the script itself prints it) and over the whole process (start-up
included; and per interleaved pair, with the median's interval: issue 24
asks for under 1% over at least 8 pairs, `--repeats 8`), whether that cost
stays flat over a long run (the feature-keeping leak: median of the last steps over the first ones, under
oomdoc relative to plain), how many replays `oomdoc run` needed for the
exact max batch (the snapshot's replay.batch_search.trials), the whole
`oomdoc run`'s wall time (the failing run and every replay) and how many
replays it ran (side by side: `--replay-jobs`, else as the machine allows).

    python benchmarks/suite.py                                   # CPU: the simulated device
    python benchmarks/suite.py --device cuda --device-memory 16GiB
    python benchmarks/suite.py --device cuda --device-memory 16GiB --quick
    python benchmarks/suite.py --models gpt,keep_features --repeats 3
    python benchmarks/suite.py --device cuda --models hf --no-overhead --replay-jobs 1

On the CPU the presets are tiny and every process runs with one thread
(OMP_NUM_THREADS=1), which keeps timings steady on a shared machine; scripts
that print their CPU time per step are compared on it. ResNet-50 needs
torchvision and a GPU; its row is skipped otherwise. Targets: under 3% per
step on CUDA, under 2x on the simulated device, flat over the run (< 1.10),
the exact max batch in at most 3 replays, the whole run under 60 s on the
H100 (16 GiB cap) for the reference GPT, ResNet-50 and the GPT-2-medium
Trainer, under 90 s for the leak.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "benchmarks" / "scripts"
STEP_RE = re.compile(r"^step (\d+): loss \S+ \(([\d.]+) ms(?:, cpu ([\d.]+) ms)?\)$", re.M)


@dataclass
class Model:
    name: str
    script: Path
    overhead_args: list[str]  # a configuration that fits
    replay_args: list[str] | None  # one that runs out of memory, for the whole run
    warmup: int = 3
    flat: bool = False  # report how the step time changes over the run
    needs: list[str] = field(default_factory=list)  # importable modules
    gpu_only: bool = False


def models(device: str, quick: bool) -> list[Model]:
    if device == "cpu":
        return [
            Model(
                "gpt (tiny)",
                ROOT / "examples" / "gpt_train.py",
                ["--preset", "tiny", "--batch-size", "8", "--steps", "12" if quick else "25"],
                ["--preset", "tiny", "--batch-size", "64", "--steps", "4"],
            ),
            Model("resnet50", SCRIPTS / "resnet50_train.py", [], None, gpu_only=True),
            Model(
                "hf trainer gpt2 (tiny)",
                SCRIPTS / "hf_trainer_gpt2.py",
                ["--preset", "tiny", "--per_device_train_batch_size", "8"]
                + ["--max_steps", "12" if quick else "25"],
                ["--preset", "tiny", "--per_device_train_batch_size", "256", "--max_steps", "4"],
                needs=["transformers"],
            ),
            Model(
                "keep_features (leak)",
                SCRIPTS / "keep_features.py",
                ["--steps", "200" if quick else "400"],
                ["--steps", "100000"],
                warmup=1,
                flat=True,
            ),
        ]
    return [
        Model(
            "gpt (reference)",
            ROOT / "examples" / "gpt_train.py",
            ["--batch-size", "8", "--steps", "15" if quick else "30"],
            ["--batch-size", "32", "--steps", "6"],
            warmup=5,
        ),
        Model(
            "resnet50",
            SCRIPTS / "resnet50_train.py",
            ["--batch-size", "128", "--steps", "20" if quick else "40"],
            ["--batch-size", "512", "--steps", "6"],
            warmup=5,
            needs=["torchvision"],
        ),
        Model(
            "hf trainer gpt2-medium",
            SCRIPTS / "hf_trainer_gpt2.py",
            ["--preset", "medium", "--seq-len", "512", "--per_device_train_batch_size", "4"]
            + ["--max_steps", "15" if quick else "30"],
            ["--preset", "medium", "--seq-len", "512", "--per_device_train_batch_size", "32"]
            + ["--max_steps", "6"],
            warmup=5,
            needs=["transformers"],
        ),
        Model(
            "keep_features (leak)",
            SCRIPTS / "keep_features.py",
            ["--steps", "200" if quick else "400"]
            + ["--batch-size", "4096", "--inputs", "1024", "--width", "2048"],
            ["--steps", "100000", "--batch-size", "4096", "--inputs", "1024", "--width", "2048"],
            warmup=1,
            flat=True,
        ),
    ]


def environment(device: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("OOMDOC_REPLAY", None)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = "1"
    return env


def run(command: list[str], env: dict, allowed=(0,)) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode not in allowed:
        sys.exit(
            f"command failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}"
        )
    return result.stdout


def step_times(output: str, warmup: int, device: str) -> list[float]:
    """Per-step milliseconds the script printed: on the simulated device its
    CPU time when it printed it (steadier on a shared machine), on CUDA the
    wall time (a step's CPU time there is mostly spent waiting on the GPU)."""
    found = STEP_RE.findall(output)
    use_cpu = clock_of(output, device) == "cpu"
    return [float(cpu if use_cpu else wall) for step, wall, cpu in found if int(step) >= warmup]


def clock_of(output: str, device: str) -> str:
    found = STEP_RE.findall(output)
    cpu = device == "cpu" and found and all(cpu for _s, _w, cpu in found)
    return "cpu" if cpu else "wall"


def oomdoc_command(args, output: Path, replay: bool) -> list[str]:
    command = [sys.executable, "-m", "oomdoc", "run", "--device", args.device, "-o", str(output)]
    if args.device_memory:
        command += ["--device-memory", args.device_memory]
    if not replay:
        command.append("--no-replay")
    elif args.replay_jobs:
        command += ["--replay-jobs", str(args.replay_jobs)]
    return command


def paired_overhead(plain: list[list[float]], captured: list[list[float]]) -> str:
    """Each interleaved pair's overhead (its oomdoc run's median step over its
    plain run's), their median, and a distribution-free interval for that
    median from the pairs' order statistics (the binomial sign-test interval,
    the narrowest whose coverage is at least 90%; its coverage is printed).
    Pairs, not pooled steps, so that one slow process shows as one sample."""
    ratios = sorted(
        statistics.median(mine) / statistics.median(theirs) - 1.0
        for theirs, mine in zip(plain, captured)
        if theirs and mine
    )
    count = len(ratios)
    if count == 0:
        return ""
    rank, coverage = 1, 1.0 - 2 * 0.5**count
    while rank + 1 <= count // 2:
        # Coverage of [x(rank+1), x(count-rank)]: 1 - 2 P(Binomial(count, 1/2) <= rank).
        below = sum(math.comb(count, i) for i in range(rank + 1)) * 0.5**count
        if 1.0 - 2 * below < 0.90:
            break
        rank, coverage = rank + 1, 1.0 - 2 * below
    low, high = ratios[rank - 1], ratios[count - rank]
    middle = statistics.median(ratios)
    return f"{100 * middle:+.2f}% [{100 * low:+.2f}, {100 * high:+.2f}] ({coverage:.0%}, {count})"


def median_window(samples: list[float], start: int, stop: int) -> float | None:
    window = samples[start:stop]
    return statistics.median(window) if window else None


def measure(model: Model, args, tmp: Path) -> list:
    env = environment(args.device)
    row = [model.name] + ([""] * 8 if args.no_overhead else overhead_row(model, args, tmp, env))
    return row + whole_run(model, args, tmp, env)


def overhead_row(model: Model, args, tmp: Path, env: dict) -> list:
    """The capture's cost per step, plain and under `oomdoc run --no-replay`."""
    script = [str(model.script), *model.overhead_args]
    plain: list[list[float]] = []
    captured: list[list[float]] = []
    clock = "wall"
    # Each process's whole wall time, start-up included: what a user waits for.
    plain_wall: list[float] = []
    oomdoc_wall: list[float] = []
    for repeat in range(args.repeats):  # interleaved, so drift hits both alike
        started = time.perf_counter()
        output = run([sys.executable, *script], env)
        plain_wall.append(time.perf_counter() - started)
        clock = clock_of(output, args.device)
        plain.append(step_times(output, model.warmup, args.device))
        snapshot = tmp / f"{model.script.stem}-{repeat}.json"
        started = time.perf_counter()
        output = run(oomdoc_command(args, snapshot, False) + script, env)
        oomdoc_wall.append(time.perf_counter() - started)
        captured.append(step_times(output, model.warmup, args.device))
    plain_median = statistics.median([t for run_ in plain for t in run_])
    oomdoc_median = statistics.median([t for run_ in captured for t in run_])
    overhead = oomdoc_median / plain_median - 1.0
    flat = ""
    if model.flat:
        # The last 50 steps against the first 50, per run, then the median.
        def growth(runs):
            return statistics.median(
                median_window(r, len(r) - 50, len(r)) / median_window(r, 0, 50) for r in runs
            )

        flat = f"{growth(captured) / growth(plain):.2f}"
    return [
        f"{len([t for r in plain for t in r])} / {args.repeats}",
        clock,
        f"{plain_median:.2f}",
        f"{oomdoc_median:.2f}",
        f"{100 * overhead:+.1f}%",
        f"{oomdoc_median / plain_median:.2f}x",
        flat,
        f"{statistics.median(plain_wall):.1f} / {statistics.median(oomdoc_wall):.1f}",
        paired_overhead(plain, captured),
    ]


def whole_run(model: Model, args, tmp: Path, env: dict) -> list:
    """The whole `oomdoc run` of the configuration that runs out of memory:
    the batch search's probes, the wall time, and the replays it ran."""
    replays = whole = ran = ""
    if model.replay_args is not None and not args.no_whole_run:
        snapshot = tmp / f"{model.script.stem}-whole.json"
        started = time.perf_counter()
        run(
            oomdoc_command(args, snapshot, True) + [str(model.script), *model.replay_args],
            env,
            allowed=(0, 1),
        )
        whole = f"{time.perf_counter() - started:.1f}"
        document = json.loads(snapshot.read_text())
        search = ((document.get("replay") or {}).get("batch_search")) or {}
        trials = search.get("trials") or []
        if trials:
            tried = ", ".join(f"{batch} {'fits' if fits else 'fails'}" for batch, fits in trials)
            exact = "" if search.get("exact") else ", not exact"
            replays = f"{len(trials)} ({tried}){exact}"
        else:
            replays = f"- ({document.get('outcome')})"
        summary = document.get("replay") or {}
        unused = len(summary.get("unused_runs") or [])
        jobs = summary.get("jobs") or 1
        ran = f"{summary.get('replays', 0)}" + (f" (+{unused} unused)" if unused else "")
        ran += f", {jobs} side by side" if jobs > 1 else ", one at a time"
    return [replays, whole, ran]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--device-memory", default=None, help="as for oomdoc run")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs of each")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--models", default=None, help="comma-separated name prefixes")
    parser.add_argument("--no-whole-run", action="store_true", help="skip the replaying runs")
    parser.add_argument(
        "--no-overhead", action="store_true", help="only the whole runs (no per-step overhead)"
    )
    parser.add_argument("--replay-jobs", type=int, default=None, help="as for oomdoc run")
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if _cuda_available() else "cpu"
    if args.device_memory is None:
        args.device_memory = "16GiB" if args.device == "cuda" else None
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for model in models(args.device, args.quick):
            if args.models and not any(
                model.name.startswith(prefix) for prefix in args.models.split(",")
            ):
                continue
            missing = [name for name in model.needs if importlib.util.find_spec(name) is None]
            if (model.gpu_only and args.device != "cuda") or missing:
                why = "needs a GPU" if model.gpu_only and args.device != "cuda" else "no "
                rows.append(
                    [model.name, "skipped: " + (why + ", ".join(missing) if missing else why)]
                )
                continue
            memory = args.device_memory
            if args.device == "cpu":
                # The simulated device's capacity: what each CPU preset fits in.
                args.device_memory = memory or _CPU_MEMORY.get(model.script.stem, "256MiB")
            print(f"{model.name} ...", file=sys.stderr, flush=True)
            rows.append(measure(model, args, Path(directory)))
            args.device_memory = memory
    device = "simulated device (CPU, 1 thread)" if args.device == "cpu" else "CUDA"
    print(
        f"{device}, {args.repeats} interleaved runs of each, memory {args.device_memory or 'per model'}"
    )
    print(
        tabulate(
            rows,
            headers=[
                "model",
                "steps timed / runs",
                "clock",
                "plain ms/step",
                "oomdoc ms/step",
                "overhead",
                "ratio",
                "flat (late/early vs plain)",
                "whole script plain / oomdoc --no-replay (s)",
                "per pair: median [interval] (coverage, pairs)",
                "replays for exact max batch",
                "whole oomdoc run (s)",
                "replays run",
            ],
            disable_numparse=True,
        )
    )


# Simulated capacities of the CPU presets: the overhead runs fit, the
# replaying runs (replay_args) run out of memory.
_CPU_MEMORY = {"gpt_train": "192MiB", "hf_trainer_gpt2": "256MiB", "keep_features": "8MiB"}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if __name__ == "__main__":
    main()
