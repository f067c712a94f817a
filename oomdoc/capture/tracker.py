"""Step and phase detection, and what is recorded per step and at an OOM.

A training step ends at `optimizer.step()` (global optimizer hooks see every
torch.optim optimizer and subclass). Without an optimizer the unit is the
outermost `nn.Module` call. A step is closed lazily, when the next step's
first forward starts (or the script ends), so several optimizers stepping in
one iteration form one step and `--max-steps` stops between steps.
"""

from __future__ import annotations

import sys
import time
import weakref

import torch
import torch.nn as nn

from oomdoc import frames
from oomdoc.capture.backends import Backend, storage_key
from oomdoc.capture.modules import ModuleScopes, block_categories, simulated_attribution
from oomdoc.capture.modules import category_of as storage_category
from oomdoc.snapshot import CATEGORIES


class StopRun(BaseException):
    """Raised into the script to stop it cleanly after `max_steps` steps.

    A BaseException so that a script's `except Exception` does not swallow it.
    """


_GRAPH_STAMP = "oomdoc_step"
_GRAPH_WALK_LIMIT = 4000
_LEAK_FRAMES = 3
_CONTAINER_ITEMS = 8


class Tracker:
    def __init__(self, backend: Backend, max_steps: int | None = None):
        self.backend = backend
        self.max_steps = max_steps
        self.step_index = 0
        self.phase = "setup"
        self.unit = "module"  # becomes "optimizer" at the first optimizer step
        self.steps: list[dict] = []
        self.oom: dict | None = None
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.optimizer_classes: set[str] = set()
        self.models: list[dict] = []
        self._module_depth = 0
        self._backward_depth = 0
        self._pending_close = False
        # Called with the module at each outermost model call, and with no
        # argument at each outermost backward: replays apply fixes there.
        self.forward_start_callbacks: list = []
        self.backward_start_callbacks: list = []
        self._handles: list = []
        self._originals: list = []
        self._step_started = time.perf_counter()
        self.peak_sample: dict | None = None
        # The most each category held at any phase boundary (or the OOM):
        # what `oomdoc check` gates, since the categories peak at different
        # moments (activations at the end of forward, gradients after backward).
        self.category_peaks: dict[str, int] = {category: 0 for category in CATEGORIES}
        # Module attribution (oomdoc.capture.modules): the running module's
        # path, and the `modules` table of the last breakdown with sites.
        self.scopes = ModuleScopes()
        self.last_modules: list | None = None
        self._new_step()

    # ------------------------------------------------------------ steps
    def _new_step(self) -> None:
        self._current = {
            "index": self.step_index,
            "peak_allocated_bytes": 0,
            "peak_reserved_bytes": 0,
            "peak_phase": self.phase,
            "end_allocated_bytes": None,
            "forward_calls": 0,
            "forward_calls_with_grad": 0,
            # Of those, calls on a module in eval mode (`model.eval()`): an
            # evaluation pass that forgot torch.no_grad().
            "eval_mode_forward_calls_with_grad": 0,
            "backward_calls": 0,
            "optimizer_steps": 0,
            # Peak allocated bytes per phase: replays model each phase against
            # the batch size separately (the optimizer peak does not grow with it).
            "phase_peaks": {},
        }
        self._step_started = time.perf_counter()

    def _fold_peak(self) -> None:
        """Attribute the peak since the last phase change to the phase that is ending."""
        allocated, reserved = self.backend.read_and_reset_peak()
        current = self._current
        phase_peaks = current["phase_peaks"]
        phase_peaks[self.phase] = max(phase_peaks.get(self.phase, 0), int(allocated))
        if allocated > current["peak_allocated_bytes"]:
            current["peak_allocated_bytes"] = allocated
            current["peak_phase"] = self.phase
        current["peak_reserved_bytes"] = max(current["peak_reserved_bytes"], reserved)

    def _set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self._sample_peak()
            self._fold_peak()
            self.phase = phase

    def _sample_peak(self) -> None:
        """Keep the breakdown at the fullest moment seen at a phase boundary.

        Memory peaks at the end of the forward pass or inside the optimizer
        step; sampling at the boundaries costs nothing in between, and the
        breakdown is only recomputed when a new high is reached.
        """
        if self.phase not in ("forward", "backward", "optimizer"):
            return
        allocated = self.backend.allocated_bytes()
        breakdown, _ = self.breakdown_and_sites(with_sites=False)
        self._fold_category_peaks(breakdown)
        if self.peak_sample is not None and allocated <= self.peak_sample["allocated_bytes"]:
            return
        breakdown, sites = self.breakdown_and_sites()
        self.peak_sample = {
            "allocated_bytes": int(allocated),
            "step": self.step_index,
            "phase": self.phase,
            "breakdown": breakdown,
            "top_allocations": sites,
            "modules": self.last_modules,
        }

    def _fold_category_peaks(self, breakdown: dict) -> None:
        for category, nbytes in breakdown.items():
            if nbytes > self.category_peaks.get(category, 0):
                self.category_peaks[category] = int(nbytes)

    def _close_step(self) -> None:
        if self.backend.kind == "cuda":
            # Step durations are compared between replays: wait for the
            # step's kernels so a duration is the step's, not its launch's.
            torch.cuda.synchronize()
        self._fold_peak()
        current = self._current
        if current["end_allocated_bytes"] is None:
            current["end_allocated_bytes"] = self.backend.allocated_bytes()
        current["duration_s"] = round(time.perf_counter() - self._step_started, 6)
        if "retained_graphs" not in current:  # steps without an optimizer
            current["retained_graphs"] = self._find_retained_graphs()
        if self.backend.per_storage:
            retained = sum(
                nbytes
                for _key, nbytes, record in self.backend.live_storages()
                if record is not None
                and record.step < current["index"]
                and record.phase in ("forward", "backward")
            )
            current["retained_activation_bytes"] = int(retained)
        self.steps.append(current)
        self.step_index += 1
        self._pending_close = False
        self._new_step()

    def finish(self) -> None:
        """Close the last step when the script ends (normally or not)."""
        self._sample_peak()
        current = self._current
        if current["forward_calls"] or current["optimizer_steps"] or current["backward_calls"]:
            self._close_step()
        else:
            self._fold_peak()

    # ------------------------------------------------------------ hooks
    def install(self) -> None:
        module_hooks = nn.modules.module
        self._handles.append(module_hooks.register_module_forward_pre_hook(self._on_forward_pre))
        try:
            handle = module_hooks.register_module_forward_hook(
                self._on_forward_post, always_call=True
            )
        except TypeError:  # torch without always_call
            handle = module_hooks.register_module_forward_hook(self._on_forward_post)
        self._handles.append(handle)
        import torch.optim.optimizer as optim

        self._handles.append(optim.register_optimizer_step_pre_hook(self._on_optimizer_pre))
        self._handles.append(optim.register_optimizer_step_post_hook(self._on_optimizer_post))
        self._patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
        self._patch(torch.autograd, "grad", self._wrap_backward(torch.autograd.grad))
        original_init = torch.optim.Optimizer.__init__
        tracker = self

        def optimizer_init(optimizer, *args, **kwargs):
            original_init(optimizer, *args, **kwargs)
            tracker._add_optimizer(optimizer)

        self._patch(torch.optim.Optimizer, "__init__", optimizer_init)
        self.scopes.install(cuda=self.backend.kind == "cuda")

    def _patch(self, owner, name, replacement) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def uninstall(self) -> None:
        self.scopes.uninstall()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def _wrap_backward(self, original):
        tracker = self

        def wrapped(*args, **kwargs):
            tracker._on_backward_start(
                args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
            )
            tracker._backward_depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                tracker._backward_depth -= 1

        wrapped.__wrapped__ = original
        wrapped.__name__ = getattr(original, "__name__", "backward")
        wrapped.__doc__ = getattr(original, "__doc__", None)
        return wrapped

    def _on_forward_pre(self, module, inputs):
        if self._module_depth == 0 and self._backward_depth == 0:
            self._outermost_forward_start(module)
        self._module_depth += 1
        self.scopes.push(module, inputs if self._module_depth == 1 else None)

    def _on_forward_post(self, module, inputs, output):
        self.scopes.pop(output)
        self._module_depth = max(0, self._module_depth - 1)
        if self._module_depth == 0 and self._backward_depth == 0:
            _stamp_graph(output, self.step_index)
            self._sample_peak()
            if self.unit == "module":
                self._current["end_allocated_bytes"] = self.backend.allocated_bytes()

    def _outermost_forward_start(self, module) -> None:
        if self._pending_close or (self.unit == "module" and self._current["forward_calls"]):
            self._close_step()
            if self.max_steps is not None and len(self.steps) >= self.max_steps:
                raise StopRun()
        self._add_model(module)
        self._set_phase("forward")
        current = self._current
        if current["forward_calls"] == 0:
            # What is alive when the step's work begins: replays use it as the
            # batch-independent part of the step's peaks.
            current["start_allocated_bytes"] = int(self.backend.allocated_bytes())
            if not self.backend.per_storage:
                self._remember_forward_baseline()
        current["forward_calls"] += 1
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            if any(parameter.requires_grad for parameter in module.parameters()):
                current["forward_calls_with_grad"] += 1
                if not module.training:
                    current["eval_mode_forward_calls_with_grad"] += 1
        for callback in self.forward_start_callbacks:
            callback(module)

    def _on_backward_start(self, roots) -> None:
        if self._backward_depth == 0:
            _stamp_graph(roots, self.step_index)
            self._set_phase("backward")
            self._current["backward_calls"] += 1
            for callback in self.backward_start_callbacks:
                callback()

    def _add_optimizer(self, optimizer) -> None:
        if optimizer not in self.optimizers:
            self.optimizers.add(optimizer)
            self.optimizer_classes.add(type(optimizer).__name__)

    def _add_model(self, module) -> None:
        """Remember a model the first time it is called: its size and the
        repeated blocks that activation checkpointing could wrap."""
        if module in self.modules:
            return
        self.modules.add(module)
        self.scopes.add_model(module)
        parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        self.models.append(
            {
                "class": type(module).__name__,
                "parameters_bytes": int(parameter_bytes),
                "repeated_blocks": repeated_blocks(module),
            }
        )

    def _on_optimizer_pre(self, optimizer, args, kwargs):
        self._add_optimizer(optimizer)
        if self.unit != "optimizer":
            self._switch_to_optimizer_unit()
        self._set_phase("optimizer")

    def _on_optimizer_post(self, optimizer, args, kwargs):
        # The bookkeeping of a finished step happens here rather than when the
        # next step begins: on CUDA the optimizer's kernels are still queued, so
        # this host work overlaps them instead of delaying the next forward.
        self._sample_peak()
        self._fold_peak()
        current = self._current
        current["optimizer_steps"] += 1
        current["end_allocated_bytes"] = self.backend.allocated_bytes()
        retained = current.setdefault("retained_graphs", [])
        known = {(entry["variable"], entry["file"]) for entry in retained}
        retained.extend(
            entry
            for entry in self._find_retained_graphs()
            if (entry["variable"], entry["file"]) not in known
        )
        if not self.backend.per_storage:
            self._state_bytes = sum(self._known_tensors()[2].values())
        self._pending_close = True
        self.phase = "idle"

    def _switch_to_optimizer_unit(self) -> None:
        """Steps closed per module call before the first optimizer step were
        really micro-batches of the first optimizer step: merge them."""
        self.unit = "optimizer"
        if not self.steps:
            return
        merged = self._current
        for earlier in self.steps:
            if earlier["peak_allocated_bytes"] > merged["peak_allocated_bytes"]:
                merged["peak_allocated_bytes"] = earlier["peak_allocated_bytes"]
                merged["peak_phase"] = earlier["peak_phase"]
            merged["peak_reserved_bytes"] = max(
                merged["peak_reserved_bytes"], earlier["peak_reserved_bytes"]
            )
            for key in (
                "forward_calls",
                "forward_calls_with_grad",
                "eval_mode_forward_calls_with_grad",
                "backward_calls",
            ):
                merged[key] += earlier[key]
        merged["index"] = 0
        self.steps.clear()
        self.step_index = 0

    # ------------------------------------------------------------ leaks
    def _find_retained_graphs(self) -> list[dict]:
        """Variables in the user's frames whose autograd graph reaches back into
        an earlier step (e.g. `total += loss`): graphs that outlive their step."""
        found = []
        if self.step_index == 0:
            return found
        try:
            user_frames = frames.user_frames(_LEAK_FRAMES, sys._getframe(1))
        except Exception:
            return found
        seen_tensors = set()
        visited_nodes: dict[int, object] = {}  # shared: a graph is walked once
        for frame in user_frames:
            for name, value in _frame_locals(frame):
                for tensor in _candidate_tensors(value):
                    if id(tensor) in seen_tensors:
                        continue
                    seen_tensors.add(id(tensor))
                    oldest = _oldest_stamp(tensor.grad_fn, self.step_index, visited_nodes)
                    if oldest is not None:
                        found.append(
                            {
                                "variable": name,
                                "file": frame.f_code.co_filename,
                                "line": frame.f_lineno,
                                "function": frame.f_code.co_name,
                                "from_step": oldest,
                            }
                        )
                        break
        return found

    # ------------------------------------------------------------ OOM
    def on_oom(self, requested_bytes: int, message: str | None) -> None:
        """Record the state at the moment of the OOM, before the stack unwinds."""
        allocated = self.backend.allocated_bytes()
        reserved = self.backend.reserved_bytes()
        capacity = self.backend.capacity_bytes()
        self._fold_peak()
        breakdown, sites = self.breakdown_and_sites()
        self._fold_category_peaks(breakdown)
        self.oom = {
            "step": self.step_index,
            "phase": self.phase,
            "requested_bytes": int(requested_bytes),
            "allocated_bytes": int(allocated),
            "reserved_bytes": int(reserved),
            "free_bytes": int(max(0, capacity - reserved)),
            "capacity_bytes": int(capacity),
            "message": message or "",
            "location": frames.current_user_location(sys._getframe(1)),
            # The module whose forward (or backward) asked for the memory.
            "module": self.scopes.allocation_path(),
            "breakdown": breakdown,
            "top_allocations": sites,
            "modules": self.last_modules,
            "allocator": self.backend.allocator_stats(),
        }

    # ------------------------------------------------------------ breakdown
    def _known_tensors(self):
        """Storage keys of parameters, gradients and optimizer state on the device."""
        parameters, gradients, state = {}, {}, {}
        backend = self.backend

        def add(table, tensor):
            if isinstance(tensor, torch.Tensor) and backend.owns(tensor):
                key = storage_key(tensor)
                if key is not None and key not in table:
                    try:
                        table[key] = backend.storage_bytes(tensor.untyped_storage().nbytes())
                    except Exception:
                        pass

        all_parameters = []
        for module in list(self.modules):
            all_parameters.extend(module.parameters())
        for optimizer in list(self.optimizers):
            for group in optimizer.param_groups:
                all_parameters.extend(group["params"])
        for parameter in all_parameters:
            add(parameters, parameter)
            if parameter.grad is not None:
                add(gradients, parameter.grad)
        for optimizer in list(self.optimizers):
            for per_parameter in list(optimizer.state.values()):
                if isinstance(per_parameter, dict):
                    for value in per_parameter.values():
                        add(state, value)
        # A storage is counted once, in the first category that claims it.
        gradients = {k: v for k, v in gradients.items() if k not in parameters}
        state = {k: v for k, v in state.items() if k not in parameters and k not in gradients}
        return parameters, gradients, state

    def breakdown_and_sites(
        self, limit: int = 20, with_sites: bool = True
    ) -> tuple[dict, list[dict]]:
        """Live memory split into the five categories, and the largest
        allocation sites (aggregated by user location, shape and dtype).
        Without `with_sites` only the breakdown is computed (no allocator
        snapshot on CUDA), cheap enough for every phase boundary."""
        parameters, gradients, state = self._known_tensors()
        breakdown = {category: 0 for category in CATEGORIES}
        breakdown["parameters"] = sum(parameters.values())
        breakdown["gradients"] = sum(gradients.values())
        breakdown["optimizer_state"] = sum(state.values())

        def category_of(key, record) -> str:
            if key in parameters:
                return "parameters"
            if key in gradients:
                return "gradients"
            if key in state:
                return "optimizer_state"
            return storage_category(None, record.phase if record is not None else None)

        per_storage = list(self.backend.live_storages())
        if self.backend.per_storage:
            # The simulated device sees every storage with the phase it was made in.
            breakdown = {category: 0 for category in CATEGORIES}
            for key, nbytes, record in per_storage:
                breakdown[category_of(key, record)] += nbytes
        else:
            allocated = self.backend.allocated_bytes()
            known = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]
            baseline = self._forward_baseline
            if baseline is not None:
                grown = allocated - baseline["allocated"]
                grown -= max(0, breakdown["gradients"] - baseline["gradients"])
                grown -= max(0, breakdown["optimizer_state"] - baseline["optimizer_state"])
                breakdown["activations"] = max(0, min(grown, allocated - known))
            breakdown["other"] = max(0, allocated - known - breakdown["activations"])
        if not with_sites:
            return {k: int(v) for k, v in breakdown.items()}, []

        records = {key: record for key, _nbytes, record in per_storage}
        sites = self.backend.allocation_sites() or []
        # One category per byte for the breakdown, the sites and the modules
        # (oomdoc.capture.modules); on CUDA all three come from the same blocks.
        blocks = None
        if self.backend.per_storage:
            known = dict.fromkeys(state, "optimizer_state")
            known.update(dict.fromkeys(gradients, "gradients"))
            known.update(dict.fromkeys(parameters, "parameters"))
            owners = self.scopes.owners(self.optimizers, storage_key)
            self.last_modules = self.scopes.table(simulated_attribution(per_storage, known, owners))
        elif sites and "address" in sites[0]:
            addresses = self._address_categories(parameters, gradients, state)
            owners = self.scopes.owners(self.optimizers, self._address_of)
            blocks = block_categories(sites, addresses, owners, self.scopes)
            breakdown = {category: 0 for category in CATEGORIES}
            for _path, category, size in blocks:
                breakdown[category] += size
            self.last_modules = self.scopes.table(blocks)
        grouped: dict[tuple, dict] = {}
        for index, site in enumerate(sites):
            if "key" in site:
                category = category_of(site["key"], records.get(site["key"]))
            else:
                category = blocks[index][1] if blocks else "other"
            location = site.get("location")
            loc_key = (location or {}).get("file"), (location or {}).get("line")
            group_key = (category, loc_key, tuple(site.get("shape") or ()), site.get("dtype"))
            entry = grouped.get(group_key)
            if entry is None:
                entry = grouped[group_key] = {
                    "bytes": 0,
                    "count": 0,
                    "category": category,
                    "location": location,
                    "shape": site.get("shape"),
                    "dtype": site.get("dtype"),
                }
            entry["bytes"] += int(site["bytes"])
            entry["count"] += 1
        top = sorted(grouped.values(), key=lambda entry: entry["bytes"], reverse=True)[:limit]
        return {k: int(v) for k, v in breakdown.items()}, top

    _forward_baseline: dict | None = None

    _state_bytes = 0

    def _remember_forward_baseline(self) -> None:
        """Without per-storage tags (CUDA), activations are what was allocated
        since the step's first forward began, less new gradients and state.

        This runs when the GPU may be idle (the step before ended with a
        sync), so it only sums gradients; the optimizer state, which changes
        only inside optimizer.step(), was measured after the last step."""
        gradient_bytes = 0
        seen = set()
        for module in list(self.modules):
            for parameter in module.parameters():
                grad = parameter.grad
                if grad is not None and self.backend.owns(grad):
                    key = storage_key(grad)
                    if key not in seen:
                        seen.add(key)
                        gradient_bytes += self.backend.storage_bytes(
                            grad.untyped_storage().nbytes()
                        )
        self._forward_baseline = {
            "allocated": self.backend.allocated_bytes(),
            "gradients": gradient_bytes,
            "optimizer_state": self._state_bytes,
        }

    def _address_categories(self, parameters, gradients, state) -> dict:
        """CUDA: map block addresses to categories through tensors' data pointers."""
        table = {}
        for category, _keys in (
            ("parameters", parameters),
            ("gradients", gradients),
            ("optimizer_state", state),
        ):
            for tensor in self._tensors_for(category):
                try:
                    table[tensor.untyped_storage().data_ptr()] = category
                except Exception:
                    pass
        return table

    def _address_of(self, tensor) -> int | None:
        if not self.backend.owns(tensor):
            return None
        try:
            return tensor.untyped_storage().data_ptr()
        except Exception:
            return None

    def _tensors_for(self, category: str):
        for module in list(self.modules):
            for parameter in module.parameters():
                if category == "parameters":
                    yield parameter
                elif category == "gradients" and parameter.grad is not None:
                    yield parameter.grad
        if category == "optimizer_state":
            for optimizer in list(self.optimizers):
                for per_parameter in list(optimizer.state.values()):
                    if isinstance(per_parameter, dict):
                        for value in per_parameter.values():
                            if isinstance(value, torch.Tensor):
                                yield value


_CO_OPTIMIZED = 0x0001


def _frame_locals(frame) -> list[tuple[str, object]]:
    """A function frame's local variables, without keeping them alive.

    Before Python 3.13, `frame.f_locals` of a running function is a snapshot
    dict cached on the frame until the next access: it would hold the
    previous step's tensors (logits, loss) alive through the whole next step
    and inflate that step's peak. The snapshot is emptied after it is read;
    the frame's real variables are untouched (the next access rebuilds the
    snapshot from them). Module frames' f_locals is the namespace itself and
    3.13's is a write-through proxy: neither is cleared.
    """
    snapshot = frame.f_locals
    items = list(snapshot.items())
    if (
        sys.version_info < (3, 13)
        and frame.f_code.co_flags & _CO_OPTIMIZED
        and isinstance(snapshot, dict)
    ):
        snapshot.clear()
    return items


def repeated_blocks(model: nn.Module) -> list[dict]:
    """The blocks activation checkpointing would wrap, for the snapshot."""
    return [
        {"path": path or "(root)", "class": class_name, "count": len(blocks)}
        for path, _container, class_name, blocks, _composite in checkpoint_targets(model)
    ]


def checkpoint_targets(model: nn.Module) -> list[tuple[str, nn.Module, str, list[nn.Module], bool]]:
    """(path, container, block class, blocks, composite) for the outermost
    nn.ModuleList / nn.Sequential containers holding several children of one
    class: the blocks activation checkpointing wraps. `composite` blocks have
    children of their own (a transformer block); leaf blocks (a Linear in a
    Sequential) are checkpointed in segments with the modules that follow them."""
    found = []
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[type, list[nn.Module]] = {}
        for child in container.children():
            if any(True for _ in child.parameters()):
                groups.setdefault(type(child), []).append(child)
        for block_class, blocks in groups.items():
            if len(blocks) >= 2:
                composite = any(True for _ in blocks[0].children())
                if composite or isinstance(container, nn.Sequential):
                    found.append((path, container, block_class.__name__, blocks, composite))
    chosen: list = []
    for target in sorted(
        found, key=lambda item: (item[0].count(".") if item[0] else -1, not item[4])
    ):
        path = target[0]
        if any(
            other == "" or path == other or path.startswith(other + ".") for other, *_ in chosen
        ):
            continue
        chosen.append(target)
    return chosen


def _stamp_graph(output, step_index: int) -> None:
    """Mark the graph roots made in this step so a later step can tell that a
    variable still holds them."""
    stack = [output]
    budget = 64
    while stack and budget:
        budget -= 1
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            grad_fn = item.grad_fn
            if grad_fn is not None:
                try:
                    grad_fn.metadata.setdefault(_GRAPH_STAMP, step_index)
                except Exception:
                    pass
        elif isinstance(item, (list, tuple)):
            stack.extend(item[:16])
        elif isinstance(item, dict):
            stack.extend(list(item.values())[:16])
        elif hasattr(item, "__dataclass_fields__") or hasattr(item, "to_tuple"):
            try:
                stack.extend(list(vars(item).values())[:16])
            except TypeError:
                pass


def _candidate_tensors(value):
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value[-_CONTAINER_ITEMS:]:
            if isinstance(item, torch.Tensor) and item.grad_fn is not None:
                yield item
    elif isinstance(value, dict):
        for item in list(value.values())[-_CONTAINER_ITEMS:]:
            if isinstance(item, torch.Tensor) and item.grad_fn is not None:
                yield item


def _oldest_stamp(grad_fn, current_step: int, visited: dict[int, object]) -> int | None:
    """The earliest step stamp older than the current step reachable from
    `grad_fn`, or None.

    The walk does not go below a stamped root other than the start: below a
    root of this step lies this step's model graph (nothing to find in the
    usual training loop, and costly to walk), below an older root lies the
    older step already found. `visited` holds the node wrappers so their ids
    are not reused while the walk runs.
    """
    if grad_fn is None:
        return None
    oldest = None
    stack = [grad_fn]
    budget = _GRAPH_WALK_LIMIT
    while stack and budget:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        budget -= 1
        try:
            stamp = node.metadata.get(_GRAPH_STAMP) if node.metadata else None
        except Exception:
            stamp = None
        if stamp is not None and stamp < current_step:
            oldest = stamp if oldest is None else min(oldest, stamp)
            continue
        if stamp is not None and node is not grad_fn:
            continue
        try:
            stack.extend(next_node for next_node, _ in node.next_functions)
        except Exception:
            pass
    return oldest
