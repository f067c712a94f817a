"""Progress of the replays on stderr: a spinner on a terminal, plain lines
otherwise (logs, CI, tests that capture stderr). Replays that run side by
side (`--replay-jobs`) each get their line when they end; the spinner shows
those running."""

from __future__ import annotations

import itertools
import threading
import time


class Progress:
    FRAMES = "|/-\\"
    # The spinner's line is cut here: several labels may run at once.
    WIDTH = 150

    def __init__(self, stream, interactive: bool | None = None):
        self.stream = stream
        if interactive is None:
            try:
                interactive = stream.isatty()
            except (AttributeError, ValueError):
                interactive = False
        self.interactive = interactive
        self.count = 0
        self.started = time.perf_counter()
        # Replay number -> (its label, when it started).
        self._running: dict[int, tuple[str, float]] = {}
        self._lock = threading.Lock()
        # The spinner while replays run, and the event that ends it.
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def header(self, text: str) -> None:
        with self._lock:
            self._write(("\r\033[K" if self._thread else "") + f"oomdoc: {text}\n")

    def start(self, label: str, number: int | None = None) -> int:
        """A replay begins; returns its number (1, 2, ... in start order,
        unless the caller numbers them)."""
        with self._lock:
            number = number or self.count + 1
            self.count = max(self.count, number)
            self._running[number] = (f"replay {number}: {label}", time.perf_counter())
            if self.interactive and self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._spin, args=(self._stop,), daemon=True)
                self._thread.start()
        return number

    def _spin(self, stop: threading.Event) -> None:
        for frame in itertools.cycle(self.FRAMES):
            now = time.perf_counter()
            with self._lock:
                running = list(self._running.values())
                if running and not stop.is_set():
                    text = "  |  ".join(f"{label}  {now - since:5.1f}s" for label, since in running)
                    line = f"{frame} {text}"[: self.WIDTH - 16]
                    self._write(f"\r\033[K{line}  (total {now - self.started:.0f}s)")
            if stop.wait(0.1):
                return

    def finish(self, summary: str, number: int | None = None) -> None:
        """A replay ended (`number`: the one start() returned; the latest
        when not given)."""
        stop = None
        with self._lock:
            if number is None:
                number = max(self._running, default=self.count)
            label, since = self._running.pop(number, (f"replay {number}", time.perf_counter()))
            elapsed = time.perf_counter() - since
            if self._thread is not None:
                self._write(f"\r\033[K  {label}: {summary} ({elapsed:.1f} s)\n")
                if not self._running:
                    stop, self._thread = self._thread, None
                    self._stop.set()
            else:
                self._write(f"oomdoc: {label}: {summary} ({elapsed:.1f} s)\n")
        if stop is not None:
            stop.join()

    def total(self) -> float:
        return time.perf_counter() - self.started
