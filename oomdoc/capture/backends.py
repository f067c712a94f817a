"""Device backends behind one small interface (oomdoc.capture.backend_base).

`SimulatedBackend` (oomdoc.capture.simulated) counts every CPU tensor storage
through a TorchDispatchMode and raises a real `torch.OutOfMemoryError` when an
allocation would exceed its capacity, so that every oomdoc path can be
exercised without a GPU. `CudaBackend` (oomdoc.capture.cuda) reads the real
caching allocator. This module names them all in one place.
"""

from __future__ import annotations

from oomdoc.capture.backend_base import (
    Backend,
    OutOfMemoryError,
    StorageRecord,
    oom_behind,
    storage_key,
    storage_sites,
)
from oomdoc.capture.cuda import CudaBackend
from oomdoc.capture.simulated import SimulatedBackend

__all__ = [
    "Backend",
    "CudaBackend",
    "OutOfMemoryError",
    "SimulatedBackend",
    "StorageRecord",
    "oom_behind",
    "storage_key",
    "storage_sites",
]
