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
caching allocator does, and is not part of the capture. With `--capped-only`
the plain capped run is the only plain run and the baseline of every row.

`--optimizer-steps` times scripts that print no step lines (the HF `Trainer`,
Lightning): a `sitecustomize` put first on every run's PYTHONPATH registers
one global optimizer-step post-hook that synchronizes and prints the interval
since the last optimizer step, in the plain runs and in oomdoc's capture child
(never in oomdoc's parent, which does not import torch). Each interval then
holds the whole of a step: data loading, accumulation's micro-batches, the
framework's own work. The same hook runs in every variant.

    python benchmarks/capture_parts.py --device-memory 16GiB --repeats 2 \
        --capped-only --optimizer-steps --warmup 3 -- \
        tests/scripts/fw_hf_trainer.py --use_cpu False --bf16 True \
        --gradient_checkpointing True --per_device_train_batch_size 16 --max_steps 12

Variants (`--variant NAME=KEY=VALUE[,KEY=VALUE]`, repeatable) default to:
oomdoc as it is, without the per-allocation Python stacks
(OOMDOC_ALLOCATION_HISTORY=0), without the saved-tensors pack hook
(OOMDOC_MODULE_HOOKS=0), and without both.
"""

from __future__ import annotations

import argparse
import os
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

# Prints `step N: loss nan (T ms)` at each optimizer step, the wall time since
# the previous one after a synchronize. In oomdoc's child only (the parent has
# neither OOMDOC_CHILD_CONFIG nor ..._FD), or in a plain run.
STEP_TIMER = r"""
import os
_mode = os.environ.get("OOMDOC_BENCH_STEP_TIMER")
_child = os.environ.get("OOMDOC_CHILD_CONFIG") or os.environ.get("OOMDOC_CHILD_CONFIG_FD")
if _mode == "plain" or (_mode == "oomdoc" and _child):
    import time
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _last = [None, 0]

    def _after_step(_optimizer, _args, _kwargs):
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if _last[0] is not None:
            print(f"step {_last[1]}: loss nan ({1000 * (now - _last[0]):.3f} ms)", flush=True)
            _last[1] += 1
        _last[0] = now

    register_optimizer_step_post_hook(_after_step)
"""


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
    parser.add_argument(
        "--capped-only", action="store_true", help="the plain capped run is the baseline"
    )
    parser.add_argument(
        "--optimizer-steps", action="store_true", help="time optimizer steps from outside"
    )
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS")
    args = parser.parse_args()
    script = script_after_dashes(args.script)
    if not script:
        parser.error("give the script and its arguments after --")
    args.replay_jobs = None
    variants = [parse_variant(text) for text in (args.variant or DEFAULT_VARIANTS)]
    if args.plain_capped and not args.capped_only:
        variants.insert(0, (PLAIN_CAPPED, {}))
    if args.uncapped:
        variants.append((UNCAPPED, {}))
    baseline = PLAIN_CAPPED if args.capped_only else "plain"
    base_env = environment(args.device)
    walls: dict[str, list[list[float]]] = {baseline: []}
    cpus: dict[str, list[float]] = {baseline: []}
    for name, _env in variants:
        walls[name], cpus[name] = [], []
    with tempfile.TemporaryDirectory() as directory:
        if args.optimizer_steps:
            Path(directory, "sitecustomize.py").write_text(STEP_TIMER)
            base_env["PYTHONPATH"] = os.pathsep.join([directory, base_env["PYTHONPATH"]])
        plain_capped = [sys.executable, "-c", CAPPED, args.device_memory, *script]
        plain = plain_capped if args.capped_only else [sys.executable, *script]
        for round_ in range(args.repeats):
            started = time.perf_counter()
            plain_env = dict(base_env, OOMDOC_BENCH_STEP_TIMER="plain")
            wall, cpu = steps_of(run(plain, plain_env), args.warmup)
            walls[baseline].append(wall)
            cpus[baseline] += cpu
            for index, (name, env) in enumerate(variants):
                snapshot = Path(directory) / f"{round_}-{index}.json"
                if name == PLAIN_CAPPED:
                    command = plain_capped
                else:
                    capped = args.device_memory if name != UNCAPPED else None
                    command = oomdoc_command(
                        argparse.Namespace(**dict(vars(args), device_memory=capped)),
                        snapshot,
                        False,
                    )
                    command += script
                timer = "plain" if name == PLAIN_CAPPED else "oomdoc"
                run_env = dict(base_env, OOMDOC_BENCH_STEP_TIMER=timer, **env)
                wall, cpu = steps_of(run(command, run_env), args.warmup)
                walls[name].append(wall)
                cpus[name] += cpu
            print(
                f"round {round_ + 1}/{args.repeats}: {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    plain_wall = statistics.median([t for run_ in walls[baseline] for t in run_])
    plain_cpu = statistics.median(cpus[baseline]) if cpus[baseline] else None
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
                if name == baseline or cpu is None or plain_cpu is None
                else f"{cpu - plain_cpu:+.2f}",
                "" if name == baseline else f"{100 * (wall / plain_wall - 1):+.2f}%",
                "" if name == baseline else paired_overhead(walls[baseline], walls[name]),
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
