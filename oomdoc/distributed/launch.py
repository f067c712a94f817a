"""Parent side of a distributed run: one job through PyTorch's own launcher.

`python -m torch.distributed.run <options> -m oomdoc.capture.child` starts
each rank as oomdoc's capture child (the same python as oomdoc; the parent
never imports torch). Every rank reads the one configuration file and writes
its own capture (`capture-rank{rank}-local{local_rank}.json`).

The job never hangs: torchrun tears the other ranks down when one fails, and
oomdoc adds its own bound. Once a rank has ended badly (or oomdoc got Ctrl-C
or SIGTERM, which it passes on to the launcher), the launcher has
`rank_timeout_s` to end the job; then oomdoc sends SIGTERM to every process
of the job (the ranks run in sessions of their own, so each is signalled by
pid), and SIGKILL to what is left `KILL_GRACE_S` later. A rank that gets
SIGTERM still writes its capture, with where it was waiting.

A replay (a job limited to `max_steps`) ends together: once one rank has
ended, whether it ran out of memory, failed or reached the step limit, the
others have `PEER_GRACE_S` to end as well. A rank still running then is
left waiting for its peer (in a collective, or in work only it does after
its last step: evaluation, logging, a checkpoint on rank 0) and is ended;
when its peer reached the step limit, its steps so far are the replay's
result, not a failure (`ended_with_peers`). When a rank ran out of memory,
the replay's answer is in, and the others get `OOM_PEER_GRACE_S` only.

A replay's job may have been started ahead (oomdoc.distributed.warm_jobs):
its ranks waited for their configuration, written when the replay began.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from oomdoc.capture import CONFIG_ENV, PEER_GRACE_S, STARTED_ENV
from oomdoc.child_config import ChildConfig, DistributedJob
from oomdoc.distributed import DistOptions
from oomdoc.distributed.merge import ended_only_with_peers, ended_with_the_replay, read_captures
from oomdoc.runner import ChildRequest, ChildResult, child_config, child_env
from oomdoc.snapshot import write_atomic

KILL_GRACE_S = 10.0
# Launches again when the port oomdoc chose was taken before torchrun bound it.
PORT_RETRIES = 2
POLL_S = 0.1
# A replay in which a rank ran out of memory: its peers get this long to end
# as well, then this long after SIGTERM (a rank writes its capture on SIGTERM
# unless it waits inside a collective, as a peer of an OOM usually does).
OOM_PEER_GRACE_S = 1.0
OOM_KILL_GRACE_S = 2.0
CAPTURE_PATTERN = re.compile(r"^capture-rank(\d+)-local(\d+)\.json$")


@dataclass
class JobResult:
    """What one job (this node's ranks) left behind."""

    exit_code: int
    captures: list[dict]  # one per rank that wrote its capture, by rank
    missing: list[dict]  # {rank, local_rank, node_rank} of ranks without one
    launcher_exit_code: int | None
    wall_s: float
    timed_out: bool = False
    signal_name: str | None = None  # a signal that reached oomdoc
    terminated_by_oomdoc: bool = False
    notes: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launcher_command(dist: DistOptions, master_port: int | None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *dist.launcher_options(master_port),
        "-m",
        "oomdoc.capture.child",
    ]


def job_config(request: ChildRequest, workdir: str, dist: DistOptions) -> ChildConfig:
    """The configuration every rank reads; `{rank}` is filled in by each."""
    config = child_config(
        request,
        os.path.join(workdir, "capture-rank{rank}-local{local_rank}.json"),
        os.path.join(request.artifact_dir or workdir, "rank{rank}"),
    )
    config.distributed = DistributedJob(
        nproc_per_node=dist.nproc_per_node,
        started_path=os.path.join(workdir, "started-rank{rank}-local{local_rank}.pid"),
    )
    return config


class FailureWatch:
    """Notices the first rank capture that is not `ok` (each file is read
    once) and, for a replay, the first one that is (`finished`)."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.checked: set[str] = set()
        self.finished = False
        self.out_of_memory = False

    def any_failed(self) -> bool:
        for name in sorted(os.listdir(self.workdir)):
            if name in self.checked or not CAPTURE_PATTERN.match(name):
                continue
            self.checked.add(name)
            try:
                with open(os.path.join(self.workdir, name), encoding="utf-8") as handle:
                    capture = json.load(handle)
            except (OSError, json.JSONDecodeError):
                self.checked.discard(name)
                continue
            if capture.get("partial"):
                # Only the device the rank chose: its capture is still to come.
                self.checked.discard(name)
            elif capture.get("outcome") != "ok":
                self.out_of_memory = capture.get("outcome") == "oom"
                return True
            else:
                self.finished = True
        return False


def rank_pids(workdir: str) -> list[int]:
    pids = []
    for name in os.listdir(workdir):
        if name.startswith("started-rank") and name.endswith(".pid"):
            try:
                with open(os.path.join(workdir, name), encoding="utf-8") as handle:
                    pids.append(int(handle.read().strip()))
            except (OSError, ValueError):
                pass
    return pids


def job_processes(launcher: subprocess.Popen, workdir: str) -> list:
    """Every process of the job still alive: the launcher, its descendants
    and the ranks that said their pid (psutil; nothing here imports torch)."""
    import psutil

    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(launcher.pid)
        found[root.pid] = root
        for child in root.children(recursive=True):
            found[child.pid] = child
    except psutil.Error:
        pass
    for pid in rank_pids(workdir):
        if pid not in found:
            try:
                found[pid] = psutil.Process(pid)
            except psutil.Error:
                pass
    return list(found.values())


def terminate_job(launcher: subprocess.Popen, workdir: str, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM to every process of the job (the ranks write their captures),
    SIGKILL to those still alive `grace_s` later."""
    import psutil

    processes = job_processes(launcher, workdir)
    for process in processes:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


@dataclass
class StartedJob:
    """A launcher started, with its ranks; their configuration file is
    written before (a cold job) or after (a warm one, whose ranks wait for it)."""

    workdir: str
    config_path: str
    launcher: subprocess.Popen
    # Where the launcher's output goes: the replay's log, or a warm job's own
    # file (copied into the replay's log once it ends).
    log_path: str | None


def launched_port(dist: DistOptions) -> int | None:
    """The port oomdoc chooses for a single-node job that names none."""
    if (
        dist.master_port is None
        and dist.single_node
        and not dist.rdzv_endpoint
        and not dist.standalone
    ):
        return free_port()
    return None


def start_job(
    dist: DistOptions,
    env: dict[str, str],
    log_path: str | None,
    port: int | None,
    request: ChildRequest | None = None,
) -> StartedJob:
    """Start torchrun and its ranks in a fresh folder. With `request` the
    ranks read its configuration at once; without, `env` tells them to wait
    for it (CONFIG_WAIT_ENV, hand_over)."""
    workdir = tempfile.mkdtemp(prefix="oomdoc-job-")
    config_path = os.path.join(workdir, "config.json")
    if request is not None:
        write_atomic(config_path, job_config(request, workdir, dist).to_json())
    elif log_path is None:  # a warm job's output, until a replay takes it
        log_path = os.path.join(workdir, "launcher.log")
    env = dict(env)
    env[CONFIG_ENV] = config_path
    env[STARTED_ENV] = repr(time.time())
    output = open(log_path, "wb") if log_path else None
    try:
        launcher = subprocess.Popen(
            launcher_command(dist, port),
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            stdin=subprocess.DEVNULL if output else None,
            # Its own process group: Ctrl-C reaches oomdoc, which passes it
            # on once (torchrun passes it on to the ranks).
            start_new_session=True,
        )
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        if output:
            output.close()
    return StartedJob(workdir, config_path, launcher, log_path)


def hand_over(job: StartedJob, request: ChildRequest, dist: DistOptions) -> None:
    """Give a warm job its work: the ranks waiting for the file read it
    (whole: they read it as soon as it exists)."""
    write_atomic(job.config_path, job_config(request, job.workdir, dist).to_json())


def end_job(job: StartedJob, grace_s: float = KILL_GRACE_S) -> None:
    """A job no replay needs: ended, its folder removed."""
    if job.launcher.poll() is None or job_processes(job.launcher, job.workdir):
        terminate_job(job.launcher, job.workdir, grace_s)
        job.launcher.wait()
    shutil.rmtree(job.workdir, ignore_errors=True)


class JobsStartedAhead(Protocol):
    """Jobs started before their work is known (oomdoc.distributed.warm_jobs)."""

    def take(self, request: ChildRequest) -> StartedJob | None: ...


def run_job(
    request: ChildRequest, dist: DistOptions, warm: JobsStartedAhead | None = None
) -> JobResult:
    """Run the job to its end (bounded, see the module's docstring), in a
    job `warm` started ahead when it has one that suits the request."""
    job = warm.take(request) if warm is not None else None
    if job is not None:
        hand_over(job, request, dist)
    else:
        env = child_env(request.device, request.extra_env)
        job = start_job(dist, env, request.output_path, launched_port(dist), request)
    try:
        return _watch(job, request, dist)
    finally:
        if job.log_path and request.output_path and job.log_path != request.output_path:
            _append_log(job.log_path, request.output_path)
        shutil.rmtree(job.workdir, ignore_errors=True)


def _append_log(source: str, target: str) -> None:
    try:
        with open(source, "rb") as reader, open(target, "ab") as writer:
            shutil.copyfileobj(reader, writer)
    except OSError:
        pass


def _watch(job: StartedJob, request: ChildRequest, dist: DistOptions) -> JobResult:
    """Wait for the job's end, ending it within the bounds; its ranks' captures."""
    workdir, launcher = job.workdir, job.launcher
    started = time.perf_counter()
    state: dict[str, Any] = {"signal": None, "stop_from": None}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    timed_out = terminated = False
    try:

        def forward(signum, frame):
            if state["signal"] is None:
                state["signal"] = signum
                state["stop_from"] = time.monotonic()
            if launcher.poll() is None:
                launcher.send_signal(signum)

        for sig in previous:
            signal.signal(sig, forward)
        deadline = time.monotonic() + request.timeout_s if request.timeout_s is not None else None
        watch = FailureWatch(workdir)
        replay = request.max_steps is not None
        # A replay's ranks end together (see the module's docstring).
        grace_s = min(PEER_GRACE_S, dist.rank_timeout_s) if replay else dist.rank_timeout_s
        while launcher.poll() is None:
            now = time.monotonic()
            if state["stop_from"] is None:
                if watch.any_failed():
                    state["stop_from"] = now  # a rank failed: the clock starts
                elif replay and watch.finished:
                    state["stop_from"] = now
                    state["peer_finished"] = True
            if replay and watch.out_of_memory:
                # The replay's answer is in: its peers, left waiting in a
                # collective (where SIGTERM is not handled), need not be waited for.
                grace_s = min(grace_s, OOM_PEER_GRACE_S)
            if deadline is not None and now > deadline:
                timed_out = True
            elif state["stop_from"] is None or now - state["stop_from"] < grace_s:
                time.sleep(POLL_S)
                continue
            terminated = True
            terminate_job(launcher, workdir, min(KILL_GRACE_S, max(grace_s, OOM_KILL_GRACE_S)))
            break
        launcher_exit = launcher.wait()
        # Ranks that outlived the launcher (it was killed) are ended too.
        if any(process.is_running() for process in job_processes(launcher, workdir)):
            terminated = True
            terminate_job(launcher, workdir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    wall_s = time.perf_counter() - started
    by_local = read_captures(workdir, CAPTURE_PATTERN, group=2)  # by local rank

    captures = sorted(by_local.values(), key=lambda c: (c.get("rank") or {}).get("rank", 0))
    node_rank = dist.node_rank or 0
    static = dist.rdzv_backend in (None, "static") and not dist.standalone
    missing = [
        {
            "rank": node_rank * dist.nproc_per_node + local if static else None,
            "local_rank": local,
            "node_rank": node_rank,
        }
        for local in range(dist.nproc_per_node)
        if local not in by_local
    ]
    signal_name = signal.Signals(state["signal"]).name if state["signal"] else None
    notes = []
    ended_with_peers = bool(state.get("peer_finished")) and terminated and not timed_out
    if ended_with_peers:
        notes.append(
            f"oomdoc ended the ranks still running {grace_s:g} s after the first rank "
            "reached the replay's step limit (they were waiting for it, or doing work "
            "of their own after their last step)"
        )
    elif terminated:
        notes.append(
            "oomdoc ended the job itself (SIGTERM, then SIGKILL): "
            + (
                "it ran past the time limit"
                if timed_out
                else f"the launcher had not ended it {dist.rank_timeout_s:g} s after the first rank failed or the job was interrupted"
            )
        )
    return JobResult(
        exit_code=job_exit_code(captures, missing, launcher_exit, state["signal"]),
        captures=captures,
        missing=missing,
        launcher_exit_code=launcher_exit,
        wall_s=wall_s,
        timed_out=timed_out,
        signal_name=signal_name,
        terminated_by_oomdoc=terminated,
        notes=notes,
    )


def job_exit_code(captures: list[dict], missing: list, launcher_exit: int, signum) -> int:
    """1 when a rank ran out of memory; 130/143 when oomdoc was interrupted;
    else the first failing rank's status, else the launcher's."""
    if any(capture.get("outcome") == "oom" for capture in captures):
        return 1
    if signum is not None:
        return 128 + int(signum)
    failed = [c for c in captures if int(c.get("exit_code") or 0) != 0]
    if failed:
        first = min(failed, key=lambda c: c.get("ended_at") or float("inf"))
        return int(first["exit_code"])
    return 1 if missing or launcher_exit else 0


def port_was_taken(result: JobResult, request: ChildRequest, dist: DistOptions) -> bool:
    """Whether the launcher failed before any rank ran because the free port
    oomdoc chose was taken meanwhile (by a process of the job before: a
    port is free between free_port() and torchrun's bind, not reserved)."""
    if result.captures or dist.master_port is not None or not request.output_path:
        return False
    try:
        with open(request.output_path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 20000))
            tail = handle.read().decode("utf-8", "replace")
    except OSError:
        return False
    return "EADDRINUSE" in tail or "address already in use" in tail


def finished_with_peers(result: JobResult) -> None:
    """A replay in which a rank finished (its steps done): the ranks that
    ended without finishing only because of that, stopped by oomdoc or the
    launcher (`interrupted`) or failed in a collective whose peer had gone
    (gloo raises at once), ended with the replay. Their captures count as
    finished (`ok`, `ended_with_peers`), with where they were."""
    if not any(capture.get("outcome") == "ok" for capture in result.captures):
        return
    for capture in result.captures:
        if ended_only_with_peers(capture):
            ended_with_the_replay(capture)
    if all(capture.get("outcome") == "ok" for capture in result.captures) and not result.missing:
        result.exit_code = 0


def run_distributed_child(
    request: ChildRequest, dist: DistOptions, warm: JobsStartedAhead | None = None
) -> ChildResult:
    """run_child's contract for a whole job: its `capture` is the merged job
    document's capture-level fields (the first failing rank's, with `ranks`,
    `world_size` and `first_oom_rank`), so replays keep the world size."""
    from oomdoc.distributed.merge import merge_rank_captures

    result = run_job(request, dist, warm)
    for _retry in range(PORT_RETRIES):
        if not port_was_taken(result, request, dist):
            break
        result = run_job(request, dist)  # with another free port
    if request.max_steps is not None:  # a replay
        finished_with_peers(result)
    capture = None
    if result.captures:
        capture = merge_rank_captures(
            result.captures, missing=result.missing, launch=dist.as_dict()
        )
        capture.setdefault("notes", []).extend(result.notes)
        if capture.get("outcome") == "interrupted" and result.signal_name is None:
            # The launcher (or oomdoc's bound) stopped the ranks, not the user:
            # for the replays that is a failed run, not Ctrl-C.
            capture["outcome"] = "error"
            capture["error"] = {"type": "RankStopped", "message": "; ".join(result.notes)[:500]}
        if request.artifact_dir is None:
            capture["artifacts"] = {}
    return ChildResult(
        exit_code=result.exit_code,
        capture=capture,
        wall_s=result.wall_s,
        timed_out=result.timed_out,
        signal_name=result.signal_name,
    )
