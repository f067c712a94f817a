"""Capture: everything that runs inside the child process next to the user's
script (hooks, step detection, device backends). It produces the `capture`
part of a snapshot; the parent adds the rest and writes the file."""

from __future__ import annotations

import json
import os

# The parent names the child's configuration file in this variable, so that
# nothing is added to the script's own argv. Kept here, free of torch imports,
# so the parent can validate its arguments before paying for `import torch`.
CONFIG_ENV = "OOMDOC_CHILD_CONFIG"
# A warm child (started before its work is known) reads the configuration
# file's path from the pipe whose descriptor this variable names.
CONFIG_FD_ENV = "OOMDOC_CHILD_CONFIG_FD"
# A fork server (oomdoc.capture.zygote) reads its requests from the socket
# whose descriptor this variable names; its forks are warm children.
ZYGOTE_FD_ENV = "OOMDOC_ZYGOTE_FD"
# A line on that pipe that starts with this names modules (a JSON list) for
# the waiting child to import: the framework the failing run used.
PREIMPORT_PREFIX = "import "
# The fork server's protocol words (oomdoc.capture.zygote, oomdoc.forking):
# requests, then replies.
FORK_REQUEST, CLOSE_REQUEST = "fork", "close"
FORKED, FORK_REFUSED, FORK_ENDED = "pid", "refused", "exit"


def preimport_request(modules: list[str]) -> str:
    """The line that asks a waiting child (or the fork server) to import `modules`."""
    return PREIMPORT_PREFIX + json.dumps(list(modules))


def preimport_names(line: str) -> list[str] | None:
    """The modules a preimport line names (none when it is garbled); None
    when the line is not one."""
    if not line.startswith(PREIMPORT_PREFIX):
        return None
    try:
        names = json.loads(line[len(PREIMPORT_PREFIX) :])
    except ValueError:
        return []
    return [str(name) for name in names] if isinstance(names, list) else []


# A rank of a job started before its work is known (a warm job: its launcher
# and ranks import while the replay before runs) waits for the file
# CONFIG_ENV names to appear; this variable holds what it imports meanwhile
# and the pid whose end ends the wait (JSON, oomdoc.distributed.warm_jobs).
CONFIG_WAIT_ENV = "OOMDOC_CHILD_CONFIG_WAIT"
# When the parent started the child (seconds since the epoch): the child's
# start-up is measured from it, on the same clock as the child's own times.
STARTED_ENV = "OOMDOC_CHILD_STARTED"
# A replay's ranks end within this many seconds of the first one, whichever
# launcher started them (oomdoc.distributed.launch for torchrun's,
# oomdoc.capture.spawned and oomdoc.capture.relaunch for the script's own).
PEER_GRACE_S = 5.0
# Attributes through which a wrapper holds the model: a (Distributed)DataParallel
# module's `module`, a torch.compile'd model's `_orig_mod`. Module paths are
# named without them (oomdoc.capture.modules); the parent strips them from a
# path recorded on the wrapper (oomdoc.replay.batch). Torch-free, for both.
WRAPPER_ATTRIBUTES = ("_orig_mod", "module")
# The one-line usage error for `--device cuda` on a machine without CUDA,
# raised by the child (which decides the device) or by the parent.
CUDA_UNAVAILABLE = "--device cuda: CUDA is not available on this machine (use --device cpu for the simulated device)"


def choose_device(requested: str, cuda_available: bool) -> str | None:
    """What `--device auto|cuda|cpu` means on this machine: `cuda`, or `cpu`
    (the simulated device); None when CUDA is asked for and missing. One rule
    for the child, which decides, and for parent-side callers."""
    if requested == "cpu":
        return "cpu"
    if cuda_available:
        return "cuda"
    return None if requested == "cuda" else "cpu"


def nvml_handle(pynvml, device_index: int):
    """NVML's handle of the GPU that CUDA calls `device_index` in this
    process: CUDA_VISIBLE_DEVICES may renumber GPUs, or name them by UUID
    (`GPU-...`, `MIG-...`). Torch-free, for the parent too."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ""
    parts = [part.strip() for part in visible.split(",") if part.strip()]
    chosen = parts[device_index] if device_index < len(parts) else str(device_index)
    if chosen.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(chosen)
    return pynvml.nvmlDeviceGetHandleByIndex(int(chosen) if chosen.isdigit() else device_index)
