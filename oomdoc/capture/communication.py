"""Buffers made for collectives are `communication`, a category of their own.

DistributedDataParallel copies each parameter's gradient into flat buckets
for its all-reduce: one gradient's worth of memory beside the gradients
themselves (unless `gradient_as_bucket_view=True`). Its reducer makes them
when DDP is built (the setup phase: they were "other") and again at the
first forward after the first backward (`_rebuild_buckets`: they were
"activations", which then drove the activation advice). FSDP2
(`fully_shard`) gathers each unit's parameters into one flat all-gather
buffer (`foreach_all_gather`) and copies its gradients into one flat
reduce-scatter buffer (`foreach_reduce`). While any of these runs, the
tracker's phase is `communication`, which the one category rule
(oomdoc.capture.modules.category_of) counts as communication; on CUDA the
same is read from the blocks' allocation stacks (phase_from_frames, through
oomdoc.categories.COMMUNICATION_BUILDERS, which says what is not covered).
No phase boundary is made: the step's phase peaks stay as they were.

FSDP2's module is patched when the script imports it (importing it here
would cost every run most of a second).
"""

from __future__ import annotations

import sys
from importlib.abc import Loader, MetaPathFinder
from typing import Any, Callable

from oomdoc.categories import COMMUNICATION

# FSDP2's parameter group calls these by their global names: torch >= 2.6,
# then 2.4-2.5.
FSDP_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",
    "torch.distributed._composable.fsdp._fsdp_param_group",
)
FSDP_BUILDERS = ("foreach_all_gather", "foreach_reduce")


def install(tracker: Any) -> Callable[[], None]:
    """Mark DDP's bucket building and FSDP2's collective buffers with the
    `communication` phase. Returns the undo (nothing to do where torch has
    no DDP or no such methods)."""
    originals: list = []
    try:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
    except Exception:
        return lambda: None
    _mark(
        tracker,
        [
            (DistributedDataParallel, "_ddp_init_helper"),
            (getattr(dist, "Reducer", None), "_rebuild_buckets"),
        ],
        originals,
    )
    finder = _AfterImport(FSDP_MODULES, lambda module: _mark_fsdp(tracker, module, originals))
    for name in FSDP_MODULES:
        if name in sys.modules:
            _mark_fsdp(tracker, sys.modules[name], originals)
    # A process forked from the script's own inherits its finder: one only.
    sys.meta_path[:] = [entry for entry in sys.meta_path if not isinstance(entry, _AfterImport)]
    sys.meta_path.insert(0, finder)

    def undo() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for owner, name, original in originals:
            setattr(owner, name, original)

    return undo


def _mark_fsdp(tracker: Any, module: Any, originals: list) -> None:
    _mark(tracker, [(module, name) for name in FSDP_BUILDERS], originals)


def _mark(tracker: Any, targets: list, originals: list) -> None:
    for owner, name in targets:
        original = getattr(owner, name, None) if owner is not None else None
        if not callable(original) or hasattr(original, "__oomdoc_communication__"):
            continue
        try:
            setattr(owner, name, _in_communication(tracker, original))
        except (AttributeError, TypeError):
            continue  # a type that takes no new attributes
        originals.append((owner, name, original))


def _in_communication(tracker: Any, original: Callable) -> Callable:
    def marked(*args, **kwargs):
        phase, tracker.phase = tracker.phase, COMMUNICATION
        try:
            return original(*args, **kwargs)
        finally:
            tracker.phase = phase

    marked.__wrapped__ = original  # type: ignore[attr-defined]
    marked.__oomdoc_communication__ = True  # type: ignore[attr-defined]
    marked.__doc__ = getattr(original, "__doc__", None)
    return marked


class _AfterImport(MetaPathFinder):
    """Calls `then(module)` once one of `names` has been imported (executed)."""

    def __init__(self, names: tuple[str, ...], then: Callable[[Any], None]) -> None:
        self.names = names
        self.then = then

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names or fullname in _FINDING:
            return None
        _FINDING.add(fullname)  # the other finders are asked once, not this again
        try:
            for finder in sys.meta_path:
                if isinstance(finder, _AfterImport) or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _ThenLoader(spec.loader, self.then)
                    return spec
            return None
        finally:
            _FINDING.discard(fullname)


# The module names an _AfterImport is finding now (imports hold the import lock).
_FINDING: set[str] = set()


class _ThenLoader(Loader):
    def __init__(self, loader: Any, then: Callable[[Any], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)  # get_source, is_package, ...

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        try:
            self.then(module)
        except Exception:
            pass  # the script's import never fails for oomdoc
