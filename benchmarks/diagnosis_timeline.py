"""Where a diagnosis's time goes: `oomdoc run` of one script, `--runs` times
in a row (the first on a fresh machine is the cold one), and for each run a
Markdown table of its replays from the snapshot's `replay.runs` (and
`unused_runs`): when each started after the replays began, its wall time,
the wait for a warm child, the script's start-up to its first step, its
waits for the device lock, and its outcome. Above each table: the whole
command's time, the failing run's, and the replays'.

    python benchmarks/diagnosis_timeline.py --runs 2 --device-memory 16GiB -- \\
        benchmarks/scripts/hf_trainer_varlen.py --n_layer 12 --n_embd 768 \\
        --per_device_train_batch_size 32 --max_steps 32 --eval_steps 16 --use_cpu False

The critical chain shows as replays that start when another ends; waits for
warm children as `ready_wait_s`, for the device as `lock_wait_s`; `beside`:
how many other replays ran during each. Below each table, the prescription's
own-flags timing and the configurations its flags ruled out (whether the
replays that decide were timed beside others or alone).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from script_args import prescription_label, script_after_dashes
from whole_run_check import oomdoc as diagnose  # one `oomdoc run`: (snapshot, seconds)

COLUMNS = (
    "started_s",
    "wall_s",
    "ready_wait_s",
    "first_step_s",
    "steps_s",
    "steps_cpu_wait_s",
    "script_s",
    "lock_wait_s",
    "forked",
    "outcome",
)


def cell(value) -> str:
    if isinstance(value, list):  # each step's duration: steps_s
        return "/".join(cell(float(item)) for item in value)
    if isinstance(value, float):
        return f"{value:.2f}"
    return "" if value is None else str(value)


def table(document: dict, seconds: float) -> str:
    replay = document.get("replay") or {}
    total = float(replay.get("total_s") or 0.0)
    chosen = prescription_label(document.get("prescription"))
    lines = [
        f"whole command {seconds:.1f} s, failing run about {max(seconds - total, 0):.1f} s "
        f"(the rest), {len(replay.get('runs') or [])} replays in {total:.1f} s, "
        f"{replay.get('jobs')} lanes; prescription: {chosen}",
        "",
        "| replay | " + " | ".join(COLUMNS) + " | beside |",
        "| --- | " + " | ".join("---:" for _ in COLUMNS) + " | ---: |",
    ]
    unused = [
        dict(run, outcome=f"unused: {run.get('outcome')}")
        for run in replay.get("unused_runs") or []
    ]
    every = [*(replay.get("runs") or []), *unused]
    for run in every:
        lines.append(
            f"| {run.get('label', '?')[:60]} | "
            + " | ".join(cell(run.get(column)) for column in COLUMNS)
            + f" | {cell(beside(run, every))} |"
        )
    flags = flags_lines(document.get("prescription") or {})
    return "\n".join([*lines, *([""] + flags if flags else [])])


def beside(run: dict, every: list[dict]) -> int | None:
    """How many other replays ran during this one (their intervals overlap):
    the own-flags replays that decide the prescription were timed beside
    others or alone."""
    start, wall = run.get("started_s"), run.get("wall_s")
    if start is None or wall is None:
        return None
    return sum(
        1
        for other in every
        if other is not run
        and other.get("started_s") is not None
        and other.get("wall_s") is not None
        and other["started_s"] < start + wall
        and other["started_s"] + other["wall_s"] > start
    )


def flags_lines(prescription: dict) -> list[str]:
    """The prescription's own-flags timing against oomdoc's replay of it, and
    every configuration the flags ruled out, with their timings."""
    checked = prescription.get("verified_by_flags") or {}
    if not checked.get("samples_per_second"):
        return []
    lines = [
        f"by its flags: {checked['samples_per_second']} samples/s "
        f"(noise {checked.get('samples_per_second_noise')}; oomdoc's replay of it: "
        f"{checked.get('replay_samples_per_second')})"
    ]
    for entry in prescription.get("considered") or []:
        if entry.get("verdict") == "slower_by_flags":
            fixes = " + ".join(entry.get("fixes") or []) or "no fix"
            lines.append(
                f"{fixes} at {entry.get('batch_size')} x {entry.get('accumulation_steps')}: "
                f"{entry.get('reason')}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--device-memory", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--replay-jobs", type=int, default=None, help="lanes (default: oomdoc's)")
    parser.add_argument("--out", type=Path, default=None, help="snapshots and logs (a temp dir)")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py ARGS")
    options = parser.parse_args()
    script = script_after_dashes(options.script)
    if not script:
        parser.error("the script to diagnose comes after --")
    out = options.out or Path(tempfile.mkdtemp(prefix="oomdoc-timeline-"))
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--device", options.device]
    if options.device_memory:
        flags += ["--device-memory", options.device_memory]
    if options.replay_jobs:
        flags += ["--replay-jobs", str(options.replay_jobs)]
    for index in range(options.runs):
        document, seconds = diagnose(out, f"run{index + 1}", flags, script)
        print(f"### run {index + 1}\n")
        print(table(document, seconds) if document else f"no snapshot (see {out})")
        print()


if __name__ == "__main__":
    main()
