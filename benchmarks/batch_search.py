"""Finding the largest batch size that fits: oomdoc's search against the usual ones.

    python benchmarks/batch_search.py                       # GPU: reference GPT, 16 GiB cap, batch 32
    python benchmarks/batch_search.py --device cpu          # simulated device: tiny GPT, 192 MiB, batch 64
    python benchmarks/batch_search.py --full-run            # also time a whole `oomdoc run` with its fixes
    python benchmarks/batch_search.py --offline             # no device: the recorded H100 runs

--offline replays oomdoc's search on what replays measured on an H100
(tests/data/batch_grid/, recorded by benchmarks/batch_grid.py): the reference
GPT, torchvision's ResNet-50, a Hugging Face GPT-2-medium Trainer and a
Lightning TransformerEncoder, each failing under a 16 GiB cap. A probe at a
recorded batch size gets that replay's capture; any other (marked ~) fits
up to the recorded limit and gets each number on the line through the
nearest recorded batch sizes. It prints the probes, the replays and whether
the result is exact, next to the search's probes on the same H100 before,
and how many replays the search takes from other first probes.

Every strategy runs the same trial: a fresh oomdoc replay child of
examples/gpt_train.py at one batch size, two training steps, the batch size
rewritten on the command line. A trial "fits" when both steps complete.

  oomdoc      the per-phase batch-size model: one probe, then verify the prediction and prediction+1
  doubling    Lightning's scale_batch_size(mode="power"): 2, 4, 8, ... until OOM
  halving     accelerate's find_executable_batch_size: 128, 64, ... until it fits
  0.9 factor  newer accelerate: 128, then x0.9 until it fits
  binary      Lightning's mode="binsearch": double until OOM, then bisect: exact

Prints one table (trials, result, exact, wall time of the trials).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tabulate import tabulate  # noqa: E402

from oomdoc.capture import choose_device  # noqa: E402
from oomdoc.replay import batch as batch_model  # noqa: E402
from oomdoc.replay import limit_estimate  # noqa: E402
from oomdoc.replay.orchestrate import Replayer, warm_pool  # noqa: E402
from oomdoc.replay.progress import Progress  # noqa: E402
from oomdoc.runner import ChildRequest, RunOptions, build_snapshot, run_child  # noqa: E402
from oomdoc.sizes import parse_size  # noqa: E402

SCRIPT = str(ROOT / "examples" / "gpt_train.py")


class Trials:
    """Runs and counts trials at a batch size."""

    def __init__(self, replayer: Replayer, base_args: list[str]):
        self.replayer = replayer
        self.base_args = base_args
        self.count = 0
        self.wall_s = 0.0

    def run(self, batch_size: int) -> batch_model.BatchRun:
        self.count += 1
        args = [*self.base_args, "--batch-size", str(batch_size)]
        fix = {"name": "smaller_batch", "batch_mode": "argv", "batch_size": batch_size}
        replay = self.replayer.run(fix, f"batch {batch_size}", args=args)
        self.wall_s += replay.wall_s
        run = (
            batch_model.observe(replay.capture, batch_size)
            if replay.capture
            else batch_model.BatchRun(batch_size, False, inconclusive=True)
        )
        run.wall_s = replay.wall_s
        return run

    def fits(self, batch_size: int) -> bool:
        return self.run(batch_size).fits


def doubling(trials: Trials, start: int = 2, limit: int = 4096) -> tuple[int, bool]:
    best, batch_size = 0, start
    while batch_size <= limit and trials.fits(batch_size):
        best, batch_size = batch_size, batch_size * 2
    return best, False


def shrinking(trials: Trials, start: int = 128, factor: float = 0.5) -> tuple[int, bool]:
    batch_size = start
    while batch_size >= 1:
        if trials.fits(batch_size):
            return batch_size, False
        smaller = int(batch_size * factor)
        batch_size = smaller if smaller < batch_size else batch_size - 1
    return 0, False


def binary(trials: Trials, limit: int = 4096) -> tuple[int, bool]:
    low, high = 0, None
    batch_size = 1
    while batch_size <= limit:
        if trials.fits(batch_size):
            low, batch_size = batch_size, batch_size * 2
        else:
            high = batch_size
            break
    if high is None:
        return low, False
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if trials.fits(middle) else (low, middle)
    return low, low > 0


GRID = ROOT / "tests" / "data" / "batch_grid"
OFFLINE_CASES = {
    "gpt": "reference GPT (examples/gpt_train.py), batch 32",
    "resnet": "ResNet-50 (torchvision), batch 512",
    "hf": "GPT-2 medium, Hugging Face Trainer, batch 16",
    "lightning": "TransformerEncoder 12x1024, Lightning Trainer, batch 256",
}
# Other first probes, as shares of the largest batch that fits.
OTHER_FIRST_PROBES = (0.5, 0.8, 1.2)


def load_grid(case: str):
    """The recorded H100 runs of one case (benchmarks/batch_grid.py's RecordedGrid)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "batch_grid", ROOT / "benchmarks" / "batch_grid.py"
    )
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("batch_grid") or importlib.util.module_from_spec(spec)
    if "batch_grid" not in sys.modules:
        sys.modules["batch_grid"] = module
        spec.loader.exec_module(module)
    return module.RecordedGrid.load(GRID / f"{case}.json")


def offline_search(case: str, probe: int | None = None):
    """oomdoc's search on a recorded case: (the grid, the search's result)."""
    grid = load_grid(case)
    failing = grid.failing
    first = probe if probe is not None else limit_estimate.first_probe_for(failing, grid.original)
    result = batch_model.search_max_batch(
        grid.original,
        failing.device.capacity_bytes,
        [batch_model.observe(failing, grid.original)],
        grid.trial,
        probe=first,
    )
    return grid, result


def probes_text(trials, interpolated=()) -> str:
    return ", ".join(
        f"{'~' if size in interpolated else ''}{size} {'fits' if fits else 'OOM'}"
        for size, fits in trials
    )


def offline() -> None:
    rows = []
    for case, title in OFFLINE_CASES.items():
        grid, result = offline_search(case)
        trials = [(run.batch_size, run.fits) for run in result.trials]
        before = grid.document.get("before", {}).get("trials") or []
        others = []
        for share in OTHER_FIRST_PROBES:
            probe = max(1, min(grid.original - 1, round(share * (grid.true_max or 1))))
            _grid, other = offline_search(case, probe)
            exact = other.exact and other.max_batch_size == grid.true_max
            others.append(f"{probe}: {len(other.trials)}{'' if exact else ' (not exact)'}")
        rows.append(
            [
                title,
                grid.true_max,
                probes_text(trials, grid.interpolated),
                len(result.trials),
                "yes" if result.exact and result.max_batch_size == grid.true_max else "NO",
                f"{probes_text(before)} ({len(before)})",
                "; ".join(others),
                f"{grid.wall_s:.0f}",
            ]
        )
    print(
        "\nLargest batch size that fits, on the recorded H100 runs (torch 2.11, --device-memory 16GiB)"
    )
    print(
        tabulate(
            rows,
            headers=[
                "case",
                "max",
                "probes (~ interpolated)",
                "replays",
                "exact",
                "before (replays)",
                "from other first probes: replays",
                "replays s",
            ],
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--offline", action="store_true", help="replay the search on the recorded H100 runs"
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument(
        "--device-memory",
        default=None,
        help="default 16GiB on CUDA, 192MiB on the simulated device",
    )
    parser.add_argument(
        "--preset", default=None, help="default reference on CUDA, tiny on the simulated device"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="the failing batch size (default 32 on CUDA, 64 on CPU)",
    )
    parser.add_argument("--strategies", default="oomdoc,doubling,halving,0.9,binary")
    parser.add_argument(
        "--full-run", action="store_true", help="also time `oomdoc run` with every fix it measures"
    )
    args = parser.parse_args()
    if args.offline:
        offline()
        return

    import torch  # the benchmark decides the device itself (oomdoc's parent never imports torch)

    device = choose_device(args.device, torch.cuda.is_available())
    if device is None:
        sys.exit("--device cuda: CUDA is not available on this machine")
    on_cuda = device == "cuda"
    capacity = parse_size(args.device_memory or ("16GiB" if on_cuda else "192MiB"))
    preset = args.preset or ("reference" if on_cuda else "tiny")
    failing = args.batch_size or (32 if on_cuda else 64)
    base_args = ["--preset", preset, "--steps", "4"]
    progress = Progress(sys.stderr)

    # The failing run, as `oomdoc run` captures it.
    request = ChildRequest(
        target=SCRIPT,
        args=[*base_args, "--batch-size", str(failing)],
        device=device,
        capacity_bytes=capacity,
        output_path=os.devnull,
    )
    started = time.perf_counter()
    baseline = run_child(request)
    baseline_s = time.perf_counter() - started
    options = RunOptions(target=SCRIPT, args=request.args, device=device, capacity_bytes=capacity)
    failing_run = build_snapshot(options, baseline)
    if failing_run.outcome != "oom":
        sys.exit(
            f"batch size {failing} did not run out of memory ({failing_run.outcome}): pick a larger --batch-size"
        )

    rows = []
    for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        pool = warm_pool(request)  # every strategy's trials start warm alike
        replayer = Replayer(failing_run, options, request, progress, pool)
        trials = Trials(replayer, base_args)
        if strategy == "oomdoc":
            observed = batch_model.observe(failing_run, failing)
            result = batch_model.search_max_batch(
                failing,
                capacity,
                [observed],
                trials.run,
                probe=limit_estimate.first_probe_for(failing_run, failing),
            )
            found, exact = result.max_batch_size or 0, result.exact
        elif strategy == "doubling":
            found, exact = doubling(trials)
        elif strategy == "halving":
            found, exact = shrinking(trials, 128, 0.5)
        elif strategy == "0.9":
            found, exact = shrinking(trials, 128, 0.9)
        elif strategy == "binary":
            found, exact = binary(trials)
        else:
            pool.close()
            sys.exit(f"unknown strategy {strategy!r}")
        pool.close()
        rows.append(
            [strategy, trials.count, found, "yes" if exact else "no", f"{trials.wall_s:.1f}"]
        )

    truth = next((row[2] for row in rows if row[3] == "yes"), None)
    for row in rows:
        row.insert(3, "" if truth is None else ("yes" if row[2] == truth else f"no ({truth})"))
    what = f"{preset} GPT, batch {failing} fails, capacity {args.device_memory or ('16GiB' if on_cuda else '192MiB')}, {device}"
    print(f"\nLargest batch size that fits: {what} (failing run {baseline_s:.1f} s, not counted)")
    print(
        tabulate(
            rows,
            headers=["strategy", "trials", "max batch", "right", "proven exact", "trials wall s"],
            colalign=("left", "right", "right", "left", "left", "right"),
        )
    )

    if args.full_run:
        full_run(
            device, args.device_memory or ("16GiB" if on_cuda else "192MiB"), base_args, failing
        )


def full_run(device: str, memory: str, base_args: list[str], failing: int) -> None:
    """A whole `oomdoc run` on the failing configuration: capture, every fix, report."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        snapshot = os.path.join(directory, "run.json")
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        )
        command = [
            sys.executable,
            "-m",
            "oomdoc",
            "run",
            "--device",
            device,
            "--device-memory",
            memory,
            "-o",
            snapshot,
            SCRIPT,
            *base_args,
            "--batch-size",
            str(failing),
        ]
        started = time.perf_counter()
        completed = subprocess.run(command, env=env, capture_output=True, text=True)
        wall_s = time.perf_counter() - started
        document = json.loads(Path(snapshot).read_text())
    replay = document.get("replay") or {}
    print(
        f"\nWhole `oomdoc run` (capture + {replay.get('replays')} replays + report): {wall_s:.1f} s, "
        f"replays {replay.get('total_s')} s, {len(document.get('fixes') or [])} fixes measured, exit {completed.returncode}"
    )
    print(
        tabulate(
            [
                [
                    f["rank"],
                    f["name"],
                    f.get("fits"),
                    f.get("peak_allocated_bytes"),
                    f.get("step_time_ratio"),
                    f.get("replay_s"),
                ]
                for f in document.get("fixes") or []
            ],
            headers=["rank", "fix", "fits", "peak bytes", "step time", "replay s"],
        )
    )
    for skipped in replay.get("skipped") or []:
        print(f"not tried: {skipped['name']}: {skipped['reason']}")
    # Where each replay's time went (seconds; see oomdoc.capture.child.timing_summary).
    columns = [
        "label",
        "outcome",
        "warm",
        "wall_s",
        "startup_s",
        "waited_s",
        "setup_s",
        "script_s",
        "capture_s",
    ]
    print(
        tabulate(
            [[run.get(column) for column in columns] for run in replay.get("runs") or []],
            headers=columns,
        )
    )


if __name__ == "__main__":
    main()
