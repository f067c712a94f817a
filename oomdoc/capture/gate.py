"""Replays side by side share the device without disturbing what they measure.

`oomdoc run --replay-jobs N` runs replays side by side: their start-up, the
script's imports and its model built on the CPU overlap. Peaks and step
times are what a replay measures. Peaks are per process (each child is
capped with the capacity), so they do not depend on the others as long as
the physical card has room for all of them; step times do.

The lock is an flock on a file the parent creates (`device_lock` in the
child's configuration): the kernel releases it when the process dies, so a
child killed while holding it (a hung replay at its timeout) never blocks the
others. The child writes to its status file how long it has waited in all
and when its current wait began; the parent's timeout does not count the
waits, and neither do the replay's step times.

Two ways to share it:

* exclusive (the card may not have room for every lane): a child takes the
  lock exclusively just before its first device work and holds it until it
  exits, so device work is one at a time.
* shared (`shared` in the configuration: the parent found room on the card
  for every lane's capped process at once, oomdoc.replay.lanes.room_to_share):
  untimed device work (moving the model, the first step, steps that end in
  an OOM) holds the lock shared and overlaps; only the steps whose times are
  used hold it exclusively (the tracker's on_timed_steps, from just before
  the first step ends until the last one has ended: oomdoc.capture.tracker).
  A child waiting for the exclusive lock goes through a turnstile (a second
  flock) that new shared holders also pass, so a stream of shared holders
  cannot keep it waiting. A child gives up the lock only after its queued
  device work has finished (CUDA: synchronize), so that work cannot run
  inside another child's timed steps. A child configured with the turnstile
  but not `shared` (a replay timed again alone) holds the lock exclusively
  from its first device work to its end, as in the exclusive way. A shared
  child whose step times are never used (`untimed`: a check of the
  prescription's peak) never holds it exclusively: it gives it up and takes
  it again through the turnstile at each step's end, so that a child waiting
  to time its steps waits for one of its steps at most.

Where device work begins: on CUDA, CUDA's lazy initialisation
(`torch.cuda._lazy_init`, which both Python and C++ call), so a waiting child
has no CUDA context and holds no device memory; the capture's own CUDA set-up
(memory cap, allocator history, OOM observer) waits until then too
(CudaBackend(deferred=True)). On the simulated device, the start of the first
step: the first outermost model call, backward or optimizer step.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from typing import Any, Callable

from oomdoc.child_config import DeviceLock


def patch_lazy_init(replacement: Callable[[], Any]) -> Callable[[], None]:
    """Make every loaded `torch.cuda._lazy_init` (torch.cuda's own, and the
    copies its submodules imported by name) `replacement`; returns the undo."""
    import torch.cuda

    original = torch.cuda._lazy_init
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("torch") and getattr(module, "_lazy_init", None) is original:
            setattr(module, "_lazy_init", replacement)  # noqa: B010 (any torch module that holds it)
            patched.append(module)

    def undo() -> None:
        for module in patched:
            setattr(module, "_lazy_init", original)  # noqa: B010 (as above)

    return undo


def _synchronize_cuda() -> None:
    """Wait for this process's queued CUDA work, if CUDA started."""
    import torch.cuda

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


SHARED, EXCLUSIVE = "shared", "exclusive"


class DeviceGate:
    """The device lock of one child (see the module's docstring)."""

    def __init__(self, lock: DeviceLock):
        self.path = lock.path
        self.status_path = lock.status
        # Untimed device work may overlap other children's (the card has room).
        self.shared = bool(lock.shared)
        self.turnstile_path = lock.turnstile
        # Shared, and its step times never used: it never holds the lock alone.
        self.untimed = bool(lock.untimed) and self.shared
        self.shared_steps = max(1, int(lock.shared_steps or 1))
        self._descriptor: int | None = None
        self.mode: str | None = None  # SHARED, EXCLUSIVE, or None: not held
        # Two threads of the script may start CUDA at once: one waits for the
        # other (a second flock in this process would wait for ever).
        self._thread_lock = threading.Lock()
        # Seconds waited in all, over every time the lock was taken.
        self.waited_s = 0.0
        # Called with the seconds of each wait, once the lock is held.
        self.on_acquired: list[Callable[[float], None]] = []
        # Waits for this process's queued device work (set by install).
        self.synchronize: Callable[[], None] | None = None
        self.compiled = False  # the script called torch.compile

    @property
    def held(self) -> bool:
        return self.mode is not None

    def acquire(self) -> None:
        """Device work begins: shared when configured so, else exclusive
        until this process exits."""
        with self._thread_lock:
            if self.mode is None:
                self._take(SHARED if self.shared else EXCLUSIVE)

    def take_alone(self) -> None:
        """The device to this process alone (the timed steps), released by
        `release`."""
        with self._thread_lock:
            if self.mode == EXCLUSIVE:
                return
            if self.mode == SHARED:
                # Give up the shared lock before queueing for the exclusive
                # one: two holders that both wait for it would wait for each
                # other (and flock's conversion is not atomic anyway).
                self._release()
            self._take(EXCLUSIVE)

    def pass_turn(self) -> None:
        """Let a child waiting to hold the lock alone go first (an untimed
        child's step ended): given up and taken again through the turnstile."""
        with self._thread_lock:
            if self.mode == SHARED:
                self._release()
                self._take(SHARED)

    def release(self) -> None:
        """This process's device work no longer needs the lock: its queued
        work is finished first, so none of it runs in another's timed steps."""
        with self._thread_lock:
            if self.mode is not None:
                self._release()

    def _release(self) -> None:
        if self.synchronize is not None:
            try:
                self.synchronize()
            except Exception:  # a broken context: nothing more of it will run
                pass
        if self._descriptor is not None:
            fcntl.flock(self._descriptor, fcntl.LOCK_UN)
        self.mode = None

    def _take(self, mode: str) -> None:
        started = time.time()
        self._write_status({"waited_s": self.waited_s, "waiting_since": started})
        if self._descriptor is None:
            self._descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            # A process forked from here on (DataLoader workers) must not keep
            # the lock alive after this one dies: its copy is closed.
            os.register_at_fork(after_in_child=self._close_in_fork)
        operation = fcntl.LOCK_SH if mode == SHARED else fcntl.LOCK_EX
        # Ctrl-C and SIGTERM still end the waits.
        if self.turnstile_path:
            turnstile = os.open(self.turnstile_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(turnstile, fcntl.LOCK_EX)
                fcntl.flock(self._descriptor, operation)
            finally:
                os.close(turnstile)  # and with it the turnstile's lock
        else:
            fcntl.flock(self._descriptor, operation)
        self.mode = mode
        held = time.time()
        waited = held - started
        self.waited_s += waited
        self._write_status(
            {"waited_s": self.waited_s, "waiting_since": started, "held_since": held}
        )
        for callback in self.on_acquired:
            callback(waited)

    def _close_in_fork(self) -> None:
        if self._descriptor is not None:
            try:
                os.close(self._descriptor)
            except OSError:
                pass
            self._descriptor = None
            self.mode = None

    def _write_status(self, status: dict) -> None:
        if not self.status_path:
            return
        temporary = self.status_path + ".tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                json.dump(status, handle)
            os.replace(temporary, self.status_path)
        except OSError:
            pass

    # ------------------------------------------------------------ where
    def install(self, backend_kind: str, tracker: Any) -> None:
        """Take the lock where this device's work begins; each wait is left
        out of the step it happens in. Shared: the tracker asks for the
        device alone around the steps it times."""
        self.on_acquired.append(tracker.exclude_seconds)
        if backend_kind == "cuda":
            self.synchronize = _synchronize_cuda
            self._before_cuda_starts()
        else:
            tracker.on_first_step = self.acquire
        if self.untimed:
            self._note_compile()
            tracker.share_device_untimed(
                self.pass_turn, self.release, self.autotunes, self.take_alone
            )
        elif self.shared:
            self._note_compile()
            tracker.share_device(
                self.take_alone, self.release, self.autotunes, self.shared_steps, self.pass_turn
            )

    def autotunes(self) -> bool:
        """Whether the script has the device choose kernels by timing them:
        cuDNN's benchmark mode, or torch.compile (Inductor may benchmark)."""
        import torch.backends.cudnn

        return self.compiled or bool(torch.backends.cudnn.benchmark)

    def _note_compile(self) -> None:
        import torch

        original = torch.compile

        def compile_noted(*args, **kwargs):
            self.compiled = True
            return original(*args, **kwargs)

        compile_noted.__wrapped__ = original  # type: ignore[attr-defined]
        compile_noted.__doc__ = original.__doc__
        torch.compile = compile_noted

    def _before_cuda_starts(self) -> None:
        import torch.cuda

        if torch.cuda.is_initialized():
            self.acquire()
            return
        original_init = torch.cuda._lazy_init
        tls = getattr(torch.cuda, "_tls", None)

        def lazy_init() -> None:
            if not (torch.cuda.is_initialized() or hasattr(tls, "is_initializing")):
                self.acquire()
            original_init()

        patch_lazy_init(lazy_init)
        original_set_device = torch.cuda.set_device
        device_index = getattr(torch.cuda, "_get_device_index", None)

        def set_device(device) -> None:
            # Selecting device 0, the one CUDA starts on, before CUDA started
            # changes nothing but would create the context now: frameworks do
            # it while parsing their arguments (TrainingArguments), long before
            # the model reaches the device.
            if not torch.cuda.is_initialized() and device_index is not None:
                try:
                    if device_index(device) == 0:
                        return
                except Exception:
                    pass
            original_set_device(device)

        torch.cuda.set_device = set_device
