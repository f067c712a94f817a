"""Device backends behind one small interface.

`SimulatedBackend` counts every CPU tensor storage through a TorchDispatchMode
and raises a real `torch.OutOfMemoryError` when an allocation would exceed its
capacity, so that every oomdoc path can be exercised without a GPU.
`CudaBackend` reads the real caching allocator.
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from oomdoc import frames
from oomdoc.capture.modules import phase_from_frames
from oomdoc.sizes import format_bytes

OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


@dataclass
class StorageRecord:
    """What the simulated device knows about one live storage."""

    nbytes: int
    step: int
    phase: str
    location: dict | None
    shape: tuple
    dtype: str
    # The module whose forward (or backward) made it (oomdoc.capture.modules).
    module: str | None = None


class Backend:
    """The interface the tracker uses; byte counts are ints."""

    kind = "?"
    # True when live_storages() sees every allocation with its step and phase.
    per_storage = False

    def install(self, tracker) -> None: ...

    def uninstall(self) -> None: ...

    def device_info(self) -> dict:
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        raise NotImplementedError

    def reserved_bytes(self) -> int:
        raise NotImplementedError

    def capacity_bytes(self) -> int:
        raise NotImplementedError

    def read_and_reset_peak(self) -> tuple[int, int]:
        """Peak (allocated, reserved) since the last call, then start anew."""
        raise NotImplementedError

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when the tensor's memory lives on this device."""
        raise NotImplementedError

    def storage_bytes(self, nbytes: int) -> int:
        """Bytes the device really spends on a storage of `nbytes`."""
        return nbytes

    def live_storages(self):
        """Yield (key, bytes, StorageRecord|None) for each live allocation when
        the backend can see them one by one, else nothing."""
        return iter(())

    def allocation_sites(self) -> list[dict] | None:
        """Live allocations with frames as {bytes, location, shape, dtype, key},
        or None if the backend cannot tell."""
        return None

    def allocator_stats(self) -> dict:
        return {}

    def on_oom_extra(self, snapshot_dir: str | None) -> dict:
        """Backend-specific data to save at an OOM (files, allocator state)."""
        return {}


def storage_key(tensor: torch.Tensor):
    """A key identifying a tensor's storage while it lives, or None."""
    try:
        return tensor.untyped_storage()._cdata
    except Exception:
        return None


# --------------------------------------------------------------- simulated


class _CountingMode(TorchDispatchMode):
    """Sees every op; registers each new storage it produces or consumes."""

    def __init__(self, backend: SimulatedBackend):
        super().__init__()
        self.backend = backend

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        backend = self.backend
        if backend.enabled:
            backend.adopt_inputs(args, kwargs)
        out = func(*args, **(kwargs or {}))
        if backend.enabled:
            backend.register_outputs(out, func)
        return out


class SimulatedBackend(Backend):
    """A device of fixed capacity made of CPU memory.

    Every CPU tensor storage counts, because on the CPU a script's model,
    data and temporaries all share the one memory; the report says so.
    Frees are seen through weak-reference finalizers on the storages.
    """

    kind = "simulated"
    per_storage = True

    def __init__(self, capacity_bytes: int):
        self._capacity = int(capacity_bytes)
        self._records: dict[int, StorageRecord] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._live = 0
        self._peak = 0
        self.enabled = False
        self._mode = None
        self.tracker = None

    # lifecycle
    def install(self, tracker) -> None:
        self.tracker = tracker
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        self.enabled = True
        # DataLoader workers fork from this process: they must not count (or
        # raise) against the parent's device.
        os.register_at_fork(after_in_child=self._disable_in_child)

    def _disable_in_child(self) -> None:
        self.enabled = False

    def uninstall(self) -> None:
        self.enabled = False
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            except Exception:
                pass
            self._mode = None

    # bookkeeping
    def _track(self, tensor: torch.Tensor, *, check_capacity: bool, pending: list | None):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return 0
        try:
            storage = tensor.untyped_storage()
        except Exception:  # sparse and other storage-less layouts
            return 0
        key = storage._cdata
        nbytes = storage.nbytes()
        record = self._records.get(key)
        if record is not None:
            if record.nbytes != nbytes:  # resized in place (resize_, out=)
                self._live += nbytes - record.nbytes
                record.nbytes = nbytes
                self._peak = max(self._peak, self._live)
            return 0
        if nbytes == 0:
            return 0
        if pending is not None:
            pending.append((key, storage, tensor))
            return nbytes
        self._register(key, storage, tensor)
        return nbytes

    def _register(self, key, storage, tensor) -> None:
        tracker = self.tracker
        nbytes = storage.nbytes()
        self._records[key] = StorageRecord(
            nbytes=nbytes,
            step=tracker.step_index if tracker else 0,
            phase=tracker.phase if tracker else "setup",
            location=frames.current_user_location(sys._getframe()),
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).replace("torch.", ""),
            module=tracker.scopes.allocation_path() if tracker else None,
        )
        self._finalizers[key] = weakref.finalize(storage, self._on_free, key)
        self._live += nbytes
        if self._live > self._peak:
            self._peak = self._live

    def _on_free(self, key) -> None:
        record = self._records.pop(key, None)
        self._finalizers.pop(key, None)
        if record is not None:
            self._live -= record.nbytes

    def adopt_inputs(self, args, kwargs) -> None:
        """Count tensors made outside dispatch (torch.from_numpy, shared memory
        from DataLoader workers) the first time an op touches them."""
        flat, _ = tree_flatten((args, kwargs))
        for item in flat:
            if isinstance(item, torch.Tensor):
                self._track(item, check_capacity=False, pending=None)

    def register_outputs(self, out, func) -> None:
        flat, _ = tree_flatten(out)
        pending: list = []
        requested = 0
        for item in flat:
            if isinstance(item, torch.Tensor):
                requested += self._track(item, check_capacity=True, pending=pending)
        if not pending:
            return
        # Storages shared between several outputs are counted once.
        unique = {}
        for key, storage, tensor in pending:
            unique.setdefault(key, (storage, tensor))
        requested = sum(storage.nbytes() for storage, _ in unique.values())
        if self._live + requested > self._capacity:
            self.raise_oom(requested)
        for key, (storage, tensor) in unique.items():
            self._register(key, storage, tensor)

    def raise_oom(self, requested: int) -> None:
        free = max(0, self._capacity - self._live)
        message = (
            f"Simulated device out of memory (oomdoc). Tried to allocate {format_bytes(requested)}. "
            f"Simulated device 0 has a total capacity of {format_bytes(self._capacity)} of which "
            f"{format_bytes(free)} is free. Of the allocated memory {format_bytes(self._live)} is allocated "
            f"by PyTorch (every CPU tensor of this process counts), and 0 bytes is reserved by PyTorch "
            f"but unallocated."
        )
        if self.tracker is not None:
            self.enabled = False  # the tracker's own work must not count
            try:
                self.tracker.on_oom(requested_bytes=requested, message=message)
            finally:
                self.enabled = True
        raise OutOfMemoryError(message)

    # interface
    def device_info(self) -> dict:
        return {
            "kind": "simulated",
            "name": "simulated device (CPU tensors counted by oomdoc)",
            "capacity_bytes": self._capacity,
            "total_bytes": self._capacity,
            "supports_bf16": True,
            "notes": ["Every CPU tensor of the process counts against the simulated capacity."],
        }

    def allocated_bytes(self) -> int:
        return self._live

    def reserved_bytes(self) -> int:
        return self._live

    def capacity_bytes(self) -> int:
        return self._capacity

    def read_and_reset_peak(self) -> tuple[int, int]:
        peak = self._peak
        self._peak = self._live
        return peak, peak

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def live_storages(self):
        for key, record in list(self._records.items()):
            yield key, record.nbytes, record

    def allocation_sites(self) -> list[dict]:
        return [
            {
                "key": key,
                "bytes": record.nbytes,
                "location": record.location,
                "shape": list(record.shape),
                "dtype": record.dtype,
            }
            for key, record in list(self._records.items())
        ]


# -------------------------------------------------------------------- cuda


class CudaBackend(Backend):
    """The real CUDA caching allocator, optionally capped to a smaller card."""

    kind = "cuda"
    # Enough trace entries to show what happened just before an OOM without
    # costing much host memory.
    HISTORY_ENTRIES = 20000

    def __init__(self, capacity_bytes: int | None, device_index: int | None = None):
        self.device_index = torch.cuda.current_device() if device_index is None else device_index
        properties = torch.cuda.get_device_properties(self.device_index)
        self._total = int(properties.total_memory)
        self._name = properties.name
        self._capacity = int(capacity_bytes) if capacity_bytes else self._total
        self.tracker = None
        self._recording = False
        self._torch_snapshot = None

    def install(self, tracker) -> None:
        self.tracker = tracker
        if self._capacity < self._total:
            torch.cuda.set_per_process_memory_fraction(
                self._capacity / self._total, self.device_index
            )
        # OOMDOC_ALLOCATION_HISTORY=0 turns off the per-allocation Python
        # stacks (allocation sites then have no locations) for the last bit of speed.
        if os.environ.get("OOMDOC_ALLOCATION_HISTORY", "1") != "0":
            try:
                torch.cuda.memory._record_memory_history(
                    enabled="all",
                    context="alloc",
                    stacks="python",
                    max_entries=self.HISTORY_ENTRIES,
                )
                self._recording = True
            except Exception as exc:  # pragma: no cover - depends on the build
                print(f"oomdoc: allocation history unavailable: {exc}", file=sys.stderr)
        torch._C._cuda_attach_out_of_memory_observer(self._oom_observer)
        torch.cuda.reset_peak_memory_stats(self.device_index)

    def uninstall(self) -> None:
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
        info = {
            "kind": "cuda",
            "name": self._name,
            "index": self.device_index,
            "capacity_bytes": self._capacity,
            "total_bytes": self._total,
            "supports_bf16": bool(torch.cuda.is_bf16_supported()),
        }
        info.update(_nvml_info(self.device_index))
        return info

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device_index))

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device_index))

    def capacity_bytes(self) -> int:
        return self._capacity

    def read_and_reset_peak(self) -> tuple[int, int]:
        stats = self._stats()
        peak = (
            int(stats.get("allocated_bytes.all.peak", 0)),
            int(stats.get("reserved_bytes.all.peak", 0)),
        )
        torch.cuda.reset_peak_memory_stats(self.device_index)
        return peak

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda" and tensor.device.index == self.device_index

    def storage_bytes(self, nbytes: int) -> int:
        # The caching allocator hands out multiples of 512 bytes.
        return ((nbytes + 511) // 512) * 512 if nbytes else 0

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
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical_index = device_index
        if visible:
            parts = [p.strip() for p in visible.split(",") if p.strip()]
            if device_index < len(parts) and parts[device_index].isdigit():
                physical_index = int(parts[device_index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(physical_index)
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
