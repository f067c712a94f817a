"""Ranks a launcher starts as new Python processes: captured as ranks.

Lightning's `ddp` strategy starts ranks 1..N-1 by running the script again
(`python train.py ARGS`, rank 0 is the script's own process), and a launcher
called from the script (accelerate's `launch`, `torch.distributed.run`'s
elastic agent) starts every rank that way: `python -u train.py ARGS`. What
marks such a process as a rank is its environment: `LOCAL_RANK` is set.

In the capture child, `subprocess.Popen` of a Python command that runs a
script (or `-m module`) with `LOCAL_RANK` in its environment runs
`python -m oomdoc.capture.child` instead, with a configuration of its own:
the same device cap, fix and replay limits, that script and arguments, and
a capture written beside the child's (`capture-spawned{rank}.json`, merged
as the job's ranks by oomdoc.runner). Every other process is left alone.

A launcher may end its own process when a rank fails (Lightning's
`_ChildProcessObserver` SIGKILLs it from a thread): that would end the
child before it writes its capture, the job losing its rank 0 (a race with
the observer's 5 s poll). Once ranks were relaunched, the script's threads'
kill of this process is a SIGTERM while the script runs (the process ends,
its capture written) and nothing once it ended (it only writes captures).

The child waits for the ranks it started before it writes its own capture
(the parent reads them next): as long as they run in the user's run (the
launcher ends them on a failure), `PEER_GRACE_S` in a replay (then they get
SIGTERM: they write their captures, ended with the replay).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from oomdoc.capture import CONFIG_ENV, PEER_GRACE_S
from oomdoc.capture.spawned import mark_ended_with_peers
from oomdoc.child_config import ChildConfig, DistributedJob

# Python options that take a value (`-X dev`, `-W ignore`); the others
# before the script (-u, -B, -O, ...) take none.
PYTHON_VALUE_OPTIONS = ("-X", "-W", "-Q")
RELAUNCHED_CAPTURE = "capture-spawned{rank}.json"
# In the user's run, the ranks get this long after the script's own
# process ends before they are ended (a launcher whose ranks outlive it).
RUN_GRACE_S = 60.0


def script_of(command: Any) -> tuple[str, bool, list[str]] | None:
    """(script or module, is_module, its arguments) when `command` runs a
    Python script or module, else None."""
    if isinstance(command, (str, bytes, os.PathLike)) or not command:
        return None
    argv = [os.fspath(part) if isinstance(part, os.PathLike) else part for part in command]
    if not all(isinstance(part, str) for part in argv):
        return None
    program = os.path.basename(argv[0])
    if argv[0] != sys.executable and not program.startswith("python"):
        return None
    index = 1
    while index < len(argv) and argv[index].startswith("-") and argv[index] != "-m":
        index += 2 if argv[index] in PYTHON_VALUE_OPTIONS else 1
    if index >= len(argv):
        return None
    if argv[index] == "-m":
        if index + 1 >= len(argv) or argv[index + 1].startswith("oomdoc"):
            return None
        return argv[index + 1], True, argv[index + 2 :]
    if argv[index].endswith(".py") and os.path.isfile(argv[index]):
        return argv[index], False, argv[index + 1 :]
    return None


class Relaunches:
    """The ranks this process started as new Python processes."""

    def __init__(self, config: ChildConfig, started: list[dict]):
        """`started`: where the launches are noted (the capture's `spawned_ranks`)."""
        self.config = config
        self.processes: list[subprocess.Popen] = []
        self.capture_paths: list[str] = []  # each process's capture, by position
        self.started = started
        self.script_ended = False  # set by the child once the script returned

    def rank_config(self, script: str, is_module: bool, args: list[str]) -> ChildConfig:
        """A rank's configuration: the child's, for that script, writing beside it."""
        directory = os.path.dirname(self.config.result_path)
        artifacts = self.config.artifact_dir
        return replace(
            self.config,
            target=script,
            is_module=is_module,
            args=list(args),
            result_path=os.path.join(directory, RELAUNCHED_CAPTURE),
            artifact_dir=os.path.join(artifacts, "rank{rank}") if artifacts else None,
            device_lock=None,
            distributed=DistributedJob(relaunched=True),
        )

    def install(self) -> Callable[[], None]:
        """Patch subprocess.Popen; returns the undo."""
        original = subprocess.Popen.__init__
        relaunches = self

        def __init__(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
            found = script_of(args)
            env = kwargs.get("env")
            environment = os.environ if env is None else env
            if found is None or "LOCAL_RANK" not in environment:
                original(popen, args, *rest, **kwargs)
                return
            script, is_module, script_args = found
            config = relaunches.rank_config(script, is_module, script_args)
            index = len(relaunches.processes)
            path = os.path.join(
                os.path.dirname(relaunches.config.result_path), f"relaunch-{index}.json"
            )
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(config.to_json())
            kwargs["env"] = {**environment, CONFIG_ENV: path}
            command = [sys.executable, "-m", "oomdoc.capture.child"]
            original(popen, command, *rest, **kwargs)
            relaunches.processes.append(popen)
            rank = environment.get("RANK") or environment["LOCAL_RANK"]
            relaunches.capture_paths.append(config.result_path.replace("{rank}", str(rank)))
            name = script if is_module else os.path.basename(script)
            for entry in relaunches.started:
                if entry["function"] == name:
                    entry["nprocs"] += 1
                    break
            else:
                relaunches.started.append({"function": name, "nprocs": 1, "launcher": "subprocess"})

        subprocess.Popen.__init__ = __init__  # type: ignore[method-assign,assignment]  # (an overloaded __init__ in the stubs)
        original_kill = os.kill

        def kill(pid: int, number: int) -> None:
            own = pid == os.getpid() and threading.current_thread() is not threading.main_thread()
            if not own or not relaunches.processes:
                original_kill(pid, number)
            elif not relaunches.script_ended:
                original_kill(pid, signal.SIGTERM)

        os.kill = kill

        def undo() -> None:
            subprocess.Popen.__init__ = original  # type: ignore[method-assign]
            os.kill = original_kill

        return undo

    def wait(self, replay: bool) -> None:
        """Wait for the ranks started here (bounded, see the module's docstring)."""
        grace = PEER_GRACE_S if replay else RUN_GRACE_S
        deadline = time.monotonic() + grace
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        left = [i for i, process in enumerate(self.processes) if process.poll() is None]
        for index in left:
            try:
                self.processes[index].send_signal(signal.SIGTERM)
            except OSError:
                pass
        for index in left:
            process = self.processes[index]
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if replay:
                mark_ended_with_peers(self.capture_paths[index])
