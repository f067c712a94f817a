"""Progress of the replays on stderr: a spinner per replay on a terminal,
plain lines otherwise (logs, CI, tests that capture stderr)."""

from __future__ import annotations

import itertools
import threading
import time


class Progress:
    FRAMES = "|/-\\"

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
        self._label = ""
        self._replay_started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def header(self, text: str) -> None:
        self._write(f"oomdoc: {text}\n")

    def start(self, label: str) -> None:
        self.count += 1
        self._label = f"replay {self.count}: {label}"
        self._replay_started = time.perf_counter()
        if not self.interactive:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        for frame in itertools.cycle(self.FRAMES):
            elapsed = time.perf_counter() - self._replay_started
            total = time.perf_counter() - self.started
            self._write(f"\r\033[K{frame} {self._label}  {elapsed:5.1f}s  (total {total:.0f}s)")
            if self._stop.wait(0.1):
                return

    def finish(self, summary: str) -> None:
        elapsed = time.perf_counter() - self._replay_started
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._write(f"\r\033[K  {self._label}: {summary} ({elapsed:.1f} s)\n")
        else:
            self._write(f"oomdoc: {self._label}: {summary} ({elapsed:.1f} s)\n")

    def total(self) -> float:
        return time.perf_counter() - self.started
