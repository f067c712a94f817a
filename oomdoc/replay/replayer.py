"""Running one replay in a fresh child process, and reading its result.

Each replay runs the same script with the same arguments on the same device
and capacity, with one fix applied from the start, until the failing step has
completed and at least two full steps have run (the optimizer creates its
state in the first step, so the second usually peaks higher), then the
tracker stops it cleanly. Replays set OOMDOC_REPLAY=1 so that a script can
skip side effects, and send the script's output to a log. Several may run
side by side (oomdoc.replay.lanes); this module knows no fix by name.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from oomdoc.model import (
    Snapshot,
)
from oomdoc.replay import batch as batch_model
from oomdoc.replay.lanes import (
    AHEAD,
    CUDA_CONTEXT_BYTES,
    DEMANDED,
    SPECULATIVE,
    Job,
    Lanes,
    cuda_free_bytes,
    default_jobs,
    host_available_bytes,
    room_to_share,
)
from oomdoc.replay.leaks import StillLeaks, leak_growth_per_step, still_leaks
from oomdoc.replay.progress import Progress
from oomdoc.replay.timing import step_timing, timed_steps
from oomdoc.runner import (
    ChildRequest,
    ChildResult,
    ChildSignals,
    WarmPool,
    guess_device_kind,
    run_child,
)
from oomdoc.sizes import format_bytes
from oomdoc.warm import script_preimports, spares_for

MIN_REPLAY_TIMEOUT_S = 120.0


# Under a leak, replays run this many steps: enough to see whether memory
# still grows per step (and by how much: oomdoc.replay.leaks needs
# MIN_DELTAS + 2), far fewer than the failing run.
LEAK_REPLAY_STEPS = 6
# Steps a replay runs at least. On CUDA with an optimizer: its state is made
# in the first step's optimizer.step, and two more steps run with it
# allocated, so that a configuration that fits only until the caching
# allocator's blocks have settled (after an evaluation, say) is not called
# fitting: a GPT trainer's prescription fitted two steps and ran out of memory
# in the third, with 4.45 GiB reserved but unallocated, on the H100. The
# simulated device has no caching allocator: two steps (the second with the
# optimizer's state) show what a third would. On CUDA a fourth step costs
# little beside a replay's start-up and makes three timed steps (the first is
# never timed): a median, and a spread to judge it by (oomdoc.replay.timing).
REPLAY_STEPS = 2
OPTIMIZER_REPLAY_STEPS = 4
# Replays that share the device run this many steps sharing it before the
# ones they time, and one step more. With only the first shared, a replay
# near the limit that runs out of memory in its second step, once the
# optimizer's state is there, first waited for the device alone: on the H200
# the Lightning encoder's six such replays waited 17.6 s in all (up to 5.4 s
# each), and their turns held up the replays whose step times were used.
SHARED_STEPS = 2


# Every replay's environment: scripts may skip side effects under
# OOMDOC_REPLAY=1; a replay needs peaks and step times, not allocation sites,
# and without the allocator's history (and the _snapshot() calls it feeds)
# each CUDA replay starts and runs faster; its module scopes run in its first
# training step only (oomdoc.capture.stack_recording.FirstStepDetail), so
# that its timed steps carry the same little capture whatever the fix.
REPLAY_ENV = {
    "OOMDOC_REPLAY": "1",
    "OOMDOC_ALLOCATION_HISTORY": "0",
    "OOMDOC_MODULE_SCOPES": "first-step",
}


@dataclass
class Replay:
    """One replay's outcome, measured."""

    label: str
    # fits | oom | timeout | error | grows (ran its steps without an OOM, but
    # still leaks: oomdoc.replay.leaks; `leaks` says how)
    outcome: str
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    step_s: float | None = None
    # How far its timed steps were apart (oomdoc.replay.timing.StepTiming.noise).
    step_noise: float | None = None
    wall_s: float = 0.0
    capture: Optional[Snapshot] = None
    message: str = ""
    log_path: str | None = None
    # What the child recorded of the fixes it applied: {fix name: record}.
    applied: dict = field(default_factory=dict)
    warm: bool = False
    fix_name: str = ""
    # When it started, in seconds since the replays began (side by side,
    # several overlap), and how long it waited for the device lock.
    started_s: float = 0.0
    lock_wait_s: float = 0.0
    # Ctrl-C or SIGTERM ended it; or oomdoc stopped it, its answer unneeded.
    stopped_by_user: bool = False
    cancelled: bool = False
    # Run a second time, with the device to itself throughout, because its
    # step time came from a step timed while other replays shared the device.
    timed_again_alone: bool = False
    # Ran its steps without an OOM but still leaks (outcome `grows`): how.
    leaks: Optional[StillLeaks] = None
    # The script's arguments it ran with (after the settler's rewrite): what
    # an evaluation batch chosen while it ran would change.
    args: Optional[list[str]] = None

    def timing(self) -> dict:
        """Where the replay's time went, for the snapshot's replay summary."""
        timings = (self.capture.timings if self.capture else None) or {}
        return {
            "label": self.label,
            "outcome": self.outcome,
            "wall_s": round(self.wall_s, 2),
            "warm": self.warm,
            "started_s": round(self.started_s, 2),
            "peak_allocated_bytes": self.peak_allocated_bytes,
            **({"timed_again_alone": True} if self.timed_again_alone else {}),
            **self.timed_steps(),
            **self.step_durations(),
            **timings,
        }

    def step_durations(self) -> dict:
        """Every step's duration, the untimed first ones too: where a
        replay's time goes beside its start-up (benchmarks/diagnosis_timeline.py)."""
        steps = self.capture.steps if self.capture is not None else []
        durations = [round(float(s.duration_s), 3) for s in steps if s.duration_s is not None]
        waits = [round(float(s.cpu_wait_s), 3) for s in steps if s.cpu_wait_s is not None]
        return {
            **({"steps_s": durations} if durations else {}),
            **({"steps_cpu_wait_s": waits} if waits else {}),
        }

    def timed_steps(self) -> dict:
        """The step time decided on and the durations it came from, so that
        a timing's noise can be read from the snapshot (which step was
        slow), not only its summary."""
        if self.step_s is None or self.capture is None:
            return {}
        durations = [
            round(float(step.duration_s), 4)
            for step in timed_steps(self.capture.steps)
            if step.duration_s is not None
        ]
        return {
            "step_s": round(self.step_s, 4),
            "step_noise": self.step_noise,
            "timed_steps_s": durations,
        }

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"

    @property
    def ran(self) -> bool:
        """It ran its steps or ran out of memory: it measured the fix."""
        return self.outcome in ("fits", "oom", "grows")

    @property
    def interrupted(self) -> bool:
        return self.capture is not None and self.capture.outcome == "interrupted"


# Runs one replay's child instead of oomdoc.runner.run_child, for a run that
# a launcher started: oomdoc.distributed passes its own, so that replays keep
# the job's launcher and world size (replay imports nothing of distributed).
Launch = Callable[[ChildRequest], ChildResult]


class ReplaysInterrupted(Exception):
    """Ctrl-C reached a replay: stop replaying, keep what was measured."""


def replay_key(
    payload: Optional[dict],
    label: str,
    args: list[str] | None,
    extra_env: dict | None,
    micro_batches_per_step: int | None = None,
    timed: bool = True,
) -> tuple:
    """What makes two asks for a replay the same replay (one run untimed
    never answers an ask for step times)."""
    return (
        label,
        json.dumps(payload, sort_keys=True),
        None if args is None else tuple(args),
        tuple(sorted((extra_env or {}).items())),
        micro_batches_per_step,
        timed,
    )


class ReplaySettler(Protocol):
    """What may change every replay once one has shown it
    (oomdoc.replay.evaluation_batch.EvaluationApart)."""

    def rewrite(self, args: list[str]) -> list[str]: ...

    def arm(self) -> None: ...

    def settle(
        self,
        replayer: Replayer,
        replay: Replay,
        payload: Optional[dict],
        label: str,
        args: Optional[list[str]],
        extra_env: Optional[dict],
        micro_batches_per_step: Optional[int],
    ) -> Replay: ...


class Replayer:
    """Runs replays like the failing run, with a fix, and measures them.

    `run` is how the decisions ask for a replay, one at a time, as if each
    ran alone. With `jobs` > 1, `ahead` starts replays the decisions will (or
    may) ask for in other lanes (oomdoc.replay.lanes); `run` then waits for
    that one instead of starting another. Replays that run side by side take
    the device in turn (the device lock, oomdoc.capture.gate): all their
    device work, or, when the device has room for all of them
    (device_has_room), only their timed steps."""

    def __init__(
        self,
        snapshot: Snapshot,
        options: Any,
        request: ChildRequest,
        progress: Progress,
        pool: WarmPool,
        leak: bool = False,
        jobs: int = 1,
        signals: ChildSignals | None = None,
        launch: Launch | None = None,
    ):
        self.snapshot = snapshot
        self.launch = launch
        self.options = options
        self.request = request
        self.progress = progress
        self.pool = pool
        self.failing_step = (snapshot.oom.step if snapshot.oom else None) or 0
        self.step_unit = snapshot.step_unit
        # An OOM in evaluation: replays run until that evaluation pass has
        # ended, wherever a smaller batch moves it (not a step count).
        oom = snapshot.oom
        self.stop_after_evaluation = (
            oom.evaluation_pass if oom is not None and oom.in_evaluation else None
        )
        settles = self.step_unit == "optimizer" and snapshot.device.on_cuda
        least = OPTIMIZER_REPLAY_STEPS if settles else REPLAY_STEPS
        self.max_steps = max(self.failing_step + 1, least)
        if leak:
            self.max_steps = LEAK_REPLAY_STEPS
        if options.max_steps:
            self.max_steps = min(self.max_steps, max(options.max_steps, 1))
        self.leak = leak
        # The failing run's growth per step under a leak, which a replay
        # that still grows is judged against (oomdoc.replay.leaks).
        self.leak_per_step = leak_growth_per_step(snapshot) if leak else None
        self.timeout_s = options.replay_timeout_s or default_timeout(snapshot)
        self.replays: list[Replay] = []
        # Where the replays note the user's files before they change them
        # (oomdoc.kept_files), put back once they end (oomdoc.replay.written).
        self.kept_files = os.path.join(pool.log_dir, "kept")
        self.jobs = max(1, jobs)
        self.signals = signals
        self.lanes = Lanes(self.jobs) if self.jobs > 1 else None
        self.device_lock: str | None = None
        # True: their untimed device work overlaps (oomdoc.capture.gate).
        # Only when replays run more than one step: the first step's time
        # is then never the one used.
        self.share_device: bool | None = None
        if self.lanes is not None:
            self.device_lock = os.path.join(pool.log_dir, "device.lock")
            open(self.device_lock, "ab").close()
            if self.max_steps >= 2 and device_has_room(snapshot, request.capacity_bytes, self.jobs):
                self.share_device = True
        # Steps a replay sharing the device runs before those it times: its
        # first steady step too, where it runs a step more to time as many.
        self.shared_steps = 1
        if self.share_device and settles and not leak and not options.max_steps:
            self.shared_steps = SHARED_STEPS
            self.max_steps += SHARED_STEPS - 1
        # Replays started ahead, by replay_key, until the decisions ask for
        # them; those they never asked for (`discard_ahead`).
        self._ahead: dict[tuple, Job] = {}
        # Started ahead but not yet handed to the lanes: that happens once
        # the first replay the decisions ask for is, so that it gets the
        # warmest child and the first lane.
        self._unsubmitted: list[Job] = []
        self._discarded: list[tuple[str, Job]] = []
        # The replays the decisions have asked for (`run`), by replay_key.
        self._asked: set[tuple] = set()
        # The bookkeeping above, for decisions asking from several threads
        # (the savers' searches, search.SaverSearches); never held while waiting.
        self._lock = threading.RLock()
        self._interrupted = False
        self.settler: ReplaySettler | None = None

    @property
    def stopped(self) -> bool:
        """Ctrl-C or SIGTERM came: no replay starts any more."""
        return self._interrupted or (self.signals is not None and self.signals.stopped)

    def _job(
        self,
        payload,
        label,
        args,
        extra_env,
        priority: int,
        micro_batches_per_step=None,
        timed: bool = True,
    ) -> Job:
        return Job(
            lambda job: self._execute(
                job, payload, label, args, extra_env, micro_batches_per_step, timed
            ),
            priority,
        )

    def ahead(
        self,
        payload: Optional[dict],
        label: str,
        args: list[str] | None = None,
        extra_env: dict | None = None,
        priority: int = AHEAD,
        micro_batches_per_step: int | None = None,
        timed: bool = True,
    ) -> Optional[tuple]:
        """Start, in a free lane, a replay that `run` will (or, SPECULATIVE,
        may) be asked for with the same arguments; its key. Nothing without
        lanes."""
        key = replay_key(payload, label, args, extra_env, micro_batches_per_step, timed)
        if self.lanes is None or self.stopped:
            return None
        with self._lock:
            if key not in self._ahead:
                job = self._job(
                    payload, label, args, extra_env, priority, micro_batches_per_step, timed
                )
                self._ahead[key] = job
                self._unsubmitted.append(job)
        return key

    def speculate(
        self,
        payload: Optional[dict],
        label: str,
        args: list[str] | None = None,
        extra_env: dict | None = None,
    ) -> Optional[tuple]:
        """`ahead` at SPECULATIVE, into a free lane at once once the decisions
        have asked for a replay (before, it waits for that with the others):
        for replays started beside the decisions (oomdoc.replay.early_trials)."""
        with self._lock:
            # One the decisions asked for already is never started again.
            if replay_key(payload, label, args, extra_env) in self._asked:
                return None
            key = self.ahead(payload, label, args=args, extra_env=extra_env, priority=SPECULATIVE)
            if self._asked:
                self._submit_waiting()
        return key

    def _submit_waiting(self) -> None:
        if self.lanes is not None:
            for waiting in self._unsubmitted:
                self.lanes.submit(waiting)
        self._unsubmitted.clear()

    def started_ahead(self, key: tuple) -> Optional[Job]:
        """The job of a replay started ahead and not yet asked for (None: no
        such replay, or taken): its answer can be read without asking for it."""
        with self._lock:
            return self._ahead.get(key)

    def run(
        self,
        payload: Optional[dict],
        label: str,
        args: list[str] | None = None,
        extra_env: dict | None = None,
        micro_batches_per_step: int | None = None,
        timed: bool = True,
    ) -> Replay:
        """The replay of these arguments: one started ahead, else run now.
        `timed=False`: its step times are never used (a check of a peak), so
        it never takes a shared device alone (ChildRequest.timed)."""
        key = replay_key(payload, label, args, extra_env, micro_batches_per_step, timed)
        with self._lock:
            self._asked.add(key)
            job = self._ahead.pop(key, None)
            if job is None:
                if self.stopped:
                    raise ReplaysInterrupted()
                job = self._job(
                    payload, label, args, extra_env, DEMANDED, micro_batches_per_step, timed
                )
                if self.lanes is not None:
                    self.lanes.submit(job)
            elif self.lanes is not None:
                if job in self._unsubmitted:
                    self._unsubmitted.remove(job)
                    job.priority = DEMANDED
                    self.lanes.submit(job)
                else:
                    self.lanes.promote(job, DEMANDED)
            self._submit_waiting()
        if self.lanes is None:
            job.run()
        replay = job.wait()
        if replay is None or replay.stopped_by_user or replay.cancelled:
            raise ReplaysInterrupted()  # it never ran, or Ctrl-C ended it
        if replay.outcome in ("timeout", "error"):
            replay.log_path = keep_log(replay.log_path or "", self.request.artifact_dir)
        with self._lock:
            self.replays.append(replay)
        if self.settler is not None:
            replay = self.settler.settle(
                self, replay, payload, label, args, extra_env, micro_batches_per_step
            )
        return replay

    def _execute(
        self,
        job: Job,
        payload: Optional[dict],
        label: str,
        args: list[str] | None,
        extra_env: dict | None,
        micro_batches_per_step: int | None = None,
        timed: bool = True,
    ) -> Optional[Replay]:
        """Run one replay's child (in a lane, or inline without lanes)."""
        if self.stopped or job.cancel.is_set():
            return None
        name = payload["name"] if payload else "flags"
        started_s = self.progress.total()
        number = self.progress.start(label, job.number)
        log_name = f"replay-{number}-{name.replace('+', '-')}.log"
        log_path = os.path.join(self.pool.log_dir, log_name)
        env = dict(REPLAY_ENV)
        env.update(extra_env or {})
        child_args = list(self.request.args if args is None else args)
        if self.settler is not None:
            child_args = self.settler.rewrite(child_args)
        child = ChildRequest(
            target=self.request.target,
            args=child_args,
            device=self.request.device,
            capacity_bytes=self.request.capacity_bytes,
            is_module=self.request.is_module,
            max_steps=self.max_steps,
            micro_batches_per_step=micro_batches_per_step,
            expected_unit=self.step_unit,
            stop_after_evaluation=self.stop_after_evaluation,
            whole_run=bool(getattr(self.options, "whole_run", True)),
            dataset_sizes=self.pool.log_dir,
            kept_files=self.kept_files,
            fix=payload,
            extra_env=env,
            output_path=log_path,
            timeout_s=self.timeout_s,
            device_lock=self.device_lock,
            share_device=self.share_device,
            shared_steps=self.shared_steps,
            timed=timed,
            quick_exit=True,
            quick_init=True,
        )
        result, replay = self._measure(child, job, label)
        if (
            replay.fits
            and timed
            and child.share_device  # as it ran (another lane may have stopped sharing)
            and not (self.stopped or job.cancel.is_set())
            and replay.capture is not None
            and batch_model.timed_on_a_shared_device(replay.capture.steps)
        ):
            # Its step time came from steps that other replays' device work
            # may have slowed (it ran a single step): timed again, alone. The
            # script's other replays are likely to stop as early: from now on
            # they keep the device to themselves from the start.
            child.share_device = self.share_device = False
            first_wall_s = replay.wall_s
            result, replay = self._measure(child, job, label)
            replay.wall_s += first_wall_s
            replay.timed_again_alone = True
        replay.fix_name = name
        replay.started_s = started_s
        replay.args = child_args
        if result.cancelled:
            replay.cancelled = True
            self.progress.finish("stopped: its answer was not needed", number)
        elif not result.timed_out and (
            result.exit_code == 130
            or replay.interrupted
            or (self.stopped and result.capture is None)
        ):
            replay.stopped_by_user = self._interrupted = True
            if self.lanes is not None:
                self.lanes.withdraw_all()
            self.progress.finish("interrupted", number)
        else:
            self.progress.finish(summarise(replay), number)
        return replay

    def _measure(self, child: ChildRequest, job: Job, label: str) -> tuple[ChildResult, Replay]:
        if self.launch is not None:  # e.g. a distributed job's launcher, with its world size
            result = self.launch(child)
        else:
            result = run_child(child, pool=self.pool, signals=self.signals, cancel=job.cancel)
        replay = measure(result, label, child.output_path or "", self.snapshot, self.leak_per_step)
        return result, replay

    def discard_ahead(self) -> None:
        """The decisions will ask for none of the replays started ahead that
        are left: those not started never start, those running are stopped."""
        with self._lock:
            self.discard(list(self._ahead))

    def discard(self, keys: list, keep_finished: bool = False) -> None:
        """The decisions will ask for none of these replays started ahead
        (keys from `ahead`; one already asked for, or never started, is
        passed over): as discard_ahead, for these only. `keep_finished`: a
        decision may still ask for them; those that have already run are
        kept (they cost nothing more), the others stopped."""
        with self._lock:
            for key in keys:
                job = self._ahead.get(key)
                if job is None or (keep_finished and job.finished.is_set()):
                    continue
                del self._ahead[key]
                job.cancel.set()
                if job in self._unsubmitted:
                    self._unsubmitted.remove(job)
                    continue
                if self.lanes is not None and self.lanes.withdraw(job):
                    continue
                self._discarded.append((key[0], job))

    def unused_runs(self) -> list[dict]:
        """The replays started ahead that no decision needed: their timings
        (`stopped` when oomdoc ended them early)."""
        runs = []
        for label, job in self._discarded:
            replay = job.result if job.finished.is_set() else None
            if isinstance(replay, Replay):
                record = replay.timing()
                if replay.cancelled:
                    record["outcome"] = "stopped"
                runs.append(record)
            else:
                runs.append({"label": label, "outcome": "stopped"})
        return runs

    def close(self) -> None:
        """Stop what still runs and wait for the lanes to end."""
        self.discard_ahead()
        if self.lanes is not None:
            self.lanes.close()


def warm_pool(request: ChildRequest, lanes: int = 1) -> WarmPool:
    """Warm children for the replays of `request`, starting now: one, or with
    `lanes` (early_lanes) one per lane and as many spares as the replays keep
    on a host with the cores for them (spares_for; replay_fixes sets the
    lanes the failing run leaves room for, and what they import ahead).

    The first replays that run out of memory in their first step end within
    seconds of each other, and the next ones (the batch search's second
    probe, the savers' second trials) then each need a child at once. On the
    H100 with one spare the HF Trainer's probe started beside the second
    waited 4.1 to 4.6 s for a child; on the H200 with two, the Lightning
    encoder's third such replay (checkpointing at 128, on the critical
    chain) waited 4.2 s. The failing run is not slowed by them: on the H200
    (2026-11-29) the Lightning encoder's, as a whole command, took 15.4 and
    14.8 s with six children importing beside it, 27.9 (a machine just
    started) and 12.9 s with none; the HF Trainer's script, to its OOM, 11.2
    and 11.4 s with them, 11.9 and 10.5 s without."""
    # The script's own imports, read from its file: the children import
    # them while the failing run still runs (the run's `imported_packages`
    # come when the replays begin).
    preimports = [] if request.is_module else script_preimports(request.target)
    pool = WarmPool(request.device, REPLAY_ENV, size=lanes, preimports=preimports)
    if lanes > 1:
        pool.ahead = spares_for(lanes)
    pool.fill()
    return pool


# What a warm child holds in host memory, for early_lanes (Python, torch and a
# framework imported: about 1 GiB for the HF Trainer's), with room to spare.
WARM_CHILD_BYTES = 2 * 1024**3


def early_lanes(device: str, replay_jobs: Optional[int] = None) -> int:
    """The lanes to start warm children for while the failing run runs, from
    what is known before it (`--replay-jobs`, the host's cores and memory).
    With only the first lane's child warm, the others' children started when
    the replays began: on the H100 the HF Trainer's first single fixes then
    waited 7.6 to 9.0 s for theirs, and the batch search's second probe 5.8
    to 6.5 s (a child's start-up and imports took 8 to 9 s, beside the
    replays). On CUDA they import beside a run whose work is on the device;
    on a machine of few cores (the simulated device's one lane per four
    cores) it stays one."""
    if replay_jobs:
        return max(1, int(replay_jobs))
    kind = "cuda" if device == "cuda" else guess_device_kind() if device == "auto" else device
    return default_jobs(kind, available_bytes=host_available_bytes(), child_bytes=WARM_CHILD_BYTES)


# Side by side on CUDA too: the deferred capture set-up they rely on (the
# memory cap and the allocator history start at CUDA's lazy initialisation,
# oomdoc.capture.gate) was checked on the H100 with 3 lanes: the largest
# batches (GPT 20, ResNet-50 192, GPT-2-medium Trainer 7, Lightning 24) and
# every peak matched the replays run one after another.
CUDA_SIDE_BY_SIDE_BY_DEFAULT = True


def device_has_room(snapshot: Snapshot, capacity_bytes: int | None, jobs: int) -> bool:
    """Whether the device has room for `jobs` replays capped at
    `capacity_bytes` at once (oomdoc.replay.lanes.room_to_share), read now:
    on CUDA from NVML (else what the failing run's NVML saw free, while it
    still held its own memory), on the simulated device from the host's
    available memory, each process also holding the failing run's resident size."""
    device = snapshot.device
    if device.kind == "cuda":
        free = cuda_free_bytes(device.index or 0)
        if free is None:
            free = device.nvml_free_bytes
        return room_to_share(jobs, capacity_bytes, free, CUDA_CONTEXT_BYTES)
    resident = snapshot.host.process_rss_bytes if snapshot.host else 0
    return room_to_share(jobs, capacity_bytes, host_available_bytes(), resident)


def replay_jobs(snapshot: Snapshot, options: Any) -> int:
    """How many replays may run side by side: `--replay-jobs`, else what this
    machine allows (oomdoc.replay.lanes.default_jobs). One for a distributed
    job, whose replays take every GPU of the failing run."""
    if getattr(options, "distributed", None) is not None:
        return 1
    requested = getattr(options, "replay_jobs", None)
    if requested:
        return int(requested)
    if snapshot.device.kind == "cuda" and not CUDA_SIDE_BY_SIDE_BY_DEFAULT:
        return 1
    host = snapshot.host
    return default_jobs(
        snapshot.device.kind,
        available_bytes=host.available_bytes if host else None,
        child_bytes=host.process_rss_bytes if host else None,
        workers=max(snapshot.dataloader_workers or [0]),
    )


def default_timeout(snapshot: Snapshot) -> float:
    """Generous: four times what the failing run's steps took, plus start-up."""
    spent = sum(step.duration_s or 0.0 for step in snapshot.steps)
    return max(MIN_REPLAY_TIMEOUT_S, 4 * (spent + 15))


def measure(
    result: ChildResult,
    label: str,
    log_path: str,
    failing: Optional[Snapshot] = None,
    leak_per_step: Optional[int] = None,
) -> Replay:
    """The replay's outcome from its child's result. One that ran its steps
    without an OOM fits unless it still leaks (oomdoc.replay.leaks, judged
    against the `failing` run and its leak's growth per step): it grows."""
    capture = Snapshot.from_dict(result.capture) if result.capture is not None else None
    replay = Replay(
        label=label,
        outcome="error",
        wall_s=result.wall_s,
        capture=capture,
        log_path=log_path,
        warm=result.warm,
        lock_wait_s=result.lock_wait_s,
    )
    if result.timed_out:
        replay.outcome = "timeout"
        # The wait for the device (replays side by side) does not count.
        replay.message = (
            f"killed after {result.wall_s - result.lock_wait_s:.0f} s (--replay-timeout)"
        )
        if result.lock_wait_s >= 1:
            replay.message += f", besides {result.lock_wait_s:.0f} s waiting for the device"
        return replay
    if capture is None:
        replay.message = f"the replay ended without a capture (exit status {result.exit_code})"
        return replay
    replay.applied = capture.fix_applied or {}
    caught = capture.ooms_seen
    if capture.outcome == "ok" and caught is not None and capture.caught_ooms:
        # The script caught it and went on (a batch-size finder): it did not fit.
        replay.outcome = "oom"
        replay.peak_allocated_bytes = caught.allocated_bytes + caught.requested_bytes
        replay.message = f"ran out of memory in step {caught.step} during {caught.phase}, caught"
    elif capture.outcome == "ok":
        peak = capture.peak
        replay.outcome = "fits"
        replay.peak_allocated_bytes = (peak.allocated_bytes if peak else None) or 0
        replay.peak_reserved_bytes = (peak.reserved_bytes if peak else None) or 0
        timing = step_timing(capture.steps)
        if timing is not None:
            replay.step_s, replay.step_noise = timing.step_s, timing.noise
        replay.leaks = still_leaks(capture, failing, leak_per_step) if failing else None
        if replay.leaks is not None:
            replay.outcome, replay.message = "grows", replay.leaks.text
    elif capture.outcome == "oom" and capture.oom is not None:
        oom = capture.oom
        replay.outcome = "oom"
        # What it needed when it failed: a lower bound of its peak.
        replay.peak_allocated_bytes = oom.needed_bytes
        replay.message = f"ran out of memory in step {oom.step} during {oom.phase}"
    else:
        error = capture.error
        kind = (error.type if error else None) or capture.outcome
        message = (error.message if error else None) or ""
        replay.message = f"{kind}: {message}".strip().rstrip(":")
    return replay


def summarise(replay: Replay) -> str:
    if replay.outcome == "fits":
        return f"fits, peak {format_bytes(replay.peak_allocated_bytes)}"
    if replay.outcome == "oom":
        return (
            f"out of memory{evaluation_oom(replay)} "
            f"(needs more than {format_bytes(replay.peak_allocated_bytes)})"
        )
    if replay.outcome == "grows":
        return f"still leaks, peak {format_bytes(replay.peak_allocated_bytes)} so far"
    if replay.outcome == "timeout":
        return "timed out"
    return f"failed: {replay.message[:120]}"


def evaluation_oom(replay: Replay) -> str:
    """' in the evaluation at batch N' when a replay ran out of memory in
    the script's evaluation after its training steps (a whole-run replay
    reaches it: a training batch alone does not decide such a replay)."""
    capture = replay.capture
    if capture is None or capture.oom is None or not capture.oom.in_evaluation:
        return ""
    batches = [
        loader.batch_size
        for loader in capture.data_loaders
        if loader.role == "evaluation" and loader.batch_size
    ]
    batch = f" at batch {max(batches)}" if batches else ""
    trained = sum(1 for step in capture.steps if step.optimizer_steps or step.backward_calls)
    after = f", after {trained} training step(s)" if trained else ""
    return f" in the evaluation{batch}{after}"


def keep_log(log_path: str, artifact_dir: str | None) -> str | None:
    """A replay that failed or hung keeps its output next to the snapshot."""
    if not artifact_dir or not os.path.exists(log_path):
        return None
    os.makedirs(artifact_dir, exist_ok=True)
    destination = os.path.join(artifact_dir, os.path.basename(log_path))
    shutil.copyfile(log_path, destination)
    return destination
