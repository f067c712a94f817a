"""The CUDA backend: the real caching allocator, optionally capped to a
smaller card."""

from __future__ import annotations

import os
import sys
from itertools import compress
from operator import attrgetter, methodcaller

import torch

from oomdoc import frames
from oomdoc.capture import nvml_handle
from oomdoc.capture.backend_base import AllocationObserver, Backend
from oomdoc.capture.modules import phase_from_frames
from oomdoc.capture.peak_view import PeakView
from oomdoc.capture.stack_recording import DetailPolicy, detail_policy

_IS_CUDA = attrgetter("is_cuda")
_GET_DEVICE = methodcaller("get_device")


class CudaBackend(Backend):
    """The real CUDA caching allocator, optionally capped to a smaller card."""

    kind = "cuda"
    # Enough trace entries to show what happened just before an OOM without
    # costing much host memory.
    HISTORY_ENTRIES = 20000

    def __init__(
        self, capacity_bytes: int | None, device_index: int | None = None, deferred: bool = False
    ):
        # `deferred`: nothing here starts CUDA; the set-up in `install` runs
        # when the script starts it (oomdoc.capture.child.make_backend).
        self.deferred = deferred and not torch.cuda.is_initialized()
        # A process forked before CUDA started inherits the queued set-up:
        # there it is not this backend's (the fork makes its own).
        self._pid = os.getpid()
        if device_index is None:
            # Before CUDA starts, the current device is 0.
            device_index = 0 if self.deferred else torch.cuda.current_device()
        self.device_index = device_index
        self._requested_capacity = int(capacity_bytes) if capacity_bytes else None
        self._total: int | None = None
        self._name = "?"
        if not self.deferred:
            self._read_properties()
        self.tracker: AllocationObserver | None = None
        # `_recording`: the allocation history was set up (blocks may hold
        # frames). `_detailed`: the module scopes run now, and where the
        # history was set up, allocations record their stacks
        # (stack_recording decides when: `_detail_policy`).
        self._recording = False
        self._detail_policy: DetailPolicy | None = None
        self._detailed = True
        self._torch_snapshot = None
        self._device_count: int | None = None
        # The script's max_memory_allocated() etc. despite the resets below.
        self._peaks = PeakView()

    @property
    def _one_device(self) -> bool:
        """This process sees one GPU: a tensor on CUDA is on this device."""
        if self._device_count is None:
            self._device_count = torch.cuda.device_count()
        return self._device_count == 1

    def _read_properties(self) -> None:
        properties = torch.cuda.get_device_properties(self.device_index)
        self._total = int(properties.total_memory)
        self._name = properties.name

    @property
    def _capacity(self) -> int:
        if self._total is None:
            self._read_properties()  # starts CUDA (after the device lock)
        assert self._total is not None
        return self._requested_capacity or self._total

    def install(self, tracker: AllocationObserver) -> None:
        self.tracker = tracker
        self._peaks.install()
        if self.deferred:
            torch.cuda._lazy_call(self._start_deferred)
        else:
            self._start()

    def _start_deferred(self) -> None:
        """The set-up, queued until CUDA starts (an error here must not
        become the script's: it would be raised at its first CUDA call)."""
        if os.getpid() != self._pid:
            return
        try:
            self._start()
        except Exception as exc:
            print(f"oomdoc: the CUDA capture could not be set up: {exc}", file=sys.stderr)

    def _start(self) -> None:
        if self._total is None:
            self._read_properties()
        assert self._total is not None
        if self._capacity < self._total:
            torch.cuda.set_per_process_memory_fraction(
                self._capacity / self._total, self.device_index
            )
        # OOMDOC_ALLOCATION_HISTORY=0 turns off the per-allocation Python
        # stacks (allocation sites then have no locations) for the last bit of speed.
        if os.environ.get("OOMDOC_ALLOCATION_HISTORY", "1") != "0":
            try:
                self._record_stacks(True)
                self._recording = True
            except Exception as exc:  # pragma: no cover - depends on the build
                print(f"oomdoc: allocation history unavailable: {exc}", file=sys.stderr)
        self._detail_policy = detail_policy(self._recording, self._capacity)
        # torch's stub for torch._C omits this binding (torch/csrc/cuda/Module.cpp).
        torch._C._cuda_attach_out_of_memory_observer(self._oom_observer)  # type: ignore[attr-defined]
        self._peaks.read_and_reset(self.device_index)

    def _record_stacks(self, on: bool) -> None:
        torch.cuda.memory._record_memory_history(
            enabled="all" if on else None,
            context="alloc",
            stacks="python",
            max_entries=self.HISTORY_ENTRIES,
        )

    def _apply_detail(self, wanted: bool) -> bool:
        """Turns the detail on or off; returns whether it is on (the stacks,
        where recorded, may fail to change: then the scopes follow them)."""
        if self._recording and wanted != self._detailed:
            try:
                self._record_stacks(wanted)
            except Exception:  # keep whatever the allocator does now
                wanted = self._detailed
        self._detailed = wanted
        return wanted

    def step_closed(self, step: dict) -> bool | None:
        if self._detail_policy is None:
            return None
        return self._apply_detail(self._detail_policy.step_closed(step, self._detailed))

    def phase_started(self, phase: str) -> bool | None:
        if self._detail_policy is None:
            return None
        return self._apply_detail(self._detail_policy.phase_started(phase))

    def capture_stats(self) -> dict[str, int]:
        policy = self._detail_policy
        return {} if policy is None else policy.stats()

    def uninstall(self) -> None:
        self._peaks.uninstall()
        if self._recording:
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:
                pass
            self._recording = False

    def _oom_observer(self, device, requested, device_allocated, device_free) -> None:
        if self.tracker is None:
            return
        try:
            self._torch_snapshot = torch.cuda.memory._snapshot() if self._recording else None
            self.tracker.on_oom(requested_bytes=int(requested), message=None)
        except Exception as exc:  # never turn an OOM into a different error
            print(f"oomdoc: failed to record the OOM: {exc}", file=sys.stderr)

    def _stats(self) -> dict:
        return torch.cuda.memory_stats(self.device_index)

    def device_info(self) -> dict:
        capacity = self._capacity  # reads the properties if CUDA never started
        info = {
            "kind": "cuda",
            "name": self._name,
            "index": self.device_index,
            "capacity_bytes": capacity,
            "total_bytes": self._total,
            "supports_bf16": bool(torch.cuda.is_bf16_supported()),
        }
        info.update(_nvml_info(self.device_index))
        return info

    def _nested_stats(self) -> dict:
        # torch.cuda.memory_allocated() and memory_stats() flatten and sort
        # the allocator's ~150 counters in Python on every call; the nested
        # dict is what the allocator returns, read where it is needed (its
        # own peaks, not the script's view of them: oomdoc.capture.peak_view).
        return self._peaks.stats(self.device_index) if torch.cuda.is_initialized() else {}

    def allocated_bytes(self) -> int:
        stats = self._nested_stats()
        return int(stats["allocated_bytes"]["all"]["current"]) if stats else 0

    def reserved_bytes(self) -> int:
        stats = self._nested_stats()
        return int(stats["reserved_bytes"]["all"]["current"]) if stats else 0

    def capacity_bytes(self) -> int:
        return self._capacity

    def read_and_reset_peak(self) -> tuple[int, int]:
        if not torch.cuda.is_initialized():
            return 0, 0
        stats = self._peaks.read_and_reset(self.device_index)
        return (
            int(stats["allocated_bytes"]["all"]["peak"]),
            int(stats["reserved_bytes"]["all"]["peak"]),
        )

    def owns(self, tensor: torch.Tensor) -> bool:
        # is_cuda and get_device() cost a tenth of building a torch.device.
        return tensor.is_cuda and tensor.get_device() == self.device_index

    def storage_bytes(self, nbytes: int) -> int:
        # The caching allocator hands out multiples of 512 bytes.
        return ((nbytes + 511) // 512) * 512 if nbytes else 0

    def owned(self, tensors: list) -> list:
        # C-level loops: parameters, gradients and optimizer state at each
        # phase boundary, where on a step bound by the host each microsecond
        # is the step's. (Adam's `step` counters stay on the CPU.)
        on_cuda = list(compress(tensors, map(_IS_CUDA, tensors)))
        if self._one_device:
            return on_cuda
        return list(compress(on_cuda, map(self.device_index.__eq__, map(_GET_DEVICE, on_cuda))))

    def allocation_sites(self) -> list[dict] | None:
        snapshot = self._torch_snapshot
        if snapshot is None and self._recording:
            snapshot = torch.cuda.memory._snapshot()
        if snapshot is None:
            return None
        sites = []
        for segment in snapshot.get("segments", []):
            if segment.get("device", self.device_index) != self.device_index:
                continue
            for block in segment.get("blocks", []):
                if block.get("state") != "active_allocated":
                    continue
                sites.append(
                    {
                        "address": block.get("address"),
                        "bytes": int(block.get("requested_size") or block.get("size", 0)),
                        # What the allocator counts, and the phase the stack shows
                        # (oomdoc.capture.modules: one category rule for all tables).
                        "size": int(block.get("size", 0)),
                        "phase": phase_from_frames(block.get("frames")),
                        "location": frames.pick_user_location(block.get("frames", [])),
                        "shape": None,
                        "dtype": None,
                    }
                )
        return sites

    def allocator_stats(self) -> dict:
        stats = self._stats()
        return {
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
            "inactive_split_blocks": int(stats.get("inactive_split.all.current", 0)),
            "segments": int(stats.get("segment.all.current", 0)),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "num_ooms": int(stats.get("num_ooms", 0)),
            "expandable_segments": "expandable_segments:true"
            in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower(),
        }

    def on_oom_extra(self, snapshot_dir: str | None) -> dict:
        """Keep PyTorch's own snapshot of the OOM for pytorch.org/memory_viz."""
        if self._torch_snapshot is None or not snapshot_dir:
            return {}
        import pickle

        path = os.path.join(snapshot_dir, "torch_memory_snapshot.pickle")
        with open(path, "wb") as handle:
            pickle.dump(self._torch_snapshot, handle)
        return {"torch_snapshot_file": path}


def _nvml_info(device_index: int) -> dict:
    """Other processes on the GPU and the driver's view of memory, via pynvml."""
    try:
        import pynvml
    except Exception:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        handle = nvml_handle(pynvml, device_index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        others = []
        try:
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid():
                    continue
                used = process.usedGpuMemory
                others.append(
                    {"pid": int(process.pid), "used_bytes": int(used) if used is not None else None}
                )
        except Exception:
            pass
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
        except Exception:
            driver = None
        return {
            "driver_version": driver,
            "nvml_used_bytes": int(memory.used),
            "nvml_free_bytes": int(memory.free),
            "other_processes": others,
        }
    except Exception:
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
