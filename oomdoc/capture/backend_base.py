"""The interface every device backend offers the tracker, and what the
simulated device records per storage.

`SimulatedBackend` (oomdoc.capture.simulated) counts every CPU tensor
storage; `CudaBackend` (oomdoc.capture.cuda) reads the real caching allocator.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Iterator, Protocol

import torch

from oomdoc import frames
from oomdoc.capture.modules import ModuleScopes


class AllocationObserver(Protocol):
    """What a backend reads of the tracker that observes it
    (oomdoc.capture.tracker.Tracker): where the script is, and where an OOM
    is reported. A protocol, so that backends do not import the tracker
    (which imports them)."""

    phase: str
    step_index: int
    scopes: ModuleScopes

    @property
    def in_backward(self) -> bool: ...

    def on_oom(self, requested_bytes: int, message: str | None) -> None: ...

    def breakdown_and_sites(
        self, limit: int = 20, with_sites: bool = True
    ) -> tuple[dict, list[dict]]: ...


# Unbound methods: map() calls them twice as fast as methodcaller.
_UNTYPED_STORAGE = torch.Tensor.untyped_storage
_STORAGE_KEY = attrgetter("_cdata")
_NBYTES = torch.UntypedStorage.nbytes
_DATA_PTR = torch.Tensor.data_ptr
_TENSOR_NBYTES = attrgetter("nbytes")


class StorageTableMemo:
    """One storage table, read again only when its tensors moved.

    A table costs a storage object per tensor (about 1 us each: 0.2 ms for
    ResNet-50's 161 parameters), and the tracker reads the parameters' and
    the gradients' at every phase boundary, where a script that waits for
    the GPU each step pays for it in its step time. The tensors' addresses
    and sizes are a tenth of that, and the same addresses and sizes of live
    tensors are the same storages (a freed storage's address reused by one
    of a different size changes the sizes). Where the table's keys name
    storages one by one (a per-storage backend, the simulated device), a
    storage swapped in at a freed one's address would keep the dead one's
    key: there each table is read."""

    def __init__(self) -> None:
        self._signature: tuple | None = None
        self._table: dict = {}

    def read(self, backend: Backend, tensors) -> dict:
        present = [tensor for tensor in tensors if tensor is not None]
        if backend.per_storage:
            return backend.storage_table(present)
        try:  # in C-level loops
            signature: tuple | None = (
                tuple(map(_DATA_PTR, present)),
                tuple(map(_TENSOR_NBYTES, present)),
            )
        except Exception:  # sparse and other layouts without one data pointer
            signature = None
        if signature is not None and signature == self._signature:
            return self._table
        table = backend.storage_table(present)
        self._signature, self._table = signature, table
        return table


OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def oom_behind(failure: BaseException) -> BaseException | None:
    """The device's OutOfMemoryError that `failure` was raised while
    handling (or from), or None. Hydra's `@hydra.main` catches every error
    of the job, prints it and calls `sys.exit(1)`: the OOM reached oomdoc
    as a SystemExit, and the run was reported as a script that failed, with
    no replays. (Only a chained error counts: accelerate's
    `find_executable_batch_size` raises its "reached zero" RuntimeError
    outside its handler, with no OOM behind it.)"""
    return next(
        (
            cause
            for cause in frames.exception_chain(failure, limit=16)
            if isinstance(cause, OutOfMemoryError)
        ),
        None,
    )


class StorageRecord:
    """What the simulated device knows about one live storage.

    Immutable once made (a storage resized in place gets a new record), so
    that a record list kept for the peak still says what it said then. The
    location is kept as (code object, line) and turned into a snapshot
    `location` only when sites are listed. `module` is the module whose
    forward (or backward) made it (oomdoc.capture.modules).
    """

    __slots__ = (
        "nbytes",
        "step",
        "phase",
        "category",
        "code",
        "line",
        "shape",
        "dtype_object",
        "sequence",
        "module",
    )

    def __init__(
        self, nbytes, step, phase, category, code, line, shape, dtype_object, sequence, module
    ):
        self.nbytes = nbytes
        self.step = step
        self.phase = phase
        # category_of(None, phase): "activations" (made during forward,
        # backward or the optimizer step) or "other"; the category unless the
        # storage is a parameter, a gradient or optimizer state (apply_known).
        self.category = category
        self.code = code
        self.line = line
        self.shape = shape
        self.dtype_object = dtype_object
        # Registration order: sites are grouped in it, as they always were.
        self.sequence = sequence
        self.module = module

    @property
    def location(self) -> dict | None:
        if self.code is None:
            return None
        return frames.location_dict(self.code.co_filename, self.line, self.code.co_name)

    @property
    def dtype(self) -> str:
        return _dtype_name(self.dtype_object)

    def resized(self, nbytes: int) -> StorageRecord:
        return StorageRecord(
            nbytes,
            self.step,
            self.phase,
            self.category,
            self.code,
            self.line,
            self.shape,
            self.dtype_object,
            self.sequence,
            self.module,
        )


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


class StorageLedger(Protocol):
    """What a backend that sees every storage come and go (the simulated
    device) offers beyond Backend: the tracker names the parameters,
    gradients and optimizer state by storage key, and the ledger keeps the
    bytes per category and the storages live at the peak mark itself."""

    def apply_known(self, known: dict[int, str]) -> None:
        """Name these storages' categories ({storage key: category})."""

    def category_bytes(self) -> dict[str, int]:
        """Live bytes per category, kept up to date as storages come and go."""

    def known_categories(self) -> dict[int, str]:
        """The naming apply_known was last given."""

    def live_storages(self) -> Iterator[tuple[int, int, StorageRecord]]:
        """(key, bytes, record) of each live storage."""

    def mark_peak(self) -> None:
        """Remember this moment as the peak (marked_storages lists it later)."""

    def marked_storages(self) -> tuple[list[tuple[int, StorageRecord]], dict[int, str]] | None:
        """The storages live at the last mark, with their naming then."""

    def retained_activation_bytes(self, step: int) -> int:
        """Live bytes made in the forward or backward of steps before `step`."""


class Backend:
    """The interface the tracker uses; byte counts are ints."""

    kind = "?"
    # True when live_storages() sees every allocation with its step and phase.
    per_storage = False

    def install(self, tracker: AllocationObserver) -> None: ...

    def uninstall(self) -> None: ...

    def storage_ledger(self) -> StorageLedger | None:
        """The per-storage ledger of a backend that sees every storage
        (`per_storage`), else None: the breakdown is then derived from the
        allocated bytes and the known tensors."""
        return None

    def backward_ended(self) -> None:
        """An outermost backward pass has ended."""

    def stop_counting(self) -> None:
        """The script has ended (or its rank was stopped): oomdoc's own work
        from here on must not count (the simulated device stops counting;
        a real device's allocator counts whatever it does)."""

    def step_closed(self, step: dict) -> bool | None:
        """A step's record is complete. Returns whether what follows is worth
        the capture's detail (allocation stacks, module scopes: the CUDA
        backend's stack_recording), None when the backend has no say."""
        return None

    def phase_started(self, phase: str) -> bool | None:
        """The script entered `phase` (forward, backward, optimizer,
        evaluation); returns as step_closed does."""
        return None

    def capture_stats(self) -> dict[str, int]:
        """The backend's share of the capture's work counters."""
        return {}

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

    def owned(self, tensors: list) -> list:
        """The tensors this device holds (backends filter in C-level loops)."""
        return [tensor for tensor in tensors if self.owns(tensor)]

    def storage_table(self, tensors) -> dict:
        """{storage key: storage_bytes} of the tensors (None allowed) on this
        device, each storage once."""
        tensors = self.owned([tensor for tensor in tensors if tensor is not None])
        try:  # in C-level loops
            storages = list(map(_UNTYPED_STORAGE, tensors))
            sizes = map(_NBYTES, storages)
            if type(self).storage_bytes is not Backend.storage_bytes:
                sizes = map(self.storage_bytes, sizes)
            return dict(zip(map(_STORAGE_KEY, storages), sizes))
        except Exception:  # a sparse tensor: one by one
            pass
        table: dict = {}
        for tensor in tensors:
            try:
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in table:
                    table[key] = self.storage_bytes(storage.nbytes())
            except Exception:  # sparse and other storage-less layouts
                pass
        return table

    def live_storages(self) -> Iterator[tuple[int, int, StorageRecord]]:
        """Yield (key, bytes, StorageRecord) for each live allocation when
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


def storage_sites(items) -> list[dict]:
    """allocation_sites() entries for [(key, StorageRecord)]."""
    locations: dict = {}
    sites = []
    for key, record in items:
        where = (id(record.code), record.line)  # the record keeps its code alive
        location = locations.get(where)
        if location is None and where not in locations:
            location = locations[where] = record.location
        sites.append(
            {
                "key": key,
                "bytes": record.nbytes,
                "location": location,
                "shape": list(record.shape),
                "dtype": record.dtype,
                "base_category": record.category,
                "module": record.module,
            }
        )
    return sites


# -------------------------------------------------------------------- cuda
