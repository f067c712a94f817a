"""Parent side: start the capture child, pass signals on, collect its capture.

The parent never touches the GPU, so it survives the OOM and stays clean for
replays. Each child is a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import oomdoc
from oomdoc.capture import CONFIG_ENV
from oomdoc.child_config import ChildConfig, DeviceLock
from oomdoc.distributed.merge import merge_rank_captures, read_captures
from oomdoc.errors import UsageError
from oomdoc.forking import ChildProcess
from oomdoc.model import Breakdown, Device, ErrorInfo, Options, Snapshot
from oomdoc.snapshot import SCHEMA_VERSION, default_snapshot_path, utc_now
from oomdoc.warm import (  # noqa: F401 (WarmChild, bytecode_cache_env: oomdoc.runner's names too)
    WarmChild,
    WarmPool,
    bytecode_cache_env,
    child_env,
    start_child,
)

SPAWNED_PATTERN = re.compile(r"^capture-spawned(\d+)\.json$")


@dataclass
class ChildRequest:
    """One run of the user's script under capture."""

    target: str
    args: list[str]
    device: str  # "cuda" or "cpu" (the simulated device)
    capacity_bytes: int | None = None
    is_module: bool = False
    max_steps: int | None = None
    # Micro-batches per optimizer step (gradient accumulation): before the
    # first optimizer step, `max_steps` counts this many model calls per step.
    micro_batches_per_step: int | None = None
    # A replay: the failing run's step unit (oomdoc.capture.step_limits.UNITS);
    # `max_steps` counts only once the replay trains in that unit.
    expected_unit: str | None = None
    # A replay of an OOM in evaluation pass N: it stops after that pass
    # (at the next training call) instead of after `max_steps`.
    stop_after_evaluation: int | None = None
    # A replay: longest batches first, the script's evaluation reached
    # (oomdoc.capture.whole_run).
    whole_run: bool = False
    # Where replays share their datasets' sample sizes (ChildConfig.dataset_sizes).
    dataset_sizes: str | None = None
    # Where replays note the user's files before changing them (ChildConfig.kept_files).
    kept_files: str | None = None
    fix: dict | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # Replays send the script's output to a log instead of the terminal.
    output_path: str | None = None
    timeout_s: float | None = None
    artifact_dir: str | None = None
    # Replays side by side share the device through this lock file
    # (oomdoc.capture.gate): the child takes it before its first device work.
    device_lock: str | None = None
    # None: every child holds that lock exclusively, from its first device
    # work to its end. Else the card has room for every lane's process and
    # children pass a turnstile: True, this child's untimed device work holds
    # the lock shared (its timed steps alone); False, it keeps the device
    # alone from its first device work to its end (a replay timed again).
    share_device: bool | None = None
    # False: the replay's step times are never used (a check of a peak); with
    # the device shared, it never takes it alone (DeviceLock.untimed).
    timed: bool = True
    # With the device shared: the steps run sharing it before the timed ones
    # (DeviceLock.shared_steps).
    shared_steps: int = 1
    # oomdoc check: DataLoaders load in the script's process (num_workers=0),
    # so that two runs of the same code count the same batches.
    serial_dataloaders: bool = False
    # A replay: the child ends without the interpreter's teardown once its
    # capture is written (ChildConfig.quick_exit).
    quick_exit: bool = False
    # A replay: the model's random initialisation drawn cheaply (ChildConfig.quick_init).
    quick_init: bool = False


@dataclass
class ChildResult:
    exit_code: int
    # The child's capture as it wrote it (parsed into a Snapshot by the caller).
    capture: dict | None
    wall_s: float
    timed_out: bool = False
    signal_name: str | None = None
    warm: bool = False  # a warm child ran it (see WarmChild)
    # The device the child chose (`cuda`/`simulated`), known even when it
    # died before writing its capture (it says so as soon as it knows).
    device_kind: str | None = None
    # Seconds it waited for the device lock (not counted in its timeout).
    lock_wait_s: float = 0.0
    # The caller no longer wanted its answer and stopped it (`cancel`).
    cancelled: bool = False


def interrupt_reached_the_group() -> bool:
    """Whether a SIGINT was, most likely, a terminal's Ctrl-C: oomdoc runs in
    the foreground process group of its terminal, whose every process (its
    children too) the terminal signals. Otherwise it was sent to oomdoc alone
    and must be passed on (the child ignores the echo of one it already had)."""
    for descriptor in (0, 1, 2):
        try:
            if os.isatty(descriptor):
                return os.tcgetpgrp(descriptor) == os.getpgrp()
        except OSError:
            continue
    return False


class ChildSignals:
    """What SIGINT and SIGTERM do to oomdoc while its children run.

    Ctrl-C reaches the children from the terminal directly (one process
    group): oomdoc only notes it (`interrupted`) and lets each child write its
    capture; a SIGINT sent to oomdoc alone is passed on to the children.
    SIGTERM sent to oomdoc is passed on to every running child (`terminated`). Installed from the main thread, once for a whole phase of
    children that several threads may start (the replays), or by run_child
    for one child. Handlers, unlike SIG_IGN, are not inherited by the
    children oomdoc starts meanwhile."""

    def __init__(self) -> None:
        self.interrupted = False
        self.terminated = False
        self._processes: set[ChildProcess] = set()
        self._lock = threading.Lock()
        self._previous: tuple[Any, Any] | None = None

    def __enter__(self) -> ChildSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers: the caller's stay
        self._previous = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        signal.signal(signal.SIGINT, self._on_interrupt)
        signal.signal(signal.SIGTERM, self._on_terminate)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous[0])
            signal.signal(signal.SIGTERM, self._previous[1])
            self._previous = None

    @property
    def stopped(self) -> bool:
        return self.interrupted or self.terminated

    def _on_interrupt(self, signum, frame) -> None:
        self.interrupted = True
        if interrupt_reached_the_group():
            return  # the terminal's Ctrl-C: the children have it already
        # `kill -INT <oomdoc>` (a supervisor, a script): only oomdoc got it.
        with self._lock:
            processes = list(self._processes)
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    def _on_terminate(self, signum, frame) -> None:
        self.terminated = True
        with self._lock:
            processes = list(self._processes)
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    def add(self, process: ChildProcess) -> None:
        with self._lock:
            self._processes.add(process)
        if self.terminated and process.poll() is None:
            process.send_signal(signal.SIGTERM)

    def discard(self, process: ChildProcess) -> None:
        with self._lock:
            self._processes.discard(process)


# How often a child's wait checks its device-lock status and `cancel`.
POLL_S = 0.1
# A child asked to stop (SIGTERM) gets this long to write its capture.
STOP_GRACE_S = 10.0


def lock_wait_seconds(status_path: str | None, now: float | None = None) -> float:
    """How long the child has waited for the device lock so far, over every
    time it took it, from the status file it writes (oomdoc.capture.gate):
    the waits that ended, plus the one under way."""
    if not status_path:
        return 0.0
    try:
        with open(status_path, encoding="utf-8") as handle:
            status = json.load(handle)
        waited = float(status.get("waited_s", 0.0))
        if status.get("held_since") is None:
            waited += (time.time() if now is None else now) - float(status["waiting_since"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    return max(0.0, waited)


def _stop(process: ChildProcess) -> int:
    """SIGTERM (the child writes its capture), then SIGKILL after the grace."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _wait(
    process: ChildProcess,
    timeout_s: float | None,
    status_path: str | None,
    cancel: threading.Event | None,
) -> tuple[int, bool, bool, float]:
    """Wait for the child: (exit status, timed out, cancelled, seconds it
    waited for the device lock). The time it waits for the lock does not
    count toward `timeout_s`; a child that hangs holding it is killed at its
    timeout, which releases the lock for the others."""
    if status_path is None and cancel is None:
        try:
            return process.wait(timeout=timeout_s), False, False, 0.0
        except subprocess.TimeoutExpired:
            return _stop(process), True, False, 0.0
    started = time.perf_counter()
    waited = 0.0
    while True:
        try:
            returncode = process.wait(timeout=POLL_S)
            return returncode, False, False, lock_wait_seconds(status_path)
        except subprocess.TimeoutExpired:
            pass
        waited = lock_wait_seconds(status_path) or waited
        if cancel is not None and cancel.is_set():
            return _stop(process), False, True, waited
        if timeout_s is not None and time.perf_counter() - started - waited > timeout_s:
            return _stop(process), True, False, waited


def child_config(request: ChildRequest, result_path: str, artifact_dir: str) -> ChildConfig:
    """What a child running `request` reads (oomdoc.child_config); each
    launcher adds its own part (a device lock, a job's rank paths)."""
    return ChildConfig(
        target=request.target,
        result_path=result_path,
        args=list(request.args),
        is_module=request.is_module,
        device=request.device,
        capacity_bytes=request.capacity_bytes,
        max_steps=request.max_steps,
        micro_batches_per_step=request.micro_batches_per_step,
        expected_unit=request.expected_unit,
        stop_after_evaluation=request.stop_after_evaluation,
        whole_run=request.whole_run,
        dataset_sizes=request.dataset_sizes,
        kept_files=request.kept_files,
        fix=request.fix,
        artifact_dir=artifact_dir,
        quick_exit=request.quick_exit,
        quick_init=request.quick_init,
    )


def run_child(
    request: ChildRequest,
    pool: WarmPool | None = None,
    signals: ChildSignals | None = None,
    cancel: threading.Event | None = None,
) -> ChildResult:
    """Run one child to its end. `signals`: the handlers of a whole phase of
    children, installed by the caller (else this child's own); `cancel`: set
    to stop the child early (its result says `cancelled`)."""
    warm = pool.take(request) if pool is not None else None
    with tempfile.TemporaryDirectory(prefix="oomdoc-") as workdir:
        config_path = os.path.join(workdir, "config.json")
        result_path = os.path.join(workdir, "capture.json")
        status_path = os.path.join(workdir, "lock.json") if request.device_lock else None
        lock = None
        if request.device_lock:
            lock = DeviceLock(request.device_lock, status_path)
            if request.share_device is not None:
                lock.shared = request.share_device
                lock.turnstile = request.device_lock + ".turnstile"
                lock.untimed = not request.timed
                lock.shared_steps = request.shared_steps
        config = child_config(request, result_path, request.artifact_dir or workdir)
        config.serial_dataloaders = request.serial_dataloaders
        config.device_lock = lock
        if warm is not None:
            config.late_env = warm.late_env_for(request)
        config.asked_at = time.time()
        with open(config_path, "w", encoding="utf-8") as handle:
            handle.write(config.to_json())

        output = None
        started = time.perf_counter()
        own_signals = signals is None
        scope = signals or ChildSignals()
        process = None
        try:
            if own_signals:
                scope.__enter__()
            if warm is not None and request.output_path is not None:
                process = warm.hand(config_path, request.output_path)
            else:
                env = child_env(request.device, request.extra_env)
                env[CONFIG_ENV] = config_path
                output = open(request.output_path, "wb") if request.output_path else None
                process = start_child(
                    env,
                    stdout=output,
                    stderr=subprocess.STDOUT if output else None,
                    stdin=subprocess.DEVNULL if output else None,
                )
            scope.add(process)
            returncode, timed_out, cancelled, lock_wait_s = _wait(
                process, request.timeout_s, status_path, cancel
            )
        finally:
            if process is not None:
                scope.discard(process)
            if own_signals:
                scope.__exit__(None, None, None)
            if output:
                output.close()
        wall_s = time.perf_counter() - started

        signal_name = None
        if returncode < 0:
            signal_name = signal.Signals(-returncode).name
            returncode = 128 - returncode
        capture = None
        if os.path.exists(result_path):
            try:
                with open(result_path, encoding="utf-8") as handle:
                    capture = json.load(handle)
            except (OSError, json.JSONDecodeError):
                capture = None
        device_kind = None
        if isinstance(capture, dict):
            device = capture.get("device")
            if isinstance(device, dict) and device.get("kind") in ("cuda", "simulated"):
                device_kind = device["kind"]
            if capture.get("partial"):
                capture = None  # only the device: the child died before its capture
        if capture is not None and request.artifact_dir is None:
            capture["artifacts"] = {}  # the files died with the temporary directory
        # The ranks the script started with torch.multiprocessing.spawn
        # (oomdoc.capture.spawned) wrote their captures beside the child's.
        capture = with_spawned_ranks(capture, read_spawned_captures(workdir))
        return ChildResult(
            exit_code=returncode,
            capture=capture,
            wall_s=wall_s,
            timed_out=timed_out,
            device_kind=device_kind,
            signal_name=signal_name,
            warm=warm is not None,
            lock_wait_s=round(lock_wait_s, 3),
            cancelled=cancelled,
        )


def read_spawned_captures(workdir: str) -> list[dict]:
    """The captures of the ranks spawned by the script, by index."""
    found = read_captures(workdir, SPAWNED_PATTERN)
    return [found[index] for index in sorted(found)]


def with_spawned_ranks(capture: dict | None, spawned: list[dict]) -> dict | None:
    """The script's own capture, or, when it started ranks that used the
    device (torch.multiprocessing.spawn, or new Python processes a launcher
    started: oomdoc.capture.relaunch), the job they form. The script's own
    process is a rank too when it trained and no started process is rank 0
    (Lightning's `ddp`: rank 0 is the script, ranks 1.. run it again); else
    it only launched them."""
    if not spawned:
        return capture
    started = (capture or {}).get("spawned_ranks") or []
    launchers = sorted(
        {str(entry.get("launcher") or "torch.multiprocessing.spawn") for entry in started}
    ) or ["torch.multiprocessing.spawn"]
    members = list(spawned)
    own_steps = len((capture or {}).get("steps") or [])
    ranks = {(member.get("rank") or {}).get("rank") for member in spawned}
    own_is_rank = capture is not None and own_steps > 0 and 0 not in ranks
    if capture is not None and own_is_rank:
        world = max([len(spawned) + 1, *(r + 1 for r in ranks if isinstance(r, int))])
        own = {**capture, "rank": {"rank": 0, "local_rank": 0, "world_size": world}}
        members.insert(0, own)
    job = merge_rank_captures(members, launch={"launcher": ", ".join(launchers)})
    if capture is not None:
        for key in ("spawned_ranks", "uncaptured_processes", "script_options", "command"):
            if key in capture and key not in job:
                job[key] = capture[key]
        if own_steps and not own_is_rank:
            job.setdefault("notes", []).append(
                f"The script's own process also ran {own_steps} step(s) itself; "
                "the report is the spawned ranks'."
            )
    job.setdefault("notes", []).append(
        f"The script started {len(spawned)} process(es) as ranks ({', '.join(launchers)}): "
        "each was capped and captured as a rank of one job"
        + (", with the script's own process as rank 0." if own_is_rank else ".")
    )
    return job


# ------------------------------------------------------- running a script


@dataclass
class RunOptions:
    """What `oomdoc run` and `oomdoc check` were asked to run, and how."""

    target: str
    args: list[str]
    is_module: bool = False
    device: str = "auto"
    capacity_bytes: int | None = None
    output: str | None = None
    max_steps: int | None = None
    replay: bool = True
    # Replays run the whole run's worst case (oomdoc.capture.whole_run);
    # False (--first-batches): the data as it comes.
    whole_run: bool = True
    fixes: list[str] | None = None
    replay_timeout_s: float | None = None
    # Replays that may run side by side (None: as the machine allows).
    replay_jobs: int | None = None
    batch_arg: str | None = None
    # The share of the capacity the prescription leaves free; None (`--margin
    # auto`): measured from the failing run (oomdoc.replay.certificate).
    margin_fraction: float | None = None
    # Also write the report as HTML here.
    html_path: str | None = None
    # A torchrun job: the launcher's options (oomdoc.distributed.launch).
    distributed: Any = None

    @property
    def command(self) -> list[str]:
        return ["-m", self.target, *self.args] if self.is_module else [self.target, *self.args]


def check_device_choice(requested: str) -> None:
    if requested not in ("auto", "cuda", "cpu"):
        raise UsageError(f"--device must be auto, cuda or cpu, not {requested!r}")


def check_target(options: RunOptions) -> None:
    """The script (or module) exists: a usage error before anything starts."""
    if options.is_module:
        import importlib.util

        try:
            spec = importlib.util.find_spec(options.target)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise UsageError(f"no module named {options.target!r}")
        return
    path = os.path.abspath(options.target)
    if not os.path.exists(path):
        raise UsageError(f"can't open file {options.target!r}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"{options.target!r} is a directory, not a Python script")


def child_request(options: RunOptions, **extra) -> ChildRequest:
    """The child run of the script that `options` describe (`extra`: the
    ChildRequest fields a caller sets itself, e.g. artifact_dir, extra_env).
    The child resolves `--device auto` itself: the parent never imports torch."""
    return ChildRequest(
        target=options.target,
        args=list(options.args),
        device=options.device,
        capacity_bytes=options.capacity_bytes,
        is_module=options.is_module,
        max_steps=options.max_steps,
        **extra,
    )


def raise_child_usage_error(result: ChildResult) -> None:
    """The child refused its configuration (e.g. --device cuda without CUDA)."""
    message = (result.capture or {}).get("usage_error")
    if message:
        raise UsageError(str(message))


def build_snapshot(options: RunOptions, result: ChildResult) -> Snapshot:
    """The run's snapshot: the child's capture, parsed, plus what only the
    parent knows. Never imports torch, also when the child died without a
    capture (the device is then the one the child said it chose, else what
    was asked for)."""
    capture = result.capture
    snapshot = Snapshot.from_dict(capture) if capture is not None else Snapshot()
    snapshot.write_every_field()
    snapshot.schema_version = SCHEMA_VERSION
    snapshot.oomdoc_version = oomdoc.__version__
    snapshot.created_at = utc_now()
    snapshot.command = options.command
    snapshot.cwd = os.getcwd()
    snapshot.python = sys.version.split()[0]
    if capture is None or not isinstance(capture.get("torch_version"), str):
        snapshot.torch_version = installed_torch_version()
    kind = (
        result.device_kind
        or {"cpu": "simulated", "cuda": "cuda"}.get(options.device)
        or guess_device_kind()
    )
    snapshot.options = Options(
        device="cuda" if kind == "cuda" else "cpu",
        capacity_bytes=options.capacity_bytes,
        max_steps=options.max_steps,
    )
    snapshot.exit_code = int(result.exit_code)
    if capture is None:
        # The child died before it could write anything (killed, crashed).
        snapshot.device = Device(
            kind=kind, name="unknown", capacity_bytes=int(options.capacity_bytes or 0)
        )
        # Ctrl-C and SIGTERM interrupt; SIGKILL is no request to stop (the
        # kernel's OOM killer sends it when the host runs out of memory).
        snapshot.outcome = "interrupted" if result.exit_code in (130, 143) else "error"
        snapshot.breakdown = Breakdown()
        snapshot.breakdown_at = "none"
        if result.signal_name == "SIGKILL" or result.exit_code == 137:
            snapshot.error = ErrorInfo(type="killed by SIGKILL", message="")
            snapshot.notes = [
                "The script's process was killed (SIGKILL) without writing its capture: by the "
                "kernel's OOM killer when the host ran out of memory (see `dmesg`), or by another process."
            ]
        else:
            snapshot.notes = [
                "The script's process ended without writing its capture (it was killed or crashed)."
            ]
    return snapshot


def installed_torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def guess_device_kind() -> str:
    """`--device auto` when the child died before it chose: CUDA when NVML
    sees a GPU this process may use (without importing torch)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "simulated"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return "cuda" if pynvml.nvmlDeviceGetCount() > 0 else "simulated"
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return "simulated"


def output_path(options: RunOptions) -> Path:
    """Where the snapshot is meant to go, checked before the run (the name
    actually written may differ: oomdoc.output_paths.write_new_file)."""
    from oomdoc.output_paths import check_output_file

    if options.output is None:
        path = default_snapshot_path(options.target)
        check_output_file(path, "snapshot", create_parents=True)
        return path
    check_output_file(options.output, "-o/--output", create_parents=True)
    return Path(options.output)


def remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()  # only when nothing was saved there
    except OSError:
        pass


def replays_failed(exc: Exception, artifact_dir: Path, stderr: TextIO) -> str:
    """Say, in one line, that the replays stopped on an error of oomdoc's
    own, and keep its traceback beside the snapshot for a bug report."""
    path = artifact_dir / "replay-error.txt"
    try:
        path.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        kept = f"; its traceback: {path}"
    except OSError:
        kept = ""
    text = f"The replays stopped on an error of oomdoc's own ({type(exc).__name__}: {exc}){kept}"
    print(f"oomdoc: {text[0].lower()}{text[1:]}", file=stderr)
    return text + ". The failing run's diagnosis stands; no fix was measured."
