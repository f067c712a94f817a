"""Are the snapshot's numbers unchanged by a change to the capture?

Runs a fixed set of scripts through `oomdoc run --device cpu --no-replay`
with the oomdoc of a given checkout and writes their snapshots to a folder;
`--compare A B` then diffs two such folders, ignoring what legitimately
differs between runs (times, dates, paths, host memory, capture statistics).

    python benchmarks/compare_snapshots.py --write /tmp/before            # this checkout
    python benchmarks/compare_snapshots.py --write /tmp/before --root /other/checkout
    python benchmarks/compare_snapshots.py --compare /tmp/before /tmp/after
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"

CASES = {
    # name: (script, capacity, script args)
    "mlp_oom": (SCRIPTS / "run_mlp.py", "256MiB", ["--batch-size", "2048"]),
    "mlp_fits": (SCRIPTS / "run_mlp.py", "256MiB", ["--batch-size", "64"]),
    "replay_mlp": (SCRIPTS / "replay_mlp_train.py", "256MiB", ["--batch-size", "2048"]),
    "replay_mlp_fits": (SCRIPTS / "replay_mlp_train.py", "256MiB", ["--batch-size", "256"]),
    "check_mlp": (SCRIPTS / "check_mlp.py", "256MiB", ["--steps", "4"]),
    "leak_sum": (SCRIPTS / "suggest_leak_total_loss.py", "8MiB", ["--steps", "12"]),
    "leak_oom": (
        SCRIPTS / "suggest_leak_total_loss.py",
        "8MiB",
        ["--steps", "80", "--mode", "sum-retain"],
    ),
    "leak_outputs": (
        SCRIPTS / "suggest_leak_total_loss.py",
        "8MiB",
        ["--steps", "30", "--mode", "outputs"],
    ),
    "leak_fixed": (
        SCRIPTS / "suggest_leak_total_loss.py",
        "8MiB",
        ["--steps", "12", "--mode", "fixed"],
    ),
    "eval_oom": (SCRIPTS / "suggest_eval_no_grad.py", "20MiB", []),
    "eval_collect": (SCRIPTS / "suggest_eval_no_grad.py", "64MiB", ["--collect"]),
    "train_eval": (SCRIPTS / "suggest_train_then_eval.py", "64MiB", []),
    "two_views": (SCRIPTS / "suggest_train_then_eval.py", "64MiB", ["--two-views"]),
    "gpt_oom": (
        ROOT / "examples" / "gpt_train.py",
        "192MiB",
        ["--preset", "tiny", "--batch-size", "64", "--steps", "3"],
    ),
    "gpt_fits": (
        ROOT / "examples" / "gpt_train.py",
        "192MiB",
        ["--preset", "tiny", "--batch-size", "8", "--steps", "6"],
    ),
}

# Fields that differ between two runs of the same code.
VOLATILE = {
    "created_at",
    "timings",
    "duration_s",
    "host",
    "cwd",
    "oomdoc_version",
    "capture_stats",
    "replay",
}


def normalise(value):
    if isinstance(value, dict):
        return {key: normalise(item) for key, item in value.items() if key not in VOLATILE}
    if isinstance(value, list):
        return [normalise(item) for item in value]
    return value


def write(folder: Path, root: Path, jobs: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)

    def one(name):
        script, capacity, args = CASES[name]
        output = folder / f"{name}.json"
        if output.exists():
            output.unlink()
        env = dict(os.environ, PYTHONPATH=str(root))
        command = [sys.executable, "-m", "oomdoc", "run", "--device", "cpu"]
        command += ["--device-memory", capacity, "--no-replay", "-o", str(output), str(script)]
        completed = subprocess.run(
            command + args, env=env, cwd=folder, capture_output=True, text=True
        )
        return name, completed.returncode, output.exists()

    with ThreadPoolExecutor(jobs) as pool:
        for name, status, written in pool.map(one, CASES):
            print(f"{name}: exit {status}{'' if written else ', NO SNAPSHOT'}")


def diff(left, right, path="") -> list[str]:
    if isinstance(left, dict) and isinstance(right, dict):
        found = []
        for key in sorted(set(left) | set(right)):
            if key not in left or key not in right:
                found.append(f"{path}.{key}: only in {'after' if key in right else 'before'}")
            else:
                found += diff(left[key], right[key], f"{path}.{key}")
        return found
    if isinstance(left, list) and isinstance(right, list):
        if len(left) != len(right):
            return [f"{path}: {len(left)} items before, {len(right)} after"]
        return [
            line
            for a, b, i in zip(left, right, range(len(left)))
            for line in diff(a, b, f"{path}[{i}]")
        ]
    return [] if left == right else [f"{path}: {left!r} before, {right!r} after"]


def compare(before: Path, after: Path) -> int:
    differences = 0
    for name in CASES:
        left_path, right_path = before / f"{name}.json", after / f"{name}.json"
        if not left_path.exists() or not right_path.exists():
            print(f"{name}: missing")
            differences += 1
            continue
        left = normalise(json.loads(left_path.read_text()))
        right = normalise(json.loads(right_path.read_text()))
        found = diff(left, right)
        differences += bool(found)
        steps = len(left.get("steps", []))
        print(
            f"{name}: {'identical' if not found else f'{len(found)} differences'} ({steps} steps)"
        )
        for line in found[:10]:
            print("   ", line)
    return 1 if differences else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="write snapshots to this folder")
    parser.add_argument("--root", type=Path, default=ROOT, help="the oomdoc checkout to run")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.write:
        write(args.write.resolve(), args.root.resolve(), args.jobs)
    if args.compare:
        sys.exit(compare(*args.compare))


if __name__ == "__main__":
    main()
