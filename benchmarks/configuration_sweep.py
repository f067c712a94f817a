"""A dense sweep by hand, to check a prescription against: every subset of
the memory savers (given as the script's own flags) x a grid of micro-batches,
each with the gradient accumulation that keeps the effective batch, run under
`oomdoc run --no-replay` on the same capacity (or, with `--plain`, as plain
capped runs without oomdoc: benchmarks/plain_step_time.py); a table of peaks and
throughputs (median optimizer step after the first), the best marked, and
oomdoc's prescription (from its snapshot) against the best.

    python benchmarks/configuration_sweep.py --device-memory 16GiB \\
        --batch-flag=--per_device_train_batch_size --accumulation-flag=--gradient_accumulation_steps \\
        --saver "autocast=--bf16 True" --saver "checkpointing=--gradient_checkpointing True" \\
        --batches 16,8,4 --snapshot hf.json --out sweep -- \\
        tests/scripts/fw_hf_trainer.py --use_cpu False --n_layer 24 ... --max_steps 8

The script's own batch flag and value (the effective batch) must be among
the script's arguments after `--`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from script_args import set_flag


def run_by_hand(
    out: Path, name: str, device_memory: str, script_args: list[str], history: bool
) -> dict:
    snapshot = out / f"{name}.json"
    snapshot.unlink(missing_ok=True)
    command = [sys.executable, "-m", "oomdoc", "run", "--no-replay"]
    command += ["--device-memory", device_memory, "-o", str(snapshot), *script_args]
    started = time.perf_counter()
    # Without the per-allocation stacks unless asked: they cost time the plain
    # script does not pay (replays run without them too).
    environment = {**os.environ, "OOMDOC_ALLOCATION_HISTORY": "1" if history else "0"}
    completed = subprocess.run(command, capture_output=True, text=True, env=environment)
    (out / f"{name}.log").write_text(completed.stdout + completed.stderr)
    row = {"wall_s": round(time.perf_counter() - started, 1), "outcome": "error"}
    if not snapshot.exists():
        return row
    document = json.loads(snapshot.read_text())
    row["outcome"] = document.get("outcome")
    row["peak"] = (document.get("peak") or {}).get("allocated_bytes")
    durations = [
        step["duration_s"]
        for step in document.get("steps") or []
        if step.get("duration_s") and step.get("index", 0) > 0
    ]
    row["step_s"] = statistics.median(durations) if durations else None
    row["steps_timed"] = len(durations)
    return row


def run_plain(out: Path, name: str, device_memory: str, script_args: list[str]) -> dict:
    """One configuration as a plain capped run (plain_step_time.py, CUDA): no
    capture at all. On an H200 `oomdoc run --no-replay`'s capture slowed the
    HF Trainer's bf16 + checkpointing step from 0.138 s to 0.197 s and the
    Lightning encoder's bf16 at 16 x 16 from 0.519 s to 0.70 s (their many
    small modules' hooks on a step the CPU launches), so the sweeps under it
    ranked those configurations lower than the user's own runs do."""
    here = Path(__file__).resolve().parent
    command = [sys.executable, str(here / "plain_step_time.py"), "--device-memory", device_memory]
    started = time.perf_counter()
    completed = subprocess.run([*command, "--", *script_args], capture_output=True, text=True)
    (out / f"{name}.log").write_text(completed.stdout + completed.stderr)
    row = {"wall_s": round(time.perf_counter() - started, 1), "outcome": "error"}
    for line in completed.stdout.splitlines():
        if line.startswith("PLAIN "):
            measured = json.loads(line[len("PLAIN ") :])
            row.update(
                outcome=measured["outcome"],
                peak=measured["peak_allocated_bytes"],
                step_s=measured["median_step_s"],
                steps_timed=max(0, measured["optimizer_steps"] - 2),
            )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-memory", required=True)
    parser.add_argument("--batch-flag", required=True)
    parser.add_argument("--accumulation-flag", required=True)
    parser.add_argument("--saver", action="append", default=[], help="name=flags")
    parser.add_argument("--batches", required=True, help="micro-batches, e.g. 16,8,4")
    parser.add_argument("--snapshot", help="oomdoc's snapshot of the same script")
    parser.add_argument("--out", default="sweep")
    parser.add_argument(
        "--history", action="store_true", help="record per-allocation stacks (slower steps)"
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="time each configuration as a plain capped run (CUDA), not under oomdoc's capture",
    )
    parser.add_argument("script", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    script = [arg for arg in options.script if arg != "--"]
    effective = int(script[script.index(options.batch_flag) + 1])
    savers = dict(item.split("=", 1) for item in options.saver)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for count in range(len(savers) + 1):
        for subset in itertools.combinations(savers, count):
            for micro in (int(b) for b in options.batches.split(",")):
                steps = max(1, effective // micro)
                args = set_flag(script, options.batch_flag, str(micro))
                args = set_flag(args, options.accumulation_flag, str(steps))
                for name in subset:
                    args += shlex.split(savers[name])
                label = "+".join(subset) or "none"
                name = f"{label}-{micro}x{steps}"
                row = (
                    run_plain(out, name, options.device_memory, args)
                    if options.plain
                    else run_by_hand(out, name, options.device_memory, args, options.history)
                )
                row.update(fixes=label, micro=micro, steps=steps)
                if row.get("step_s") and row["outcome"] == "ok":
                    row["samples_per_second"] = micro * steps / row["step_s"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    fitting = [row for row in rows if row.get("samples_per_second")]
    best = max(fitting, key=lambda row: row["samples_per_second"]) if fitting else None
    print("| savers | batch | peak GiB | samples/s | outcome |")
    print("| --- | --- | ---: | ---: | --- |")
    for row in rows:
        peak = f"{row['peak'] / 2**30:.2f}" if row.get("peak") else "-"
        speed = f"{row['samples_per_second']:.1f}" if row.get("samples_per_second") else "-"
        mark = " **best**" if row is best else ""
        print(
            f"| {row['fixes']} | {row['micro']} x {row['steps']} | {peak} | {speed}{mark} | {row['outcome']} |"
        )
    if options.snapshot and best is not None:
        prescription = json.loads(Path(options.snapshot).read_text()).get("prescription") or {}
        fixes = "+".join(prescription.get("fixes") or []) or "none"
        speed = prescription.get("samples_per_second")
        same = next(
            (
                row
                for row in rows
                if row["fixes"] == fixes
                and row["micro"] == prescription.get("batch_size")
                and row["steps"] == prescription.get("accumulation_steps")
            ),
            None,
        )
        by_hand = same.get("samples_per_second") if same else None
        print(
            f"\noomdoc prescribed {fixes} at {prescription.get('batch_size')} x "
            f"{prescription.get('accumulation_steps')}: {speed} samples/s in its replay; by hand "
            + (
                f"{by_hand:.1f} samples/s, {by_hand / best['samples_per_second']:.1%}"
                if by_hand
                else "not in the sweep"
            )
            + f" of the best ({best['fixes']} at {best['micro']} x {best['steps']}, "
            f"{best['samples_per_second']:.1f} samples/s)"
        )


if __name__ == "__main__":
    main()
