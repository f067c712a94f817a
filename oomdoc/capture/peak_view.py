"""The script's own view of the CUDA allocator's peak statistics.

oomdoc reads the allocator's peaks at every phase boundary and resets them
(`torch.cuda.reset_peak_memory_stats`), so that each phase has its own peak.
Without more, the script's `torch.cuda.max_memory_allocated()`,
`max_memory_reserved()`, `memory_stats()` and `memory_summary()` would then
show the peak of oomdoc's last phase, not the script's.

`PeakView` replaces the two functions of torch's C module that all of these
go through (torch/cuda/memory.py looks them up on `torch._C` at each call;
torch.accelerator's pair likewise): the allocator's statistics and its peak
reset. Per device it keeps two sets of folded peaks, one for each reader:

* the script's: what oomdoc's resets took away since the script's last reset.
  Every `peak` the script reads is the larger of this and the allocator's.
* oomdoc's: what the script's own resets took away since oomdoc's last reset,
  so that the phase peak oomdoc reads next is not lost by them.

A reset by either side folds the allocator's peaks into the other side's set,
clears its own, and really resets the allocator. Every stat with a `peak`
(allocated/reserved/active/requested bytes, allocation, segment,
inactive_split..., for all/small_pool/large_pool, oversize_*) is folded: those
the allocator does not reset only ever grow, so folding them changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

Path = tuple

# (read, reset) pairs of torch._C, each pair one view of the same allocator.
SEAMS = (
    ("_cuda_memoryStats", "_cuda_resetPeakMemoryStats"),
    ("_accelerator_getDeviceStats", "_accelerator_resetPeakStats"),
)


def _peak_stats(stats: dict, prefix: Path = ()) -> list[tuple[Path, dict]]:
    """Every (path, stat) in the allocator's nested statistics whose stat has a peak."""
    found = []
    for key, value in stats.items():
        if isinstance(value, dict):
            path = (*prefix, key)
            if "peak" in value:
                found.append((path, value))
            else:
                found.extend(_peak_stats(value, path))
    return found


def _fold(folded: dict[Path, int], stats: dict) -> None:
    for path, stat in _peak_stats(stats):
        peak = stat["peak"]
        if peak > folded.get(path, -1):
            folded[path] = peak


def _raise_peaks(stats: dict, folded: dict[Path, int]) -> dict:
    """`stats` (a fresh dict from the allocator) with each peak at least the folded one."""
    if folded:
        for path, stat in _peak_stats(stats):
            earlier = folded.get(path)
            if earlier is not None and earlier > stat["peak"]:
                stat["peak"] = earlier
    return stats


# oomdoc's reads whose peaks the script's set has not taken yet, at most.
_FOLD_EVERY = 32


class PeakView:
    def __init__(self) -> None:
        self._originals: dict[str, Callable] = {}
        self._installed: dict[str, Callable] = {}
        self._script: dict[object, dict[Path, int]] = {}
        # oomdoc's reads not yet folded into the script's set: folded when
        # the script reads (rare), else every _FOLD_EVERY. Walking the ~40
        # peaks of a read was 0.06 ms of each phase boundary's 0.09 on an
        # H200, two of them before each forward's first kernel.
        self._unfolded: dict[object, list[dict]] = {}
        self._oomdoc: dict[object, dict[Path, int]] = {}
        self._lock = threading.Lock()

    def _script_peaks(self, device) -> dict[Path, int]:
        """The script's folded peaks, with oomdoc's reads since taken in."""
        folded = self._script.setdefault(device, {})
        for stats in self._unfolded.pop(device, ()):
            _fold(folded, stats)
        return folded

    # ----------------------------------------------------------- seam

    def install(self) -> None:
        C = torch._C
        for read_name, reset_name in SEAMS:
            read, reset = getattr(C, read_name, None), getattr(C, reset_name, None)
            if read is None or reset is None:
                continue
            self._originals[read_name], self._originals[reset_name] = read, reset
            self._installed[read_name] = self._script_read(read)
            self._installed[reset_name] = self._script_reset(read, reset)
        for name, function in self._installed.items():
            setattr(C, name, function)

    def uninstall(self) -> None:
        C = torch._C
        for name, function in self._installed.items():
            if getattr(C, name, None) is function:  # not patched again on top of ours
                setattr(C, name, self._originals[name])
        self._installed.clear()

    def _original(self, name: str) -> Callable:
        return self._originals.get(name) or getattr(torch._C, name)

    def _script_read(self, read: Callable) -> Callable:
        def memory_stats(device):
            stats = read(device)
            with self._lock:
                return _raise_peaks(stats, self._script_peaks(device))

        return memory_stats

    def _script_reset(self, read: Callable, reset: Callable) -> Callable:
        def reset_peak_stats(device):
            with self._lock:
                try:
                    stats = read(device)
                except Exception:  # an index torch refuses (before CUDA starts): its error
                    return reset(device)
                _fold(self._oomdoc.setdefault(device, {}), stats)
                self._script.pop(device, None)
                self._unfolded.pop(device, None)
                return reset(device)

        return reset_peak_stats

    # --------------------------------------------------------- oomdoc's side

    def stats(self, device: int) -> dict:
        """The allocator's own statistics (peaks since the last reset by either side)."""
        return self._original("_cuda_memoryStats")(device)

    def read_and_reset(self, device: int) -> dict:
        """oomdoc's phase boundary: the statistics with the peaks since oomdoc's
        last reset (whatever the script reset since), then reset the peaks,
        which the script keeps seeing."""
        read = self._original("_cuda_memoryStats")
        with self._lock:
            stats = read(device)
            earlier = self._oomdoc.pop(device, None)
            if earlier:
                # Raised in place below with peaks the script reset away:
                # its own set takes this read now, before that.
                _fold(self._script.setdefault(device, {}), stats)
                _raise_peaks(stats, earlier)
            else:
                unfolded = self._unfolded.setdefault(device, [])
                unfolded.append(stats)  # never changed: folded later as read
                if len(unfolded) >= _FOLD_EVERY:
                    self._script_peaks(device)
            self._original("_cuda_resetPeakMemoryStats")(device)
        return stats
