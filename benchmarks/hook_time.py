"""Where the capture's host time goes: the host seconds spent in each of the
tracker's hooks (inclusive: a hook that calls another counts both), per step,
for one `oomdoc run --no-replay` of a script.

    python benchmarks/hook_time.py --device-memory 16GiB -- \\
        benchmarks/scripts/resnet50_train.py --batch-size 128 --steps 40

The child is timed from a `sitecustomize` put first on its PYTHONPATH (the
parent does not time anything, and oomdoc's code is not changed): it wraps
the tracker's and the module scopes' methods before the capture installs its
hooks, and writes the totals when the child exits. A script that waits for
the GPU at each step (reads its loss) pays on the step's wall time for the
host work done between that wait and its next forward's first kernel: the
`_on_forward_pre` of the outermost call (`outermost` below) is that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from script_args import script_after_dashes
from suite import environment, oomdoc_command
from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = r"""
import atexit, json, os, time
if os.environ.get("OOMDOC_CHILD_CONFIG") or os.environ.get("OOMDOC_CHILD_CONFIG_FD"):
    _totals = {}
    _perf = time.perf_counter
    # Steps before this one are left out (the first step reads an allocator
    # snapshot, cuDNN plans its kernels): the steady state is what is timed.
    _warmup = int(os.environ.get("OOMDOC_HOOK_TIME_WARMUP", "5"))
    _counting = [False]
    _counted_steps = [0]
    _in_outermost = [False]

    def _timed(owner, name, label=None):
        original = getattr(owner, name, None)
        if original is None:
            return
        label = label or f"{owner.__name__}.{name}"
        entry = _totals.setdefault(label, [0, 0.0])
        # The same call inside the outermost pre-hook, listed apart: on a
        # script that waits for the GPU each step, that is the exposed part.
        exposed = _totals.setdefault("  of which in outermost: " + label, [0, 0.0])

        def wrapped(*args, **kwargs):
            if not _counting[0]:
                return original(*args, **kwargs)
            started = _perf()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = _perf() - started
                entry[0] += 1
                entry[1] += elapsed
                if _in_outermost[0]:
                    exposed[0] += 1
                    exposed[1] += elapsed

        setattr(owner, name, wrapped)

    from oomdoc.capture import modules, tracker
    from oomdoc.capture.tracker import Tracker

    original_pre = Tracker._on_forward_pre
    outermost = _totals.setdefault("outermost _on_forward_pre", [0, 0.0])

    original_new_step = Tracker._new_step

    def new_step(self):
        original_new_step(self)
        _counting[0] = self.step_index >= _warmup
        _counted_steps[0] += _counting[0]

    Tracker._new_step = new_step

    def on_forward_pre(self, module, inputs):
        if _counting[0] and self._module_depth == 0 and self._backward_depth == 0:
            started = _perf()
            _in_outermost[0] = True
            try:
                return original_pre(self, module, inputs)
            finally:
                _in_outermost[0] = False
                outermost[0] += 1
                outermost[1] += _perf() - started
        return original_pre(self, module, inputs)

    Tracker._on_forward_pre = on_forward_pre
    named = (
        "_close_step", "_outermost_forward_start", "_set_phase", "_sample_peak",
        "_fold_peak", "_find_retained_graphs", "_breakdown", "_new_step",
        "_backward_ended", "_add_model", "_call_kind", "_note_shapes",
        "_deep_walk_due", "_known_tensors", "_remember_forward_baseline", "_sites",
    )
    for name in [n for n in vars(Tracker) if n.startswith("_on_")] + list(named):
        _timed(Tracker, name)
    for name in ("push", "pop", "_pack", "owners"):
        _timed(modules.ModuleScopes, name)
    try:
        from oomdoc.capture.cuda import CudaBackend
        for name in ("allocated_bytes", "read_and_reset_peak", "storage_table", "allocation_sites"):
            _timed(CudaBackend, name)
    except Exception:
        pass
    from oomdoc.capture.backend_base import Backend
    _timed(Backend, "storage_table")
    from oomdoc.capture import step_records
    _timed(step_records.CudaStepTimer, "close")
    _timed(step_records.BoundedSteps, "trim")
    from oomdoc.capture import frameworks
    for name in vars(frameworks.FrameworkDetector) if hasattr(frameworks, "FrameworkDetector") else ():
        if name.startswith("_on"):
            _timed(frameworks.FrameworkDetector, name)

    def _write():
        # The last step counted is the one open at the end (often not run).
        steps = max(0, _counted_steps[0] - 1)
        path = os.environ.get("OOMDOC_HOOK_TIME_OUT")
        if path:
            with open(path, "w") as handle:
                json.dump({"steps": steps, "totals": _totals}, handle)

    atexit.register(_write)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--device-memory", default=None)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS")
    args = parser.parse_args()
    script = script_after_dashes(args.script)
    if not script:
        parser.error("give the script and its arguments after --")
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "sitecustomize.py").write_text(SITECUSTOMIZE)
        out = Path(directory, "hook_time.json")
        env = environment(args.device)
        env["PYTHONPATH"] = os.pathsep.join((directory, env["PYTHONPATH"]))
        env["OOMDOC_HOOK_TIME_OUT"] = str(out)
        env["OOMDOC_HOOK_TIME_WARMUP"] = str(args.warmup)
        command = oomdoc_command(args, Path(directory, "snapshot.json"), False) + script
        completed = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        if not out.exists():
            sys.exit(
                f"no timings written (exit {completed.returncode}):\n{completed.stderr[-3000:]}"
            )
        result = json.loads(out.read_text())
    steps = max(1, result["steps"])
    rows = sorted(
        (
            [name, calls, f"{calls / steps:.1f}", f"{1000 * seconds / steps:.3f}"]
            for name, (calls, seconds) in result["totals"].items()
            if calls
        ),
        key=lambda row: -float(row[3]),
    )
    print(f"{' '.join(script)}: {result['steps']} steps timed (the first ones left out)")
    print(
        tabulate(
            rows, headers=["hook", "calls", "calls/step", "host ms/step"], disable_numparse=True
        )
    )


if __name__ == "__main__":
    main()
