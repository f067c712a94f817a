"""The same diagnosis run again: whether `oomdoc run` gives the same
prescription every time (issue 24: 5 of 5), and how long each takes.

    python benchmarks/stability.py --runs 5 --device-memory 16GiB --out stability -- \\
        examples/gpt_train.py --batch-size 32 --steps 6

Each run writes OUT/run-N.json and OUT/run-N.log; prints one row per run
(wall time, replays, the prescription, its replayed throughput and peak) and
how many runs gave the most common prescription.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path

from script_args import prescription_label, script_after_dashes

GiB = 1 << 30


def diagnose(out: Path, number: int, device_memory: str, script: list[str]) -> dict:
    snapshot = out / f"run-{number}.json"
    snapshot.unlink(missing_ok=True)
    command = [sys.executable, "-m", "oomdoc", "run", "--device-memory", device_memory]
    command += ["-o", str(snapshot), *script]
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True)
    (out / f"run-{number}.log").write_text(completed.stdout + completed.stderr)
    row: dict = {"run": number, "wall_s": round(time.perf_counter() - started, 1)}
    if not snapshot.exists():
        row["prescription"] = f"no snapshot (exit {completed.returncode})"
        return row
    document = json.loads(snapshot.read_text())
    prescription = document.get("prescription") or {}
    replay = document.get("replay") or {}
    row["replays"] = replay.get("replays")
    row["prescription"] = prescription_label(prescription)
    row["samples_per_second"] = prescription.get("samples_per_second")
    row["peak"] = prescription.get("peak_allocated_bytes")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device-memory", required=True)
    parser.add_argument("--out", default="stability")
    parser.add_argument("script", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    script = script_after_dashes(options.script)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for number in range(1, options.runs + 1):
        rows.append(diagnose(out, number, options.device_memory, script))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| run | diagnosis s | replays | prescription | samples/s in its replay | peak GiB |")
    print("| ---: | ---: | ---: | --- | ---: | ---: |")
    for row in rows:
        peak = f"{row['peak'] / GiB:.2f}" if row.get("peak") else "-"
        print(
            f"| {row['run']} | {row['wall_s']} | {row.get('replays', '-')} | {row['prescription']} "
            f"| {row.get('samples_per_second') or '-'} | {peak} |"
        )
    counts = collections.Counter(row["prescription"] for row in rows)
    common, times = counts.most_common(1)[0]
    print(f"\n{' '.join(script)}: {common} in {times} of {len(rows)} runs")


if __name__ == "__main__":
    main()
