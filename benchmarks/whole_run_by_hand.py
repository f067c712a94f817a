"""Whole runs by hand, to check that a batch holds for the whole run (the
longest inputs, the evaluation, the later steps) and not only its first
steps: each (batch, seed) run under `oomdoc run --no-replay` on the same
capacity, all epochs and the script's evaluation, the outcome and peak read
from its snapshot; a Markdown table per batch (seeds survived, the largest
peak, the first OOM's step and phase) and the largest batch that survives
every seed.

    python benchmarks/whole_run_by_hand.py --device-memory 128MiB \\
        --batch-flag=--batch_size --batches 4,6,8,10,12,16 --out whole -- \\
        tests/corpus/varlen_text_classifier.py

    # one configuration (e.g. oomdoc's prescription) over the seeds:
    python benchmarks/whole_run_by_hand.py --device-memory 128MiB \\
        --check "--batch_size 6 --accumulation_steps 2" -- \\
        tests/corpus/varlen_text_classifier.py

Measured (2026-11-27, simulated device, CPU, one thread per run) on
tests/corpus/varlen_text_classifier.py at its defaults (256 train / 64 val
samples, lengths lognormal(3.2, 0.8) clipped to [8, 512]: median 23, the
longest 432, the first two batches of seeds 0..9 at most 209; d_model 64,
2 layers, 4 heads, 1 epoch + evaluation at 2x batch), --device-memory 128MiB:

| configuration | survived | max peak MiB | earliest OOM | OOM steps over seeds |
| --- | ---: | ---: | --- | --- |
| --batch_size 4 | 10/10 | 98.4 | - | - |
| --batch_size 5 | 10/10 | 121.8 | - | - |
| --batch_size 6 | 0/10 | 127.4 | step 2, forward (training, seed 2) | 25,32,2,27,24,39,15,4,11,31 |
| --batch_size 8 | 0/10 | 122.0 | step 1, forward (training, seed 2) | 19,24,1,20,18,29,11,3,8,23 |

largest batch that survives all 10 seeds: 5. Every OOM is the training
forward of the batch holding the 432-token sample (attention scores
2 x B x 4 x 432 x 432 float32); evaluation at 2x batch never is the OOM here
(the validation set's longest sample is 81 tokens). For an OOM the max peak
is the one before the failure.

oomdoc's answer today (`oomdoc run --device cpu --device-memory 128MiB
varlen_text_classifier.py --batch_size 16`, seed 0: OOM at step 9, forward):
"largest batch that fits: 15", prescription `--batch_size 8
--accumulation_steps 2` (the snapshot's prescription record lists fixes
autocast+checkpointing at 8 x 2 while the text prescribes smaller_batch
alone); its replays ran 10 steps of the failing run's first steps, not the
longest batch. By hand (--check) 8 x 2 survives 0/10 seeds,
each out of memory in the forward of the longest batch (steps, counted in
optimizer steps: 9,12,0,10,9,14,5,1,4,11; max peak before it 123.4 MiB).
Today's answer runs out of memory later in the run, as the issue expects;
By hand --check "--batch_size 5 --accumulation_steps 4" survives 10/10
(max peak 123.1 MiB): that is what holds at an effective batch of 20.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from script_args import set_flag


@dataclass
class WholeRun:
    """One (configuration, seed) run by hand, as its snapshot tells it."""

    label: str
    seed: int
    outcome: str
    peak_bytes: Optional[int] = None
    oom_step: Optional[int] = None
    oom_phase: Optional[str] = None


def run_whole(
    out: Path, label: str, seed: int, options: argparse.Namespace, script_args: list[str]
) -> WholeRun:
    name = "".join(c if c.isalnum() else "_" for c in label) + f"-seed{seed}"
    snapshot = out / f"{name}.json"
    snapshot.unlink(missing_ok=True)
    command = [sys.executable, "-m", "oomdoc", "run", "--no-replay", "--device", options.device]
    command += ["--device-memory", options.device_memory, "-o", str(snapshot), *script_args]
    # One thread per run: the simulated device measures memory, not speed, and
    # oversubscribed threads make a whole run on a shared CPU ~5x slower.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    (out / f"{name}.log").write_text(completed.stdout + completed.stderr)
    if not snapshot.exists():
        return WholeRun(label, seed, "error")
    document = json.loads(snapshot.read_text())
    oom = document.get("oom") or {}
    return WholeRun(
        label,
        seed,
        str(document.get("outcome")),
        (document.get("peak") or {}).get("allocated_bytes"),
        oom.get("step"),
        oom.get("phase"),
    )


def run_all(options, configurations: list[tuple[str, list[str]]]) -> dict[str, list[WholeRun]]:
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [
        (label, seed, set_flag(args, options.seed_flag, str(seed)))
        for label, args in configurations
        for seed in range(options.seeds)
    ]
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        runs = list(pool.map(lambda job: run_whole(out, job[0], job[1], options, job[2]), jobs))
    by_label: dict[str, list[WholeRun]] = {label: [] for label, _ in configurations}
    for run in runs:
        print(json.dumps(run.__dict__), file=sys.stderr, flush=True)
        by_label[run.label].append(run)
    return by_label


def first_oom(runs: list[WholeRun]) -> Optional[WholeRun]:
    """The OOM that came earliest in its run, over the seeds."""
    failed = [run for run in runs if run.outcome == "oom"]
    return min(
        failed, key=lambda run: run.oom_step if run.oom_step is not None else -1, default=None
    )


def describe_oom(run: Optional[WholeRun]) -> str:
    if run is None:
        return "-"
    where = "evaluation" if run.oom_phase == "evaluation" else "training"
    return f"step {run.oom_step}, {run.oom_phase} ({where}, seed {run.seed})"


def print_table(by_label: dict[str, list[WholeRun]], seeds: int) -> None:
    print("| configuration | survived | max peak MiB | earliest OOM | OOM steps over seeds |")
    print("| --- | ---: | ---: | --- | --- |")
    for label, runs in by_label.items():
        survived = sum(run.outcome == "ok" for run in runs)
        peaks = [run.peak_bytes for run in runs if run.peak_bytes]
        peak = f"{max(peaks) / 2**20:.1f}" if peaks else "-"
        steps = ",".join(
            f"{run.oom_step}{'e' if run.oom_phase == 'evaluation' else ''}"
            for run in runs
            if run.outcome == "oom"
        )
        errors = sum(run.outcome not in ("ok", "oom") for run in runs)
        note = f" ({errors} errors)" if errors else ""
        print(
            f"| {label} | {survived}/{seeds}{note} | {peak} | {describe_oom(first_oom(runs))} | {steps or '-'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-memory", required=True)
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (the simulated device) or cuda; on one GPU, --jobs runs share it, "
        "each capped at --device-memory",
    )
    parser.add_argument("--batch-flag", default="--batch_size")
    parser.add_argument("--seed-flag", default="--seed")
    parser.add_argument("--batches", help="batch sizes, e.g. 4,8,16")
    parser.add_argument("--check", help="one configuration's flags, run over the seeds")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", default="whole_run")
    parser.add_argument("script", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    script = [arg for arg in options.script if arg != "--"]
    if options.check:
        checked = shlex.split(options.check)
        args = list(script)
        for flag, value in zip(checked, checked[1:] + [""]):
            if flag.startswith("--") and value and not value.startswith("--"):
                args = set_flag(args, flag, value)
            elif flag.startswith("--"):
                args.append(flag)
        configurations = [(options.check, args)]
    else:
        batches = [int(b) for b in (options.batches or "").split(",") if b]
        configurations = [
            (f"{options.batch_flag} {batch}", set_flag(script, options.batch_flag, str(batch)))
            for batch in batches
        ]
    by_label = run_all(options, configurations)
    print_table(by_label, options.seeds)
    if not options.check:
        surviving = [
            label for label, runs in by_label.items() if all(run.outcome == "ok" for run in runs)
        ]
        print(
            f"\nlargest batch that survives all {options.seeds} seeds: {surviving[-1] if surviving else 'none'}"
        )


if __name__ == "__main__":
    main()
