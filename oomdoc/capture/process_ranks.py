"""Processes the script starts with `multiprocessing.Process` (or
`torch.multiprocessing.Process`, the same class), with the spawn or fork
start method: each one that joins the default process group is captured as
that rank of the job.

What makes such a process a rank is `init_process_group` (however the
script imported it: the hook is torch's `_update_default_pg`, which every
default group goes through). That, not device use, is the mark because:
on the simulated device every CPU tensor counts, so a data-preparation
process "uses the device" as much as a trainer; capping every process
from its start would stop data processes with a simulated OOM and give each
a CUDA context on a GPU; and a process has a rank and a world size only
once it has joined the group (the job's merge needs both). A process that
never joins one (DataLoader workers, which are torch's own and never
wrapped; data-preparation processes) runs as without oomdoc and is named
(`uncaptured_processes`). What a rank allocates before it joins the group
is not in its capture (on the simulated device it does not count against
the cap either): scripts join first, as DDP's tutorial does.

In the script's process (the capture child) `Process.start` wraps the
target of a process whose function is the script's, or the `run` of the
script's Process subclass (`ProcessTarget`, pickled by reference like the
function; the standard library's Pool workers are never wrapped); in the
started process the
function runs under oomdoc.capture.child's `run_process`, which starts the
rank's capture when the group is joined (first writing a `partial` capture
with its pid: that marks the process as a rank) and writes
`capture-spawned{rank}.json` when the function ends. The processes of a
job end together: in a replay, once one rank has ended (its steps done)
the others have PEER_GRACE_S; in the user's run, once a rank has failed,
RUN_GRACE_S (NCCL may wait for a dead peer forever). Then they get SIGTERM
and write their captures with where they waited.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, Callable

from oomdoc.capture import PEER_GRACE_S
from oomdoc.child_config import ChildConfig, DistributedJob
from oomdoc.distributed.merge import ended_only_with_peers, ended_with_the_replay

PROCESS_CAPTURE = "capture-spawned{rank}.json"
_CAPTURE_NAME = re.compile(r"^capture-spawned\d+\.json$")
LAUNCHER = "multiprocessing.Process"
POLL_S = 0.2
# In the user's run, the other ranks get this long after one failed.
RUN_GRACE_S = 60.0


class ProcessTarget:
    """What a started process runs instead of the script's function.
    `runner` names the function that runs it under capture (`module:name`:
    oomdoc.capture.child runs as `__main__` in the script's process)."""

    def __init__(self, target: Callable, config: ChildConfig, runner: str):
        self.target = target
        self.config = config
        self.runner = runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, name = self.runner.split(":")
        run_process = getattr(importlib.import_module(module), name)
        return run_process(self.config, self.target, args, kwargs)


class RunOf:
    """The `run` of a Process subclass, as a function of no arguments
    (pickled with its process, by reference to its class)."""

    def __init__(self, process: Any):
        self.process = process

    def __call__(self) -> Any:
        return type(self.process).run(self.process)


def when_joining_the_group(joined: Callable[[int, int], None]) -> Callable[[], None]:
    """Call `joined(rank, world_size)` once, when this process joins the
    default process group. Returns the undo."""
    try:
        import torch.distributed.distributed_c10d as c10d
    except ImportError:  # a build without torch.distributed: no group to join
        return lambda: None

    original = c10d._update_default_pg
    done: list[bool] = []

    def update_default_pg(pg: Any) -> None:
        original(pg)
        if done or pg is None or pg == c10d.GroupMember.NON_GROUP_MEMBER:
            return
        done.append(True)
        joined(pg.rank(), pg.size())

    c10d._update_default_pg = update_default_pg

    def undo() -> None:
        c10d._update_default_pg = original

    return undo


def own_function(target: Any) -> bool:
    """Whether a process's function (or Process subclass) is the script's
    (not torch's own, as DataLoader workers and spawn's ranks, nor oomdoc's)."""
    module = getattr(target, "__module__", "") or ""
    return target is not None and not module.startswith(("torch.", "oomdoc."))


def pool_function(target: Any) -> bool:
    """A process of the standard library's own (a `multiprocessing.Pool` or
    `ProcessPoolExecutor` worker, a `Manager`'s server): the script's work
    in it is a task it is sent, never a rank; named, never wrapped."""
    module = getattr(target, "__module__", "") or ""
    return module.startswith(("multiprocessing.", "concurrent."))


def function_name(target: Any) -> str:
    return getattr(target, "__qualname__", None) or repr(target)


@dataclass
class StartedProcess:
    process: Any  # multiprocessing's Process
    pid: int  # (kept: a closed Process no longer says it)
    function: str


class ProcessRanks:
    """The processes the script started with `multiprocessing.Process`."""

    def __init__(self, config: ChildConfig, ranks: list[dict], uncaptured: list[dict], runner: str):
        """`ranks`, `uncaptured`: the capture's `spawned_ranks` and
        `uncaptured_processes`, where they are noted; `runner`: oomdoc.capture.child's
        run_process by name."""
        self.config = config
        self.ranks = ranks
        self.uncaptured = uncaptured
        self.runner = runner
        self.directory = os.path.dirname(config.result_path)
        self.rank_config = replace(
            config,
            result_path=os.path.join(self.directory, PROCESS_CAPTURE),
            artifact_dir=(
                os.path.join(config.artifact_dir, "rank{rank}") if config.artifact_dir else None
            ),
            device_lock=None,
            distributed=DistributedJob(spawned=True),
        )
        self.replay = config.max_steps is not None
        self.started: list[StartedProcess] = []
        self._read: dict[str, tuple[tuple[int, int], dict]] = {}  # path: (its stat, capture)
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._done = threading.Event()

    def install(self) -> Callable[[], None]:
        """Patch `Process.start`; returns the undo."""
        import multiprocessing.process as process

        original = process.BaseProcess.start
        ranks = self

        def start(self, *args, **kwargs):
            target = getattr(self, "_target", None)
            overridden = type(self).run is not process.BaseProcess.run
            if overridden and own_function(type(self)) and not pool_function(type(self)):
                # A subclass's own `run` (`class Trainer(Process)`): the
                # instance's `run` runs it under capture.
                name = function_name(type(self))
                self.run = ProcessTarget(RunOf(self), ranks.rank_config, ranks.runner)
            elif not overridden and own_function(target):
                name = function_name(target)
                if not pool_function(target):
                    self._target = ProcessTarget(target, ranks.rank_config, ranks.runner)
            else:
                return original(self, *args, **kwargs)
            result = original(self, *args, **kwargs)
            ranks.started_one(StartedProcess(self, self.pid, name))
            return result

        process.BaseProcess.start = start  # type: ignore[method-assign]

        def undo() -> None:
            process.BaseProcess.start = original  # type: ignore[method-assign]
            self._done.set()

        return undo

    def started_one(self, started: StartedProcess) -> None:
        with self._lock:
            self.started.append(started)
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name="oomdoc-process-ranks", daemon=True
            )
            self._watcher.start()

    # ------------------------------------------------------------ ranks
    def rank_captures(self) -> dict[int, tuple[str, dict]]:
        """By pid: the capture (path, content) of each started process that
        joined the group (a `partial` one until it ends)."""
        pids = {started.pid for started in self.started}
        found: dict[int, tuple[str, dict]] = {}
        try:
            names = os.listdir(self.directory)
        except OSError:
            return found
        for name in names:
            if not _CAPTURE_NAME.match(name):
                continue
            path = os.path.join(self.directory, name)
            capture = self._read_capture(path)
            if capture is None:
                continue
            pid = capture.get("pid") if capture.get("partial") else None
            pid = pid or (capture.get("rank") or {}).get("pid")
            if isinstance(pid, int) and pid in pids:
                found[pid] = (path, capture)
        return found

    def _read_capture(self, path: str) -> dict | None:
        """A capture file, read again only when it changed (the watcher
        looks every POLL_S)."""
        try:
            stat = os.stat(path)
            key = (stat.st_mtime_ns, stat.st_size)
            known = self._read.get(path)
            if known is not None and known[0] == key:
                return known[1]
            with open(path, encoding="utf-8") as handle:
                capture = json.load(handle)
        except (OSError, ValueError):
            return None
        if not isinstance(capture, dict):
            return None
        self._read[path] = (key, capture)
        return capture

    def _alive(self, pids: set[int]) -> set[int]:
        """Which of these started processes still run (read from their
        sentinels: never reaped here, the script's join does that)."""
        sentinels = {}
        for started in list(self.started):
            if started.pid not in pids:
                continue
            try:
                sentinels[started.process.sentinel] = started.pid
            except ValueError:  # closed by the script: it ended
                continue
        ended = {sentinels[s] for s in wait_for_sentinels(list(sentinels), timeout=0)}
        return set(sentinels.values()) - ended

    def _watch(self) -> None:
        """End the ranks together (see the module's docstring)."""
        grace = PEER_GRACE_S if self.replay else RUN_GRACE_S
        first_end = None
        while not self._done.wait(POLL_S):
            captures = self.rank_captures()
            alive = self._alive(set(captures))
            ended = [pid for pid in captures if pid not in alive]
            if not self.replay:  # only a failed rank ends the others
                ended = [pid for pid in ended if not finished(captures[pid][1])]
            if not ended or not alive:
                continue
            first_end = first_end or time.monotonic()
            if time.monotonic() - first_end > grace:
                self.stop(alive)
                first_end = None

    def stop(self, pids: set[int]) -> None:
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + PEER_GRACE_S
        while self._alive(pids) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for pid in self._alive(pids):
            _signal(pid, signal.SIGKILL)

    def wait(self) -> None:
        """The script ended: its ranks end too (bounded, as above), a
        replay's ranks that ended only because a peer finished its steps
        are marked so, and the ranks move from `uncaptured` to `ranks`."""
        self._done.set()
        if not self.started:
            return
        grace = PEER_GRACE_S if self.replay else RUN_GRACE_S
        deadline = time.monotonic() + grace
        while self._alive(set(self.rank_captures())) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        left = self._alive(set(self.rank_captures()))
        if left:
            self.stop(left)
        captures = self.rank_captures()
        if self.replay and any(capture.get("outcome") == "ok" for _, capture in captures.values()):
            from oomdoc.snapshot import write_atomic

            for path, capture in captures.values():
                if ended_only_with_peers(capture):
                    ended_with_the_replay(capture)
                    write_atomic(path, json.dumps(capture), overwrite=True)
        self._note(captures)

    def _note(self, captures: dict[int, tuple[str, dict]]) -> None:
        for started in self.started:
            if started.pid in captures:
                note(self.ranks, started.function, "nprocs", launcher=LAUNCHER)
            else:
                note(self.uncaptured, started.function, "count", launcher=LAUNCHER)


def note(entries: list[dict], name: str, counter: str, launcher: str) -> None:
    """One more process of function `name` in `entries`."""
    for entry in entries:
        if entry["function"] == name and entry.get("launcher") == launcher:
            entry[counter] += 1
            return
    entries.append({"function": name, counter: 1, "launcher": launcher})


def finished(capture: dict) -> bool:
    """A rank's capture says it ended well (a partial one: it died)."""
    return not capture.get("partial") and capture.get("outcome") == "ok"


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except OSError:
        pass
