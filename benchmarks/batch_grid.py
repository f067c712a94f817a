"""Record what a replay measures at many batch sizes: the data behind the
offline evaluation of the largest-batch search (benchmarks/batch_search.py --offline).

    python benchmarks/batch_grid.py --cases gpt,resnet OUT_DIR          # GPU, 16 GiB cap
    python benchmarks/batch_grid.py --device cpu --cases tiny OUT_DIR   # simulated device

For each case: the failing run, captured as `oomdoc run` captures it (module
attribution on), then one replay per batch size of the case's grid, exactly
as the batch search replays it (a warm child, `--batch-size` rewritten, the
replays' step limit). Writes OUT_DIR/<case>.json: the failing run's snapshot
and, per batch size, what the search reads from a replay (outcome, OOM,
peaks, per-step phase peaks, wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oomdoc.model import Snapshot  # noqa: E402
from oomdoc.replay.batch import BatchRun, observe  # noqa: E402
from oomdoc.replay.orchestrate import Replayer, warm_pool  # noqa: E402
from oomdoc.replay.progress import Progress  # noqa: E402
from oomdoc.runner import ChildRequest, RunOptions, build_snapshot, run_child  # noqa: E402
from oomdoc.sizes import parse_size  # noqa: E402

# name: (script, arguments before the batch flag, batch flag, failing batch, grid)
CASES = {
    "gpt": (
        "examples/gpt_train.py",
        ["--preset", "reference", "--steps", "4"],
        "--batch-size",
        32,
        [12, 16, 18, 19, 20, 21, 22, 24],
    ),
    "resnet": (
        "benchmarks/scripts/resnet50_train.py",
        ["--steps", "6"],
        "--batch-size",
        512,
        [64, 128, 160, 176, 184, 188, 190, 191, 192, 193, 194, 200, 256],
    ),
    "hf": (
        "tests/scripts/fw_hf_trainer.py",
        ["--use_cpu", "False", "--n_layer", "24", "--n_embd", "1024", "--seq_len", "512"],
        "--per_device_train_batch_size",
        16,
        [2, 4, 5, 6, 7, 8],
    ),
    "lightning": (
        "tests/scripts/fw_lightning_trainer.py",
        ["--accelerator", "gpu", "--width", "1024", "--depth", "12", "--seq-len", "512"],
        "--batch-size",
        256,
        [8, 12, 16, 20, 22, 23, 24, 25, 26, 32],
    ),
    # The simulated device (CPU): a quick check of this script.
    "tiny": (
        "examples/gpt_train.py",
        ["--preset", "tiny", "--steps", "4"],
        "--batch-size",
        64,
        [8, 16, 32, 48, 56, 57, 58, 59, 60],
    ),
}
TAILS = {
    "hf": ["--vocab_size", "50257", "--max_steps", "6"],
    "lightning": ["--vocab-size", "32000", "--steps", "6"],
}
KEPT_STEP_FIELDS = (
    "index",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "peak_phase",
    "end_allocated_bytes",
    "phase_peaks",
    "start_allocated_bytes",
    "forward_calls",
    "backward_calls",
    "optimizer_steps",
    "duration_s",
)
KEPT_OOM_FIELDS = (
    "step",
    "phase",
    "requested_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "free_bytes",
    "capacity_bytes",
    "module",
)


def arguments(case: str, batch_size: int) -> list[str]:
    _script, head, flag, _failing, _grid = CASES[case]
    return [*head, flag, str(batch_size), *TAILS.get(case, [])]


def slim(capture: dict, wall_s: float) -> dict:
    """What the batch search reads from a replay's capture."""
    oom = capture.get("oom")
    return {
        "outcome": capture.get("outcome"),
        "step_unit": capture.get("step_unit"),
        "oom": {key: oom.get(key) for key in KEPT_OOM_FIELDS} if oom else None,
        "peak": capture.get("peak"),
        "breakdown": capture.get("breakdown"),
        "steps": [
            {key: step.get(key) for key in KEPT_STEP_FIELDS} for step in capture.get("steps") or []
        ],
        "wall_s": round(wall_s, 2),
    }


def record(
    case: str,
    device: str,
    capacity: int,
    out: Path,
    progress: Progress,
    sizes: list[int] | None = None,
) -> None:
    script, _head, _flag, failing, grid = CASES[case]
    grid = sizes or grid
    target = str(ROOT / script)
    request = ChildRequest(
        target=target,
        args=arguments(case, failing),
        device=device,
        capacity_bytes=capacity,
        output_path=os.devnull,
    )
    options = RunOptions(target=target, args=request.args, device=device, capacity_bytes=capacity)
    progress.header(f"{case}: the failing run at batch size {failing}")
    started = time.perf_counter()
    failing_run = build_snapshot(options, run_child(request))
    failing_s = time.perf_counter() - started
    document = {
        "case": case,
        "script": script,
        "args": request.args,
        "original_batch_size": failing,
        "failing": failing_run.to_dict(),
        "failing_wall_s": round(failing_s, 2),
        "runs": {},
    }
    pool = warm_pool(request)
    try:
        replayer = Replayer(failing_run, options, request, progress, pool)
        for batch_size in grid:
            fix = {"name": "smaller_batch", "batch_mode": "argv", "batch_size": batch_size}
            replay = replayer.run(
                fix, f"{case} batch {batch_size}", args=arguments(case, batch_size)
            )
            capture = (
                replay.capture.to_dict() if replay.capture is not None else {"outcome": "error"}
            )
            document["runs"][str(batch_size)] = slim(capture, replay.wall_s)
            (out / f"{case}.json").write_text(json.dumps(document, indent=1) + "\n")
    finally:
        pool.close()
    (out / f"{case}.json").write_text(json.dumps(document, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", default="gpt,resnet,hf,lightning")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--device-memory", default=None, help="16GiB on CUDA, 192MiB on the CPU")
    parser.add_argument(
        "--sizes", default="", help="batch sizes instead of the case's grid, e.g. 23,25 (one case)"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    memory = args.device_memory or ("16GiB" if args.device == "cuda" else "192MiB")
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress(sys.stderr)
    for case in [name.strip() for name in args.cases.split(",") if name.strip()]:
        if case not in CASES:
            sys.exit(f"unknown case {case!r} (one of {', '.join(CASES)})")
        record(case, args.device, parse_size(memory), args.out, progress, sizes)


if __name__ == "__main__":
    main()


# ---------------------------------------------------------------- replaying a grid


class RecordedGrid:
    """Answers a replay at any batch size from a recorded grid (OUT_DIR/<case>.json):
    recorded batch sizes exactly; others interpolated between their
    neighbours (`interpolated` lists them), fitting up to the recorded largest
    batch that fits and out of memory above it."""

    def __init__(self, document: dict):
        self.document = document
        self.case = document["case"]
        self.failing = Snapshot.from_dict(document["failing"])
        self.original = int(document["original_batch_size"])
        # A replay's capture also names the device, the optimizers and the
        # model (its repeated blocks), as the failing run's does.
        described = {
            key: document["failing"].get(key) for key in ("device", "optimizers", "models")
        }
        self.runs = {int(size): {**described, **run} for size, run in document["runs"].items()}
        fitting = [size for size, run in self.runs.items() if run["outcome"] == "ok"]
        self.true_max = max(
            (
                size
                for size in fitting
                if (self.runs.get(size + 1) or {}).get("outcome") == "oom"
                or size + 1 == self.original
            ),
            default=None,
        )
        self.interpolated: list[int] = []
        self.wall_s = 0.0

    @classmethod
    def load(cls, path: Path) -> RecordedGrid:
        return cls(json.loads(Path(path).read_text()))

    def capture(self, batch_size: int) -> dict:
        if batch_size in self.runs:
            return self.runs[batch_size]
        self.interpolated.append(batch_size)
        fits = self.true_max is not None and batch_size <= self.true_max
        outcome = "ok" if fits else "oom"
        same = [size for size, run in self.runs.items() if run["outcome"] == outcome]
        nearest = min(same or self.runs, key=lambda size: (abs(size - batch_size), size))
        return _interpolate(self.runs[nearest], self.runs, batch_size)

    def trial(self, batch_size: int) -> BatchRun:
        capture = self.capture(batch_size)
        run = observe(Snapshot.from_dict(capture), batch_size)
        run.wall_s = float(capture.get("wall_s") or 0.0)
        self.wall_s += run.wall_s
        return run


def _on_line(samples: list[tuple[int, int]], batch_size: int):
    """The value at `batch_size` on the line through the two recorded batch
    sizes nearest it (between them where they bracket it)."""
    if not samples:
        return None
    samples = sorted(samples)
    below = [sample for sample in samples if sample[0] <= batch_size]
    above = [sample for sample in samples if sample[0] > batch_size]
    if below and above:
        (b1, v1), (b2, v2) = below[-1], above[0]
    elif len(samples) == 1:
        return samples[0][1]
    else:
        (b1, v1), (b2, v2) = sorted(samples, key=lambda s: abs(s[0] - batch_size))[:2]
    return max(0, int(round(v1 + (v2 - v1) * (batch_size - b1) / (b2 - b1))))


def _completed(run: dict):
    """(step index, phase, peak) of the phases a run completed (not the one it ran out of memory in)."""
    oom = run.get("oom") or {}
    for step in run["steps"]:
        for phase, value in step["phase_peaks"].items():
            if oom and step["index"] == oom.get("step") and phase == oom.get("phase"):
                continue
            yield step["index"], phase, value


def _interpolate(shape: dict, runs: dict, size: int) -> dict:
    """A run shaped like `shape` (its outcome, steps, phases, OOM) at batch
    size `size`: each number on the line through the same number (a completed
    phase's peak, a step's start, the OOM's bytes in the same step and phase)
    at the two nearest recorded batch sizes that have it."""
    run = json.loads(json.dumps(shape))
    phases: dict = {}
    starts: dict = {}
    for recorded, other in runs.items():
        for index, phase, value in _completed(other):
            phases.setdefault((index, phase), []).append((recorded, value))
        for step in other["steps"]:
            if step.get("start_allocated_bytes") is not None:
                starts.setdefault(step["index"], []).append(
                    (recorded, step["start_allocated_bytes"])
                )
    oom = run.get("oom")
    for step in run["steps"]:
        if step.get("start_allocated_bytes") is not None:
            step["start_allocated_bytes"] = _on_line(starts[step["index"]], size)
        for phase in step["phase_peaks"]:
            samples = phases.get((step["index"], phase))
            if samples and not (oom and step["index"] == oom["step"] and phase == oom["phase"]):
                step["phase_peaks"][phase] = _on_line(samples, size)
    if oom:
        alike = [
            (recorded, other["oom"])
            for recorded, other in runs.items()
            if other.get("oom")
            and (other["oom"]["step"], other["oom"]["phase"]) == (oom["step"], oom["phase"])
        ]
        if len(alike) >= 2:
            for key in ("allocated_bytes", "requested_bytes", "reserved_bytes"):
                oom[key] = _on_line([(recorded, record[key]) for recorded, record in alike], size)
        else:
            # One OOM in this step and phase: shift it along the phase's
            # peaks where other runs completed the phase.
            (recorded, record), samples = alike[0], phases.get((oom["step"], oom["phase"]), [])
            if len(samples) >= 2:
                shift = _on_line(samples, size) - _on_line(samples, recorded)
                oom["allocated_bytes"] = max(0, record["allocated_bytes"] + shift)
                oom["reserved_bytes"] = max(0, record["reserved_bytes"] + shift)
    for step in run["steps"]:
        peaks = list(step["phase_peaks"].values())
        if oom and step["index"] == oom["step"]:
            peaks.append(oom["allocated_bytes"])
        step["peak_allocated_bytes"] = max(peaks)
    if run.get("peak"):
        run["peak"]["allocated_bytes"] = max(step["peak_allocated_bytes"] for step in run["steps"])
        reserved = [
            (recorded, (other.get("peak") or {}).get("reserved_bytes"))
            for recorded, other in runs.items()
        ]
        run["peak"]["reserved_bytes"] = _on_line([item for item in reserved if item[1]], size)
    return run
