"""Typed records of whose weights an OOM found outside every called model
and optimizer (docs/snapshot.md: `oom.uncalled_models`, `oom.weight_copies`):
the report names them instead of guessing a dataset; and of the OOMs the run
raised in all (`ooms_seen`), where the script caught some. Part of oomdoc.model
(which imports them): parsed the same way, by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class UncalledModel:
    """At an OOM: the outermost module holding weights on the device that no
    model call nor optimizer of the run made known (an EMA copy of the
    model, a model kept for later; before any call, the model being built or
    moved to the device); those weights count as `other`."""

    class_name: str = field(default="?", metadata={"key": "class"})
    bytes: int = 0  # its weights on the device
    weights_bytes: int = 0  # all its parameters and buffers, wherever they are
    # Where the script keeps it (`model_ema (a local of main)`, `Trainer.ema`).
    held_by: List[str] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightCopy:
    """At an OOM: plain tensors on the device shaped like a called model's
    parameters (`copies` of its shapes: a saved state_dict, an EMA's shadow
    weights); they count as `other`."""

    of: str = "?"
    copies: int = 0
    tensors: int = 0
    bytes: int = 0
    # Where the script keeps them (`EMAModel.shadow_params`, `best_state (a
    # global of __main__)`), where the capture could name it.
    held_by: List[str] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OomsSeen:
    """Every out-of-memory error the run raised, where the script caught
    some and went on (its own batch-size retry: accelerate's
    `find_executable_batch_size`, the HF `Trainer`'s `auto_find_batch_size`,
    Lightning's `BatchSizeFinder`; or a step it skips): how many, and the
    first one."""

    count: int = 0
    step: Optional[int] = None
    phase: Optional[str] = None
    requested_bytes: int = 0
    allocated_bytes: int = 0  # in use when it was raised
    file: Optional[str] = None
    line: int = 0
    function: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)
