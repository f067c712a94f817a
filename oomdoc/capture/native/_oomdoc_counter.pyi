"""The compiled ledger of the simulated device (counter.cpp), as Python sees it.

Built at run time by `python -m oomdoc.capture.native` and loaded under the
name `_oomdoc_counter` by oomdoc.capture.native.load(); this stub says what
each function takes and returns, and why it exists. One ledger per process:
the functions act on module-level state. tests/test_native.py checks that
the compiled module has exactly these functions.
"""

from typing import Any, Callable, Iterable

import torch

def install(
    capacity: int,
    tracker: Any,
    is_user_code: Callable[[Any], bool],
    raise_oom: Callable[[int], None],
    flush: Callable[[], None],
    names: list[str],
    snapshot_names: set[str],
) -> list[str]:
    """Register the ledger's kernel at the Python dispatch key for each op
    in `names` ("namespace::name.overload"), so that an op whose storages
    are all counted never reaches the Python dispatch mode; returns the names
    registered. The ledger starts empty with `capacity` bytes. `tracker`
    gives a new storage's step, phase and module; `is_user_code(code)`
    decides its site's frame; `raise_oom(requested)` raises the device's OOM;
    `flush()` reads the event log when it grows long. `snapshot_names`: the
    ops that need torch's PythonTLSSnapshot taken first."""

def uninstall() -> None:
    """Remove the kernels and empty the ledger, dropping its references to
    the device's callbacks (the device is uninstalled)."""

def set_enabled(enabled: bool) -> None:
    """Count or not: the tracker's own work (the device disabled) must not."""

def look(value: object, outputs: bool) -> None:
    """The dispatch mode's own check of an op it still sees: the tensors in
    `value` (nested lists, tuples, dicts) are its arguments (`outputs`
    False) or what it made (True); storages new or resized are registered."""

def read_events() -> list[tuple[Any, ...]]:
    """The log of changes since the last read, in order, for the Python side
    to bring its records up to date at a phase boundary: (0, key, nbytes,
    sequence, step, phase, code, line, module, node sequence, shape, dtype)
    for an add, (1, key, nbytes) for a free, (2, key, nbytes) for a resize."""

def read_and_reset_peak() -> tuple[int, int]:
    """(peak, live) bytes; the peak starts again from the live bytes (a
    phase's peak is folded at each phase boundary)."""

def totals() -> tuple[int, int, int]:
    """(live bytes, peak bytes, storages registered so far)."""

def hand_over() -> list[tuple[int, torch.UntypedStorage]]:
    """Stop keeping the ledger (another dispatch mode or a tensor subclass
    came): [(key, storage)] of the live storages, for the Python side to
    watch by weak references from now on. Call read_events first."""

def storage_table(tensors: Iterable[object]) -> dict[int, int]:
    """{storage key: nbytes} of the CPU tensors among `tensors` (others and
    None skipped), each storage once: the tracker reads parameters, gradients
    and optimizer state at every phase boundary without a Python storage
    object per tensor."""

def after_fork_in_child() -> None:
    """In a process forked from the script's (a DataLoader worker): count
    nothing, and never take the ledger's mutex another thread may have held
    at the fork."""
