"""Does the prescription hold for the whole run? oomdoc diagnoses a script
twice, its replays running the whole run's worst case (the default) and the
data as it comes (`--first-batches`, what batch-size finders do); then each
prescription is run by hand over the whole run (`oomdoc run --no-replay`,
every step and evaluation) under the same cap, once per seed; a Markdown
table of diagnosis time, prescription, and by-hand outcome and peak.

    python benchmarks/whole_run_check.py --device-memory 16GiB --seed-flag=--seed \\
        --seeds 42,1 --out whole-run -- benchmarks/scripts/hf_trainer_varlen.py \\
        --use_cpu False --per_device_train_batch_size 32 --max_steps 32

The by-hand runs take the prescription's own flags (`verified_by_flags.args`,
else its batch flag rewritten with its accumulation flag), so the script must
declare them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from script_args import prescription_label, script_after_dashes, set_flag


def oomdoc(out: Path, name: str, options: list[str], script: list[str]) -> tuple[dict, float]:
    snapshot = out / f"{name}.json"
    snapshot.unlink(missing_ok=True)
    command = [sys.executable, "-m", "oomdoc", "run", *options, "-o", str(snapshot), *script]
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    (out / f"{name}.log").write_text(completed.stdout + completed.stderr)
    document = json.loads(snapshot.read_text()) if snapshot.exists() else {}
    return document, seconds


def prescribed_args(document: dict) -> list[str] | None:
    """The script's arguments as prescribed: the replay of its own flags."""
    prescription = document.get("prescription") or {}
    checked = prescription.get("verified_by_flags") or {}
    if checked.get("args"):
        return list(checked["args"])
    accumulation = prescription.get("accumulation_replay") or {}
    if accumulation.get("args") and not prescription.get("fixes"):
        return list(accumulation["args"])
    return None


def size(value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def by_hand_runs(
    out: Path, name: str, common: list[str], script: list[str], args: list[str], options
) -> tuple[str, str]:
    """(outcomes per seed, the highest by-hand peak) of `args` over the whole run."""
    outcomes, peaks = [], []
    for seed in options.seeds.split(","):
        by_hand = set_flag(args, options.seed_flag, seed) if options.seed_flag else args
        plain, _ = oomdoc(
            out, f"{name}-by-hand-{seed}", [*common, "--no-replay"], [script[0], *by_hand]
        )
        outcome = plain.get("outcome", "error")
        oom = plain.get("oom") or {}
        if outcome == "oom":
            outcome += f" at step {oom.get('step')} ({oom.get('phase')})"
        outcomes.append(f"seed {seed}: {outcome}")
        peak = (plain.get("peak") or {}).get("allocated_bytes")
        if peak:
            peaks.append(peak)
    return "; ".join(outcomes), size(max(peaks)) if peaks else "-"


def describe(document: dict) -> str:
    prescription = document.get("prescription") or {}
    certificate = prescription.get("certificate") or {}
    certified = " (certified)" if certificate.get("certified") else ""
    return prescription_label(prescription) + certified


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-memory", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed-flag", default=None, help="the script's seed flag, e.g. --seed")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds for the by-hand runs")
    parser.add_argument("--out", default="whole-run-check")
    parser.add_argument(
        "--modes", default="whole-run,first-batches", help="which diagnoses (comma-separated)"
    )
    parser.add_argument("script", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    script = script_after_dashes(options.script)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--device", options.device, "--device-memory", options.device_memory]
    rows = []
    for mode, extra in (("whole run", []), ("first batches", ["--first-batches"])):
        name = mode.replace(" ", "-")
        if name not in options.modes.split(","):
            continue
        document, seconds = oomdoc(out, name, [*common, *extra], script)
        replays = (document.get("replay") or {}).get("replays")
        head = [mode, f"{seconds:.0f} s, {replays} replays"]
        # The largest batch that fits, as the batch search found it.
        search = (document.get("replay") or {}).get("batch_search") or {}
        largest, flag = document.get("max_batch_size"), search.get("source")
        if largest and flag and flag.startswith("-"):
            args = set_flag(script[1:], flag, str(largest))
            outcomes, peak = by_hand_runs(out, f"{name}-largest", common, script, args, options)
            rows.append([*head, f"largest batch {largest}", outcomes, peak])
        args = prescribed_args(document)
        if args is None:
            rows.append([*head, describe(document), "-", "-"])
            continue
        outcomes, peak = by_hand_runs(out, name, common, script, args, options)
        claimed = (document.get("prescription") or {}).get("peak_allocated_bytes") or 0
        rows.append([*head, describe(document), outcomes, f"{peak} (claimed {size(claimed)})"])
    print("| replays | diagnosis | answer | by hand, whole run | by-hand peak |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
