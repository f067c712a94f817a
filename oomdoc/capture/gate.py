"""One replay on the device at a time, however many run side by side.

`oomdoc run --replay-jobs N` runs replays side by side: their start-up, the
script's imports and its model built on the CPU overlap. Peaks and step times
are what a replay measures, so the device work must not: a child takes the
device lock just before its first device work and holds it until it exits.

The lock is an flock on a file the parent creates (`device_lock` in the
child's configuration): the kernel releases it when the process dies, so a
child killed while holding it (a hung replay at its timeout) never blocks the
others. The child writes when it began to wait and when it got the lock to
its status file; the parent's timeout does not count the wait, and neither
do the replay's step times.

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


def patch_lazy_init(replacement: Callable[[], Any]) -> Callable[[], None]:
    """Make every loaded `torch.cuda._lazy_init` (torch.cuda's own, and the
    copies its submodules imported by name) `replacement`; returns the undo."""
    import torch.cuda

    original = torch.cuda._lazy_init
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("torch") and getattr(module, "_lazy_init", None) is original:
            module._lazy_init = replacement  # type: ignore[attr-defined]
            patched.append(module)

    def undo() -> None:
        for module in patched:
            module._lazy_init = original

    return undo


class DeviceGate:
    """The device lock of one child (see the module's docstring)."""

    def __init__(self, config: dict):
        self.path = str(config["path"])
        self.status_path = config.get("status")
        self._descriptor: int | None = None
        # Two threads of the script may start CUDA at once: one waits for the
        # other (a second flock in this process would wait for ever).
        self._thread_lock = threading.Lock()
        self.waited_s = 0.0
        # Called with the seconds waited, once the lock is held.
        self.on_acquired: list[Callable[[float], None]] = []

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def acquire(self) -> None:
        """Wait for the device; held until this process exits."""
        with self._thread_lock:
            if self._descriptor is None:
                self._acquire()

    def _acquire(self) -> None:
        started = time.time()
        self._write_status({"waiting_since": started})
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)  # Ctrl-C and SIGTERM still end the wait
        except BaseException:
            os.close(descriptor)
            raise
        self._descriptor = descriptor
        # A process forked from here on (DataLoader workers) must not keep the
        # lock alive after this one dies: its copy of the descriptor is closed.
        os.register_at_fork(after_in_child=self._close_in_fork)
        held = time.time()
        self.waited_s = held - started
        self._write_status({"waiting_since": started, "held_since": held})
        for callback in self.on_acquired:
            callback(self.waited_s)

    def _close_in_fork(self) -> None:
        if self._descriptor is not None:
            try:
                os.close(self._descriptor)
            except OSError:
                pass
            self._descriptor = None

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
        """Take the lock where this device's work begins; the wait is left
        out of the step it happens in."""
        self.on_acquired.append(tracker.exclude_seconds)
        if backend_kind == "cuda":
            self._before_cuda_starts()
        else:
            tracker.on_first_step = self.acquire

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
