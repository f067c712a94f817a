"""The child process: runs the user's script as `__main__` under capture.

Started by the parent as `python -m oomdoc.capture.child`; the configuration
comes in a JSON file named by $OOMDOC_CHILD_CONFIG, so that nothing is added
to the script's own argv. The capture is written, whatever happens, to the
result file the configuration names.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys
import time
import traceback
import types
import zipfile
from dataclasses import replace
from typing import Any, Callable

# Seconds since the epoch when this module started importing: with the
# process's creation time it says what start-up (Python, `import torch`) cost.
_IMPORT_STARTED = time.time()

import psutil
import torch

from oomdoc.capture import (
    CONFIG_ENV,
    CONFIG_FD_ENV,
    CONFIG_WAIT_ENV,
    CUDA_UNAVAILABLE,
    STARTED_ENV,
    ZYGOTE_FD_ENV,
    choose_device,
    communication,
    process_ranks,
    quick_exit,
    quick_init,
    relaunch,
    replay_writes,
    shared_memory,
    spawned,
)
from oomdoc.capture.backend_base import oom_behind
from oomdoc.capture.backends import Backend, CudaBackend, OutOfMemoryError, SimulatedBackend
from oomdoc.capture.frameworks import capture_keys as framework_keys
from oomdoc.capture.frameworks import install as detect_framework
from oomdoc.capture.gate import DeviceGate
from oomdoc.capture.imports import imported_packages
from oomdoc.capture.parallel import ParallelCapture
from oomdoc.capture.tracker import StopRun, Tracker
from oomdoc.capture.waiting import wait_for_config_file, wait_for_work
from oomdoc.capture.whole_run import WholeRun
from oomdoc.capture.whole_run import install as install_whole_run
from oomdoc.child_config import ChildConfig
from oomdoc.fixes import fix_named
from oomdoc.fixes.allocator import CONF_ENV
from oomdoc.snapshot import dumps, write_atomic


def apply_late_env(late_env: dict[str, str], device: str) -> None:
    """Set what a warm child was handed late (oomdoc.warm.LATE_ENV): in the
    environment, where the script looks, and, for the CUDA allocator's
    settings, in the allocator too: torch may have read the variable already,
    when it was imported (2.9 and later parse it then)."""
    if not late_env:
        return
    os.environ.update(late_env)
    settings = late_env.get(CONF_ENV)
    if settings is None or device == "cpu":
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if setter is None:
        print(f"oomdoc: this torch cannot set {CONF_ENV} late", file=sys.stderr)
        return
    try:
        setter(settings)
    except Exception as exc:
        # Not in the environment either: the capture then says (and the
        # certificate reads) that the replay ran at the allocator's defaults.
        os.environ.pop(CONF_ENV, None)
        print(f"oomdoc: {CONF_ENV}={settings} was not applied: {exc}", file=sys.stderr)


def apply_fix(payload: dict, tracker: Tracker) -> None:
    """Apply every part of the replayed fix (`a+b` applies both) before the
    script starts; what each did goes into the capture (`fix_applied`)."""
    fix = fix_named(payload["name"])
    if fix is None:
        raise ValueError(f"oomdoc: unknown fix {payload['name']!r}")
    # `also`: fixes applied with it, e.g. smaller_batch when the largest
    # batch under a combination is searched.
    parts = fix.parts + [extra for name in payload.get("also") or [] if (extra := fix_named(name))]
    applied: dict = {}
    tracker.fix_applied = applied
    for part in parts:
        part.apply(payload, applied.setdefault(part.name, {}), tracker)


class Terminated(BaseException):
    """SIGTERM, turned into an exception so the capture is still written."""


def _on_sigterm(signum, frame):
    raise Terminated()


# A second SIGINT this soon after the first is the same interrupt twice: a
# process group's signal that oomdoc, not seeing a terminal, passed on too.
SIGINT_ECHO_S = 1.0
_last_interrupt = [float("-inf")]


def _on_sigint(signum, frame):
    now = time.monotonic()
    if now - _last_interrupt[0] < SIGINT_ECHO_S:
        return
    _last_interrupt[0] = now
    raise KeyboardInterrupt


class DeviceUnavailable(Exception):
    """The configuration asks for a device this machine does not have."""


def resolve_device(requested: str) -> str:
    """`auto`: CUDA when this machine has it, else the simulated device
    (`cpu`). Decided here rather than in the parent, which then never needs
    to import torch. CUDA is counted through NVML (torch.cuda.device_count):
    torch.cuda.is_available() asks the CUDA runtime, which marks this
    process so that a process it forks cannot use CUDA, and a script that
    forks its ranks before touching CUDA must work as without oomdoc."""
    device = choose_device(requested, requested != "cpu" and torch.cuda.device_count() > 0)
    if device is None:
        raise DeviceUnavailable(CUDA_UNAVAILABLE)
    return device


def tracker_for(config: ChildConfig, backend: Backend) -> Tracker:
    """The tracker a run's configuration asks for (the script's process and
    each rank it spawns alike); a replay's files written are watched from here."""
    replay_writes.watch_run(config)
    return Tracker(
        backend,
        max_steps=config.max_steps,
        micro_batches_per_step=config.micro_batches_per_step,
        expected_unit=config.expected_unit,
        stop_after_evaluation=config.stop_after_evaluation,
        names_uncalled_models=not config.quick_exit,  # a replay's OOM is diagnosed by no one
    )


def make_backend(config: ChildConfig) -> Backend:
    if resolve_device(config.device) == "cuda":
        # CUDA starts only when the script starts it: as without oomdoc, a
        # script that never touches CUDA before it forks its ranks can fork
        # them, and a replay waiting for the device lock holds no context.
        return CudaBackend(config.capacity_bytes, deferred=True)
    capacity = config.capacity_bytes or psutil.virtual_memory().total
    return SimulatedBackend(capacity)


def _host_memory() -> dict:
    try:
        memory = psutil.virtual_memory()
        return {
            "total_bytes": int(memory.total),
            "available_bytes": int(memory.available),
            "process_rss_bytes": int(psutil.Process().memory_info().rss),
        }
    except Exception:
        return {}


_OOMDOC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _not_the_scripts(filename: str) -> bool:
    """oomdoc's own hooks, and runpy's frames (the only ones left when the
    script never ran: a SyntaxError in it)."""
    return filename == "<frozen runpy>" or os.path.abspath(filename).startswith(
        (_OOMDOC_DIR + os.sep, os.path.splitext(runpy.__file__)[0])
    )


def _without_oomdoc_frames(summary: traceback.TracebackException | None) -> None:
    """Drop the frames of oomdoc's own hooks and runpy's, here and in chained
    exceptions."""
    seen = set()
    while summary is not None and id(summary) not in seen:
        seen.add(id(summary))
        summary.stack = traceback.StackSummary.from_list(
            [frame for frame in summary.stack if not _not_the_scripts(frame.filename)]
        )
        for chained in (summary.__cause__, summary.__context__):
            if chained is not None:
                _without_oomdoc_frames(chained)
        summary = None


def _script_ended(backend: Backend) -> None:
    """The script has ended, however it ended: no more signals while its
    traceback prints and the capture is written (a SIGTERM from the
    launcher, as a rank's peer died, used to cut both short), and oomdoc's
    own work from here on does not count on the simulated device."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    backend.stop_counting()


def _print_user_traceback(exc: BaseException, target_file: str | None) -> None:
    """Print the traceback as plain `python script.py` would: from the
    script's first frame on, without oomdoc's and runpy's frames."""
    tb = exc.__traceback__
    if target_file:
        real_target = os.path.realpath(target_file)
        probe = tb
        while probe is not None:
            if os.path.realpath(probe.tb_frame.f_code.co_filename) == real_target:
                tb = probe
                break
            probe = probe.tb_next
    summary = traceback.TracebackException(type(exc), exc, tb)
    _without_oomdoc_frames(summary)
    sys.stderr.write("".join(summary.format()))
    sys.stderr.flush()


def _exit_code_of(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF
    return 1


_STARTED: float | None = None  # from the parent (STARTED_ENV), read in main()
_FORKED = False  # a fork of the fork server (oomdoc.capture.zygote), set in main()


def _process_started() -> float:
    """When this process started. The parent's word first: psutil's creation
    time is counted from the boot time in whole seconds, up to a second off."""
    if _STARTED is not None:
        return _STARTED
    try:
        return psutil.Process().create_time()
    except Exception:
        return _IMPORT_STARTED


def run(
    config: ChildConfig, imported_at: float | None = None, preimported: dict | None = None
) -> int:
    """Run the script under capture; `imported_at` is when the imports above
    were done (a warm child waited after them, and imported `preimported`)."""
    timings = {"run_started": time.time(), "imported": imported_at or time.time()}
    if config.asked_at is not None:
        timings["asked"] = config.asked_at
    if preimported:
        timings["preimport_s"] = preimported.get("seconds", 0.0)
    apply_late_env(config.late_env, config.device)
    parallel = ParallelCapture(config)  # distributed: rank paths, the rank's GPU
    try:
        backend = make_backend(config)
    except DeviceUnavailable as exc:
        write_atomic(config.result_path, dumps({"usage_error": str(exc)}), overwrite=True)
        return 2
    # Say which device was chosen before the script runs: a parent whose
    # child dies without a capture still knows (and need not import torch).
    write_atomic(
        config.result_path,
        dumps({"partial": True, "device": {"kind": backend.kind}}),
        overwrite=True,
    )
    tracker = tracker_for(config, backend)
    gate = None
    if config.device_lock is not None:  # replays side by side: one on the device at a time
        gate = DeviceGate(config.device_lock)
        gate.install(backend.kind, tracker)
    tracker.install()
    backend.install(tracker)
    parallel.install(
        tracker, backend, lambda o, c: _watcher_write(config, backend, tracker, o, c, timings)
    )
    detector = detect_framework(tracker)
    if config.serial_dataloaders:  # oomdoc check: the same batches every run
        from oomdoc.capture.serial_dataloaders import load_in_process

        tracker.dataloader_workers_removed = []
        load_in_process(tracker.dataloader_workers_removed)
    if config.fix:
        apply_fix(config.fix, tracker)
    else:
        from oomdoc.fixes.smaller_batch import watch_dataloaders

        watch_dataloaders(tracker)
    undo_hooks = [communication.install(tracker), shared_memory.install()]
    if config.quick_init and backend.kind == "cuda":
        # On the simulated device the CPU's tensors are the device's: the
        # blocks it repeats would be counted.
        undo_hooks.append(quick_init.install())
    whole_run = None
    if config.whole_run:  # after the fix's DataLoader edits: it orders what they made
        whole_run, undo_whole_run = install_whole_run(tracker, config.dataset_sizes)
        undo_hooks.append(undo_whole_run)
    # Processes the script starts, captured as ranks: torch.multiprocessing.spawn's
    # (oomdoc.capture.spawned), new Python processes a launcher starts (LOCAL_RANK
    # set: Lightning's ddp, accelerate launch), multiprocessing.Process's that
    # join the process group (oomdoc.capture.process_ranks); the others are named.
    relaunches = processes = None
    if config.distributed is None:
        tracker.spawned_ranks, tracker.uncaptured_processes = [], []
        relaunches = relaunch.Relaunches(config, tracker.spawned_ranks)
        processes = process_ranks.ProcessRanks(
            config, tracker.spawned_ranks, tracker.uncaptured_processes, _RUN_PROCESS
        )
        undo_hooks += [
            spawned.install(config, tracker.spawned_ranks, _RUN_RANK),
            processes.install(),
            relaunches.install(),
        ]

    target = config.target
    script_args = list(config.args)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)

    failure: BaseException | None = None
    outcome, exit_code, error, system_exit = "ok", 0, None, None
    loaded_before = frozenset(sys.modules)
    _note_first_step(tracker, timings)
    timings["script_started"] = time.time()
    target_file = None
    try:
        try:
            if config.is_module:
                # As `python -m`: the current folder first on the path.
                sys.path[0] = os.getcwd()
                spec = __import__("importlib.util").util.find_spec(target)
                target_file = spec.origin if spec is not None else None
                sys.argv = [target_file or target, *script_args]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                target_file = os.path.abspath(target)
                sys.argv = [target, *script_args]
                sys.path[0] = os.path.dirname(target_file)
                run_script(target_file)
        finally:
            _script_ended(backend)
    except StopRun:
        outcome, exit_code = "ok", 0
    except SystemExit as exc:
        exit_code, system_exit = _exit_code_of(exc), exc
        behind = oom_behind(exc) if exit_code else None  # (Hydra exits 1 on any error)
        outcome = "ok" if exit_code == 0 else ("oom" if behind is not None else "error")
        error = None if behind is None else {"type": type(behind).__name__, "message": str(behind)}
    except (KeyboardInterrupt, Terminated) as exc:
        outcome = "interrupted"
        exit_code = 130 if isinstance(exc, KeyboardInterrupt) else 143
        failure = exc
    except OutOfMemoryError as exc:
        outcome, exit_code, failure = "oom", 1, exc
        error = {"type": type(exc).__name__, "message": str(exc)}
    except BaseException as exc:
        outcome, exit_code, failure = "oom" if oom_behind(exc) else "error", 1, exc
        error = {"type": type(exc).__name__, "message": str(exc)[:2000]}
    # Again: a signal handled at the start of the `finally` above (a
    # SIGTERM raised as Terminated there) skipped the rest of it.
    _script_ended(backend)
    if relaunches is not None:
        relaunches.script_ended = True  # its launcher's threads no longer end this process
    if failure is not None:
        # Where a rank was stopped, noted before anything slow: the signal
        # watcher writes the capture if this thread is not done in time.
        parallel.note_failure(failure)
        _print_user_traceback(failure, target_file)

    timings["script_ended"] = time.time()
    if gate is not None:
        if gate.shared and outcome == "oom":
            # The card has room for every lane and no step time of a run
            # that ran out of memory is used: the others need not wait for
            # its capture or its exit (its queued work is finished first).
            tracker.timed_steps_done()
            gate.release()
        timings["lock_wait_s"] = gate.waited_s
    tracker.imported_packages = imported_packages(loaded_before)
    if relaunches is not None:
        # Their captures are read with this one: they end first (bounded).
        relaunches.wait(replay=config.max_steps is not None)
    if processes is not None:
        processes.wait()
    parallel.finish()  # blocks when its signal watcher writes the capture
    write_capture(config, backend, tracker, outcome, exit_code, error, timings, whole_run=whole_run)
    if gate is not None and gate.shared:
        gate.release()  # its last step is closed: nor for its exit
    detector.uninstall()
    for undo in undo_hooks:
        undo()
    tracker.uninstall()
    backend.uninstall()
    if config.quick_exit and config.distributed is None and not quick_exit.in_process_group():
        quick_exit.end_now(exit_code)
    if system_exit is not None:
        sys.stdout.flush()
        raise system_exit
    return exit_code


# run_rank by name, for the spawned processes (this module is `__main__` here).
_RUN_RANK = "oomdoc.capture.child:run_rank"


def run_rank(config: ChildConfig, index: int, nprocs: int, fn: Callable, args: tuple) -> Any:
    """Run the script's function as the rank `index` that torch.multiprocessing.spawn
    started, under the same capture as the script (oomdoc.capture.spawned)."""
    artifact_dir = os.path.join(config.artifact_dir or ".", f"spawned{index}")
    config = replace(
        config, result_path=config.result_path.format(index=index), artifact_dir=artifact_dir
    )
    os.makedirs(artifact_dir, exist_ok=True)
    rank = RankCapture(config, _rank_fields(index, nprocs, "torch.multiprocessing.spawn"))
    return _run_as_rank(lambda: fn(index, *args), lambda: rank)


# run_process by name, for the processes the script starts with multiprocessing.Process.
_RUN_PROCESS = "oomdoc.capture.child:run_process"


def run_process(config: ChildConfig, target: Callable, args: tuple, kwargs: dict) -> Any:
    """Run the function of a process the script started with
    `multiprocessing.Process`: captured as a rank from when it joins the
    default process group, else as without oomdoc (oomdoc.capture.process_ranks)."""
    ranks: list[RankCapture] = []

    def joined(rank: int, world_size: int) -> None:
        fields = _rank_fields(rank, world_size, process_ranks.LAUNCHER)
        ranks.append(RankCapture(config, fields, mark_started=True))
        # Stopped by oomdoc as its peers end: the capture is still written.
        signal.signal(signal.SIGTERM, _on_sigterm)

    undo = process_ranks.when_joining_the_group(joined)
    try:
        return _run_as_rank(lambda: target(*args, **kwargs), lambda: ranks[0] if ranks else None)
    finally:
        undo()


def _rank_fields(rank: int, world_size: int, launcher: str) -> dict:
    """A started rank's place in the job (one host: its local rank is its rank)."""
    return {
        "rank": rank,
        "local_rank": rank,
        "world_size": world_size,
        "local_world_size": world_size,
        "node_rank": None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "launcher": launcher,
    }


class RankCapture:
    """The capture of a rank the script started: installed when made, written by `end`."""

    def __init__(self, config: ChildConfig, rank: dict, mark_started: bool = False):
        """`mark_started`: first write a `partial` capture with this process's
        pid, which marks it as a rank (oomdoc.capture.process_ranks)."""
        self.timings = {"run_started": time.time(), "imported": time.time()}
        self.parallel = ParallelCapture(config, rank=rank)  # (fills the rank into the paths)
        self.config = config
        if mark_started:
            write_atomic(
                config.result_path, dumps({"partial": True, "pid": os.getpid()}), overwrite=True
            )
        self.backend = backend = make_backend(config)
        self.tracker = tracker = tracker_for(config, backend)
        tracker.install()
        backend.install(tracker)
        self.parallel.install(
            tracker,
            backend,
            lambda o, c: _watcher_write(config, backend, tracker, o, c, self.timings),
        )
        if config.fix:
            apply_fix(config.fix, tracker)
        self.undo_hooks = [communication.install(tracker), shared_memory.install()]
        self.timings["script_started"] = time.time()

    def end(
        self, outcome: str, exit_code: int, error: dict | None, failure: BaseException | None
    ) -> None:
        if failure is not None:
            self.parallel.note_failure(failure)
        self.timings["script_ended"] = time.time()
        self.parallel.finish()
        write_capture(
            self.config, self.backend, self.tracker, outcome, exit_code, error, self.timings
        )
        for undo in reversed(self.undo_hooks):
            undo()
        self.tracker.uninstall()
        self.backend.uninstall()


def _run_as_rank(call: Callable[[], Any], rank_of: Callable[[], RankCapture | None]) -> Any:
    """`call()`, the function of a rank the script started, and then its
    capture (`rank_of()`, None while it has none) written with how it
    ended; its exception goes on as without oomdoc."""
    outcome, exit_code, error = "ok", 0, None
    failure: BaseException | None = None
    try:
        try:
            return call()
        finally:
            rank = rank_of()
            if rank is not None:
                _script_ended(rank.backend)
    except StopRun:
        return None  # a replay's stop: this rank ends cleanly
    except (KeyboardInterrupt, Terminated) as exc:
        outcome, failure = "interrupted", exc
        exit_code = 130 if isinstance(exc, KeyboardInterrupt) else 143
        raise
    except OutOfMemoryError as exc:
        outcome, exit_code, failure = "oom", 1, exc
        error = {"type": type(exc).__name__, "message": str(exc)}
        raise
    except BaseException as exc:
        outcome, exit_code, failure = "oom" if oom_behind(exc) else "error", 1, exc
        error = {"type": type(exc).__name__, "message": str(exc)[:2000]}
        raise
    finally:
        rank = rank_of()
        if rank is not None:
            rank.end(outcome, exit_code, error, failure)


def run_script(path: str) -> None:
    """Run a script file as `python script.py` does: as `__main__`, with an
    absolute `__file__` (3.9+) while `sys.argv[0]` stays as typed (runpy's
    run_path would set it to the path it is given). Directories and zip
    files with a `__main__.py` go through runpy."""
    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        argv0 = sys.argv[0]
        runpy.run_path(path, run_name="__main__")
        sys.argv[0] = argv0
        return
    with open(path, "rb") as handle:
        code = compile(handle.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None
    )
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


def _watcher_write(
    config: ChildConfig,
    backend: Backend,
    tracker: Tracker,
    outcome: str,
    exit_code: int,
    timings: dict[str, float],
) -> None:
    """The capture of a rank stopped while stuck in a collective (written by
    oomdoc.distributed's signal watcher thread)."""
    timings.setdefault("script_ended", time.time())
    timings.setdefault("script_started", timings["script_ended"])
    write_capture(config, backend, tracker, outcome, exit_code, None, timings)


def _note_first_step(tracker: Tracker, timings: dict[str, float]) -> None:
    """Note when the script's first step begins (its start-up ends there)."""
    previous = tracker.on_first_step

    def first_step_begins() -> None:
        timings["first_step"] = time.time()
        if previous is not None:
            previous()

    tracker.on_first_step = first_step_begins


def timing_summary(timings: dict) -> dict:
    """Where the child's time went, in seconds: start-up (interpreter and
    imports), waiting for work (a warm child, which meanwhile imported the
    script's framework: preimport_s), setting up the capture, the script
    (without its wait for the device lock: lock_wait_s), and writing the
    capture. A replay's start-up as its parent saw it: ready_wait_s (from
    asking to this child starting the run: a warm child still importing
    makes it wait), setup_s, then first_step_s (the script's own start-up)."""
    started = _process_started()
    lock_wait = timings.get("lock_wait_s", 0.0)
    summary = {
        "startup_s": timings["imported"] - started,
        "waited_s": max(0.0, timings["run_started"] - timings["imported"]),
        "setup_s": timings["script_started"] - timings["run_started"],
        "script_s": timings["script_ended"] - timings["script_started"] - lock_wait,
        "capture_s": time.time() - timings["script_ended"],
    }
    for key in ("preimport_s", "lock_wait_s"):
        if key in timings:
            summary[key] = timings[key]
    if "asked" in timings:  # from the parent's ask to this child starting the run
        summary["ready_wait_s"] = timings["run_started"] - timings["asked"]
    if "first_step" in timings:  # the script's imports, model building, data
        summary["first_step_s"] = timings["first_step"] - timings["script_started"]
    rounded: dict = {key: round(max(value, 0.0), 3) for key, value in summary.items()}
    if _FORKED:
        rounded["forked"] = True
    return rounded


def write_capture(
    config: ChildConfig,
    backend: Backend,
    tracker: Tracker,
    outcome: str,
    exit_code: int,
    error: dict | None,
    timings: dict[str, float] | None = None,
    whole_run: WholeRun | None = None,
) -> None:
    tracker.finish()
    oom = tracker.oom if outcome == "oom" else None
    if outcome == "oom" and oom is None:
        # The allocator raised without calling the observer (e.g. an OOM
        # raised by a library): keep what the exception says.
        oom = {
            "step": tracker.step_index,
            "phase": tracker.phase,
            "requested_bytes": 0,
            "allocated_bytes": backend.allocated_bytes(),
            "reserved_bytes": backend.reserved_bytes(),
            "free_bytes": 0,
            "capacity_bytes": backend.capacity_bytes(),
            "message": "",
            "location": None,
            "breakdown": None,
            "top_allocations": [],
            "allocator": backend.allocator_stats(),
        }
    if oom is not None:
        if error and not oom.get("message"):
            oom["message"] = error["message"]
        breakdown, top, breakdown_at = oom.pop("breakdown"), oom.pop("top_allocations"), "oom"
        allocator = oom.pop("allocator", {})
        modules = oom.pop("modules", None)
        if breakdown is None:
            breakdown, top = tracker.breakdown_and_sites()
            modules = tracker.last_modules
    elif tracker.peak_sample is not None:
        breakdown, top, breakdown_at = (
            tracker.peak_sample["breakdown"],
            tracker.peak_sample["top_allocations"],
            "peak",
        )
        modules = tracker.peak_sample.get("modules")
        allocator = backend.allocator_stats()
    else:
        breakdown, top = tracker.breakdown_and_sites()
        breakdown_at, allocator = "end", backend.allocator_stats()
        modules = tracker.last_modules

    extra = {}
    if outcome == "oom":
        try:
            extra = backend.on_oom_extra(config.artifact_dir)
        except Exception as exc:
            print(f"oomdoc: could not save PyTorch's memory snapshot: {exc}", file=sys.stderr)

    steps = tracker.steps
    peak_step = max(steps, key=lambda s: s["peak_allocated_bytes"], default=None)
    outside_allocated, outside_reserved, outside_phase = tracker.peak_outside_steps
    peak_allocated = max(
        [s["peak_allocated_bytes"] for s in steps] + [oom["allocated_bytes"] if oom else 0]
    )
    if outside_allocated > peak_allocated:
        # Held outside every step (e.g. a script without a training loop).
        peak_allocated, peak_step = outside_allocated, None
    capture = {
        "torch_version": torch.__version__,
        "device": backend.device_info(),
        "host": _host_memory(),
        "outcome": outcome,
        "exit_code": int(exit_code),
        "error": error if outcome == "error" else None,
        "step_unit": tracker.unit,
        "oom": oom,
        "breakdown": breakdown,
        "breakdown_at": breakdown_at,
        "category_peaks": dict(tracker.category_peaks),
        "peak": {
            "allocated_bytes": int(peak_allocated),
            "reserved_bytes": int(
                max(
                    [s["peak_reserved_bytes"] for s in steps]
                    + [oom["reserved_bytes"] if oom else 0, outside_reserved]
                )
            ),
            "step": peak_step["index"] if peak_step else None,
            "phase": peak_step["peak_phase"] if peak_step else outside_phase,
        },
        "steps": steps,
        # Steps closed but not kept (oomdoc.capture.step_records).
        "steps_omitted": max(0, tracker.step_index - len(steps)),
        "top_allocations": top,
        # Bytes per module and category where the breakdown was taken (oomdoc.capture.modules).
        "modules": modules,
        "allocator": allocator,
        "optimizers": sorted(tracker.optimizer_classes),
        "models": tracker.models,
        "artifacts": extra,
        "capture_stats": tracker.capture_stats(),
        # Heavy packages the script imported: warm children import them (oomdoc.capture.imports).
        "imported_packages": tracker.imported_packages,
        # DataLoaders whose batch size the smaller-batch fix could change; their workers.
        "dataloader_batch_sizes": tracker.dataloader_batch_sizes,
        "dataloader_workers": tracker.dataloader_workers,
        # oomdoc check: the num_workers of DataLoaders made to load in-process.
        "dataloader_workers_removed": tracker.dataloader_workers_removed,
        **framework_keys(tracker),
    }
    if tracker.spawned_ranks:
        capture["spawned_ranks"] = tracker.spawned_ranks
    if tracker.uncaptured_processes:
        capture["uncaptured_processes"] = tracker.uncaptured_processes
    if tracker.parallel_capture is not None:
        capture.update(tracker.parallel_capture.fields())  # oomdoc.distributed
    if timings:
        capture["timings"] = timing_summary(timings)
    if whole_run is not None:
        # How a replay ordered and cut its DataLoaders (oomdoc.capture.whole_run).
        capture["data_loaders"] = whole_run.fields()
    if config.fix:  # what the replayed fix changed (Fix.apply)
        capture["fix_applied"] = getattr(tracker, "fix_applied", None)
    capture["files_written"] = replay_writes.fields()
    write_atomic(config.result_path, dumps(capture), overwrite=True)


def main() -> None:
    global _STARTED, _FORKED
    imported_at = time.time()
    try:
        _STARTED = float(os.environ.pop(STARTED_ENV))
    except (KeyError, ValueError):
        _STARTED = None
    descriptor = os.environ.pop(CONFIG_FD_ENV, None)
    server = os.environ.pop(ZYGOTE_FD_ENV, None)
    preimported = None
    if server is not None or descriptor is not None:  # a fork, or a warm child
        try:
            if server is not None:
                from oomdoc.capture.zygote import serve

                config_path, imported_at, preimported, _STARTED = serve(int(server))
                _FORKED = True
            else:
                config_path, imported_at, preimported = wait_for_work(int(descriptor or 0))
        except KeyboardInterrupt:  # Ctrl-C before the script started: no capture
            sys.exit(130)
        if config_path is None:
            sys.exit(0)
    else:
        config_path = os.environ.pop(CONFIG_ENV, None)
        wait = os.environ.pop(CONFIG_WAIT_ENV, None)
        if config_path and wait is not None:
            try:
                has_work, imported_at, preimported = wait_for_config_file(config_path, wait)
            except KeyboardInterrupt:
                sys.exit(130)
            if not has_work:
                sys.exit(0)
    if not config_path:
        print("oomdoc: the capture child needs $OOMDOC_CHILD_CONFIG", file=sys.stderr)
        sys.exit(2)
    with open(config_path, encoding="utf-8") as handle:
        config = ChildConfig.from_json(handle.read())
    sys.exit(run(config, imported_at, preimported))


if __name__ == "__main__":
    main()
