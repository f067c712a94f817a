"""CPU tensors moved to shared memory under the capture.

`torch.multiprocessing` hands CPU tensors to the processes it starts by
moving their storages to shared memory (Lightning's `ddp_spawn` passes the
model that way, Hogwild scripts call `model.share_memory()`). The copy into
shared memory runs tensor ops on the storage; under the simulated device's
dispatch mode that copy is seen as the mode's and torch's check that the
storage now lives in shared memory fails ("ctx INTERNAL ASSERT FAILED"), so
the script could not start its processes under oomdoc. The move runs with
the dispatch modes off: the storage keeps its size (only where its bytes
live changes), so what the capture counts is unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable

SHARING_METHODS = ("share_memory_", "_share_fd_cpu_", "_share_filename_cpu_")


def install() -> Callable[[], None]:
    """Patch UntypedStorage's moves to shared memory; returns the undo."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    storage_class = torch.UntypedStorage
    originals = {name: storage_class.__dict__[name] for name in SHARING_METHODS}

    def outside_the_modes(method: Callable) -> Callable:
        @functools.wraps(method)
        def share(self, *args, **kwargs):
            with _disable_current_modes():
                return method(self, *args, **kwargs)

        return share

    for name, method in originals.items():
        setattr(storage_class, name, outside_the_modes(method))

    def undo() -> None:
        for name, method in originals.items():
            setattr(storage_class, name, method)

    return undo
