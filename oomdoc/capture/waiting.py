"""How a warm child waits for its work: it imports what every run needs
(and what the parent names) while the run or the replay before it runs,
then takes its configuration: from a pipe (oomdoc.warm) or, as a rank of a
job started ahead, from a file that appears (oomdoc.distributed.warm_jobs)."""

from __future__ import annotations

import json
import os
import time

import psutil

from oomdoc.capture import preimport_names
from oomdoc.capture.imports import preimport


def import_ahead() -> None:
    """What every run imports, done by a warm child while it waits."""
    import torch.nn  # noqa: F401
    import torch.optim  # noqa: F401
    import torch.utils.checkpoint  # noqa: F401
    import torch.utils.data  # noqa: F401

    try:
        # Constructing any torch.optim optimizer imports TorchDynamo (and with
        # it sympy and ~800 modules: as long as `import torch` itself); done
        # here, while the previous replay runs, it is off the replay's path.
        import torch._dynamo  # noqa: F401
    except Exception:
        pass


def wait_for_work(descriptor: int) -> tuple[str | None, float, dict]:
    """A warm child: import what every run needs, then wait for the path of
    the configuration (None when the parent has no work for it), importing
    the modules the parent sends meanwhile. Also returns when the first
    imports were done, and what was imported ahead (`preimport`)."""
    import_ahead()
    imported_at = time.time()
    preimported: dict = {}
    return wait_on_pipe(descriptor, preimported), imported_at, preimported


def wait_on_pipe(descriptor: int, preimported: dict) -> str | None:
    """The configuration's path, the first line on the pipe that names no
    modules to import (those are imported, into `preimported`, meanwhile);
    None when the pipe closes first."""
    with os.fdopen(descriptor, encoding="utf-8") as pipe:
        for line in pipe:
            line = line.strip()
            names = preimport_names(line)
            if names is None:
                return line or None
            preimport(names, preimported)
    return None


def wait_for_config_file(path: str, wait: str) -> tuple[bool, float, dict]:
    """A rank of a warm job (oomdoc.distributed.warm_jobs): import ahead what
    `wait` names (JSON: the modules, and the pid of oomdoc, whose end
    ends the wait), then wait for the configuration file to appear. False
    when oomdoc ended first: there is no work."""
    try:
        order = json.loads(wait)
    except ValueError:
        order = {}
    import_ahead()
    imported_at = time.time()
    preimported: dict = {}
    preimport([str(name) for name in order.get("preimports") or []], preimported)
    owner = int(order.get("parent_pid") or 0)
    while not os.path.exists(path):
        if owner and not psutil.pid_exists(owner):
            return False, imported_at, preimported
        time.sleep(0.01)
    return True, imported_at, preimported
