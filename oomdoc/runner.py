"""Parent side: start the capture child, pass signals on, collect its capture.

The parent never touches the GPU, so it survives the OOM and stays clean for
replays. Each child is a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from oomdoc.capture import CONFIG_ENV


@dataclass
class ChildRequest:
    """One run of the user's script under capture."""

    target: str
    args: list[str]
    device: str  # "cuda" or "cpu" (the simulated device)
    capacity_bytes: int | None = None
    is_module: bool = False
    max_steps: int | None = None
    fix: dict | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # Replays send the script's output to a log instead of the terminal.
    output_path: str | None = None
    timeout_s: float | None = None
    artifact_dir: str | None = None


@dataclass
class ChildResult:
    exit_code: int
    capture: dict | None
    wall_s: float
    timed_out: bool = False
    signal_name: str | None = None


def child_env(request: ChildRequest) -> dict[str, str]:
    env = dict(os.environ)
    if request.device == "cpu":
        # On the simulated device the script must not find a GPU to use.
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(request.extra_env)
    return env


def run_child(request: ChildRequest) -> ChildResult:
    with tempfile.TemporaryDirectory(prefix="oomdoc-") as workdir:
        config_path = os.path.join(workdir, "config.json")
        result_path = os.path.join(workdir, "capture.json")
        config = {
            "target": request.target,
            "is_module": request.is_module,
            "args": list(request.args),
            "device": request.device,
            "capacity_bytes": request.capacity_bytes,
            "max_steps": request.max_steps,
            "fix": request.fix,
            "result_path": result_path,
            "artifact_dir": request.artifact_dir or workdir,
        }
        with open(config_path, "w", encoding="utf-8") as handle:
            json.dump(config, handle)
        env = child_env(request)
        env[CONFIG_ENV] = config_path
        # Where oomdoc itself was imported from must stay importable in the
        # child even though sys.path[0] becomes the script's directory.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if package_root not in site.getsitepackages():
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)

        output = open(request.output_path, "wb") if request.output_path else None
        started = time.perf_counter()
        timed_out = False
        previous_int = signal.getsignal(signal.SIGINT)
        previous_term = signal.getsignal(signal.SIGTERM)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "oomdoc.capture.child"],
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
                stdin=subprocess.DEVNULL if output else None,
            )

            def forward(signum, frame):
                if process.poll() is None:
                    process.send_signal(signum)

            # Ctrl-C reaches the child from the terminal directly (same process
            # group); SIGTERM sent to oomdoc is passed on.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, forward)
            try:
                returncode = process.wait(timeout=request.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                process.send_signal(signal.SIGTERM)
                try:
                    returncode = process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    returncode = process.wait()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)
            if output:
                output.close()
        wall_s = time.perf_counter() - started

        signal_name = None
        if returncode < 0:
            signal_name = signal.Signals(-returncode).name
            returncode = 128 - returncode
        capture = None
        if os.path.exists(result_path):
            try:
                with open(result_path, encoding="utf-8") as handle:
                    capture = json.load(handle)
            except (OSError, json.JSONDecodeError):
                capture = None
        if capture is not None and request.artifact_dir is None:
            capture["artifacts"] = {}  # the files died with the temporary directory
        return ChildResult(exit_code=returncode, capture=capture, wall_s=wall_s, timed_out=timed_out, signal_name=signal_name)
