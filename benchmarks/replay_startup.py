"""How long a replay waits before the script's own code runs.

    python benchmarks/replay_startup.py                    # HF Trainer GPT-2, simulated device
    python benchmarks/replay_startup.py --rounds 2         # each variant twice, interleaved
    python benchmarks/replay_startup.py --script tests/scripts/hf_gpt2_tiny.py \
        --device-memory 24MiB -- --batch-size 64
    python benchmarks/replay_startup.py --device cuda --device-memory 16GiB -- \
        --use_cpu False --n_layer 24 --n_embd 1024 --per_device_train_batch_size 16

Runs `oomdoc run --device cpu` on a script that runs out of memory (by
default tests/scripts/fw_hf_trainer.py, a Hugging Face Trainer on a tiny
GPT-2, at batch 16 under 24 MiB) and prints, per replay, where its start-up
went (the children's own timings, `replay.runs` in the snapshot):

  ready wait   from oomdoc asking for the replay to a child starting it: 0
               when a warm child was ready, else the rest of its start-up
               (Python, torch, what it imports ahead: `preimport_s`)
  setup        the capture's set-up in the child
  first line   ready wait + setup: the script's first line runs
  first step   the script's own start-up to its first step (its imports
               not done ahead, building the model, the data)
  start-up     first line + first step

Two variants, interleaved: `forked`, warm children forked from one process
that imported everything once (oomdoc.forking; OOMDOC_FORKS=1, which CUDA
needs), and `own process`, each warm child started on its own and
importing torch and the script's framework itself (OOMDOC_FORKS=0). Prints
a markdown table per run and the medians of each variant, with the replays'
total time (`replay.total_s`) and the whole diagnosis's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each variant's environment (forks are opt-in on CUDA: oomdoc.forking).
VARIANTS = {"forked": {"OOMDOC_FORKS": "1"}, "own process": {"OOMDOC_FORKS": "0"}}


def run_oomdoc(
    variant: str, device: str, script: str, memory: str, args: list[str], out: Path
) -> tuple[dict, float]:
    """One `oomdoc run`: its snapshot, and how long it took (seconds)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.update(VARIANTS[variant])
    command = [sys.executable, "-m", "oomdoc", "run", "--device", device, "--device-memory", memory]
    command += ["-o", str(out), script, *args]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if not out.exists():
        raise SystemExit(f"oomdoc run wrote no snapshot:\n{done.stdout}\n{done.stderr}")
    return json.loads(out.read_text()), wall_s


def startup_rows(snapshot: dict) -> list[dict]:
    """Per replay: its start-up parts, in seconds."""
    rows = []
    for run in (snapshot.get("replay") or {}).get("runs") or []:
        ready = run.get("ready_wait_s", 0.0)
        first_line = ready + run.get("setup_s", 0.0)
        first_step = run.get("first_step_s")
        rows.append(
            {
                "replay": run["label"],
                "warm": run.get("warm"),
                "forked": run.get("forked", False),
                "preimport": run.get("preimport_s", 0.0),
                "ready wait": ready,
                "setup": run.get("setup_s", 0.0),
                "first line": first_line,
                "first step": first_step,
                "start-up": None if first_step is None else first_line + first_step,
                "wall": run.get("wall_s"),
            }
        )
    return rows


def seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f} s"


def markdown(rows: list[dict]) -> str:
    keys = [
        "replay",
        "warm",
        "forked",
        "preimport",
        "ready wait",
        "setup",
        "first line",
        "first step",
    ]
    keys += ["start-up", "wall"]
    lines = ["| " + " | ".join(keys) + " |", "| --- | --- | --- |" + " ---: |" * (len(keys) - 3)]
    for row in rows:
        cells = [str(row["replay"]), "yes" if row["warm"] else "no"]
        cells += ["yes" if row["forked"] else "no"]
        cells += [seconds(row[key]) for key in keys[3:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_of(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if row[key] is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", default=str(ROOT / "tests" / "scripts" / "fw_hf_trainer.py"))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--device-memory", default="24MiB")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("args", nargs="*", default=["--per_device_train_batch_size", "16"])
    options = parser.parse_args()
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="oomdoc-replay-startup-") as workdir:
        for round_index in range(options.rounds):
            for number, variant in enumerate(VARIANTS):
                out = Path(workdir) / f"{round_index}-{number}.json"
                snapshot, wall_s = run_oomdoc(
                    variant,
                    options.device,
                    options.script,
                    options.device_memory,
                    options.args,
                    out,
                )
                rows = startup_rows(snapshot)
                total = (snapshot.get("replay") or {}).get("total_s")
                results[variant].append({"rows": rows, "total": total, "wall": wall_s})
                print(f"\n### {variant}, round {round_index + 1}\n\n{markdown(rows)}", flush=True)
    print("\n### medians over the replays (first replay / the others)\n")
    print(
        "| variant | ready wait | first line | first step | start-up | replays in all "
        "| whole diagnosis |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for variant, rounds in results.items():
        firsts = [run["rows"][0] for run in rounds if run["rows"]]
        others = [row for run in rounds for row in run["rows"][1:]]
        cells = []
        for key in ("ready wait", "first line", "first step", "start-up"):
            first = median_of(firsts, key)
            rest = median_of(others, key)
            cells.append(f"{seconds(first)} / {seconds(rest)}")
        totals = [run["total"] for run in rounds if run["total"] is not None]
        cells.append(seconds(statistics.median(totals)) if totals else "")
        cells.append(seconds(statistics.median(run["wall"] for run in rounds)))
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
