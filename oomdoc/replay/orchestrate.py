"""Replaying the failing step with fixes, in fresh child processes.

Each replay runs the same script with the same arguments on the same device
and capacity, with one fix applied from the start, until the failing step has
completed and at least two full steps have run (the optimizer creates its
state in the first step, so the second usually peaks higher), then the
tracker stops it cleanly. Replays set OOMDOC_REPLAY=1 so that a script can
skip side effects, and send the script's output to a log.

The orchestrator knows no fix by name: it asks each fix in the catalogue
(oomdoc.fixes) whether it is worth a replay, what to send the child, and how
to describe what the replay did. A fix that `searches_batch` is measured by
the largest-batch search instead of one replay.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, TextIO

from oomdoc.diagnosis.leak import rule as leak_rule
from oomdoc.diagnosis.steps import steady_growth
from oomdoc.errors import UsageError
from oomdoc.fixes import FIXES, Combination, Fix, fix_named
from oomdoc.fixes.optimizer import optimizer_state_estimate
from oomdoc.fixes.ranking import rank_fixes
from oomdoc.frameworks import context_from_snapshot, framework_of, preimports
from oomdoc.frameworks.base import accumulation_on_command_line, with_enough_steps
from oomdoc.model import (
    BatchSearch,
    Breakdown,
    FixResult,
    Prescription,
    ReplaySummary,
    Skipped,
    Snapshot,
    to_dict,
)
from oomdoc.replay import batch as batch_model
from oomdoc.replay import prescribe
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
from oomdoc.replay.progress import Progress
from oomdoc.replay.rank import best_pair
from oomdoc.runner import ChildRequest, ChildResult, ChildSignals, WarmPool, run_child
from oomdoc.script_flags import (
    EVAL_BATCH_FLAGS,
    LONG_BATCH_FLAGS,
    batch_flags,
    is_short,
    listed,
    spelled,
)
from oomdoc.sizes import format_bytes

MIN_REPLAY_TIMEOUT_S = 120.0
# Under a leak, replays run this many steps: enough to see whether memory
# still grows per step (and by how much), far fewer than the failing run.
LEAK_REPLAY_STEPS = 6
# Every replay's environment: scripts may skip side effects under
# OOMDOC_REPLAY=1; a replay needs peaks and step times, not allocation sites,
# and without the allocator's history (and the _snapshot() calls it feeds)
# each CUDA replay starts and runs faster.
REPLAY_ENV = {"OOMDOC_REPLAY": "1", "OOMDOC_ALLOCATION_HISTORY": "0"}


def replayable() -> list[Fix]:
    """The fixes a replay can measure, in the order they are tried."""
    return sorted(FIXES, key=lambda fix: fix.replay_priority)


def parse_fix_names(names: list[str] | None) -> list[str] | None:
    """Validate `--fixes`: catalogue names, or `a+b` for a compatible pair."""
    if not names:
        return None
    known = ", ".join(fix.name for fix in replayable())
    valid = []
    for name in names:
        fix = fix_named(name)
        if fix is None:
            if "+" in name:
                raise UsageError(
                    f"--fixes: {name!r} is not a combination oomdoc can measure (two compatible fixes a+b from: {known})"
                )
            raise UsageError(f"--fixes: unknown fix {name!r} (known: {known}, or a+b)")
        if isinstance(fix, Combination) and any(part.searches_batch for part in fix.parts):
            raise UsageError(
                f"--fixes: {name!r}: combinations are measured at the failing batch size, so "
                f"{next(part.name for part in fix.parts if part.searches_batch)} cannot be part of one"
            )
        valid.append(fix.name)
    return list(dict.fromkeys(valid))


def check_replay_options(
    fixes: str | None,
    replay_timeout_s: float | None,
    batch_arg: str | None,
    replay: bool,
    replay_jobs: int | None = None,
) -> list[str] | None:
    """Validate --fixes, --replay-timeout, --replay-jobs and --batch-arg
    before anything runs."""
    names = (
        [name.strip() for name in fixes.split(",") if name.strip()] if fixes is not None else None
    )
    if fixes is not None and not names:
        raise UsageError("--fixes: give at least one fix name")
    if not replay and names:
        raise UsageError("--fixes has no effect with --no-replay")
    if replay_jobs is not None and (isinstance(replay_jobs, bool) or replay_jobs < 1):
        raise UsageError(f"--replay-jobs must be a positive whole number, not {replay_jobs}")
    if not replay and replay_jobs is not None:
        raise UsageError("--replay-jobs has no effect with --no-replay")
    if replay_timeout_s is not None and not replay_timeout_s > 0:
        raise UsageError(
            f"--replay-timeout must be a positive number of seconds, not {replay_timeout_s:g}"
        )
    if batch_arg is not None and (
        not batch_arg.startswith("-") or len(batch_arg) < 2 or "=" in batch_arg
    ):
        raise UsageError(
            f"--batch-arg: {batch_arg!r} is not an option name (e.g. --micro-batch or -b)"
        )
    return parse_fix_names(names)


def find_batch_arg(
    args: list[str], flag: str | None = None, flags: tuple[str, ...] = LONG_BATCH_FLAGS
) -> tuple[int, str, int] | None:
    """(index of the value, flag, batch size) of the last batch-size flag on
    the command line (`flag`, else one of `flags`), as `--batch-size 64`,
    `--batch-size=64`, or for a short flag also `-b64`."""
    names = (flag,) if flag else flags
    found = None
    for index, arg in enumerate(args):
        for name in names:
            if arg == name and index + 1 < len(args) and args[index + 1].isdigit():
                found = (index + 1, name, int(args[index + 1]))
            elif arg.startswith(name + "=") and arg[len(name) + 1 :].isdigit():
                found = (index, name, int(arg[len(name) + 1 :]))
            elif is_short(name) and arg.startswith(name) and arg[len(name) :].isdigit():
                found = (index, name, int(arg[len(name) :]))
    return found


def with_batch_size(args: list[str], position: int, flag: str, batch_size: int) -> list[str]:
    """args with the batch at `position` (find_batch_arg's) set, in its form."""
    rewritten = list(args)
    current = rewritten[position]
    if current.startswith(flag + "="):
        rewritten[position] = f"{flag}={batch_size}"
    elif is_short(flag) and current.startswith(flag):
        rewritten[position] = f"{flag}{batch_size}"
    else:
        rewritten[position] = str(batch_size)
    return rewritten


def find_search_batch(
    args: list[str], batch_arg: str | None, snapshot: Snapshot
) -> tuple[int, str, int] | None:
    """The batch the search changes (find_batch_arg's triple): the flag
    named with --batch-arg; at an OOM in evaluation, the script's
    evaluation batch flag when it is on the command line (its training
    batch does not decide that memory); else its training batch flag."""
    oom = snapshot.oom
    if batch_arg is None and oom is not None and oom.in_evaluation:
        found = find_batch_arg(args, None, EVAL_BATCH_FLAGS)
        if found is not None:
            return found
    return find_batch_arg(args, batch_arg, script_batch_flags(snapshot))


def script_batch_flags(snapshot: Snapshot) -> tuple[str, ...]:
    """The batch flags looked for on the script's command line."""
    return batch_flags(snapshot.script_options, snapshot.script_option_aliases)


@dataclass
class Replay:
    """One replay's outcome, measured."""

    label: str
    outcome: str  # fits | oom | timeout | error
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    step_s: float | None = None
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
            **timings,
        }

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"

    @property
    def interrupted(self) -> bool:
        return self.capture is not None and self.capture.outcome == "interrupted"


class ReplaysInterrupted(Exception):
    """Ctrl-C reached a replay: stop replaying, keep what was measured."""


def replay_key(
    payload: Optional[dict],
    label: str,
    args: list[str] | None,
    extra_env: dict | None,
    micro_batches_per_step: int | None = None,
) -> tuple:
    """What makes two asks for a replay the same replay."""
    return (
        label,
        json.dumps(payload, sort_keys=True),
        None if args is None else tuple(args),
        tuple(sorted((extra_env or {}).items())),
        micro_batches_per_step,
    )


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
    ):
        self.snapshot = snapshot
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
        self.max_steps = max(self.failing_step + 1, 2)
        if leak:
            self.max_steps = LEAK_REPLAY_STEPS
        if options.max_steps:
            self.max_steps = min(self.max_steps, max(options.max_steps, 1))
        self.leak = leak
        self.timeout_s = options.replay_timeout_s or default_timeout(snapshot)
        self.replays: list[Replay] = []
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
        # Replays started ahead, by replay_key, until the decisions ask for
        # them; those they never asked for (`discard_ahead`).
        self._ahead: dict[tuple, Job] = {}
        # Started ahead but not yet handed to the lanes: that happens once
        # the first replay the decisions ask for is, so that it gets the
        # warmest child and the first lane.
        self._unsubmitted: list[Job] = []
        self._discarded: list[tuple[str, Job]] = []
        self._interrupted = False

    @property
    def stopped(self) -> bool:
        """Ctrl-C or SIGTERM came: no replay starts any more."""
        return self._interrupted or (self.signals is not None and self.signals.stopped)

    def _job(
        self, payload, label, args, extra_env, priority: int, micro_batches_per_step=None
    ) -> Job:
        return Job(
            lambda job: self._execute(job, payload, label, args, extra_env, micro_batches_per_step),
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
    ) -> Optional[tuple]:
        """Start, in a free lane, a replay that `run` will (or, SPECULATIVE,
        may) be asked for with the same arguments; its key. Nothing without
        lanes."""
        key = replay_key(payload, label, args, extra_env, micro_batches_per_step)
        if self.lanes is None or self.stopped:
            return None
        if key not in self._ahead:
            job = self._job(payload, label, args, extra_env, priority, micro_batches_per_step)
            self._ahead[key] = job
            self._unsubmitted.append(job)
        return key

    def run(
        self,
        payload: Optional[dict],
        label: str,
        args: list[str] | None = None,
        extra_env: dict | None = None,
        micro_batches_per_step: int | None = None,
    ) -> Replay:
        job = self._ahead.pop(
            replay_key(payload, label, args, extra_env, micro_batches_per_step), None
        )
        if job is None:
            if self.stopped:
                raise ReplaysInterrupted()
            job = self._job(payload, label, args, extra_env, DEMANDED, micro_batches_per_step)
            if self.lanes is None:
                job.run()
            else:
                self.lanes.submit(job)
        elif self.lanes is not None:
            if job in self._unsubmitted:
                self._unsubmitted.remove(job)
                job.priority = DEMANDED
                self.lanes.submit(job)
            else:
                self.lanes.promote(job, DEMANDED)
        if self.lanes is not None:
            for waiting in self._unsubmitted:
                self.lanes.submit(waiting)
            self._unsubmitted.clear()
        replay = job.wait()
        if replay is None or replay.stopped_by_user or replay.cancelled:
            raise ReplaysInterrupted()  # it never ran, or Ctrl-C ended it
        if replay.outcome in ("timeout", "error"):
            replay.log_path = keep_log(replay.log_path or "", self.request.artifact_dir)
        self.replays.append(replay)
        return replay

    def _execute(
        self,
        job: Job,
        payload: Optional[dict],
        label: str,
        args: list[str] | None,
        extra_env: dict | None,
        micro_batches_per_step: int | None = None,
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
        child = ChildRequest(
            target=self.request.target,
            args=list(self.request.args if args is None else args),
            device=self.request.device,
            capacity_bytes=self.request.capacity_bytes,
            is_module=self.request.is_module,
            max_steps=self.max_steps,
            micro_batches_per_step=micro_batches_per_step,
            expected_unit=self.step_unit,
            stop_after_evaluation=self.stop_after_evaluation,
            fix=payload,
            extra_env=env,
            output_path=log_path,
            timeout_s=self.timeout_s,
            device_lock=self.device_lock,
            share_device=self.share_device,
        )
        result, replay = self._measure(child, job, label)
        if (
            replay.fits
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
        distributed = getattr(self.options, "distributed", None)
        if distributed is not None:  # the same launcher and world size (oomdoc.distributed)
            from oomdoc.distributed.launch import run_distributed_child

            result = run_distributed_child(child, distributed)
        else:
            result = run_child(child, pool=self.pool, signals=self.signals, cancel=job.cancel)
        return result, measure(result, label, child.output_path or "")

    def discard_ahead(self, keep: Iterable[Optional[tuple]] = ()) -> None:
        """The decisions will ask for none of the replays started ahead that
        are left but those of `keep` (keys): the others not started never
        start, those running are stopped."""
        kept = set(keep)
        for key, job in list(self._ahead.items()):
            if key in kept:
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


def warm_pool(request: ChildRequest) -> WarmPool:
    """Warm children for the replays of `request`, the first one starting now
    (replay_fixes adds one per lane, and what they import ahead)."""
    pool = WarmPool(request.device, REPLAY_ENV)
    pool.fill()
    return pool


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
        free = cuda_free_bytes(int(device.extra.get("index") or 0))
        if free is None and isinstance(device.extra.get("nvml_free_bytes"), int):
            free = device.extra["nvml_free_bytes"]
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
    )


def default_timeout(snapshot: Snapshot) -> float:
    """Generous: four times what the failing run's steps took, plus start-up."""
    spent = sum(step.duration_s or 0.0 for step in snapshot.steps)
    return max(MIN_REPLAY_TIMEOUT_S, 4 * (spent + 15))


def measure(result: ChildResult, label: str, log_path: str) -> Replay:
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
    applied = capture.extra.get("fix_applied")
    replay.applied = applied if isinstance(applied, dict) else {}
    if capture.outcome == "ok":
        peak = capture.peak
        replay.outcome = "fits"
        replay.peak_allocated_bytes = (peak.allocated_bytes if peak else None) or 0
        replay.peak_reserved_bytes = (peak.reserved_bytes if peak else None) or 0
        replay.step_s = batch_model.median_step_seconds(capture.steps)
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
        return f"out of memory (needs more than {format_bytes(replay.peak_allocated_bytes)})"
    if replay.outcome == "timeout":
        return "timed out"
    return f"failed: {replay.message[:120]}"


# ---------------------------------------------------------------- planning


def plan(snapshot: Snapshot, requested: list[str] | None) -> tuple[list[str], list[Skipped]]:
    """The single fixes worth a replay, and the others with the reason."""
    explicit = set(requested or [])
    names = (
        [name for name in requested if "+" not in name]
        if requested
        else [fix.name for fix in replayable()]
    )
    chosen, skipped = [], []
    for name in names:
        fix = fix_named(name)
        assert fix is not None, name  # --fixes was validated
        if not fix.applies_to(snapshot) and name not in explicit:
            continue
        reason = fix.skip_reason(snapshot, explicit=name in explicit)
        if reason:
            skipped.append(Skipped(name, reason))
        else:
            chosen.append(name)
    return chosen, skipped


# ---------------------------------------------------------------- the replays


def replay_fixes(
    snapshot: Snapshot,
    options: Any,
    request: ChildRequest,
    stderr: TextIO | None = None,
    pool: WarmPool | None = None,
) -> None:
    """Measure the fixes for an OOM, store them ranked in `snapshot`, and
    the prescription. `pool`: warm children started earlier (one is made
    when not given)."""
    stderr = stderr or sys.stderr
    own_pool = pool is None
    pool = pool or warm_pool(request)
    requested = parse_fix_names(options.fixes)
    singles, skipped = plan(snapshot, requested)
    combinations = [name for name in (requested or []) if "+" in name]
    progress = Progress(stderr)
    progress.header("replaying the failing step with fixes (OOMDOC_REPLAY=1 is set in replays)")
    leak = leak_rule(snapshot) is not None
    jobs = replay_jobs(snapshot, options)
    if getattr(options, "distributed", None) is None:
        # One warm child per lane, each importing the script's framework while it waits.
        pool.configure(size=jobs, preimports=preimports(snapshot))
    state = ReplayState(skipped=skipped)
    # Ctrl-C and SIGTERM are handled once for all the replays, which may run
    # side by side: Ctrl-C stops them all and keeps what was measured.
    with ChildSignals() as signals:
        replayer = Replayer(
            snapshot, options, request, progress, pool, leak=leak, jobs=jobs, signals=signals
        )
        try:
            interrupted = False
            start_ahead(replayer, snapshot, singles, combinations, automatic=requested is None)
            # The decisions, one replay at a time; a replay started ahead
            # answers at once. After Ctrl-C, only replays that already ended
            # are read: each step below is skipped without them.
            for name in singles:
                fix = fix_named(name)
                assert fix is not None
                try:
                    if fix.searches_batch:
                        if leak:
                            skipped.append(Skipped(name, LEAK_NO_BATCH_SEARCH))
                            continue
                        state.search, state.batch_info, reason = search_batch(
                            replayer, snapshot, options
                        )
                        if reason:
                            skipped.append(Skipped(name, reason))
                        continue
                    replay_single(replayer, fix, snapshot, state)
                except ReplaysInterrupted:
                    interrupted = True
            savers_ahead: list = []
            if requested is None and not leak:
                combination = combination_to_measure(snapshot, state)
                if combination is not None:
                    combinations.append(combination)
                    savers_ahead = start_savers_ahead(
                        replayer, snapshot, options, state, combination
                    )
            for name in combinations:
                fix = fix_named(name)
                assert fix is not None
                try:
                    replay_single(replayer, fix, snapshot, state)
                except ReplaysInterrupted:
                    interrupted = True
            # A speculative combination no decision wanted goes; what the
            # search under the savers may ask for stays until it has asked.
            replayer.discard_ahead(keep=savers_ahead)
            if requested is None and not leak and not interrupted:
                try:
                    search_under_savers(replayer, snapshot, options, state)
                except ReplaysInterrupted:
                    interrupted = True
            # The prescription's, for finish, when that search ran.
            replayer.discard_ahead(keep=savers_ahead[1:] if state.saver_search else [])
            if interrupted or replayer.stopped:
                snapshot.notes.append(
                    "Replays were interrupted: the fixes below are those measured before."
                )
            finish(snapshot, replayer, state, progress)
        except Exception as exc:  # the snapshot of the OOM must be written whatever happens here
            progress.header(f"replays failed: {type(exc).__name__}: {exc}")
            snapshot.notes.append(
                f"Replays failed ({type(exc).__name__}: {exc}); no fixes were measured."
            )
            snapshot.fixes, snapshot.max_batch_size = [], None
        finally:
            replayer.close()
            if own_pool:
                pool.close()


def start_ahead(
    replayer: Replayer,
    snapshot: Snapshot,
    singles: list[str],
    combinations: list[str],
    automatic: bool,
) -> None:
    """With lanes to spare, start now the replays the decisions will ask for
    whatever the others measure: each single fix and each combination asked
    for by name (the batch search is a chain: its probes run in the lane kept
    for what the decisions wait for). With `automatic` choices (no --fixes),
    also every memory saver that shrinks what held memory at the OOM,
    together: the combination most likely to be wanted (a lighter optimizer
    cannot help an OOM before the first optimizer step). Its answer is used
    only when combination_to_measure asks for it."""
    if replayer.lanes is None:
        return
    for name in [*singles, *combinations]:
        fix = fix_named(name)
        if fix is None or fix.searches_batch:
            continue
        request = fix.request(snapshot)  # as replay_single asks for it
        replayer.ahead(request.payload, fix.name, extra_env=request.env)
    held = snapshot.breakdown
    savers = [
        fix.name
        for name in singles
        if (fix := fix_named(name)) is not None
        and fix.prescribable
        and any(getattr(held, category, 0) for category in fix.addresses)
    ]
    likely = fix_named("+".join(savers)) if automatic and not replayer.leak else None
    if len(savers) >= 2 and likely is not None:
        request = likely.request(snapshot)
        replayer.ahead(request.payload, likely.name, extra_env=request.env, priority=SPECULATIVE)


LEAK_NO_BATCH_SEARCH = (
    "a leak decides this OOM: a smaller batch only delays it (see the leak diagnosis)"
)


@dataclass
class ReplayState:
    """What the replays of one run have measured so far."""

    skipped: list[Skipped]
    results: list[FixResult] = field(default_factory=list)
    # The replay behind each result, by fix name.
    replays: dict[str, Replay] = field(default_factory=dict)
    # Fixes that ran with the fix in effect (fit or not).
    applied: set[str] = field(default_factory=set)
    search: Optional[batch_model.SearchResult] = None
    batch_info: dict = field(default_factory=dict)
    # What each fix's replay learned for its snippet (blocks, dtype, ...).
    contexts: dict[str, dict] = field(default_factory=dict)
    # The largest batch under the combined memory savers.
    saver_search: Optional[batch_model.SearchResult] = None
    saver_fix: Optional[Fix] = None


def failing_signature(snapshot: Snapshot) -> Optional[tuple]:
    oom = snapshot.oom
    return (oom.step, oom.phase, oom.requested_bytes, oom.allocated_bytes) if oom else None


def helpful(snapshot: Snapshot, state: ReplayState, name: str) -> bool:
    """The fix applied and saved at least 1% of the failing run's need."""
    replay = state.replays.get(name)
    if name not in state.applied or replay is None:
        return False
    signature = batch_model.observe(replay.capture, 0).oom_signature if replay.capture else None
    return not prescribe.is_no_op(
        replay.peak_allocated_bytes,
        replay.fits,
        signature,
        failing_signature(snapshot),
        snapshot.oom.needed_bytes if snapshot.oom else 0,
    )


def combination_to_measure(snapshot: Snapshot, state: ReplayState) -> Optional[str]:
    """Every memory saver that helped, together (autocast+checkpointing is
    the pair most likely to fit at the user's own batch); else the two
    helpful fixes with the lowest peaks. Never a fix that saved under 1%."""
    useful = [
        result
        for result in state.results
        if "+" not in result.name and helpful(snapshot, state, result.name)
    ]
    savers = {result.name for result in useful if _prescribable(result.name)}
    if len(savers) >= 2:
        return "+".join(fix.name for fix in replayable() if fix.name in savers)
    pair = best_pair(useful)
    return "+".join(pair) if pair is not None else None


def _prescribable(name: str) -> bool:
    fix = fix_named(name)
    return fix is not None and fix.prescribable


def search_under_savers(
    replayer: Replayer, snapshot: Snapshot, options: Any, state: ReplayState
) -> None:
    """When the combined savers (or the one saver that helped) do not fit at
    the failing batch with the margin free, the largest batch under them."""
    if state.search is None or not state.batch_info.get("source"):
        return
    original = state.search.original_batch_size
    capacity = snapshot.device.capacity_bytes
    limit = capacity - int(getattr(options, "margin_fraction", 0.05) * capacity)
    savers = [
        result
        for result in state.results
        if all(
            _prescribable(part) and helpful(snapshot, state, part)
            for part in result.name.split("+")
        )
    ]
    if not savers:
        return
    best = max(savers, key=lambda result: (len(result.parts), -(result.peak_allocated_bytes or 0)))
    if best.fits and best.peak_allocated_bytes is not None and best.peak_allocated_bytes <= limit:
        return  # it fits at the user's own batch
    fix = fix_named(best.name)
    replay = state.replays.get(best.name)
    if fix is None or replay is None or replay.capture is None:
        return
    at_original = to_batch_run(replay, original)
    if at_original.inconclusive:
        return

    def trial(batch_size: int) -> batch_model.BatchRun:
        payload, label, args, env = saver_trial(replayer, snapshot, state, fix, batch_size)
        return to_batch_run(replayer.run(payload, label, args=args, extra_env=env), batch_size)

    def enough(fit: int, oom: int) -> str | None:
        # The search is for the prescription, whose gradient accumulation
        # makes up the user's batch: once every batch from the fit to below
        # the OOM gives the same micro-batch, no probe can change it.
        plan = batch_model.accumulation_plan(original, fit, not snapshot.oom_in_evaluation)
        if plan != batch_model.accumulation_plan(original, oom - 1, not snapshot.oom_in_evaluation):
            return None
        return (
            f"any largest batch from {fit} to {oom - 1} gives the same prescription, "
            f"{plan[0]} x {plan[1]} accumulation steps"
        )

    probe = saver_first_probe(state.search)
    if probe < 1:
        return
    state.saver_search = batch_model.search_max_batch(
        original, capacity, [at_original], trial, probe=probe, max_trials=4, enough=enough
    )
    state.saver_fix = fix


def saver_first_probe(search: batch_model.SearchResult) -> int:
    """Where the search under the savers starts: halfway from the plain
    largest batch to the user's, at least one above it."""
    original = search.original_batch_size
    plain_max = search.max_batch_size or 0
    return min(original - 1, max(plain_max + 1, (plain_max + original) // 2))


def batch_size_in(
    replayer: Replayer, state: ReplayState, payload: dict, batch_size: int
) -> tuple[Optional[list[str]], Optional[str]]:
    """Say in `payload` how a replay sets `batch_size`: through the script's
    batch flag the batch search found, else its DataLoader. (The script's
    args with that flag rewritten, the flag), or (None, None)."""
    args = list(replayer.request.args)
    source = state.batch_info.get("source") or ""
    found = (
        find_search_batch(args, replayer.options.batch_arg, replayer.snapshot)
        if source.startswith("-")
        else None
    )
    if found is None:
        payload.update(
            batch_mode="dataloader", original_batch_size=state.batch_info.get("original_batch_size")
        )
        return None, None
    position, flag, _value = found
    payload["batch_mode"] = "argv"
    return with_batch_size(args, position, flag, batch_size), flag


def saver_trial(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, fix: Fix, batch_size: int
) -> tuple[dict, str, Optional[list[str]], dict]:
    """(payload, label, args, env) of the replay of `fix` at `batch_size`:
    one place, so that a replay started ahead is the one later asked for."""
    request = fix.request(snapshot)
    payload = dict(request.payload, also=["smaller_batch"], batch_size=batch_size)
    args, flag = batch_size_in(replayer, state, payload, batch_size)
    how = (
        spelled(flag, batch_size, snapshot.script_option_syntax)
        if flag
        else f"DataLoader batch {batch_size}"
    )
    return payload, f"{fix.name} ({how})", args, request.env


def start_savers_ahead(
    replayer: Replayer, snapshot: Snapshot, options: Any, state: ReplayState, combination: str
) -> list[Optional[tuple]]:
    """While the combined savers' replay runs: should it not fit at the
    user's batch, the search under them asks first for its probe (known
    from the plain search), and most likely prescribes that probe's
    micro-batch with gradient accumulation, then checks that prescription
    with the script's own flags. All start now in free lanes; their keys
    (probe first), for discard_ahead to keep. Not when one saver
    alone fit with the margin free: together they fit too, and no search
    follows (replays run for nothing compete for the card)."""
    fix = fix_named(combination)
    search = state.search
    capacity = snapshot.device.capacity_bytes
    limit = capacity - int(getattr(options, "margin_fraction", 0.05) * capacity)
    one_fits = any(
        result.fits
        and result.peak_allocated_bytes is not None
        and result.peak_allocated_bytes <= limit
        for result in state.results
        if "+" not in result.name and _prescribable(result.name)
    )
    if (
        replayer.lanes is None
        or fix is None
        or search is None
        or one_fits
        or not state.batch_info.get("source")
        or not all(_prescribable(part.name) for part in fix.parts)
    ):
        return []
    probe = saver_first_probe(search)
    if probe < 1:
        return []
    payload, label, args, env = saver_trial(replayer, snapshot, state, fix, probe)
    keys = [replayer.ahead(payload, label, args, env, priority=SPECULATIVE)]
    micro, steps = batch_model.accumulation_plan(
        search.original_batch_size, probe, not snapshot.oom_in_evaluation
    )
    if steps > 1:
        fixes = [part.name for part in fix.parts]
        payload, label, args, env, micro_batches, _raised = prescription_replay(
            replayer, snapshot, state, fixes, micro, steps
        )
        keys.append(
            replayer.ahead(
                payload,
                label,
                args,
                env,
                priority=SPECULATIVE,
                micro_batches_per_step=micro_batches,
            )
        )
        likely = Prescription(fixes=fixes, batch_size=micro, accumulation_steps=steps)
        flags_key = start_flags_ahead(replayer, snapshot, state, likely)
        if flags_key is not None:
            keys.append(flags_key)
    return keys


def replay_single(replayer: Replayer, fix: Fix, snapshot: Snapshot, state: ReplayState) -> None:
    """Replay one fix (or combination) and add its result, or say why it
    changed nothing."""
    request = fix.request(snapshot)
    replay = replayer.run(request.payload, fix.name, extra_env=request.env)
    ran = replay.outcome in ("fits", "oom")
    reason = fix.not_applied(replay.applied) if ran else None
    if reason:
        state.skipped.append(Skipped(fix.name, reason))
        return
    detail = fix.describe(replay.applied, request)
    state.contexts[fix.name] = request.context
    result = result_from(
        replay, fix, detail, snippet_in_framework(snapshot, fix.name, request.context)
    )
    if replayer.leak and replay.fits and replay.capture is not None:
        still_leaking(result, replay.capture, snapshot)
    state.results.append(result)
    state.replays[fix.name] = replay
    if ran:
        state.applied.add(fix.name)


def still_leaking(result: FixResult, capture: Snapshot, failing: Snapshot) -> None:
    """Under a leak, a replay that ran its few steps without an OOM fits only
    if memory stopped growing; otherwise it says by how many steps it would
    delay the OOM."""
    growth = steady_growth(capture)
    if growth is None:
        return
    _first, last, per_step, count = growth
    result.fits = False
    result.outcome = "grows"
    capacity = failing.device.capacity_bytes
    last_step = capture.steps[-1] if capture.steps else None
    oom_step = (failing.oom.step if failing.oom else None) or 0
    text = f"memory still grows by {format_bytes(per_step)} per step (the leak)"
    if per_step > 0 and last_step is not None and capacity:
        reaches = last_step.index + max(0, capacity - last_step.peak_allocated_bytes) // per_step
        delay = int(reaches - oom_step)
        text += (
            f": it would run out of memory near step {reaches}, "
            f"{delay:+d} steps from the failing run's step {oom_step}"
        )
        result.extra["delays_oom_by_steps"] = delay
    result.detail = f"{text}; {result.detail}" if result.detail else text


def result_from(replay: Replay, fix: Fix, detail: str, snippet: str) -> FixResult:
    if replay.outcome != "fits" and replay.message:
        detail = f"{replay.message}; {detail}" if detail else replay.message
    if replay.outcome in ("timeout", "error") and replay.log_path:
        detail += f" (its output: {replay.log_path})"
    return FixResult(
        name=fix.name,
        title=fix.title,
        outcome=replay.outcome,
        fits=replay.fits,
        peak_allocated_bytes=replay.peak_allocated_bytes,
        peak_reserved_bytes=replay.peak_reserved_bytes,
        saved_bytes=None,
        step_time_ratio=None,
        step_s=replay.step_s,
        replay_s=round(replay.wall_s, 2),
        detail=detail,
        snippet=snippet,
        measured=True,
    )


# ---------------------------------------------------------------- batch size


def no_batch_size() -> str:
    """Why the smaller batch cannot be searched: no flag, no DataLoader."""
    return (
        f"the script has no batch-size flag on its command line ({listed()}, "
        "or one named with --batch-arg) and creates no DataLoader with a batch size"
    )


def search_batch(
    replayer: Replayer, snapshot: Snapshot, options: Any
) -> tuple[Optional[batch_model.SearchResult], dict, Optional[str]]:
    """The largest batch size that fits. Returns (search result or None,
    information for the report, reason when it could not be searched)."""
    args = list(replayer.request.args)
    found = find_search_batch(args, options.batch_arg, snapshot)
    baseline = batch_model.observe(snapshot, 0)
    info: dict = {}
    if found is not None:
        position, flag, original = found
        info.update(source=flag, original_batch_size=original)

        def trial(batch_size: int) -> batch_model.BatchRun:
            payload = {"name": "smaller_batch", "batch_mode": "argv", "batch_size": batch_size}
            replay = replayer.run(
                payload,
                f"smaller_batch ({spelled(flag, batch_size, snapshot.script_option_syntax)})",
                args=with_batch_size(args, position, flag, batch_size),
            )
            return to_batch_run(replay, batch_size)

        runs = []
    else:
        if options.batch_arg:
            replayer.progress.header(
                f"{options.batch_arg} is not on the command line: trying the DataLoader's batch size"
            )
        if snapshot.dataloader_batch_sizes == []:
            # The failing run made no DataLoader a replay could change.
            return None, info, no_batch_size()
        divisor = batch_model.probe_divisor(snapshot)
        probe_replay = replayer.run(
            {"name": "smaller_batch", "batch_mode": "dataloader", "batch_divisor": divisor},
            f"smaller_batch (DataLoader batch / {divisor})",
        )
        record = probe_replay.applied.get("smaller_batch") or {}
        if probe_replay.outcome in ("fits", "oom") and not record.get("patched"):
            return None, info, no_batch_size()
        if not record.get("original_batch_size") or not record.get("batch_size"):
            return None, info, f"the first smaller-batch replay failed: {probe_replay.message}"
        original = int(record["original_batch_size"])
        info.update(source="DataLoader", original_batch_size=original)

        def trial(batch_size: int) -> batch_model.BatchRun:
            payload = {
                "name": "smaller_batch",
                "batch_mode": "dataloader",
                "batch_size": batch_size,
                "original_batch_size": original,
            }
            return to_batch_run(
                replayer.run(payload, f"smaller_batch (DataLoader batch {batch_size})"), batch_size
            )

        runs = [to_batch_run(probe_replay, int(record["batch_size"]))]
    if original <= 1:
        return None, info, "the batch size is already 1"
    baseline.batch_size = original
    result = batch_model.search_max_batch(
        original,
        snapshot.device.capacity_bytes,
        [baseline, *runs],
        trial,
        probe=batch_model.first_probe_for(snapshot, original),
    )
    result.trials[:0] = runs  # the DataLoader probe was a trial too
    return result, info, None


def to_batch_run(replay: Replay, batch_size: int) -> batch_model.BatchRun:
    if replay.capture is None or replay.outcome in ("timeout", "error"):
        run = batch_model.BatchRun(
            batch_size=batch_size, fits=False, inconclusive=True, note=replay.message
        )
    else:
        run = batch_model.observe(replay.capture, batch_size)
    run.wall_s = replay.wall_s
    run.replay = replay
    return run


# ---------------------------------------------------------------- results


def reference_step_seconds(
    snapshot: Snapshot, search: Optional[batch_model.SearchResult]
) -> tuple[float | None, str]:
    """What a step of the failing run would take if it fit: its own complete
    steady steps when it had any, else the largest fitting smaller batch's
    step scaled per sample."""
    oom_step = (snapshot.oom.step if snapshot.oom else None) or 0
    steady = [step for step in snapshot.steps if 0 < step.index < oom_step and step.duration_s]
    if steady:
        return batch_model.median_step_seconds(steady), "the failing run's completed steps"
    best = search.best_run if search is not None else None
    if search is not None and best is not None and best.step_s:
        return best.step_s * search.original_batch_size / best.batch_size, (
            f"a step at batch size {best.batch_size} scaled to {search.original_batch_size} samples (an estimate)"
        )
    return None, "no step of the failing configuration completed"


def smaller_batch_result(
    snapshot: Snapshot,
    fix: Fix,
    search: batch_model.SearchResult,
    info: dict,
    reference_s: float | None,
) -> Optional[FixResult]:
    best = search.best_run
    if best is None:
        last = search.trials[-1] if search.trials else None
        replay = getattr(last, "replay", None) if last else None
        if replay is None:
            return None
        result = result_from(
            replay, fix, search.stopped or "no smaller batch fits", fix.snippet({})
        )
        result.fits = False
        return result
    original = search.original_batch_size
    maximum = search.max_batch_size
    assert maximum is not None
    micro, steps = batch_model.accumulation_plan(
        original, maximum, accumulates=not snapshot.oom_in_evaluation
    )
    how = info.get("source", "batch size")
    how_text = (
        spelled(how, maximum, snapshot.script_option_syntax)
        if how.startswith("-")
        else f"DataLoader(batch_size={maximum})"
    )
    exactness = (
        f"exact: {maximum + 1} ran out of memory"
        if search.exact
        else f"not proven exact: {search.stopped}"
    )
    detail = f"largest batch that fits: {maximum} ({exactness}; {len(search.trials)} replays)"
    if snapshot.oom_in_evaluation:
        detail += f"; an evaluation batch of {micro} ({how_text})"
    else:
        detail += (
            f"; keep the effective batch of {original} with {steps} accumulation steps of {micro}"
        )
    snippet = snippet_in_framework(
        snapshot,
        fix.name,
        {
            "micro_batch": micro,
            "accumulation_steps": steps,
            "how": how if how.startswith("-") else "batch_size",
            "update": parameter_update(snapshot, search),
        },
    )
    result = result_from(best.replay, fix, detail, snippet)
    result.extra.update(
        max_batch_size=maximum, micro_batch_size=micro, accumulation_steps=steps, how=how_text
    )
    if reference_s and best.step_s:
        # Accumulation processes the original batch in `steps` micro-steps.
        result.step_time_ratio = round(steps * best.step_s * (micro / maximum) / reference_s, 3)
    return result


def parameter_update(
    snapshot: Snapshot, search: Optional[batch_model.SearchResult]
) -> Optional[str]:
    """How the script updates its parameters (Snapshot.parameter_update):
    as the failing run showed, else as the largest fitting batch's replay
    did (a run that failed in its first forward ran no backward)."""
    best = search.best_run if search is not None else None
    replay = getattr(best, "replay", None)
    capture = replay.capture if replay is not None else None
    return snapshot.parameter_update or (capture.parameter_update if capture else None)


def static_breakdown(snapshot: Snapshot, replayer: Replayer) -> Breakdown:
    """Parameters, gradients and optimizer state at their largest, from the
    failing run and every replay that kept the script's optimizer."""
    static = Breakdown(
        parameters=snapshot.breakdown.parameters,
        gradients=snapshot.breakdown.gradients,
        optimizer_state=snapshot.breakdown.optimizer_state,
    )
    for replay in replayer.replays:
        fix = fix_named(replay.fix_name)
        # Only the batch search's replays keep the script's own model and optimizer.
        if replay.capture is None or fix is None or not fix.searches_batch:
            continue
        measured = replay.capture.breakdown
        static.parameters = max(static.parameters, measured.parameters)
        static.gradients = max(static.gradients, measured.gradients)
        static.optimizer_state = max(static.optimizer_state, measured.optimizer_state)
    if not static.optimizer_state:
        static.optimizer_state = optimizer_state_estimate(snapshot)
    if not static.gradients:
        static.gradients = static.parameters
    return static


def finish(snapshot: Snapshot, replayer: Replayer, state: ReplayState, progress: Progress) -> None:
    """Rank what the replays measured, choose the prescription, and record
    both in the snapshot."""
    search = state.search
    results = state.results
    lower_bound = snapshot.oom.needed_bytes if snapshot.oom else 0
    need, estimated = lower_bound, False
    if search is not None and search.model is not None:
        predicted = search.model.need(search.original_batch_size)
        if predicted is not None and predicted > lower_bound:
            need, estimated = int(predicted), True
    reference_s, reference_text = reference_step_seconds(snapshot, search)
    if search is not None:
        batch_fix = next(fix for fix in FIXES if fix.searches_batch)
        found = smaller_batch_result(snapshot, batch_fix, search, state.batch_info, reference_s)
        if found is not None:
            results.insert(0, found)
    static = static_breakdown(snapshot, replayer)
    for result in results:
        if result.fits and result.peak_allocated_bytes is not None:
            result.saved_bytes = int(need - result.peak_allocated_bytes)
            if result.step_time_ratio is None and reference_s and result.step_s:
                result.step_time_ratio = round(result.step_s / reference_s, 3)
        fix = fix_named(result.name)
        if fix is not None:
            fix.annotate(result, static, snapshot)
    snapshot.fixes = rank_fixes(results)
    snapshot.max_batch_size = search.max_batch_size if search is not None and search.exact else None
    snapshot.prescription = prescription_for(snapshot, replayer, state)
    summary = ReplaySummary(
        replays=len(replayer.replays),
        total_s=round(progress.total(), 2),
        max_steps=replayer.max_steps,
        timeout_s=replayer.timeout_s,
        baseline_need_bytes=int(need),
        baseline_need_estimated=estimated,
        reference_step_s=reference_s,
        reference=reference_text,
        skipped=state.skipped,
        runs=[replay.timing() for replay in replayer.replays],
        jobs=replayer.jobs,
    )
    unused = replayer.unused_runs()
    if unused:
        summary.extra["unused_runs"] = unused
    if search is not None:
        summary.batch_search = batch_search_record(search, state.batch_info.get("source"))
    if state.saver_search is not None and state.saver_fix is not None:
        summary.extra["saver_batch_search"] = dict(
            to_dict(batch_search_record(state.saver_search, state.batch_info.get("source"))),
            fixes=state.saver_fix.name,
        )
    snapshot.replay = summary
    side_by_side = f", up to {replayer.jobs} side by side" if replayer.jobs > 1 else ""
    progress.header(f"{len(replayer.replays)} replays in {progress.total():.1f} s{side_by_side}")


def batch_search_record(search: batch_model.SearchResult, source: Optional[str]) -> BatchSearch:
    return BatchSearch(
        source=source,
        original_batch_size=search.original_batch_size,
        max_batch_size=search.max_batch_size,
        exact=search.exact,
        trials=[[run.batch_size, run.fits] for run in search.trials],
        stopped=search.stopped or None,
    )


def prescription_for(
    snapshot: Snapshot, replayer: Replayer, state: ReplayState
) -> Optional[Prescription]:
    """The leak's remedy under a leak; else the measured configuration with
    the highest throughput that leaves the margin free."""
    if replayer.leak:
        leak = leak_rule(snapshot)
        return Prescription(
            fixes=[],
            batch_size=None,
            measured=False,
            fits=False,
            kind="leak",
            detail=(leak.summary if leak else "a leak decides this OOM")
            + "; no configuration fixes a leak: every fix only delays the OOM (see the fixes below)",
            snippet=leak.remedy if leak else None,
        )
    search = state.search
    original = search.original_batch_size if search is not None else None
    candidates: list[prescribe.Candidate] = []
    reference = None
    best_plain = search.best_run if search is not None else None
    for run in search.trials if search is not None else []:
        if run.fits and run.peak_allocated_bytes is not None and run.replay is not None:
            candidate = prescribe.Candidate(
                [], run.batch_size, run.peak_allocated_bytes, run.step_s, run.replay.label
            )
            candidates.append(candidate)
            if run is best_plain:
                reference = candidate
    for result in state.results:
        if not result.measured or not result.fits or result.peak_allocated_bytes is None:
            continue
        fix = fix_named(result.name)
        if fix is None or fix.searches_batch:
            continue
        candidates.append(
            prescribe.Candidate(
                result.parts, original or 1, result.peak_allocated_bytes, result.step_s, result.name
            )
        )
    if state.saver_search is not None and state.saver_fix is not None:
        parts = [part.name for part in state.saver_fix.parts]
        for run in state.saver_search.trials:
            if run.fits and run.peak_allocated_bytes is not None and run.replay is not None:
                candidates.append(
                    prescribe.Candidate(
                        parts,
                        run.batch_size,
                        run.peak_allocated_bytes,
                        run.step_s,
                        run.replay.label,
                    )
                )
    if original is not None:
        capacity = snapshot.device.capacity_bytes
        margin = float(getattr(replayer.options, "margin_fraction", 0.05))
        prescribe.plan_limits(candidates, measured_points(state), capacity - int(margin * capacity))
    chosen, interrupted = measured_choice(
        replayer, snapshot, state, candidates, original, reference
    )
    if chosen is None:
        return None
    source = state.batch_info.get("source") or ""
    if snapshot.oom_in_evaluation and source in EVAL_BATCH_FLAGS and chosen.batch_size:
        chosen.evaluation_batch_flag = source
    chosen.snippet = prescription_snippet(snapshot, chosen, state)
    if chosen.fits and not interrupted and not replayer.stopped:
        try:
            verify_with_flags(replayer, snapshot, chosen, state)
        except ReplaysInterrupted:
            pass  # Ctrl-C during the check: the prescription stands without it
    return chosen


def measured_points(state: ReplayState) -> list[tuple[tuple, int, int]]:
    """(fixes, batch, peak) of every batch the searches ran; for a batch that
    ran out of memory, the most it was seen to need."""
    points = []
    searches: list[tuple[tuple, Optional[batch_model.SearchResult]]] = [((), state.search)]
    if state.saver_search is not None and state.saver_fix is not None:
        searches.append((tuple(part.name for part in state.saver_fix.parts), state.saver_search))
    for fixes, search in searches:
        for run in search.trials if search is not None else []:
            peak = run.peak_allocated_bytes
            if not run.fits:
                peak = max([*run.lower_bounds.values(), peak or 0])
            if peak:
                points.append((fixes, run.batch_size, int(peak)))
    return points


# At most this many replays measure a prescription with gradient
# accumulation (the next candidate is tried when one does not fit).
PRESCRIPTION_REPLAYS = 2


def measured_choice(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    candidates: list[prescribe.Candidate],
    original: Optional[int],
    reference: Optional[prescribe.Candidate],
) -> tuple[Optional[Prescription], bool]:
    """The prescription among the candidates, and whether Ctrl-C stopped its
    replay. A candidate was measured at one batch without accumulation; when
    its prescription accumulates, one more replay runs exactly the prescribed
    configuration, accumulation included (the later micro-batches' forward
    runs with the earlier ones' gradients alive, which can peak higher): its
    peak is the prescription's. One that then leaves the margin no longer
    free gives way to a smaller micro-batch or the next candidate. A
    micro-batch larger than the candidate's (planned from its `plan_limit`)
    is prescribed only as that replay measured it."""
    capacity = snapshot.device.capacity_bytes
    margin = float(getattr(replayer.options, "margin_fraction", 0.05))
    limit = capacity - int(margin * capacity)
    remaining = list(candidates)
    rejected: list[str] = []
    replays = 0
    interrupted = False

    def prescription_of(candidate: prescribe.Candidate, fits: bool) -> Prescription:
        return prescribe.prescription_from(
            candidate,
            fits,
            original or 1,
            capacity,
            margin,
            reference,
            accumulates=not snapshot.oom_in_evaluation,
        )

    while True:
        picked = prescribe.pick(remaining, capacity, margin)
        if picked is None:
            return None, interrupted
        candidate, fits = picked
        chosen = prescription_of(candidate, fits)
        if original is None:
            chosen.batch_size, chosen.accumulation_steps = None, 1
        if chosen.batch_size is None or (
            chosen.accumulation_steps <= 1 and chosen.batch_size == candidate.batch_size
        ):
            break  # measured as it is prescribed
        micro = chosen.batch_size
        planned = micro > candidate.batch_size
        if planned and (not fits or replays >= PRESCRIPTION_REPLAYS):
            candidate.plan_limit = None  # not measured: only the batch it ran
            continue
        without = f"the peak is batch {candidate.batch_size}'s without accumulation"
        if not fits or replays >= PRESCRIPTION_REPLAYS:
            chosen.accumulation_measured = False
            chosen.detail = f"{chosen.detail}; {without}"
            break
        replays += 1
        # Should the replay with accumulation confirm it, verify_with_flags
        # asks for this one next: it runs beside it.
        start_flags_ahead(replayer, snapshot, state, chosen)
        try:
            replay = replay_prescription(replayer, snapshot, state, chosen)
        except ReplaysInterrupted:
            if planned:
                candidate.plan_limit = None
                chosen = prescription_of(candidate, fits)
            interrupted, chosen.accumulation_measured = True, False
            chosen.detail = (
                f"{chosen.detail}; its replay with accumulation was interrupted: {without}"
            )
            break
        if replay.outcome in ("timeout", "error") and planned:
            candidate.plan_limit = None  # measure the batch it ran instead
            continue
        if replay.outcome in ("timeout", "error"):
            chosen.accumulation_measured = False
            chosen.detail = (
                f"{chosen.detail}; its replay with {chosen.accumulation_steps} accumulation steps "
                f"failed ({replay.message}): {without}"
            )
            break
        if replay.fits and replay.peak_allocated_bytes is not None:
            if replay.peak_allocated_bytes <= limit:
                with_accumulation(chosen, candidate, replay, capacity)
                break
        rejected.append(
            f"{' + '.join(chosen.fixes) or 'no fix'} at batch {chosen.batch_size} x "
            f"{chosen.accumulation_steps} accumulation steps: {summarise(replay)}, over the margin"
        )
        if planned:
            # Plan below the micro-batch that went over, down to the batch it ran.
            below = micro - 1
            candidate.plan_limit = below if below > candidate.batch_size else None
        # With the same fixes, accumulating over a micro-batch at least as
        # large would not fit either (the user's own batch, measured without
        # accumulation, stays a candidate).
        remaining = [
            other
            for other in remaining
            if other.fixes != candidate.fixes or not micro <= other.batch_size < (original or 1)
        ]
    if rejected:
        chosen.detail = (
            f"{chosen.detail}; replayed with accumulation and not prescribed: "
            + "; ".join(rejected)
        )
    return chosen, interrupted


def replay_prescription(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, prescription: Prescription
) -> Replay:
    """One replay of exactly the prescribed configuration: its fixes, its
    micro-batch, and oomdoc.fixes.smaller_batch's gradient accumulation, long
    enough for two optimizer steps (the script's steps flag raised if need be)."""
    payload, label, args, env, micro_batches, raised = prescription_replay(
        replayer,
        snapshot,
        state,
        prescription.fixes,
        int(prescription.batch_size or 1),
        prescription.accumulation_steps,
    )
    replay = replayer.run(
        payload, label, args=args, extra_env=env, micro_batches_per_step=micro_batches
    )
    prescription.extra["accumulation_replay"] = replay_record(replay, args, raised)
    return replay


def prescription_replay(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    fixes: list[str],
    micro: int,
    steps: int,
) -> tuple[dict, str, list[str], dict, int, Optional[str]]:
    """(payload, label, args, env, micro-batches per optimizer step, the
    steps flag raised) of the replay of `fixes` at micro-batch `micro` with
    `steps` accumulation steps: one place, so that one started ahead
    (start_savers_ahead) is the one replay_prescription asks for."""
    payload: dict = {"name": "smaller_batch"}
    env: dict = {}
    if fixes:
        fix = fix_named("+".join(fixes))
        assert fix is not None
        request = fix.request(snapshot)
        payload, env = dict(request.payload, also=["smaller_batch"]), request.env
    payload.update(batch_size=micro, accumulation_steps=steps)
    rewritten, _flag = batch_size_in(replayer, state, payload, micro)
    args = rewritten if rewritten is not None else list(replayer.request.args)
    micro_batches = steps * accumulation_on_command_line(args, snapshot.script_options)
    args, raised = enough_steps(replayer, snapshot, args, micro_batches)
    label = f"the prescription ({' + '.join(fixes) or 'no fix'}, batch {micro} x {steps} accumulation steps)"
    return payload, label, args, env, micro_batches, raised


def enough_steps(
    replayer: Replayer, snapshot: Snapshot, args: list[str], micro_batches: int
) -> tuple[list[str], Optional[str]]:
    """args with the script's steps flag raised so that a replay with
    `micro_batches` micro-batches per optimizer step runs its steps, whether
    the script counts optimizer steps or micro-batches."""
    if micro_batches <= 1 or not snapshot.script_options:
        return args, None
    needed = replayer.max_steps * micro_batches
    args, raised = with_enough_steps(
        args, snapshot.script_options, context_from_snapshot(snapshot), needed
    )
    if raised:
        raised += (
            f" so that the replay runs {replayer.max_steps} optimizer steps of "
            f"{micro_batches} micro-batches"
        )
    return args, raised


def accumulation_covered(capture: Optional[Snapshot]) -> bool:
    """Whether a replay ran an optimizer step and then at least two more
    micro-batches (a forward with the gradients and the optimizer state alive)."""
    if capture is None or capture.step_unit != "optimizer":
        return False
    return any(step.index >= 1 and step.forward_calls >= 2 for step in capture.steps)


def replay_record(replay: Replay, args: list[str], raised: Optional[str]) -> dict:
    """A replay of the prescription, for the snapshot: what ran and what it
    measured, and how its steps were made long enough."""
    record: dict[str, Any] = {
        "args": args,
        "outcome": replay.outcome,
        "peak_allocated_bytes": replay.peak_allocated_bytes,
        "accumulation_covered": accumulation_covered(replay.capture),
    }
    if raised:
        record["note"] = raised
    return record


def with_accumulation(
    prescription: Prescription, candidate: prescribe.Candidate, replay: Replay, capacity: int
) -> None:
    """The prescription's peak as its replay with the accumulation running
    measured it. The throughput stays the candidate's: the same micro-batches
    (a step of the replay also holds the script's data loading and epoch ends,
    which its few steps do not average out)."""
    assert replay.peak_allocated_bytes is not None
    peak = replay.peak_allocated_bytes
    prescription.peak_allocated_bytes = peak
    prescription.headroom_bytes = capacity - peak
    if prescription.accumulation_steps > 1:
        prescription.accumulation_measured = True
    record = prescription.extra.get("accumulation_replay") or {}
    throughput = (
        f", {candidate.samples_per_second:.1f} samples/s" if candidate.samples_per_second else ""
    )
    detail = (
        f"peak measured in the replay {replay.label!r}, with the accumulation running; "
        f"batch {candidate.batch_size} without accumulation in {candidate.label!r}: "
        f"peak {format_bytes(candidate.peak_allocated_bytes)}{throughput}"
    )
    if not record.get("accumulation_covered"):
        detail += "; the replay ended before an optimizer step and two more micro-batches: the peak may be low"
    prescription.detail = detail + "".join(f"; {note}" for note in candidate.notes)


def snippet_in_framework(snapshot: Snapshot, name: str, context: dict) -> str:
    """A fix's snippet in the knobs of the framework the run went through
    (torch code for a plain loop)."""
    return framework_of(snapshot).snippet(name, {**context_from_snapshot(snapshot), **context})


def prescription_context(
    snapshot: Snapshot, prescription: Prescription, state: ReplayState
) -> tuple[list[str], dict]:
    """The prescription's changes (the batch change as `smaller_batch`) and
    what their replays learned, for the framework units."""
    changes = list(prescription.fixes)
    context = context_from_snapshot(snapshot)
    context["update"] = parameter_update(snapshot, state.search)
    for name in prescription.fixes:
        context.update(state.contexts.get(name) or {})
    if prescription.batch_size and prescription.accumulation_steps > 1:
        how = state.batch_info.get("source") or "batch_size"
        changes.append("smaller_batch")
        context.update(
            micro_batch=prescription.batch_size,
            accumulation_steps=prescription.accumulation_steps,
            how=how if how.startswith("-") else "batch_size",
        )
    return changes, context


def prescription_snippet(snapshot: Snapshot, prescription: Prescription, state: ReplayState) -> str:
    """The prescribed changes as one block in the framework's own terms."""
    changes, context = prescription_context(snapshot, prescription, state)
    if not changes:
        return ""
    return framework_of(snapshot).prescription_snippet(changes, context)


@dataclass
class FlagsReplay:
    """The script run with its own flags for a prescription's changes."""

    args: list[str]  # the script's argv with those flags
    replayed_args: list[str]  # the same, its steps flag raised if need be
    raised: Optional[str]  # how the steps flag was raised
    covers: list[str]  # the changes the flags make
    micro_batches: int  # micro-batches per optimizer step

    @property
    def label(self) -> str:
        return "the script's own flags: " + " ".join(self.replayed_args)

    @property
    def micro_batches_per_step(self) -> Optional[int]:
        return self.micro_batches if self.micro_batches > 1 else None


def flags_replay(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, prescription: Prescription
) -> Optional[FlagsReplay]:
    """The replay verify_with_flags runs for `prescription` (only its fixes,
    batch size and accumulation steps are read), or None where the script
    has no flag for any of its changes: one place, so that one started ahead
    is the one later asked for."""
    changes, context = prescription_context(snapshot, prescription, state)
    if not changes or not snapshot.script_options:
        return None
    framework = framework_of(snapshot)
    args = list(replayer.request.args)
    covered: list[str] = []
    for change in changes:
        variant = framework.flag_variant(change, args, snapshot.script_options, context)
        if variant is not None:
            args, covered = variant, [*covered, change]
    if not covered:
        return None
    micro_batches = 1
    if "smaller_batch" in covered:
        micro_batches = accumulation_on_command_line(args, snapshot.script_options)
    replayed_args, raised = enough_steps(replayer, snapshot, args, micro_batches)
    return FlagsReplay(args, replayed_args, raised, covered, micro_batches)


def start_flags_ahead(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, prescription: Prescription
) -> Optional[tuple]:
    """Start the script's-own-flags replay of a prescription that is likely
    (its replay with accumulation still to confirm it) in a free lane, so
    that it runs beside that replay instead of after it; its key."""
    flags = flags_replay(replayer, snapshot, state, prescription)
    if flags is None:
        return None
    return replayer.ahead(
        None,
        flags.label,
        flags.replayed_args,
        priority=SPECULATIVE,
        micro_batches_per_step=flags.micro_batches_per_step,
    )


def verify_with_flags(
    replayer: Replayer, snapshot: Snapshot, prescription: Prescription, state: ReplayState
) -> None:
    """Where the script has its own command-line flags for the prescribed
    changes (HfArgumentParser's --gradient_checkpointing, --bf16, ...), one
    replay runs the script with those flags and no fix of oomdoc's: its peak
    is reported next to the prescription's."""
    flags = flags_replay(replayer, snapshot, state, prescription)
    if flags is None:
        return
    replay = replayer.run(
        None,
        flags.label,
        args=flags.replayed_args,
        micro_batches_per_step=flags.micro_batches_per_step,
    )
    record = replay_record(replay, flags.args, flags.raised)
    record["covers"] = flags.covers
    if flags.micro_batches <= 1:
        del record["accumulation_covered"]
    prescription.extra["verified_by_flags"] = record
    if replay.fits and replay.peak_allocated_bytes and prescription.peak_allocated_bytes:
        ratio = replay.peak_allocated_bytes / prescription.peak_allocated_bytes
        record["peak_ratio"] = round(ratio, 3)


def keep_log(log_path: str, artifact_dir: str | None) -> str | None:
    """A replay that failed or hung keeps its output next to the snapshot."""
    if not artifact_dir or not os.path.exists(log_path):
        return None
    os.makedirs(artifact_dir, exist_ok=True)
    destination = os.path.join(artifact_dir, os.path.basename(log_path))
    shutil.copyfile(log_path, destination)
    return destination
