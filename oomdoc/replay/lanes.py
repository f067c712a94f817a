"""Replays side by side: how many at once, whether their device work may
overlap, and the threads that run them.

Most of a replay's time is spent before the device: starting Python,
importing the framework, building the model on the CPU (on the H100, ~10 s
of a GPT-2-medium Trainer replay, against ~2 s on the GPU). Replays that do
not depend on each other (the single fixes, beside the batch search's chain
of probes) run side by side in `jobs` lanes, while the device lock
(oomdoc.capture.gate) keeps each measurement as clean as when it runs
alone: their device work one at a time, or, when the card has room for
every lane's capped process at once (room_to_share), only their timed steps.

The decisions stay sequential: the orchestrator asks for one replay at a
time, as it always did, and gets the answer of a replay started ahead of
time when there is one. One lane is kept for what it asks for, so the
critical chain never waits behind work started ahead.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
from typing import Any, Callable

from oomdoc.capture import nvml_handle
from oomdoc.warm import host_cpus

# Lanes at most by default: beyond them the device, which replays take in
# turn, is the bottleneck. Four: on the H100 the HF Trainer's first replays
# are the batch search's probe, autocast, checkpointing and the two together,
# and a probe started ahead beside the search's next one (search.BatchProbes)
# takes the lane the combination had; 3 and 4 lanes measured alike before
# (54.6 s and 52.8 s).
MAX_JOBS = 4
# Priorities: what the decisions wait for now, replays they will ask for,
# and replays they may ask for.
DEMANDED, AHEAD, SPECULATIVE = 0, 1, 2


def default_jobs(
    device_kind: str,
    cpus: int | None = None,
    available_bytes: int | None = None,
    child_bytes: int | None = None,
    workers: int = 0,
) -> int:
    """Lanes for this machine. On CUDA a replay's device work leaves the CPU
    to the others: one lane per core beyond the first. On the simulated
    device the device work is CPU work too: one lane per four cores. A
    script's DataLoader `workers` take a core each beside it, in every
    replay: a replay timing its steps must have the cores the user's run
    has, or its steps wait for the CPU (pytorch/examples' ImageNet trainer
    with 8 workers, 4 lanes on 16 cores of the H200: autocast at 256 timed
    0.213 s a step beside three others, 0.111 s beside two, and was not
    prescribed). Each lane holds a running child and a warm one: together at
    most three quarters of the host memory available, at the failing run's
    size (`child_bytes`)."""
    if cpus is None:
        cpus = host_cpus()
    by_cpu = cpus - 1 if device_kind == "cuda" else cpus // 4
    jobs = max(1, min(MAX_JOBS, by_cpu // (1 + max(0, workers))))
    if available_bytes and child_bytes and child_bytes > 0:
        jobs = max(1, min(jobs, int(0.75 * available_bytes) // (2 * child_bytes)))
    return jobs


# What a CUDA process holds on the card beyond the capacity its allocator is
# capped to: its context (kernels, cuBLAS and cuDNN handles), about 0.5 GiB
# on an H100 under torch 2.x; counted with room to spare.
CUDA_CONTEXT_BYTES = 1536 * 1024 * 1024
# `OOMDOC_REPLAY_OVERLAP=0`: replays side by side never overlap device work.
OVERLAP_ENV = "OOMDOC_REPLAY_OVERLAP"


def room_to_share(
    jobs: int, capacity_bytes: int | None, free_bytes: int | None, per_process_bytes: int
) -> bool:
    """Whether `jobs` processes, each capped at `capacity_bytes` and holding
    `per_process_bytes` besides, fit in `free_bytes` all at once: then their
    peaks do not depend on each other, and their untimed device work may
    overlap. Never without a cap (a process may take the whole card) or when
    what is free is unknown, nor when it is turned off (OVERLAP_ENV)."""
    if jobs < 2 or not capacity_bytes or free_bytes is None:
        return False
    if os.environ.get(OVERLAP_ENV, "1").strip() == "0":
        return False
    return free_bytes >= jobs * (capacity_bytes + per_process_bytes)


def cuda_free_bytes(device_index: int = 0) -> int | None:
    """What NVML says is free now on the GPU CUDA calls `device_index` here
    (torch-free: the parent asks), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(nvml_handle(pynvml, device_index)).free)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def host_available_bytes() -> int | None:
    """Host memory available now: the simulated device's memory is the host's."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


class Job:
    """One replay to run in a lane; `wait()` returns what its work returned
    (None when it was cancelled before it started)."""

    def __init__(self, work: Callable[[Job], Any], priority: int):
        self.work = work
        self.priority = priority
        self.cancel = threading.Event()
        self.finished = threading.Event()
        self.started = False
        # Running in a lane as work started ahead (Lanes counts those).
        self.running_ahead = False
        # Its place among the jobs its lanes started (1, 2, ...), or None.
        self.number: int | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        self.started = True
        try:
            self.result = self.work(self)
        except BaseException as exc:  # handed to whoever waits for it
            self.error = exc
        finally:
            self.finished.set()

    def wait(self) -> Any:
        self.finished.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Lanes:
    """`count` threads that run jobs, the highest priority first; jobs
    started ahead (priority above DEMANDED) use at most count - 1 of them."""

    def __init__(self, count: int):
        self.count = count
        self._pending: list[tuple[int, int, Job]] = []
        self._order = itertools.count()
        self._numbers = itertools.count(1)
        self._condition = threading.Condition()
        self._closed = False
        self._running_ahead = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"oomdoc-replay-lane-{n}", daemon=True)
            for n in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> None:
        with self._condition:
            if self._closed:
                job.finished.set()
                return
            heapq.heappush(self._pending, (job.priority, next(self._order), job))
            self._condition.notify_all()

    def promote(self, job: Job, priority: int) -> None:
        """Now wanted sooner (a job started ahead that the decisions ask for).
        One already running ahead that is now DEMANDED holds a lane of what
        the decisions wait for: it no longer counts against the lanes kept
        for work started ahead, which may start one more."""
        with self._condition:
            if job.running_ahead and priority == DEMANDED:
                job.running_ahead = False
                self._running_ahead -= 1
                self._condition.notify_all()
                return
            for index, (_priority, order, pending) in enumerate(self._pending):
                if pending is job and priority < job.priority:
                    job.priority = priority
                    self._pending[index] = (priority, order, job)
                    heapq.heapify(self._pending)
                    self._condition.notify_all()
                    return

    def withdraw(self, job: Job) -> bool:
        """Drop a job that has not started (True), so that it never runs."""
        with self._condition:
            for index, (_priority, _order, pending) in enumerate(self._pending):
                if pending is job:
                    del self._pending[index]
                    heapq.heapify(self._pending)
                    job.finished.set()
                    return True
        return False

    def withdraw_all(self) -> None:
        with self._condition:
            for _priority, _order, job in self._pending:
                job.finished.set()
            self._pending.clear()

    def close(self) -> None:
        """Run nothing more; wait for the jobs running (the caller cancels them)."""
        self.withdraw_all()
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        for thread in self._threads:
            thread.join()

    def _next(self) -> Job | None:
        with self._condition:
            while True:
                if self._pending:
                    priority = self._pending[0][0]
                    if priority == DEMANDED or self._running_ahead < self.count - 1:
                        job = heapq.heappop(self._pending)[2]
                        job.number = next(self._numbers)  # in the order they start
                        if priority != DEMANDED:
                            self._running_ahead += 1
                            job.running_ahead = True
                        return job
                if self._closed:
                    return None
                self._condition.wait()

    def _serve(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                job.run()
            finally:
                with self._condition:
                    if job.running_ahead:
                        job.running_ahead = False
                        self._running_ahead -= 1
                    self._condition.notify_all()
