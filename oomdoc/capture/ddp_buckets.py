"""DDP's gradient buckets are gradients, not activations.

DistributedDataParallel copies each parameter's gradient into flat buckets
for its all-reduce: one gradient's worth of memory beside the gradients
themselves (unless `gradient_as_bucket_view=True`). Its reducer makes them
when DDP is built (the setup phase: they were "other") and again at the
first forward after the first backward (`_rebuild_buckets`: they were
"activations", which then drove the activation advice). While either runs,
the tracker's phase is `communication`, which the one category rule
(oomdoc.capture.modules.category_of) counts as gradients; on CUDA the same
phase is read from the blocks' allocation stacks (phase_from_frames). No
phase boundary is made: the step's phase peaks stay as they were.
"""

from __future__ import annotations

from typing import Any, Callable

COMMUNICATION = "communication"


def install(tracker: Any) -> Callable[[], None]:
    """Mark DDP's bucket building with the `communication` phase. Returns
    the undo (nothing to do where torch has no DDP or no such methods)."""
    try:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
    except Exception:
        return lambda: None
    reducer = getattr(dist, "Reducer", None)
    targets = [
        (owner, name)
        for owner, name in (
            (DistributedDataParallel, "_ddp_init_helper"),
            (reducer, "_rebuild_buckets"),
        )
        if owner is not None and callable(getattr(owner, name, None))
    ]
    originals = []
    for owner, name in targets:
        original = getattr(owner, name)
        try:
            setattr(owner, name, _in_communication(tracker, original))
        except (AttributeError, TypeError):
            continue  # a type that takes no new attributes
        originals.append((owner, name, original))

    def undo() -> None:
        for owner, name, original in originals:
            setattr(owner, name, original)

    return undo


def _in_communication(tracker: Any, original: Callable) -> Callable:
    def marked(*args, **kwargs):
        phase, tracker.phase = tracker.phase, COMMUNICATION
        try:
            return original(*args, **kwargs)
        finally:
            tracker.phase = phase

    marked.__wrapped__ = original  # type: ignore[attr-defined]
    marked.__doc__ = getattr(original, "__doc__", None)
    return marked
