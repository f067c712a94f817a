"""A replay's end, without the interpreter's teardown.

The parent reads a replay's capture once the child has exited. After the
capture is written, Python's teardown frees the script's objects one by one
(its CUDA tensors, its modules) before the driver drops the context: on the
H100 that took 1.3 to 2.0 s of each Hugging Face `Trainer` replay, 0.1 to
0.2 s without it, on a chain of six or more replays one after another. A
replay (ChildConfig.quick_exit, never the user's own run) runs its atexit
handlers (DataLoader workers stopped, logs flushed, temporary directories
removed) and ends there. Never a rank of a job: its launcher and its peers
wait on the process group's own shutdown.
"""

from __future__ import annotations

import atexit
import os
import sys


def in_process_group() -> bool:
    """The script made a torch.distributed process group (a rank of a job)."""
    distributed = sys.modules.get("torch.distributed")
    try:
        return bool(distributed and distributed.is_available() and distributed.is_initialized())
    except Exception:
        return True


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def end_now(exit_code: int) -> None:
    """Run the atexit handlers, then end the process with `exit_code`."""
    _flush()
    try:
        atexit._run_exitfuncs()
    finally:
        _flush()
        os._exit(exit_code)
