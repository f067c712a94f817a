"""Which part of the capture costs what per step: the same script run plainly
and under `oomdoc run --no-replay` with parts of the capture turned off by
their environment switches, all interleaved in each round (fresh processes),
so that drift hits every variant alike. Prints, per variant, the median step
(wall, and the process's CPU time where the script prints it) and the
per-round overhead against the plain run of the same round, with the median's
sign-test interval (benchmarks/suite.py's paired_overhead).

    python benchmarks/capture_parts.py --device-memory 16GiB --repeats 4 -- \\
        benchmarks/scripts/resnet50_train.py --batch-size 128 --steps 40

`--plain-capped` adds the plain run under the same cap as oomdoc's
`--device-memory` (set_per_process_memory_fraction, as leak_to_oom.py caps
it), and `--uncapped` oomdoc on the whole card: the cap changes what the
caching allocator does, and is not part of the capture.

Variants (`--variant NAME=KEY=VALUE[,KEY=VALUE]`, repeatable) default to:
oomdoc as it is, without the per-allocation Python stacks
(OOMDOC_ALLOCATION_HISTORY=0), without the saved-tensors pack hook
(OOMDOC_MODULE_HOOKS=0), and without both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from leak_to_oom import CAPPED
from script_args import script_after_dashes
from suite import STEP_RE, environment, oomdoc_command, paired_overhead, run
from tabulate import tabulate

DEFAULT_VARIANTS = [
    "oomdoc=",
    "no stacks=OOMDOC_ALLOCATION_HISTORY=0",
    "no pack hook=OOMDOC_MODULE_HOOKS=0",
    "neither=OOMDOC_ALLOCATION_HISTORY=0,OOMDOC_MODULE_HOOKS=0",
]

PLAIN_CAPPED = "plain, capped"
UNCAPPED = "oomdoc, whole card"


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, assignments = text.partition("=")
    env = {}
    for assignment in filter(None, assignments.split(",")):
        key, _, value = assignment.partition("=")
        env[key] = value
    return name, env


def steps_of(output: str, warmup: int) -> tuple[list[float], list[float]]:
    """(wall ms, cpu ms) of each step from `warmup` on; cpu is empty when the
    script does not print it."""
    found = [(int(step), wall, cpu) for step, wall, cpu in STEP_RE.findall(output)]
    walls = [float(wall) for step, wall, _cpu in found if step >= warmup]
    cpus = [float(cpu) for step, _wall, cpu in found if step >= warmup and cpu]
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--device-memory", default="16GiB")
    parser.add_argument("--repeats", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of each run")
    parser.add_argument("--variant", action="append", default=None)
    parser.add_argument("--plain-capped", action="store_true", help="and plain under the cap")
    parser.add_argument("--uncapped", action="store_true", help="and oomdoc on the whole card")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS")
    args = parser.parse_args()
    script = script_after_dashes(args.script)
    if not script:
        parser.error("give the script and its arguments after --")
    args.replay_jobs = None
    variants = [parse_variant(text) for text in (args.variant or DEFAULT_VARIANTS)]
    if args.plain_capped:
        variants.insert(0, (PLAIN_CAPPED, {}))
    if args.uncapped:
        variants.append((UNCAPPED, {}))
    base_env = environment(args.device)
    walls: dict[str, list[list[float]]] = {"plain": []}
    cpus: dict[str, list[float]] = {"plain": []}
    for name, _env in variants:
        walls[name], cpus[name] = [], []
    with tempfile.TemporaryDirectory() as directory:
        for round_ in range(args.repeats):
            started = time.perf_counter()
            wall, cpu = steps_of(run([sys.executable, *script], base_env), args.warmup)
            walls["plain"].append(wall)
            cpus["plain"] += cpu
            for index, (name, env) in enumerate(variants):
                snapshot = Path(directory) / f"{round_}-{index}.json"
                if name == PLAIN_CAPPED:
                    command = [sys.executable, "-c", CAPPED, args.device_memory, *script]
                else:
                    capped = args.device_memory if name != UNCAPPED else None
                    command = oomdoc_command(
                        argparse.Namespace(**dict(vars(args), device_memory=capped)),
                        snapshot,
                        False,
                    )
                    command += script
                wall, cpu = steps_of(run(command, dict(base_env, **env)), args.warmup)
                walls[name].append(wall)
                cpus[name] += cpu
            print(
                f"round {round_ + 1}/{args.repeats}: {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    plain_wall = statistics.median([t for run_ in walls["plain"] for t in run_])
    plain_cpu = statistics.median(cpus["plain"]) if cpus["plain"] else None
    rows = []
    for name in walls:
        wall = statistics.median([t for run_ in walls[name] for t in run_])
        cpu = statistics.median(cpus[name]) if cpus[name] else None
        rows.append(
            [
                name,
                f"{wall:.2f}",
                "" if cpu is None else f"{cpu:.2f}",
                ""
                if name == "plain" or cpu is None or plain_cpu is None
                else f"{cpu - plain_cpu:+.2f}",
                "" if name == "plain" else f"{100 * (wall / plain_wall - 1):+.2f}%",
                "" if name == "plain" else paired_overhead(walls["plain"], walls[name]),
            ]
        )
    print(f"{' '.join(script)}: {args.repeats} interleaved rounds, steps from {args.warmup} on")
    print(
        tabulate(
            rows,
            headers=[
                "variant",
                "wall ms/step",
                "cpu ms/step",
                "cpu added",
                "pooled overhead",
                "per round: median [interval] (coverage, rounds)",
            ],
            disable_numparse=True,
        )
    )


if __name__ == "__main__":
    main()
