"""Warm children forked from one server (oomdoc.forking,
oomdoc.capture.zygote): each fork runs its work as a child
started on its own would, its end is reported as Popen reports one, and
neither a dead server nor a dead oomdoc leaves anything waiting."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from oomdoc.forking import LOST_EXIT_CODE, ForkedProcess, forks_allowed
from oomdoc.runner import ChildRequest, child_config, run_child
from oomdoc.warm import WarmPool

REPLAY_ENV = {"OOMDOC_REPLAY": "1"}

SCRIPT = """
import os, signal, sys, time
mode = sys.argv[1]
print("pid", os.getpid(), "parent", os.getppid(), flush=True)
if mode == "exit3":
    sys.exit(3)
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "hang":
    time.sleep(120)
import torch
x = torch.randn(64, 64, requires_grad=True)
(x @ x).sum().backward()
print("trained", flush=True)
"""


def request(tmp_path, mode: str, timeout_s: float = 60) -> ChildRequest:
    script = tmp_path / "script.py"
    if not script.exists():
        script.write_text(SCRIPT)
    return ChildRequest(
        target=str(script),
        args=[mode],
        device="cpu",
        capacity_bytes=64 << 20,
        extra_env=dict(REPLAY_ENV),
        output_path=str(tmp_path / f"{mode}.log"),
        timeout_s=timeout_s,
    )


def test_forks_are_asked_for_where_descriptors_pass(monkeypatch):
    """On Linux, for the simulated device; for CUDA only when asked
    (OOMDOC_FORKS=1: no CUDA replay has run in a fork yet); never with
    OOMDOC_FORKS=0."""
    monkeypatch.delenv("OOMDOC_FORKS", raising=False)
    linux = sys.platform.startswith("linux")
    assert forks_allowed("cpu") is linux and not forks_allowed("cuda")
    monkeypatch.setenv("OOMDOC_FORKS", "1")
    assert forks_allowed("cpu") is linux and forks_allowed("cuda") is linux
    monkeypatch.setenv("OOMDOC_FORKS", "0")
    assert not forks_allowed("cpu") and not forks_allowed("cuda")


@pytest.mark.skipif(not forks_allowed("cpu"), reason="forks need Linux")
def test_forks_run_their_work_and_end_as_children_of_their_own_do(tmp_path):
    """Every replay runs in a fork of the one server (its parent), writes its
    log, and ends with the status a child of its own has: 0, 3, killed by a
    signal, and stopped at its timeout."""
    pool = WarmPool("cpu", REPLAY_ENV, size=1)
    try:
        pool.fill()
        results = {}
        for mode in ("trained", "exit3", "killed", "hang"):
            results[mode] = run_child(request(tmp_path, mode, timeout_s=20), pool=pool)
        server = pool._server
        assert server is not None and server.alive
    finally:
        pool.close()
    logs = {mode: (tmp_path / f"{mode}.log").read_text() for mode in results}
    parents = {int(log.split()[3]) for log in logs.values()}
    assert parents == {server.process.pid}, logs
    assert all(result.warm for result in results.values())
    assert results["trained"].exit_code == 0 and "trained" in logs["trained"]
    assert results["trained"].capture and results["trained"].capture["steps"]
    assert results["trained"].capture["timings"]["forked"] is True
    assert results["exit3"].exit_code == 3
    assert results["killed"].signal_name == "SIGKILL"
    assert results["hang"].timed_out
    # Closed, the server ends once its forks have.
    server.process.wait(timeout=30)


@pytest.mark.skipif(not forks_allowed("cpu"), reason="forks need Linux")
def test_a_fork_asked_of_a_dead_server_starts_on_its_own(tmp_path):
    """The server killed: a fork that was running its work is seen to end
    (its status died with the server), and the pool's next child runs as a
    child of its own."""
    hang = request(tmp_path, "hang")
    config = child_config(hang, str(tmp_path / "capture.json"), str(tmp_path))
    (tmp_path / "config.json").write_text(config.to_json())
    pool = WarmPool("cpu", REPLAY_ENV, size=1)
    try:
        pool.fill()
        running = pool.take(hang)
        assert running is not None and isinstance(running.process, ForkedProcess)
        process = running.hand(str(tmp_path / "config.json"), hang.output_path)
        deadline = time.monotonic() + 60
        while "pid" not in (tmp_path / "hang.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        server = pool._server
        assert server is not None and process.pid is not None
        server.process.kill()
        assert process.poll() is None
        process.kill()
        assert process.wait(timeout=30) == LOST_EXIT_CODE
        result = run_child(request(tmp_path, "trained"), pool=pool)
        assert result.exit_code == 0, (tmp_path / "trained.log").read_text()
        assert not pool._forks
    finally:
        pool.close()


DIES_WITH_A_SERVER = """
    import os, sys, time
    from oomdoc.warm import WarmPool
    pool = WarmPool("cpu", {"OOMDOC_REPLAY": "1"}, size=2)
    pool.fill()
    while pool._server.process.pid is None:
        time.sleep(0.05)
    print(pool._server.process.pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.skipif(not forks_allowed("cpu"), reason="forks need Linux")
def test_the_server_and_its_forks_end_when_oomdoc_dies():
    """oomdoc killed: its socket closes, the server ends, and the waiting
    forks see their pipes close and end too."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DIES_WITH_A_SERVER)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server_pid = int(process.stdout.readline())
        server = psutil.Process(server_pid)
        deadline = time.monotonic() + 60
        while len(server.children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        forks = server.children()
        assert len(forks) == 2
    finally:
        process.kill()
        process.wait()
    gone, alive = psutil.wait_procs([server, *forks], timeout=30)
    assert not alive, alive


def test_a_signal_sent_before_the_fork_exists_reaches_it():
    """Ctrl-C and stops may come while the server is still importing: the
    signal waits for the pid."""
    started = []

    def fallback():
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(process)
        return process

    handle = ForkedProcess(fallback, [])
    handle.send_signal(signal.SIGTERM)
    assert handle.poll() is None and not handle.started
    handle._on_its_own()  # it starts on its own, and takes the signal
    assert handle.wait(timeout=30) == -signal.SIGTERM
    assert started and started[0].returncode == -signal.SIGTERM


@pytest.mark.skipif(not forks_allowed("cpu"), reason="forks need Linux")
def test_a_server_where_the_cuda_driver_loaded_refuses_to_fork(tmp_path):
    """Something the server imported loaded a library named as the CUDA
    driver: a fork could not use CUDA, so it refuses, and the child asked
    for starts on its own (oomdoc's child), as every later one does."""
    fake_driver = tmp_path / "libcuda.so.1"
    shutil.copy(psutil._psutil_linux.__file__, fake_driver)  # any shared object
    (tmp_path / "loads_the_driver.py").write_text(
        "import ctypes, os\nctypes.CDLL(os.environ['FAKE_CUDA_DRIVER'])\n"
    )
    env = {**REPLAY_ENV, "PYTHONPATH": str(tmp_path), "FAKE_CUDA_DRIVER": str(fake_driver)}
    pool = WarmPool("cpu", env, size=1, preimports=["loads_the_driver"])
    try:
        pool.fill()
        trained = request(tmp_path, "trained")
        trained.extra_env = dict(env)
        result = run_child(trained, pool=pool)
        assert result.warm and result.exit_code == 0, (tmp_path / "trained.log").read_text()
        log = (tmp_path / "trained.log").read_text()
        assert int(log.split()[3]) == os.getpid()
        assert "forked" not in result.capture["timings"]
        assert pool._server is not None and pool._server.refused and not pool._server.alive
    finally:
        pool.close()
