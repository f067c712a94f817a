"""pytest plugin: `@pytest.mark.oomdoc_limit("1.5GiB")` fails a test whose
peak tensor memory exceeds the limit, and shows the allocation sites at the
peak (in the manner of pytest-memray's `limit_memory`).

Only marked tests are measured, in-process, during the test function itself
(not its fixtures):
- on CPU (`--oomdoc-device cpu`, or `auto` without CUDA) oomdoc's simulated
  device counts every CPU tensor storage the test creates or touches, with no
  capacity (nothing is raised); the byte counts are exact and repeatable;
- on CUDA the caching allocator's peak allocated bytes (`max_memory_allocated`,
  memory held before the test included); the sites come from replaying the
  allocator's trace up to the peak.
Everything installed for a test is removed when it ends.
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass, field

import pytest
from tabulate import tabulate

MARKER = "oomdoc_limit"
SHOWN_SITES = 5
# On CPU the sites are recorded when the test first passes its limit and then
# each time it reaches a high this much above the last record, so the shown
# sites are within this fraction of the peak at a bounded cost.
SITE_RECORD_STEP = 0.02
SECTION_TITLE = "oomdoc: over the memory limit"


@dataclass
class Measurement:
    device: str  # "simulated" or "cuda"
    limit_bytes: int
    peak_bytes: int = 0
    sites_at_bytes: int | None = None  # the live bytes when the sites were recorded
    sites: list[dict] = field(default_factory=list)
    breakdown: dict | None = None

    @property
    def over_limit(self) -> bool:
        return self.peak_bytes > self.limit_bytes

    def summary(self) -> str:
        from oomdoc.sizes import format_bytes

        what = "simulated device: CPU tensors" if self.device == "simulated" else "CUDA allocator"
        return f"peak tensor memory {format_bytes(self.peak_bytes)} of a {format_bytes(self.limit_bytes)} limit ({what})"

    def failure_text(self, nodeid: str, rootdir: str) -> str:
        from oomdoc.model import Site, parse
        from oomdoc.reporters.tables import site_table
        from oomdoc.sizes import format_bytes

        lines = [
            f"{nodeid} was limited to {format_bytes(self.limit_bytes)} of tensor memory "
            f"but its peak was {format_bytes(self.peak_bytes)}"
            + (
                " (every CPU tensor counts on oomdoc's simulated device)"
                if self.device == "simulated"
                else " (CUDA)"
            )
        ]
        if self.breakdown:
            lines.append(
                "At the peak: "
                + ", ".join(
                    f"{category} {format_bytes(nbytes)}"
                    for category, nbytes in self.breakdown.items()
                    if nbytes
                )
            )
        headers, rows = site_table([parse(Site, site) for site in self.sites], rootdir, SHOWN_SITES)
        if rows:
            moment = ""
            if self.sites_at_bytes is not None and self.sites_at_bytes != self.peak_bytes:
                moment = f" (at {format_bytes(self.sites_at_bytes)})"
            lines += [
                "",
                f"Top {len(rows)} allocation sites at the peak{moment}",
                tabulate(
                    rows,
                    headers=headers,
                    colalign=("right",) + ("left",) * (len(headers) - 1),
                    disable_numparse=True,
                ),
            ]
        return "\n".join(lines)


# ------------------------------------------------------------------ CPU


_active_backends: weakref.WeakSet = weakref.WeakSet()


def _disable_in_forked_child() -> None:
    # DataLoader workers fork from the test process: their tensors are not
    # the test's. One fork hook for the whole session, not one per test.
    for backend in list(_active_backends):
        backend.enabled = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disable_in_forked_child)


def _limit_backend_class():
    from oomdoc.capture.backends import SimulatedBackend

    class LimitBackend(SimulatedBackend):
        """The simulated device with no capacity, keeping the allocation sites
        near its high-water mark once the limit is passed."""

        def __init__(self, limit_bytes: int):
            super().__init__(capacity_bytes=sys.maxsize)
            self.limit_bytes = limit_bytes
            self.high_water = 0
            self.sites_at_bytes: int | None = None
            self.sites: list[dict] = []
            self.breakdown: dict | None = None

        def install(self, tracker) -> None:
            from oomdoc.capture.simulated_dispatch import _CountingMode

            self.tracker = tracker
            self._mode = _CountingMode(self)
            self._mode.__enter__()
            self.enabled = True
            _active_backends.add(self)

        def uninstall(self) -> None:
            super().uninstall()
            _active_backends.discard(self)
            # Storages that outlive the test must not call back into it.
            for finalizer in list(self._finalizers.values()):
                finalizer.detach()
            self._finalizers.clear()
            self._records.clear()

        def _register(self, key, storage, tensor, depth: int = 1) -> None:
            super()._register(key, storage, tensor, depth + 1)
            if self._live > self.high_water:
                self.high_water = self._live
                if self._live > self.limit_bytes and (
                    self.sites_at_bytes is None
                    or self._live > self.sites_at_bytes * (1 + SITE_RECORD_STEP)
                ):
                    self._record_sites()

        def read_and_reset_peak(self):
            self.high_water = max(self.high_water, self._peak)  # in-place resizes move only _peak
            return super().read_and_reset_peak()

        def _record_sites(self) -> None:
            tracker = self.tracker
            if tracker is None:
                return
            self.enabled = False  # the tracker's own work does not count
            try:
                self.breakdown, self.sites = tracker.breakdown_and_sites()
                self.sites_at_bytes = self._live
            finally:
                self.enabled = True

        def peak_bytes(self) -> int:
            return max(self.high_water, self._peak)

    return LimitBackend


class SimulatedMeter:
    def __init__(self, limit_bytes: int):
        from oomdoc.capture.tracker import Tracker

        self.backend = _limit_backend_class()(limit_bytes)
        self.tracker = Tracker(self.backend)

    def start(self) -> None:
        self.tracker.install()
        self.backend.install(self.tracker)

    def stop(self) -> Measurement:
        backend = self.backend
        measurement = Measurement("simulated", backend.limit_bytes)
        try:
            measurement.peak_bytes = backend.peak_bytes()
            if measurement.over_limit and backend.sites_at_bytes is None:
                backend._record_sites()  # a peak reached through in-place resizes
            measurement.sites, measurement.breakdown = backend.sites, backend.breakdown
            measurement.sites_at_bytes = backend.sites_at_bytes
        finally:
            self.tracker.uninstall()
            backend.uninstall()
        return measurement


# ----------------------------------------------------------------- CUDA


class CudaMeter:
    HISTORY_ENTRIES = 200_000

    def __init__(self, limit_bytes: int):
        import torch

        self.torch = torch
        self.limit_bytes = limit_bytes
        self.device_index = torch.cuda.current_device()
        self.recording = False

    def start(self) -> None:
        cuda = self.torch.cuda
        cuda.synchronize(self.device_index)
        cuda.reset_peak_memory_stats(self.device_index)
        try:
            cuda.memory._record_memory_history(
                enabled="all", context="alloc", stacks="python", max_entries=self.HISTORY_ENTRIES
            )
            self.recording = True
        except Exception:
            self.recording = False

    def stop(self) -> Measurement:
        cuda = self.torch.cuda
        measurement = Measurement("cuda", self.limit_bytes)
        try:
            cuda.synchronize(self.device_index)
            measurement.peak_bytes = int(cuda.max_memory_allocated(self.device_index))
            if measurement.over_limit and self.recording:
                snapshot = cuda.memory._snapshot()
                traces = snapshot.get("device_traces") or []
                trace = traces[self.device_index] if self.device_index < len(traces) else []
                measurement.sites = sites_at_trace_peak(trace)
        finally:
            if self.recording:
                cuda.memory._record_memory_history(enabled=None)
        return measurement


def sites_at_trace_peak(trace: list[dict]) -> list[dict]:
    """Replay a CUDA allocator trace to its highest point and group the blocks
    live then by the user's line of code, largest first.

    Allocated bytes go up at `alloc` and down at `free_requested` (as
    `memory_allocated()` does); a block allocated before the trace began only
    shows up when it is freed, which lowers the curve all the same.
    """
    from oomdoc import frames

    # By block address (None in a malformed event).
    live: dict[int | None, int] = {}
    level = best_level = 0
    best_index = -1
    for index, event in enumerate(trace):
        action, address, size = event.get("action"), event.get("addr"), int(event.get("size") or 0)
        if action == "alloc":
            live[address] = size
            level += size
            if level > best_level:
                best_level, best_index = level, index
        elif action == "free_requested":
            level -= live.pop(address, size)
    if best_index < 0:
        return []
    at_peak: dict[int | None, dict] = {}
    for event in trace[: best_index + 1]:
        action, address = event.get("action"), event.get("addr")
        if action == "alloc":
            at_peak[address] = event
        elif action == "free_requested":
            at_peak.pop(address, None)
    grouped: dict[tuple, dict] = {}
    for event in at_peak.values():
        location = frames.pick_user_location(event.get("frames") or [])
        key = ((location or {}).get("file"), (location or {}).get("line"))
        # No category: without the test's tensors at hand it is not known on CUDA.
        entry = grouped.setdefault(
            key, {"bytes": 0, "count": 0, "location": location, "shape": None, "dtype": None}
        )
        entry["bytes"] += int(event.get("size") or 0)
        entry["count"] += 1
    return sorted(grouped.values(), key=lambda entry: entry["bytes"], reverse=True)


# ---------------------------------------------------------------- hooks


_MEASUREMENT = pytest.StashKey[Measurement]()
_LIMIT = pytest.StashKey[int]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("oomdoc", "oomdoc memory limits")
    group.addoption(
        "--oomdoc-device",
        choices=("auto", "cpu", "cuda"),
        default=None,
        help="Where @pytest.mark.oomdoc_limit measures: cpu (oomdoc's simulated device), cuda, "
        "or auto (CUDA when available; the default).",
    )
    parser.addini(
        "oomdoc_device", "Default for --oomdoc-device (auto, cpu or cuda).", default="auto"
    )


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f'{MARKER}(size): fail the test when its peak tensor memory exceeds size, e.g. "1.5GiB" or "512MiB" (oomdoc).',
    )


def _device(config) -> str:
    choice = config.getoption("oomdoc_device") or config.getini("oomdoc_device") or "auto"
    if choice not in ("auto", "cpu", "cuda"):
        raise pytest.UsageError(f"oomdoc_device must be auto, cpu or cuda, not {choice!r}")
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--oomdoc-device cuda: CUDA is not available")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def _limit_of(marker) -> int:
    from oomdoc.sizes import parse_size

    if len(marker.args) != 1 or marker.kwargs:
        pytest.fail(
            f'@pytest.mark.{MARKER} takes one size, e.g. @pytest.mark.{MARKER}("1.5GiB")',
            pytrace=False,
        )
    try:
        return parse_size(marker.args[0])
    except ValueError as exc:
        pytest.fail(f"@pytest.mark.{MARKER}: {exc}", pytrace=False)


def pytest_runtest_setup(item) -> None:
    """A bad limit is an error of the test's setup, reported before it runs."""
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        item.stash[_LIMIT] = _limit_of(marker)


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    limit_bytes = pyfuncitem.stash.get(_LIMIT, None)
    if limit_bytes is None:
        yield
        return
    meter = (
        CudaMeter(limit_bytes)
        if _device(pyfuncitem.config) == "cuda"
        else SimulatedMeter(limit_bytes)
    )
    meter.start()
    try:
        yield
    finally:
        pyfuncitem.stash[_MEASUREMENT] = meter.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call":
        return
    measurement = item.stash.get(_MEASUREMENT, None)
    if measurement is None:
        return
    report = outcome.get_result()
    report.user_properties.append(("oomdoc_peak_bytes", measurement.peak_bytes))
    if report.passed and measurement.over_limit:
        text = measurement.failure_text(item.nodeid, str(item.config.rootpath))
        report.outcome = "failed"
        report.longrepr = text
        report.sections.append((SECTION_TITLE, measurement.summary()))


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_report_teststatus(report, config):
    outcome = yield
    if (
        report.when == "call"
        and report.failed
        and any(title == SECTION_TITLE for title, _ in report.sections)
    ):
        outcome.force_result(("failed", "M", "MEMORY LIMIT"))
