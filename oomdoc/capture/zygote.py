"""The fork server of the simulated device's replays (parent side:
oomdoc.forking). Every replay child used to import Python's packages anew:
torch, and the script's framework (the Trainer's transformers: 8 s of a
core), most of a short replay's cost. This process imports them once, then
forks one warm child per request; each fork waits for its work exactly as a
warm child started on its own does (oomdoc.capture.waiting).

On CUDA the forks must be made before the CUDA driver starts here: a fork
of a process where it started cannot use CUDA. This process never touches
the device, and imports with PYTORCH_NVML_BASED_CUDA_CHECK=1 (so that a
framework's `torch.cuda.is_available()` asks NVML, not the driver); should
anything it imported load the driver all the same, it answers `refused`
and the parent starts every later child on its own.

Protocol, over a SOCK_SEQPACKET socket from the parent:
  parent -> here: `import [json list]` (PREIMPORT_PREFIX: import these too),
                  `fork TIME` with two descriptors (the fork's log, the read
                  end of its configuration pipe; TIME: when the parent asked,
                  the fork's start), `close` (exit once no fork runs).
  here -> parent: `pid N` (or `refused`) per `fork`, in order; `exit N CODE` when fork N
                  ends (CODE as subprocess.Popen's returncode: -SIGNAL for a
                  signal).
The parent's end closing (oomdoc died) ends this process at once; the forks
then see their configuration pipes close, as warm children do.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
import warnings

from oomdoc.capture import (
    CLOSE_REQUEST,
    FORK_ENDED,
    FORK_REFUSED,
    FORK_REQUEST,
    FORKED,
    preimport_names,
)
from oomdoc.capture.imports import preimport
from oomdoc.capture.waiting import import_ahead, wait_on_pipe

# Set while this process imports, the user's own value put back in each fork.
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
MESSAGE_BYTES = 1 << 20


def cuda_driver_loaded() -> bool:
    """Whether the CUDA driver library is mapped in this process: the CUDA
    runtime loads it when it starts, never before."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return True  # unknown: not safe to fork


def serve(control_fd: int) -> tuple[str | None, float, dict, float]:
    """Serve fork requests until told to close. Returns only in a fork, as
    oomdoc.capture.waiting's wait_for_work does: (the configuration's path or
    None, when its imports were done: when it was forked, what it imported
    ahead), and when it started: when the parent asked for it (its start-up
    is the wait for the server, busy importing, then the fork)."""
    users_check = os.environ.get(NVML_CHECK_ENV)
    os.environ[NVML_CHECK_ENV] = "1"
    import_ahead()
    preimported: dict = {}
    control = socket.socket(fileno=control_fd)
    # Ctrl-C reaches the whole process group: the forks running replays take
    # it, and this process stays to tell the parent how they ended.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: set[int] = set()
    closing = False

    def send(text: str) -> None:
        try:
            control.send(text.encode("utf-8"))
        except OSError:
            pass  # the parent is gone: the loop sees its end close

    while True:
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                running.clear()
                break
            if pid == 0:
                break
            running.discard(pid)
            send(f"{FORK_ENDED} {pid} {os.waitstatus_to_exitcode(status)}")
        if closing and not running:
            os._exit(0)
        ready, _, _ = select.select([control.fileno(), wake_read], [], [], 1.0)
        if wake_read in ready:
            try:
                os.read(wake_read, 4096)
            except BlockingIOError:
                pass
        if control.fileno() not in ready:
            continue
        try:
            message, descriptors, _flags, _address = socket.recv_fds(control, MESSAGE_BYTES, 2)
        except OSError:
            message, descriptors = b"", []
        if not message:
            os._exit(0)  # the parent ended
        text = message.decode("utf-8", "replace")
        names = preimport_names(text)
        if names is not None:
            preimport(names, preimported)
        elif text == CLOSE_REQUEST:
            closing = True
        elif text.partition(" ")[0] == FORK_REQUEST and len(descriptors) == 2:
            try:  # when the parent asked: the fork's start-up counts from it
                asked_at = float(text.partition(" ")[2])
            except ValueError:
                asked_at = time.time()
            log_fd, config_fd = descriptors
            if cuda_driver_loaded():
                os.close(log_fd)
                os.close(config_fd)
                send(FORK_REFUSED)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            with warnings.catch_warnings():
                # Python 3.12 warns of forking with threads; the only ones
                # here are the BLAS pools, which are fork-safe.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                forked_at = time.time()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                control.close()
                os.close(wake_read)
                os.close(wake_write)
                os.dup2(log_fd, 1)
                os.dup2(log_fd, 2)
                os.close(log_fd)
                if users_check is None:
                    os.environ.pop(NVML_CHECK_ENV, None)
                else:
                    os.environ[NVML_CHECK_ENV] = users_check
                config_path = wait_on_pipe(config_fd, preimported)
                return config_path, forked_at, preimported, min(asked_at, forked_at)
            os.close(log_fd)
            os.close(config_fd)
            running.add(pid)
            send(f"{FORKED} {pid}")
        else:
            for descriptor in descriptors:
                os.close(descriptor)
