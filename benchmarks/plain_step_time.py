"""A plain capped run's optimizer-step times, without oomdoc: the number a
prescription's throughput is checked against.

The script runs in this process (runpy, its own `__main__`), with CUDA's
allocator capped at `--device-memory` (set_per_process_memory_fraction, as
a smaller card) and one global optimizer-step hook that synchronizes and
notes the time: nothing else of the script is touched. Printed: each
interval between optimizer steps, their median after the first (the first
holds the optimizer's state creation and the warm-up), samples/s for
`--samples-per-step` (micro-batch x accumulation steps), and the peak.

    python benchmarks/plain_step_time.py --device-memory 16GiB --samples-per-step 256 -- \\
        tests/scripts/fw_lightning_trainer.py --accelerator gpu ... --batch-size 16 \\
        --accumulate-grad-batches 16 --precision bf16-mixed --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch
from script_args import script_after_dashes
from torch.optim.optimizer import register_optimizer_step_post_hook

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from oomdoc.sizes import parse_size  # noqa: E402 (the repository, put on the path above)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-memory", default=None, help="the cap, e.g. 16GiB")
    parser.add_argument("--samples-per-step", type=int, default=None)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py ARGS")
    options = parser.parse_args()
    script = script_after_dashes(options.script)
    if not script:
        parser.error("the script to run comes after --")
    if options.device_memory:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(parse_size(options.device_memory) / total)
    stamps: list[float] = []

    def after_step(_optimizer, _args, _kwargs) -> None:
        torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    register_optimizer_step_post_hook(after_step)
    sys.argv = list(script)
    # The path the script has when run as `python script.py`: its own folder
    # first (it may import its siblings), not this one's or the repository.
    ours = {str(HERE), str(HERE.parent)}
    sys.path[:] = [
        os.path.dirname(os.path.abspath(script[0])),
        *(entry for entry in sys.path if entry not in ours),
    ]
    outcome = "ok"
    try:
        runpy.run_path(script[0], run_name="__main__")
    except torch.OutOfMemoryError:
        outcome = "oom"
    except SystemExit as stop:
        outcome = "ok" if not stop.code else f"exit {stop.code}"
    intervals = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    median = statistics.median(intervals[1:] or intervals) if intervals else None
    row = {
        "outcome": outcome,
        "optimizer_steps": len(stamps),
        "intervals_s": [round(value, 4) for value in intervals],
        "median_step_s": round(median, 4) if median else None,
        "samples_per_second": (
            round(options.samples_per_step / median, 1)
            if median and options.samples_per_step
            else None
        ),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        # The allocator's frees of its cache and retries at the cap: each
        # synchronizes and calls cudaFree, a step cost near the cap.
        "alloc_retries": int(torch.cuda.memory_stats().get("num_alloc_retries", 0)),
    }
    print("PLAIN " + json.dumps(row), file=sys.__stdout__, flush=True)


if __name__ == "__main__":
    main()
