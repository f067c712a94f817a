"""The script's CUDA peak statistics under oomdoc's per-phase peak resets
(oomdoc.capture.peak_view), on a fake of the allocator behind torch's C
functions: `max_memory_allocated()` and friends read what they would without
oomdoc, and oomdoc's phase peaks survive the script's own resets."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.cuda import max_memory_allocated as imported_early  # before the view patches

from oomdoc.capture.backends import CudaBackend
from oomdoc.capture.peak_view import PeakView

MB = 2**20
POOLS = ("all", "small_pool", "large_pool")
# The stats the real allocator's resetPeakStats resets (and a few it keeps).
ARRAYS = ("allocation", "allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")


def _stat() -> dict:
    return {"current": 0, "peak": 0, "allocated": 0, "freed": 0}


class FakeAllocator:
    """The caching allocator's statistics as torch._C._cuda_memoryStats gives
    them, per device; memory freed stays reserved (a cache)."""

    def __init__(self) -> None:
        self.devices: dict[int, dict] = {}

    def _stats(self, device: int) -> dict:
        if device not in self.devices:
            stats: dict = {name: {pool: _stat() for pool in POOLS} for name in ARRAYS}
            stats["oversize_allocations"] = _stat()
            stats["num_ooms"] = 0
            self.devices[device] = stats
        return self.devices[device]

    def _change(self, device: int, nbytes: int, sign: int) -> None:
        stats = self._stats(device)
        pool = "large_pool" if nbytes >= MB else "small_pool"
        for name in ARRAYS:
            if name == "reserved_bytes":
                continue
            amount = 1 if name == "allocation" else nbytes
            for stat in (stats[name]["all"], stats[name][pool]):
                stat["current"] += sign * amount
                stat["allocated" if sign > 0 else "freed"] += amount
                stat["peak"] = max(stat["peak"], stat["current"])
        if sign > 0:
            reserved = stats["reserved_bytes"]
            allocated = stats["allocated_bytes"]["all"]["current"]
            if allocated > reserved["all"]["current"]:  # a new segment
                grow = allocated - reserved["all"]["current"]
                for stat in (reserved["all"], reserved[pool]):
                    stat["current"] += grow
                    stat["allocated"] += grow
                    stat["peak"] = max(stat["peak"], stat["current"])

    def alloc(self, nbytes: int, device: int = 0) -> None:
        self._change(device, nbytes, 1)

    def free(self, nbytes: int, device: int = 0) -> None:
        self._change(device, nbytes, -1)

    def memory_stats(self, device: int) -> dict:
        return copy.deepcopy(self._stats(device))  # a fresh dict each call, as torch's

    def reset_peak(self, device: int) -> None:
        stats = self._stats(device)
        for name in ARRAYS:
            for stat in stats[name].values():
                stat["peak"] = stat["current"]
        stats["oversize_allocations"]["peak"] = stats["oversize_allocations"]["current"]


@pytest.fixture
def fake(monkeypatch):
    allocator = FakeAllocator()
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", allocator.memory_stats, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", allocator.reset_peak, raising=False)
    monkeypatch.setattr(
        torch._C, "_accelerator_getDeviceStats", allocator.memory_stats, raising=False
    )
    monkeypatch.setattr(
        torch._C, "_accelerator_resetPeakStats", allocator.reset_peak, raising=False
    )
    monkeypatch.setattr(
        torch._C, "_accelerator_isAllocatorInitialized", lambda: True, raising=False
    )
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    return allocator


@pytest.fixture
def backend(fake, monkeypatch):
    """A CUDA backend with its view installed, on the fake allocator."""
    made = CudaBackend(None, device_index=0, deferred=True)  # reads no device properties
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_call", lambda *args, **kwargs: None)  # no set-up
    made.install(None)
    yield made
    made.uninstall()


def _script_peaks(device: int = 0) -> dict:
    stats = torch.cuda.memory_stats(device)
    return {
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "memory.max_memory_allocated": torch.cuda.memory.max_memory_allocated(device),
        "imported_early": imported_early(device),
        "accelerator": torch.accelerator.max_memory_allocated(device),
        "stats": stats["allocated_bytes.all.peak"],
        "nested": torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"],
    }


def _all_equal(peaks: dict, value: int) -> bool:
    return set(peaks.values()) == {value}


def test_oomdocs_resets_do_not_lower_what_the_script_reads(fake, backend):
    fake.alloc(100 * MB)
    fake.alloc(3000)
    fake.free(100 * MB)
    assert backend.read_and_reset_peak() == (100 * MB + 3000, 100 * MB + 3000)
    fake.alloc(10 * MB)
    assert backend.read_and_reset_peak() == (10 * MB + 3000, 100 * MB + 3000)
    assert fake.memory_stats(0)["allocated_bytes"]["all"]["peak"] == 10 * MB + 3000
    assert _all_equal(_script_peaks(), 100 * MB + 3000)
    assert torch.cuda.max_memory_reserved(0) == 100 * MB + 3000
    stats = torch.cuda.memory_stats(0)
    assert stats["allocated_bytes.large_pool.peak"] == 100 * MB
    assert stats["allocated_bytes.small_pool.peak"] == 3000
    assert stats["allocation.all.peak"] == 2
    # The current values and the counters are the allocator's own.
    assert stats["allocated_bytes.all.current"] == 10 * MB + 3000
    assert stats["allocated_bytes.all.allocated"] == 110 * MB + 3000
    assert torch.cuda.memory_allocated(0) == 10 * MB + 3000
    # A later, higher peak within a phase is the allocator's.
    fake.alloc(200 * MB)
    assert _all_equal(_script_peaks(), 210 * MB + 3000)


def test_the_scripts_own_reset_starts_its_peak_again(fake, backend):
    fake.alloc(100 * MB)
    fake.free(100 * MB)
    backend.read_and_reset_peak()  # a phase boundary
    torch.cuda.reset_peak_memory_stats(0)
    assert _all_equal(_script_peaks(), 0)
    fake.alloc(30 * MB)
    fake.free(30 * MB)
    backend.read_and_reset_peak()
    assert _all_equal(_script_peaks(), 30 * MB)
    # The deprecated spellings go through the same reset.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.cuda.reset_max_memory_allocated(0)
    assert _all_equal(_script_peaks(), 0)
    fake.alloc(5 * MB)
    torch.accelerator.reset_peak_memory_stats(0)
    fake.free(5 * MB)
    assert _all_equal(_script_peaks(), 5 * MB)


def test_a_reset_by_the_script_keeps_oomdocs_phase_peak(fake, backend):
    fake.alloc(80 * MB)
    fake.free(80 * MB)
    torch.cuda.reset_peak_memory_stats(0)  # in the middle of oomdoc's phase
    fake.alloc(20 * MB)
    fake.free(20 * MB)
    torch.cuda.memory.reset_peak_memory_stats(0)
    assert backend.read_and_reset_peak() == (80 * MB, 80 * MB)
    assert torch.cuda.max_memory_allocated(0) == 0
    fake.alloc(5 * MB)
    assert backend.read_and_reset_peak() == (5 * MB, 80 * MB)  # reserved stays cached
    assert torch.cuda.max_memory_allocated(0) == 5 * MB


def test_oomdocs_reads_are_taken_into_the_scripts_peaks_later_and_the_same(fake, backend):
    """oomdoc's reads at its phase boundaries are folded into the script's
    peaks when the script reads them, or every _FOLD_EVERY reads: the same
    peaks as folding each at once; a script's reset drops those not folded."""
    from oomdoc.capture.peak_view import _FOLD_EVERY

    fake.alloc(100 * MB)
    fake.free(100 * MB)
    for _ in range(2 * _FOLD_EVERY + 3):  # phase boundaries, more than are kept unfolded
        fake.alloc(MB)
        backend.read_and_reset_peak()
        fake.free(MB)
    assert len(backend._peaks._unfolded[0]) < _FOLD_EVERY
    assert _all_equal(_script_peaks(), 100 * MB)
    fake.alloc(40 * MB)
    fake.free(40 * MB)
    backend.read_and_reset_peak()  # unfolded when the script resets: dropped
    torch.cuda.reset_peak_memory_stats(0)
    assert _all_equal(_script_peaks(), 0)
    fake.alloc(2 * MB)
    fake.free(2 * MB)
    backend.read_and_reset_peak()
    backend.read_and_reset_peak()
    assert _all_equal(_script_peaks(), 2 * MB)


def test_devices_are_apart(fake, backend):
    fake.alloc(50 * MB, device=1)
    fake.free(50 * MB, device=1)
    fake.alloc(7 * MB, device=0)
    fake.free(7 * MB, device=0)
    backend.read_and_reset_peak()  # device 0's
    torch.cuda.reset_peak_memory_stats(1)
    assert torch.cuda.max_memory_allocated(0) == 7 * MB
    assert torch.cuda.max_memory_allocated(1) == 0


def test_a_reset_torch_refuses_raises_torchs_own_error(fake, monkeypatch):
    def refuse(what):
        def refused(device):
            raise RuntimeError(f"{what}: invalid device argument {device}")

        return refused

    monkeypatch.setattr(torch._C, "_cuda_memoryStats", refuse("read"))
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", refuse("reset"))
    view = PeakView()
    view.install()
    try:
        with pytest.raises(RuntimeError, match="^reset: invalid device argument 3"):
            torch.cuda.reset_peak_memory_stats(3)
    finally:
        view.uninstall()


def test_uninstall_restores_torchs_functions(fake):
    view = PeakView()
    view.install()
    assert torch._C._cuda_memoryStats is not fake.memory_stats
    view.uninstall()
    assert torch._C._cuda_memoryStats == fake.memory_stats
    assert torch._C._cuda_resetPeakMemoryStats == fake.reset_peak
    assert torch._C._accelerator_getDeviceStats == fake.memory_stats
    assert torch._C._accelerator_resetPeakStats == fake.reset_peak
