"""How big and how fast the HTML report is on a big snapshot.

    python benchmarks/html_report.py [--steps 20000] [--sites 40000] [--chromium PATH]

Builds a synthetic snapshot with `steps` training steps (three phase peaks
each, a slow leak, an OOM in the last one) and `sites` allocation sites with
eight-frame stacks: steps x 3 + sites allocation events (100,000 by default),
plus modules and two ranks. Prints one table: the snapshot's size, the HTML
file's size, the Python time to analyse, build the view and render, and the
time Chromium took from navigation start to the page laid out (the load
event, then a forced style and layout; measured in the page with
performance.now() and read back from the DOM with --dump-dom). Targets: under 5 MB and under 2 s in the browser.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oomdoc.analysis import analyse  # noqa: E402
from oomdoc.model import Snapshot  # noqa: E402
from oomdoc.reporters.html import build_view, render_html  # noqa: E402

MiB = 1024**2
GiB = 1024**3
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")


def synthetic_document(steps: int = 20000, sites: int = 40000) -> dict:
    """A CUDA-like snapshot: `steps` steps whose end-of-step memory grows
    slowly, an OOM in the backward of the last, and `sites` allocation sites."""
    capacity = 16 * GiB
    base = 6 * GiB
    leak = (capacity - base - 6 * GiB) // max(1, steps)
    step_list = []
    for index in range(steps):
        end = base + index * leak
        wobble = (index * 7919) % 97 * MiB  # not a straight line: min/max buckets matter
        forward = end + 4 * GiB + wobble
        backward = end + 5 * GiB + wobble
        optimizer = end + 1 * GiB
        step_list.append(
            {
                "index": index,
                "peak_allocated_bytes": backward,
                "peak_reserved_bytes": backward + 512 * MiB,
                "peak_phase": "backward",
                "end_allocated_bytes": end,
                "phase_peaks": {"forward": forward, "backward": backward, "optimizer": optimizer},
                "forward_calls": 1,
                "forward_calls_with_grad": 1,
                "eval_mode_forward_calls_with_grad": 0,
                "backward_calls": 1,
                "optimizer_steps": 1,
                "duration_s": 0.1,
                "retained_graphs": [],
            }
        )
    last = step_list[-1]
    allocated = capacity - 200 * MiB
    last["phase_peaks"]["backward"] = allocated
    last["peak_allocated_bytes"] = allocated
    top_allocations = []
    for number in range(sites):
        top_allocations.append(
            {
                "bytes": max(512, (sites - number) * 4096),
                "count": 1 + number % 5,
                "category": CATEGORIES[number % 5],
                "location": {
                    "file": f"/work/model/layer_{number % 300}.py",
                    "line": 10 + number % 400,
                    "function": "forward",
                },
                "shape": [64, 1024 + number % 7],
                "dtype": "float32",
                "stack": [
                    {
                        "file": f"/work/model/layer_{(number + depth) % 300}.py",
                        "line": depth * 10 + 1,
                        "function": f"fn_{depth}",
                    }
                    for depth in range(8)
                ],
            }
        )
    breakdown = {
        "parameters": 2 * GiB,
        "gradients": 2 * GiB,
        "optimizer_state": 4 * GiB,
        "activations": allocated - 8 * GiB - 100 * MiB,
        "other": 100 * MiB,
    }
    return {
        "schema_version": 1,
        "oomdoc_version": "0.1.0",
        "created_at": "2026-11-23T00:00:00Z",
        "command": ["train.py", "--batch-size", "32"],
        "cwd": "/work",
        "torch_version": "2.11.0",
        "device": {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "capacity_bytes": capacity},
        "outcome": "oom",
        "exit_code": 1,
        "step_unit": "optimizer",
        "oom": {
            "step": steps - 1,
            "phase": "backward",
            "requested_bytes": 1 * GiB,
            "allocated_bytes": allocated,
            "reserved_bytes": allocated + 100 * MiB,
            "free_bytes": 100 * MiB,
            "capacity_bytes": capacity,
            "message": "CUDA out of memory.",
            "location": {"file": "/work/train.py", "line": 88, "function": "main"},
        },
        "breakdown": breakdown,
        "breakdown_at": "oom",
        "peak": {
            "allocated_bytes": allocated,
            "reserved_bytes": allocated + 100 * MiB,
            "step": steps - 1,
            "phase": "backward",
        },
        "steps": step_list,
        "top_allocations": top_allocations,
        "optimizers": ["AdamW"],
        "models": [
            {
                "class": "GPT",
                "parameters_bytes": 2 * GiB,
                "repeated_blocks": [{"path": "blocks", "class": "Block", "count": 24}],
            }
        ],
        "modules": [
            {
                "path": f"blocks.{number}",
                "class": "Block",
                "blocks": 1,
                "bytes": {"activations": (500 - number) * MiB, "parameters": 80 * MiB},
            }
            for number in range(500)
        ],
        "world_size": 2,
        "first_failing_rank": 0,
        "ranks": [
            {
                "rank": rank,
                "local_rank": rank,
                "host": "node-0",
                "device": {
                    "kind": "cuda",
                    "name": "NVIDIA H100 80GB HBM3",
                    "capacity_bytes": capacity,
                },
                "outcome": "oom" if rank == 0 else "interrupted",
                "oom": None,
                "breakdown": breakdown,
                "steps": step_list,
            }
            for rank in range(2)
        ],
        "fixes": [],
    }


def chromium_binary(given: str | None) -> str | None:
    return (
        given
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )


def browser_ms(chromium: str, html_path: Path) -> tuple[float, float]:
    """Navigation start to the page laid out, as the page measured it, and the
    wall time of the whole headless run."""
    with tempfile.TemporaryDirectory() as profile:
        started = time.perf_counter()
        completed = subprocess.run(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={profile}",
                "--dump-dom",
                html_path.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        wall = time.perf_counter() - started
    match = re.search(r'data-rendered-ms="([0-9.]+)"', completed.stdout)
    if not match:
        raise SystemExit(f"no render time in the DOM: {completed.stderr[-500:]}")
    return float(match.group(1)), wall * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--sites", type=int, default=40000)
    parser.add_argument("--chromium", default=None)
    parser.add_argument("--keep", default=None, help="write the HTML here too")
    args = parser.parse_args()

    document = synthetic_document(args.steps, args.sites)
    snapshot_bytes = len(json.dumps(document))
    started = time.perf_counter()
    analysed = analyse(Snapshot.from_dict(document), top=10)
    analysed_at = time.perf_counter()
    view = build_view(analysed)
    viewed_at = time.perf_counter()
    page = render_html(view)
    rendered_at = time.perf_counter()

    rows = [
        (
            "allocation events",
            f"{args.steps * 3 + args.sites:,} ({args.steps:,} steps x 3 phases + {args.sites:,} sites)",
        ),
        ("snapshot JSON", f"{snapshot_bytes / 1e6:.1f} MB"),
        ("HTML file", f"{len(page.encode()) / 1e6:.2f} MB (target < 5 MB)"),
        (
            "timeline points drawn",
            f"{sum(len(view['timeline'][key]) for key in ('allocated', 'reserved', 'end')):,} of {view['timeline']['points_total']:,}",
        ),
        ("sites shown", f"{len(view['sites']['items'])} of {view['sites']['total']:,}"),
        ("Python: analysis()", f"{(analysed_at - started) * 1000:.0f} ms"),
        ("Python: build_view()", f"{(viewed_at - analysed_at) * 1000:.0f} ms"),
        ("Python: render_html()", f"{(rendered_at - viewed_at) * 1000:.0f} ms"),
    ]
    chromium = chromium_binary(args.chromium)
    with tempfile.TemporaryDirectory() as directory:
        html_path = Path(directory) / "report.html"
        html_path.write_text(page, encoding="utf-8")
        if args.keep:
            Path(args.keep).write_text(page, encoding="utf-8")
        if chromium:
            runs = [browser_ms(chromium, html_path) for _ in range(3)]
            in_page = sorted(run[0] for run in runs)
            wall = sorted(run[1] for run in runs)
            rows.append(
                (
                    "Chromium: navigation start to laid out (load, forced layout)",
                    f"{in_page[1]:.0f} ms median of 3 (min {in_page[0]:.0f}, max {in_page[2]:.0f}; target < 2000 ms)",
                )
            )
            rows.append(
                (
                    "Chromium: whole headless run (process start to DOM dump)",
                    f"{wall[1]:.0f} ms median of 3",
                )
            )
        else:
            rows.append(("Chromium", "not found (apt-get install chromium)"))
    width = max(len(name) for name, _ in rows)
    print(f"{'quantity':<{width}}  value")
    print(f"{'-' * width}  {'-' * 40}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"\n(os: {os.uname().sysname} {os.uname().machine}, Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
