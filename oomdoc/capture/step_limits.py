"""When a replay's run stops, and when its steps have the device alone.

The Tracker's step limit (a replay runs `max_steps` steps in the failing
run's unit, then StopRun), whether those steps are done (the whole-run data,
oomdoc.capture.whole_run, ends the training epoch then), and the hooks that
give the timed steps the device alone when replays share it
(oomdoc.capture.gate). A mixin: what it reads of the tracker's state is
declared here, the Tracker sets it up.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

# The units a step is counted in, from the finest: a model call, a backward,
# an optimizer step (the tracker moves up as the run shows them).
UNITS = ("module", "backward", "optimizer")


def thread_cpu_wait(thread_id: int) -> float | None:
    """Seconds the thread `thread_id` (native) has been runnable but waiting
    for a CPU (Linux's schedstat run_delay), or None where it is not kept: a
    step that waited is timed with the host busy (other replays' DataLoader
    workers, say), not only the device."""
    try:
        with open(f"/proc/self/task/{thread_id}/schedstat", "rb") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class StopRun(BaseException):
    """Stops the script after `max_steps` steps (not an Exception: a
    script's `except Exception` must not swallow it)."""


class StepLimits:
    """The Tracker's step limit and device-sharing hooks."""

    max_steps: int | None
    stop_after_evaluation: int | None
    expected_unit: str | None
    unit: str
    micro_batches_per_step: int
    step_index: int
    _current: dict[str, Any]
    _pending_close: bool
    _step_alone: bool
    device_to_itself: bool
    timed_steps_over: bool
    on_first_step: Callable[[], None] | None
    on_timed_steps: Callable[[], None] | None
    on_timed_steps_done: Callable[[], None] | None
    on_step_end: Callable[[], None] | None
    may_stop: Callable[[], bool] | None
    _close_step: Callable[[], None]
    sharing_untimed: bool
    # Steps a shared replay runs before those it times (share_device).
    shared_steps: int = 1
    optimizer_cycle: Any  # oomdoc.capture.optimizer_cycle.OptimizerCycle
    _step_started: float
    # The thread that began the step and its thread_cpu_wait() then (None: not kept).
    _step_cpu_wait: tuple[int, float] | None = None
    _step_timer: Any  # oomdoc.capture.step_records.CudaStepTimer, on CUDA
    # The step whose duration has ended (_end_step_timing), until it closes.
    _timing_ended: dict[str, Any] | None = None
    # Where the current step's training work ended (step_work_ended): the
    # step, the time, and on CUDA an event recorded then.
    _work_ended: tuple[dict[str, Any], float, Any] | None = None

    def _begin_step_clock(self) -> None:
        self._step_started = time.perf_counter()
        thread_id = threading.get_native_id()
        before = thread_cpu_wait(thread_id)
        self._step_cpu_wait = None if before is None else (thread_id, before)

    def _first_step(self) -> None:
        hook, self.on_first_step = self.on_first_step, None
        if hook is not None:
            hook()

    def _step_limit(self) -> int | None:
        """How many steps are closed before the run stops (StopRun), if limited."""
        limit = self.max_steps
        if limit is None or self.stop_after_evaluation is not None:
            return None
        if self.optimizer_cycle.learning:
            return None  # where an iteration ends is not known yet
        if self.expected_unit is not None and UNITS.index(self.unit) < UNITS.index(
            self.expected_unit
        ):
            return None  # not training in the failing run's unit yet
        if self.unit == "module":
            limit *= self.micro_batches_per_step
        return limit

    def _close_before_next_step(self) -> None:
        """The step that ended closes as the next one begins (its first
        training call, else its backward); past the limit, the run stops."""
        limit = self._step_limit()
        last = limit is not None and self.step_index + 1 >= limit
        if last and self.may_stop is not None and not self.may_stop():
            last = False  # a batch fetched before its epoch was cut (whole_run)
        if not last and self._next_step_timed():
            # Taken before this step's end is timed: a wait for it is left
            # out of this step (exclude_seconds), and the next step starts
            # with the device alone.
            self._timed_steps_begin()
        self._close_step()
        if last:
            self.timed_steps_done()
            raise StopRun()

    def _next_step_timed(self) -> bool:
        """Whether the step after the one closing may make the step time: a
        replay sharing the device runs its first `shared_steps` sharing it."""
        per_step = self.micro_batches_per_step if self.unit == "module" else 1
        return self.step_index + 1 >= self.shared_steps * per_step

    def steps_done(self) -> bool:
        """Whether a replay has run all its steps (the last closed or ending),
        also one that stops after an evaluation: its training DataLoader
        then ends the epoch (oomdoc.capture.whole_run)."""
        limit = self.max_steps
        if limit is None or (
            self.expected_unit is not None
            and UNITS.index(self.unit) < UNITS.index(self.expected_unit)
        ):
            return False
        if self.optimizer_cycle.learning:
            return False  # where an iteration ends is not known yet (as _step_limit)
        current, module = self._current, self.unit == "module"
        ongoing = self._pending_close or (
            module and bool(current["forward_calls"] or current["evaluation_calls"])
        )
        return self.step_index + int(ongoing) >= limit * (
            self.micro_batches_per_step if module else 1
        )

    def share_device(
        self,
        alone: Callable[[], None],
        done: Callable[[], None],
        autotunes: Callable[[], bool],
        shared_steps: int = 1,
        pass_turn: Callable[[], None] | None = None,
    ) -> None:
        """Replays that share the device (oomdoc.capture.gate): `alone` is
        called before the first step whose duration may be used is timed,
        `done` once the last one has been timed. When `autotunes()` at the
        first step, the device is alone from then on: kernels chosen by
        timing them (cuDNN's benchmark mode, torch.compile) must not be
        chosen while others use the device, since they decide the step
        times and workspace memory of every step. `shared_steps`: the steps
        run sharing it before those timed (2: the first steady step too,
        where a replay near the limit runs out of memory once the
        optimizer's state is there, so that it never waits for the device
        alone: oomdoc.replay.replayer.SHARED_STEPS). `pass_turn`: called at
        the end of each step run sharing it after which another such step
        comes, so that a replay waiting to time its steps waits for one of
        this one's steps, not for all of them."""
        self.on_timed_steps, self.on_timed_steps_done = alone, done
        self.shared_steps = max(1, shared_steps)
        if pass_turn is not None and self.shared_steps > 1:

            def between_shared_steps() -> None:
                if not self.device_to_itself:
                    pass_turn()

            self.on_step_end = between_shared_steps
        self.device_to_itself = self._step_alone = False
        first_step = self.on_first_step

        def first_step_begins() -> None:
            if first_step is not None:
                first_step()
            if autotunes():
                self._timed_steps_begin()

        self.on_first_step = first_step_begins

    def share_device_untimed(
        self,
        pass_turn: Callable[[], None],
        done: Callable[[], None],
        autotunes: Callable[[], bool],
        alone: Callable[[], None],
    ) -> None:
        """A replay that shares the device and whose step times are never
        used (the prescription's checks: its own flags, its replay with
        expandable segments): it never takes the device alone, so a replay
        timing its steps waits for one of its steps at most (`pass_turn` at
        each step's end), and it lets go once its steps are done (`done`).
        On the H100 the HF Trainer's prescription, its replay with expandable
        segments and its own-flags check ran side by side, and each waited
        5.7 to 10.2 s for the others' timed steps. When `autotunes()` at the
        first step, as share_device: the device alone from then on (`alone`),
        since the kernels chosen decide the workspace, and so the peak."""
        self.on_timed_steps_done = done
        self.device_to_itself = self._step_alone = False
        self.sharing_untimed = True
        first_step = self.on_first_step

        def first_step_begins() -> None:
            if first_step is not None:
                first_step()
            if autotunes():
                self.sharing_untimed = False
                self.on_timed_steps = alone
                self._timed_steps_begin()
            else:
                self.on_step_end = pass_turn

        self.on_first_step = first_step_begins

    def _timed_steps_begin(self) -> None:
        """The device alone from here on: the steps that start from now on
        may be those whose durations are used (steps_timed in
        oomdoc.replay.batch leaves out only the first step, when later ones
        exist)."""
        hook = self.on_timed_steps
        if hook is not None and not self.device_to_itself:
            hook()
            self.device_to_itself = True

    def step_work_ended(self) -> None:
        """The current step's optimizer step has ended its training work:
        noted, for a step that the script's end closes (at_work_end)."""
        mark = self._step_timer.mark() if self._step_timer is not None else None
        self._work_ended = (self._current, time.perf_counter(), mark)

    def _end_step_timing(self, at_work_end: bool = False) -> None:
        """The current step's duration ends now, once: at its close, or
        earlier when the timed steps end after its optimizer step but before
        it closes (at the next training call). Lightning and a plain loop
        fetch the next batch in between, and that is when the whole-run data
        ends the replay's steps (timed_steps_done): ending its time there,
        before the device is given up, keeps the others' work out of it, so
        that the replay need not be timed again alone.

        `at_work_end`: the script ended with this step open (its loop was
        over: no training call closed it), so its time ends where its
        optimizer step ended its work, if one did. What came after was the
        script's end of training, not the step's: Lightning's checkpoint at
        the end of `fit` made the last timed step of its replays 3.5 to 4.2 s
        against 0.6 s for the others (H200), where a framework counting
        oomdoc's accumulated micro-batches as its steps reached its own
        step limit with oomdoc's."""
        current = self._current
        if self._timing_ended is current:
            return
        self._timing_ended = current
        ended = self._work_ended if at_work_end else None
        if ended is not None and ended[0] is current:
            _step, ended_at, mark = ended
        else:
            ended_at, mark = time.perf_counter(), None
        current["duration_s"] = round(ended_at - self._step_started, 6)
        if self._step_cpu_wait is not None:
            thread_id, before = self._step_cpu_wait
            waited = thread_cpu_wait(thread_id)
            if waited is not None:
                current["cpu_wait_s"] = round(max(0.0, waited - before), 6)
        if self._step_timer is not None:
            # Step durations are compared between replays: a duration must be
            # the step's kernels, not their launch (events, not a sync).
            self._step_timer.close(current, self._step_started, ended_at, mark)
        if not (self._step_alone and self.device_to_itself):
            current["device_shared"] = True  # other replays' device work may be in its time

    def timed_steps_done(self) -> None:
        """No step timed from now on has the device alone (oomdoc.capture.gate),
        nor makes the replay's step time (`after_timed_steps`)."""
        if self._pending_close and not self.timed_steps_over:
            self._end_step_timing()  # its work is done: the rest is not its time
        self.timed_steps_over = True
        hook = self.on_timed_steps_done
        if hook is not None and (self.device_to_itself or self.sharing_untimed):
            hook()
            self.device_to_itself = self.sharing_untimed = False
