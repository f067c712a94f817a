"""Shared test helpers: drive the real CLI in a subprocess.

Every end-to-end test runs `python -m oomdoc ...` exactly as a user would,
with this checkout first on PYTHONPATH so the code under test is what runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "tests" / "scripts"


def benchmark_module(name: str):
    """benchmarks/<name>.py, imported once (benchmarks are scripts, not a package)."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


EXAMPLES = REPO_ROOT / "examples"


def oomdoc_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("OOMDOC_REPLAY", None)
    env.pop("GITHUB_STEP_SUMMARY", None)
    if extra:
        env.update(extra)
    return env


def run_python(code: str, *args, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -c code args` in a fresh process that imports this checkout's oomdoc."""
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=oomdoc_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_oomdoc(args, *, cwd=None, env=None, timeout=300, input=None) -> subprocess.CompletedProcess:
    """Run the oomdoc CLI; returns the CompletedProcess with text output."""
    return subprocess.run(
        [sys.executable, "-m", "oomdoc", *[str(a) for a in args]],
        cwd=cwd,
        env=oomdoc_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


def load_json(path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="session")
def tiny_gpt_oom_run(tmp_path_factory):
    """The tiny GPT out of memory on a 192 MiB simulated device, without
    replays: (the CompletedProcess, the snapshot's path). One run shared by
    the tests that read it (it runs out of memory in step 0's backward, so
    more --steps would write the same snapshot)."""
    directory = tmp_path_factory.mktemp("tiny-gpt-oom")
    snapshot = directory / "gpt.json"
    completed = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", "192MiB", "--no-replay", "-o", snapshot]
        + [EXAMPLES / "gpt_train.py", "--preset", "tiny", "--batch-size", "64", "--steps", "2"],
        cwd=directory,
    )
    return completed, snapshot


def two_at_a_time(function, items) -> list:
    """`function` of each of `items`, two at a time, results in order: each
    call runs separate processes (a script under oomdoc), which wait on
    start-up and rendezvous much of their time, so two share CI's two cores
    well where one alone leaves a core idle."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(function, items))


def run_capped(snapshot_path, capacity, script, args, options=(), cwd=None, env=None):
    """`oomdoc run` of `script args` on the simulated device of `capacity`
    (with `options`, e.g. --no-replay, and `env`), writing `snapshot_path`:
    (the CompletedProcess, the snapshot)."""
    completed = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            capacity,
            *options,
            "-o",
            snapshot_path,
            script,
            *args,
        ],
        cwd=cwd,
        env=env,
        timeout=600,
    )
    assert Path(snapshot_path).exists(), completed.stderr[-3000:]
    return completed, load_json(snapshot_path)


def run_case(tmp_path, case, *, extra_args=(), replay=False, options=()):
    """`oomdoc run` on the simulated device: case = (script, capacity, script
    arguments); without replays unless `replay`. Returns (the completed
    process, the snapshot)."""
    script, capacity, args = case
    snapshot = tmp_path / f"{script.stem}-{len(list(tmp_path.glob('*.json')))}.json"
    options = [*([] if replay else ["--no-replay"]), *options]
    return run_capped(snapshot, capacity, script, [*args, *extra_args], options, cwd=tmp_path)


@pytest.fixture
def oomdoc_cli():
    return run_oomdoc


def tree(root):
    """Every path under `root`, with a file's bytes or a link's target."""
    found = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root)
            if os.path.islink(path):
                found[relative] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                found[relative] = ("folder",)
            else:
                with open(path, "rb") as file:
                    found[relative] = ("file", file.read())
    return found


def run_as_replay(script, cwd):
    """`python -c script` in `cwd`, as a replay's process (OOMDOC_REPLAY=1)."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=oomdoc_env({"OOMDOC_REPLAY": "1"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
