"""Warm children forked from one process that imported everything once
(the fork server, oomdoc.capture.zygote), on the simulated device.

A warm child started on its own imports torch and the script's framework
before its replay can start: on a 2-core machine, most of what a short
replay costs (the Trainer's: 8 s of a core each). Forked, it costs
milliseconds. The forks are the server's children, not oomdoc's, so each
is held through a ForkedProcess, which answers as subprocess.Popen does
(poll, wait, send_signal, kill, returncode) from what the server reports.

Parent side and torch-free.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Protocol

import psutil

from oomdoc.capture import (
    CLOSE_REQUEST,
    FORK_ENDED,
    FORK_REFUSED,
    FORK_REQUEST,
    FORKED,
    ZYGOTE_FD_ENV,
    preimport_request,
)

# `OOMDOC_FORKS=0` starts every warm child on its own (to compare the two);
# `OOMDOC_FORKS=1` forks CUDA replays' children too (off by default: forking).
FORKS_ENV = "OOMDOC_FORKS"
# A fork whose server died before it ended: how often its end is looked for.
LOST_POLL_S = 0.05
# A wait for a fork's end looks again at least this often.
WAKE_S = 1.0
# Its exit status, which died with the server (it is reaped by init).
LOST_EXIT_CODE = 1


class ChildProcess(Protocol):
    """What oomdoc.runner uses of a child: a subprocess.Popen, or a fork."""

    @property
    def pid(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def kill(self) -> None: ...


def forks_allowed(device: str) -> bool:
    """Whether replays on `device` may run in forks, on a system that passes
    descriptors between processes. On the simulated device by default; on
    CUDA only with OOMDOC_FORKS=1: the server never starts CUDA and refuses
    to fork once anything it imported loaded the CUDA driver
    (oomdoc.capture.zygote), whose forks could not use it. On the H100 it
    refused every fork of the Trainer's replays, and children of their own
    were ready before each replay was asked for (README, replay start-up)."""
    choice = os.environ.get(FORKS_ENV)
    if choice == "0" or not (sys.platform.startswith("linux") and hasattr(socket, "send_fds")):
        return False
    return device == "cpu" or (device == "cuda" and choice == "1")


class ForkedProcess:
    """One fork of the server, as a Popen. Until the server has forked it
    (it may still be importing) its pid is None; signals sent meanwhile are
    delivered once it exists. Should the server end first, or refuse to fork,
    it is started on its own instead (`fallback`, a Popen on the same log and
    pipe)."""

    def __init__(self, fallback: Callable[[], subprocess.Popen], held: list[int]):
        self.args = ["oomdoc-fork"]
        self.pid: int | None = None
        self.returncode: int | None = None
        self._fallback = fallback
        self._held = held  # descriptors the fallback needs, closed once it is moot
        self._popen: subprocess.Popen | None = None
        self._lost = False  # the server died while this fork ran
        self._signals: list[int] = []
        self._changed = threading.Condition()

    # What the server's reports do (oomdoc.forking.ForkServer._read).

    def _release(self) -> None:
        for descriptor in self._held:
            try:
                os.close(descriptor)
            except OSError:
                pass
        self._held = []

    def _exists(self) -> list[int]:
        """Under the lock: the process exists (forked, or started on its
        own): what it held for the fallback is closed, and the signals sent
        meanwhile are returned, to send."""
        self._release()
        pending, self._signals = self._signals, []
        self._changed.notify_all()
        return pending

    def _forked(self, pid: int) -> None:
        with self._changed:
            self.pid = pid
            pending = self._exists()
        for signum in pending:
            self.send_signal(signum)

    def _ended(self, returncode: int) -> None:
        with self._changed:
            self.returncode = returncode
            self._changed.notify_all()

    def _on_its_own(self) -> None:
        with self._changed:
            if self.returncode is not None:
                return
            if self.pid is not None:
                self._lost = True
                self._changed.notify_all()
                return
            try:
                self._popen = self._fallback()
                self.pid = self._popen.pid
            except OSError:
                self.returncode = LOST_EXIT_CODE
            pending = self._exists()
        for signum in pending:
            self.send_signal(signum)

    # Popen's interface.

    @property
    def lost(self) -> bool:
        """Whether the server died while this fork lived: its exit status
        died with it."""
        return self._lost

    @property
    def started(self) -> bool:
        """Whether the process exists (or existed): a wait then has an end."""
        return self.pid is not None or self.returncode is not None

    def poll(self) -> int | None:
        with self._changed:
            popen, lost = self._popen, self._lost
            if popen is None and not lost:
                return self.returncode
        if popen is not None:
            self.returncode = popen.poll()
            return self.returncode
        assert self.pid is not None
        try:  # reparented: its new parent reaps it, or leaves a zombie
            ended = psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            ended = True
        if ended:
            with self._changed:
                self.returncode = LOST_EXIT_CODE
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            returncode = self.poll()
            if returncode is not None:
                return returncode
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            popen = self._popen
            if popen is not None:
                try:
                    self.returncode = popen.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
                return self.returncode
            with self._changed:
                if self.returncode is None and self._popen is None:
                    # The server's report wakes it; it looks again each
                    # WAKE_S all the same, so nothing missed can hang it.
                    pause = LOST_POLL_S if self._lost else WAKE_S
                    self._changed.wait(pause if left is None else min(pause, left))

    def send_signal(self, signum: int) -> None:
        with self._changed:
            if self.returncode is not None:
                return
            if self.pid is None:
                self._signals.append(signum)
                return
            popen, pid = self._popen, self.pid
        if popen is not None:
            popen.send_signal(signum)
            return
        try:
            os.kill(pid, signum)
        except OSError:
            pass  # it ended: the server's report follows

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One fork server: a capture child started with `env` that imports
    what every run needs and then `preimport`s, and forks a warm child per
    `fork`. Its reports (pids, exit statuses) are read on a thread of their
    own."""

    def __init__(self, env: dict[str, str], log_path: str, start: Callable[..., subprocess.Popen]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(env)
        env[ZYGOTE_FD_ENV] = str(theirs.fileno())
        try:
            with open(log_path, "wb") as log:
                self.process = start(
                    env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        self._lock = threading.Lock()
        self._waiting: collections.deque[ForkedProcess] = collections.deque()
        self._running: dict[int, ForkedProcess] = {}
        self._gone = False
        self.refused = False
        self._reader = threading.Thread(target=self._read, name="oomdoc-forks", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        """Running and forking (it refuses once the CUDA driver started in it)."""
        return not self._gone and not self.refused

    def _send(self, text: str, descriptors: list[int] | None = None) -> bool:
        """Under the lock: one request; False when the server is gone."""
        if self._gone:
            return False
        try:
            socket.send_fds(self._socket, [text.encode("utf-8")], descriptors or [])
            return True
        except OSError:
            return False

    def preimport(self, modules: list[str]) -> None:
        """Have the server import `modules` too: forks made after it start
        with them."""
        with self._lock:
            self._send(preimport_request(modules))

    def fork(
        self, log_fd: int, config_fd: int, fallback: Callable[[], subprocess.Popen]
    ) -> ForkedProcess:
        """A warm child writing to `log_fd` and reading its configuration
        from `config_fd`; both are the handle's to close."""
        handle = ForkedProcess(fallback, [log_fd, config_fd])
        with self._lock:
            asked = self._send(f"{FORK_REQUEST} {time.time()!r}", [log_fd, config_fd])
            if asked:
                self._waiting.append(handle)
        if not asked:
            handle._on_its_own()
        return handle

    def close(self) -> None:
        """The server ends once its forks have (those unused end as soon as
        their pipes close)."""
        with self._lock:
            self._send(CLOSE_REQUEST)

    def _read(self) -> None:
        while True:
            try:
                message = self._socket.recv(4096)
            except OSError:
                message = b""
            if not message:
                break
            kind, _, rest = message.decode("utf-8", "replace").partition(" ")
            try:
                numbers = [int(part) for part in rest.split()]
            except ValueError:
                continue
            if kind == FORKED and numbers:
                with self._lock:
                    handle = self._waiting.popleft() if self._waiting else None
                    if handle is not None:
                        self._running[numbers[0]] = handle
                if handle is not None:
                    handle._forked(numbers[0])
            elif kind == FORK_REFUSED:
                with self._lock:
                    self.refused = True
                    handle = self._waiting.popleft() if self._waiting else None
                if handle is not None:
                    handle._on_its_own()
            elif kind == FORK_ENDED and len(numbers) == 2:
                with self._lock:
                    ended = self._running.pop(numbers[0], None)
                if ended is not None:
                    ended._ended(numbers[1])
        with self._lock:
            self._gone = True
            orphans = [*self._waiting, *self._running.values()]
            self._waiting.clear()
            self._running.clear()
        for handle in orphans:
            handle._on_its_own()
        self._socket.close()
        self.process.wait()
