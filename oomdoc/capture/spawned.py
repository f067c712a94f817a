"""Processes the script starts with `torch.multiprocessing.spawn` (the
`--multiprocessing-distributed` pattern): each is captured as a rank.

The script's process (the capture child) hands `start_processes` a
picklable wrapper of the function it was given; in each spawned process the
wrapper installs the same capture as the child's (device cap, tracker, rank
fields), runs the function, writes `capture-spawned{index}.json` beside the
child's own capture, and lets the function's exception go on as it would
without oomdoc, so the script's own error handling and exit status are
unchanged. The parent merges those captures as the ranks of one job
(oomdoc.runner). Processes started with `multiprocessing.Process` are
oomdoc.capture.process_ranks's.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import signal
import time
from dataclasses import replace
from typing import Any, Callable

from oomdoc.capture import PEER_GRACE_S
from oomdoc.child_config import ChildConfig, DistributedJob
from oomdoc.distributed.merge import ended_with_the_replay

SPAWNED_CAPTURE = "capture-spawned{index}.json"
JOIN_POLL_S = 0.2


class CapturedRank:
    """What `start_processes` runs in each spawned process instead of the
    script's function: pickled by reference like the function itself.
    `runner` names the function that runs it under capture (`module:name`,
    oomdoc.capture.child's run_rank: that module runs as `__main__` in the
    script's process, so it is named, not pickled)."""

    def __init__(self, fn: Callable, config: ChildConfig, nprocs: int, runner: str):
        self.fn = fn
        self.config = config
        self.nprocs = nprocs
        self.runner = runner

    def __call__(self, index: int, *args: Any) -> Any:
        module, name = self.runner.split(":")
        run_rank = getattr(importlib.import_module(module), name)
        return run_rank(self.config, index, self.nprocs, self.fn, args)


def rank_config(config: ChildConfig) -> ChildConfig:
    """The spawned ranks' configuration: the child's, writing beside it
    (`{index}` is each rank's), without the device lock its process holds."""
    directory = os.path.dirname(config.result_path)
    return replace(
        config,
        result_path=os.path.join(directory, SPAWNED_CAPTURE),
        device_lock=None,
        distributed=DistributedJob(spawned=True),
    )


def install(config: ChildConfig, started: list, runner: str) -> Callable[[], None]:
    """Wrap `torch.multiprocessing`'s start_processes (which `spawn` calls)
    so that its processes are captured by the function `runner` names
    (`run_rank(config, index, nprocs, fn, args)`); `started` collects what
    was spawned. Returns the undo."""
    import torch.multiprocessing as mp

    # (`torch.multiprocessing.spawn` the attribute is the function.)
    spawn_module = importlib.import_module("torch.multiprocessing.spawn")
    original = spawn_module.start_processes
    spawned = rank_config(config)

    signature = inspect.signature(original)

    def start_processes(fn, args=(), nprocs=1, *rest, **kwargs):
        started.append({"function": function_started(fn, args), "nprocs": int(nprocs)})
        captured = CapturedRank(fn, spawned, int(nprocs), runner)
        bound = signature.bind(captured, args, nprocs, *rest, **kwargs)
        join = bound.arguments.get("join", True)
        if config.max_steps is None or not join:
            return original(captured, args, nprocs, *rest, **kwargs)
        bound.arguments["join"] = False
        return join_together(original(*bound.args, **bound.kwargs), spawned.result_path)

    start_processes.__wrapped__ = original  # type: ignore[attr-defined]
    owners = [
        module
        for module in (spawn_module, mp)
        if getattr(module, "start_processes", None) is original
    ]
    for module in owners:
        module.start_processes = start_processes  # type: ignore[attr-defined]  # (torch's stub for the package omits it)

    def undo() -> None:
        for module in owners:
            module.start_processes = original  # type: ignore[attr-defined]  # (as above)

    return undo


def function_started(fn: Callable, args: Any) -> str:
    """The name of the function the processes run: the script's, where
    torch's elastic agent (accelerate's notebook_launcher) starts them
    through its own wrapper, whose first argument it is."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    elastic = getattr(fn, "__module__", "") == "torch.distributed.elastic.multiprocessing.api"
    if elastic and name == "_wrap" and isinstance(args, tuple) and args and callable(args[0]):
        return getattr(args[0], "__qualname__", None) or name
    return name


def join_together(context: Any, result_path: str) -> None:
    """`start_processes(join=True)` for a replay: once one rank has ended
    (its steps done), the others have PEER_GRACE_S to end too. A rank still
    running then waits for its ended peer (in a collective, or in work of
    its own after its last step): it gets SIGTERM and writes its capture,
    with where it waited, which is then marked as ended with its peers
    (the replay's end, not a failure), and this returns as spawn would. A
    rank that fails makes `join` raise as without oomdoc (torch ends the
    others)."""
    first_end = None
    while not context.join(JOIN_POLL_S):
        if first_end is None and any(p.exitcode is not None for p in context.processes):
            first_end = time.monotonic()
        if first_end is None or time.monotonic() - first_end <= PEER_GRACE_S:
            continue
        stopped = [i for i, p in enumerate(context.processes) if p.exitcode is None]
        for index in stopped:
            os.kill(context.processes[index].pid, signal.SIGTERM)
        for index in stopped:
            process = context.processes[index]
            process.join(PEER_GRACE_S)
            if process.exitcode is None:
                process.kill()
                process.join()
            mark_ended_with_peers(result_path.format(index=index))
        return


def mark_ended_with_peers(path: str) -> None:
    from oomdoc.snapshot import write_atomic

    try:
        with open(path, encoding="utf-8") as handle:
            capture = json.load(handle)
    except (OSError, ValueError):
        return  # killed before it wrote one: the merge names it
    ended_with_the_replay(capture)
    write_atomic(path, json.dumps(capture), overwrite=True)
