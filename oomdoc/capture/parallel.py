"""Inside a capture child: what a data-parallel run adds to its capture.

Every child records the data-parallel wrappers its script calls
(`nn.DataParallel`, DistributedDataParallel with its bucket settings and,
when DDP says, its gradient bucket sizes). A child that is one rank of a
torchrun job (the configuration has `distributed`) also:

* writes its capture to a path with its rank in it, from the RANK and
  LOCAL_RANK that torchrun sets, and picks its GPU (LOCAL_RANK) before the
  device backend is made;
* stamps the OOM with the wall-clock time, so the job can tell which rank ran
  out of memory first;
* says where it was waiting when it was stopped: the user's innermost frame
  and the collective (`all_reduce`, ...) it was blocked in. A rank blocked in
  a collective sits in C++ (gloo, NCCL) where Python signal handlers do not
  run, so a watcher thread, woken through `signal.set_wakeup_fd`, reads the
  main thread's stack at the signal and, when the main thread does not come
  back to Python within a grace period, writes the capture itself and exits.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from oomdoc import frames
from oomdoc.capture.backend_base import Backend
from oomdoc.child_config import ChildConfig

if TYPE_CHECKING:
    from oomdoc.capture.tracker import Tracker

# After SIGTERM/SIGINT, how long the main thread has to reach its own handler
# (and write the capture) before the watcher writes it.
WATCHER_GRACE_S = 1.0
_DISTRIBUTED_DIR = os.path.join(os.path.dirname(torch.__file__), "distributed") + os.sep
# Frames of torch.distributed that are wrappers, not the collective itself.
_WRAPPER_FUNCTIONS = {"wrapper", "_wrapper", "inner", "__call__"}


def rank_environment() -> dict:
    """This process's place in the job, from torchrun's environment."""

    def integer(name: str, default=None):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return default

    local_rank = integer("LOCAL_RANK", 0)
    node_rank = integer("GROUP_RANK", integer("NODE_RANK"))
    return {
        # Lightning's launcher sets LOCAL_RANK and NODE_RANK, not RANK.
        "rank": integer("RANK", local_rank if not node_rank else None),
        "local_rank": local_rank,
        "world_size": integer("WORLD_SIZE", 1),
        "local_world_size": integer("LOCAL_WORLD_SIZE", 1),
        "node_rank": node_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def fill_rank(text: str, rank: dict) -> str:
    """A path of the job's configuration with this rank's numbers in it."""
    return text.replace("{rank}", str(rank["rank"])).replace(
        "{local_rank}", str(rank["local_rank"])
    )


def waiting_location(stack: list[tuple[str, Any, str]]) -> dict | None:
    """From a stack (outermost first, as (file, line, function)), the user's
    innermost frame and the torch.distributed collective below it, if any."""
    collective = None
    user = None
    for filename, line, function in reversed(stack):
        if (
            collective is None
            and user is None
            and os.path.realpath(filename).startswith(_DISTRIBUTED_DIR)
            and function not in _WRAPPER_FUNCTIONS
            and not function.startswith("_")
        ):
            collective = function
        if user is None and frames.is_user_file(filename):
            user = frames.location_dict(filename, line, function)
            break
    if user is None and collective is None:
        return None
    return {**(user or {"file": None, "line": None, "function": None}), "collective": collective}


def stack_of_frame(frame) -> list[tuple[str, Any, str]]:
    return [(f.filename, f.lineno, f.name) for f in traceback.extract_stack(frame)]


def stack_of_exception(exc: BaseException) -> list[tuple[str, Any, str]]:
    return [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]


class ParallelCapture:
    """Data-parallel wrappers seen, and the rank-aware parts of a child."""

    def __init__(self, config: ChildConfig, rank: dict | None = None):
        """`rank`: this process's place in the job when no launcher's
        environment says it (a `torch.multiprocessing.spawn` child)."""
        self.config = config
        self.distributed = config.distributed is not None
        self.rank: dict[str, Any] = (rank or rank_environment()) if self.distributed else {}
        self.data_parallel: list[dict] = []
        self.ddp_modules: list = []
        self.oom_time: float | None = None
        self.ended_at: float | None = None
        self.waiting_at: dict | None = None
        self.signal_name: str | None = None
        self._claimed = threading.Lock()
        self._waiting_lock = threading.Lock()
        self._owner: str | None = None
        self._writer: Any = None
        self._backend: Backend | None = None
        self._main_ident = threading.main_thread().ident
        if config.distributed is not None:
            config.result_path = fill_rank(config.result_path, self.rank)
            if config.artifact_dir:
                config.artifact_dir = fill_rank(config.artifact_dir, self.rank)
                os.makedirs(config.artifact_dir, exist_ok=True)
            started = config.distributed.started_path
            if started:
                # The parent ends a job that does not end by itself by these pids.
                with open(fill_rank(started, self.rank), "w", encoding="utf-8") as handle:
                    handle.write(f"{os.getpid()}\n")
            if config.device != "cpu" and torch.cuda.is_available():
                torch.cuda.set_device(self.rank["local_rank"] % torch.cuda.device_count())

    # ------------------------------------------------------------ install
    def install(
        self, tracker: Tracker, backend: Backend, writer: Callable[[str, int], None]
    ) -> None:
        """`writer(outcome, exit_code)` writes the capture (used by the
        watcher when the main thread is stuck in a collective)."""
        tracker.parallel_capture = self
        tracker.forward_start_callbacks.append(self._on_model_call)
        self._backend = backend
        self._writer = writer
        if not self.distributed:
            return
        on_oom = tracker.on_oom

        def stamped(*args, **kwargs):
            if self.oom_time is None:
                self.oom_time = time.time()
            return on_oom(*args, **kwargs)

        # Wrapped on this tracker only (as the framework detector does).
        tracker.on_oom = stamped  # type: ignore[method-assign]
        self._start_watcher()

    def _on_model_call(self, module) -> None:
        try:
            self._record_wrapper(module)
        except Exception:  # never a reason for the script to fail
            pass

    def _record_wrapper(self, module) -> None:
        if isinstance(module, nn.DataParallel):
            if not any(entry.get("_id") == id(module) for entry in self.data_parallel):
                self.data_parallel.append(
                    {
                        "_id": id(module),
                        "class": type(module.module).__name__,
                        # Without GPUs DataParallel has neither attribute.
                        "device_ids": [int(i) for i in getattr(module, "device_ids", None) or []],
                        "output_device": _int_or_none(getattr(module, "output_device", None)),
                    }
                )
        ddp_class = getattr(nn.parallel, "DistributedDataParallel", None)
        if ddp_class is not None and isinstance(module, ddp_class):
            if not any(existing is module for existing in self.ddp_modules):
                self.ddp_modules.append(module)

    # ------------------------------------------------------------ signals
    def _start_watcher(self) -> None:
        try:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return  # not the main thread, or no pipes: the Python handlers only
        thread = threading.Thread(
            target=self._watch, args=(read_fd,), name="oomdoc-signal-watcher", daemon=True
        )
        thread.start()

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 16)
            except OSError:
                return
            if not data:
                return
            numbers = [b for b in data if b in (signal.SIGTERM, signal.SIGINT)]
            if not numbers:
                continue
            number = numbers[0]
            if self.signal_name is None:
                self.signal_name = signal.Signals(number).name
                frame = sys._current_frames().get(self._main_ident or 0)
                if frame is not None:
                    # The main thread may have left the script's frames by now
                    # (its own handler ran): then its traceback says where.
                    self._note_waiting(waiting_location(stack_of_frame(frame)))
            time.sleep(WATCHER_GRACE_S)
            if not self.claim("watcher"):
                return  # the main thread is writing the capture
            exit_code = 130 if number == signal.SIGINT else 143
            try:
                if self._backend is not None:
                    self._backend.stop_counting()
                # The device may never finish a collective whose peer died:
                # the step's closing synchronize must not wait for it.
                torch.cuda.synchronize = lambda *args, **kwargs: None
                self.ended_at = time.time()
                self._writer("interrupted", exit_code)
                print(
                    f"oomdoc: rank {self.rank['rank']} stopped by {self.signal_name} while "
                    f"{describe_waiting(self.waiting_at)}",
                    file=sys.stderr,
                    flush=True,
                )
            finally:
                os._exit(exit_code)

    def _note_waiting(self, location: dict | None) -> None:
        """Where the main thread was stopped: the first place found wins, and
        the watcher thread and the main thread may both look, concurrently;
        except that a place in the script's own code fills in a first one
        that had only the collective (a stack caught outside the script's
        frames: once in the clean-clone CI, rank 1 was "waiting in
        all_reduce" at no line)."""
        with self._waiting_lock:
            current = self.waiting_at
            if location is None:
                return
            if current is None:
                self.waiting_at = location
            elif current.get("file") is None and location.get("file") is not None:
                collective = location.get("collective") or current.get("collective")
                self.waiting_at = {**location, "collective": collective}

    def note_failure(self, failure: BaseException) -> None:
        """Where the exception that ended the script stopped it: the
        collective it waited in, from it or from an exception it interrupted
        (a SIGTERM from the launcher often lands while a peer's death is
        being raised, or as the script ends: that Terminated then has no
        frame of the script), else where a signal stopped it."""
        if self.waiting_at is not None and self.waiting_at.get("file") is not None:
            return
        stopped = not isinstance(failure, Exception)  # KeyboardInterrupt, SIGTERM
        first = None
        for exception in frames.exception_chain(failure, limit=8):
            location = waiting_location(stack_of_exception(exception))
            if location is not None and location.get("collective"):
                self._note_waiting(location)
                if location.get("file") is not None:
                    return
            elif location is not None:
                first = first or location
        if first is not None and (stopped or self.waiting_at is not None):
            self._note_waiting(first)  # (fills in the file of a collective noted without one)

    def claim(self, owner: str) -> bool:
        """Only one thread writes the capture: the first to claim it."""
        with self._claimed:
            if self._owner is None:
                self._owner = owner
            return self._owner == owner

    # ------------------------------------------------------------ the end
    def finish(self) -> None:
        """The script ended (its failure was noted by note_failure). Blocks
        forever when the watcher thread is writing the capture (it exits the
        process)."""
        if self.ended_at is None:
            self.ended_at = time.time()
        if self.distributed and not self.claim("main"):
            while True:
                time.sleep(3600)

    def fields(self) -> dict:
        """What this adds to the capture."""
        fields: dict = {}
        parallel = {}
        if self.data_parallel:
            parallel["data_parallel"] = [
                {k: v for k, v in entry.items() if k != "_id"} for entry in self.data_parallel
            ]
        if self.ddp_modules:
            parallel["ddp"] = [ddp_record(module) for module in self.ddp_modules]
        if parallel:
            fields["parallel"] = parallel
        if not self.distributed:
            return fields
        rank = dict(self.rank)
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank["backend"] = str(dist.get_backend())
        except Exception:
            pass
        fields["rank"] = rank
        fields["ended_at"] = self.ended_at
        fields["oom_time"] = self.oom_time
        fields["waiting_at"] = self.waiting_at
        if self.signal_name:
            fields["stopped_by"] = self.signal_name
        return fields


def ddp_record(module) -> dict:
    """A DDP module's bucket settings and, when DDP reports them, its buckets.

    DDP copies each gradient into a flat bucket for the all-reduce; unless
    `gradient_as_bucket_view=True`, the gradients and the buckets are two
    copies of the same bytes."""
    cap = getattr(module, "bucket_bytes_cap", None)
    config = getattr(module, "_bucket_config", None)
    if cap is None and config is not None:
        cap = getattr(config, "bucket_bytes_cap", None)
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    record = {
        "class": type(getattr(module, "module", module)).__name__,
        "bucket_cap_bytes": _int_or_none(cap),
        "gradient_as_bucket_view": bool(getattr(module, "gradient_as_bucket_view", False)),
        "find_unused_parameters": bool(getattr(module, "find_unused_parameters", False)),
        "static_graph": bool(getattr(module, "static_graph", False)),
        "trainable_parameter_bytes": int(trainable),
        "bucket_sizes_bytes": None,
    }
    try:
        data = module._get_ddp_logging_data()
        sizes = [int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s.strip()]
        if sizes:
            record["bucket_sizes_bytes"] = sizes
    except Exception:
        pass
    return record


def describe_waiting(waiting_at: dict | None) -> str:
    if not waiting_at:
        return "at an unknown place"
    where = (
        f"{waiting_at.get('file')}:{waiting_at.get('line')} in {waiting_at.get('function')}"
        if waiting_at.get("file")
        else "outside the script's own code"
    )
    collective = waiting_at.get("collective")
    return f"waiting in {collective} at {where}" if collective else f"at {where}"


def _int_or_none(value):
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
