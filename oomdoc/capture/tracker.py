"""Step and phase detection, and what is recorded per step and at an OOM.

A step is a training step, never a stray module call. The unit is chosen by
what the script has, and can only move up (earlier steps are then merged
into the current one, since they were part of its first iteration):

- `optimizer`: an optimizer exists (from its construction, so evaluation or
  data loading before the first `optimizer.step()` is part of step 0); a
  step ends at `optimizer.step()` (global optimizer hooks see every
  torch.optim optimizer and subclass);
- `backward`: no optimizer, but the script calls backward (a manual update
  such as `p.data.add_(p.grad, alpha=-lr)`): a backward ends an iteration;
- `module`: neither yet: each outermost call of a module with parameters.

Only a *training call* (an outermost call of a module with parameters that
require grad, under autograd) opens a step. Calls of modules without
parameters (transforms, loss modules) are invisible to the step model, and
model calls under `no_grad`/`inference_mode` or in `eval()` mode are the
`evaluation` phase of the step they happen in. A step is closed lazily, when
the next step's first training call starts (or the script ends), so several
optimizers stepping in one iteration form one step, an evaluation after an
optimizer step belongs to that step, and `--max-steps` stops between steps.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from collections import deque
from operator import attrgetter
from typing import Callable

import torch
import torch.nn as nn

from oomdoc import frames
from oomdoc.capture.backends import Backend, storage_key, storage_sites
from oomdoc.capture.modules import ModuleScopes, block_categories, simulated_attribution
from oomdoc.capture.step_records import BoundedSteps
from oomdoc.snapshot import CATEGORIES


class StopRun(BaseException):
    """Raised into the script to stop it cleanly after `max_steps` steps.

    A BaseException so that a script's `except Exception` does not swallow it.
    """


_GRAPH_STAMP = "oomdoc_step"
# On an autograd node: the oldest step stamp found below it (what a walk
# from it would return), so the next walk stops there instead of walking an
# ever longer chain again (`total += loss` adds one node per step).
_GRAPH_BELOW = "oomdoc_below"
_NO_STAMP = 1 << 62
_GRAPH_WALK_LIMIT = 4000
_LEAK_FRAMES = 3
_CONTAINER_ITEMS = 8
# The deep leak walk (below this step's own graph roots) runs only while
# end-of-step memory grows, after this many steps of growth in a row, then
# with gaps that double up to the last value: O(log steps) walks in a leak.
_DEEP_WALK_AFTER_GROWTH = 3
_DEEP_WALK_FIRST_GAP = 4
_DEEP_WALK_MAX_GAP = 256
# On CUDA, the allocation sites of a new high are read again (an allocator
# snapshot, costly) only when it is this much above the last one read.
_CUDA_SITES_GROWTH = 1.25
_SAMPLED_PHASES = frozenset(("forward", "backward", "optimizer", "evaluation"))
# Step units, in the order a run can move through them (see the module's docstring).
UNITS = ("module", "backward", "optimizer")
# What an outermost module call is to the step model (_call_kind).
_AUXILIARY, _EVALUATION, _TRAINING = 0, 1, 2
_CALL = weakref.ref.__call__  # map(_CALL, references): what they refer to, or None
_GRAD = attrgetter("grad")


class Tracker:
    def __init__(
        self,
        backend: Backend,
        max_steps: int | None = None,
        micro_batches_per_step: int | None = None,
        expected_unit: str | None = None,
        stop_after_evaluation: int | None = None,
    ):
        self.backend = backend
        self.max_steps = max_steps
        # A replay knows the failing run's unit: it never stops (max_steps)
        # before it has reached that unit, so a script that evaluates or
        # warms up before it trains runs into its training steps.
        self.expected_unit = expected_unit if expected_unit in UNITS else None
        # A replay of an evaluation OOM: it stops at the first training call
        # after its evaluation pass number `stop_after_evaluation` (1-based)
        # has ended, wherever the steps are (a smaller batch moves the
        # evaluation to another step index).
        self.stop_after_evaluation = stop_after_evaluation
        # Evaluation passes begun: each entry into the evaluation phase.
        self.evaluation_passes = 0
        # The outputs of the last outermost evaluation call (weak references
        # and their bytes), and of the one before: an OOM in an evaluation
        # says how much of the previous batch's outputs was still alive.
        self._evaluation_outputs: list = []
        self._previous_evaluation_outputs: list = []
        # Under gradient accumulation, the model calls before the first
        # optimizer step (each closes a step of its own until then) that
        # make one optimizer step: the stop waits for that step.
        self.micro_batches_per_step = max(1, micro_batches_per_step or 1)
        self.step_index = 0
        self.phase = "setup"
        self.unit = "module"  # moves up to "backward", "optimizer" (UNITS)
        self.steps: list[dict] = []
        # Only the steps that matter are kept, however long the run
        # (step_records); step_index still counts every step closed.
        self._bounded_steps = BoundedSteps()
        self.oom: dict | None = None
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # The same, as lists of weak references: iterating a WeakSet costs
        # more than the few models and optimizers it holds, at every boundary.
        self._model_refs: list = []
        self._optimizer_refs: list = []
        self.optimizer_classes: set[str] = set()
        self.models: list[dict] = []
        self._module_depth = 0
        # What the running outermost module call is (_AUXILIARY, ...).
        self._outer_kind = _AUXILIARY
        self._backward_depth = 0
        self._pending_close = False
        # Called with the module at each outermost model call, and with no
        # argument at each outermost backward: replays apply fixes there.
        self.forward_start_callbacks: list = []
        self.backward_start_callbacks: list = []
        # What a replayed fix did, by fix name (see oomdoc.capture.child.apply_fix).
        self.fix_applied: dict | None = None
        self._handles: list = []
        self._originals: list = []
        self._step_started = time.perf_counter()
        # Called once, when the first step begins (the simulated device's
        # lock for replays side by side, oomdoc.capture.gate).
        self.on_first_step: Callable[[], None] | None = None
        # Replays that share the device (share_device). `device_to_itself`:
        # whether a step timed now has the device alone; a step that did not
        # all along is marked `device_shared`.
        self.on_timed_steps: Callable[[], None] | None = None
        self.on_timed_steps_done: Callable[[], None] | None = None
        self.device_to_itself = True
        self._step_alone = True
        self.peak_sample: dict | None = None
        # (allocated, reserved) peak after the last step, or of a run without
        # steps: no step record holds it, the run's peak must (finish()).
        self.peak_outside_steps: tuple[int, int, str | None] = (0, 0, None)
        # The most each category held at any phase boundary (or the OOM):
        # what `oomdoc check` gates, since the categories peak at different
        # moments (activations at the end of forward, gradients after backward).
        self.category_peaks: dict[str, int] = {category: 0 for category in CATEGORIES}
        # Parameters of each model called, rebuilt only after a parameter or
        # module was registered somewhere (torch's global registration hooks).
        self._registration_epoch = 0
        self._registration_seen = False  # install(): both registration hooks exist
        self._module_parameters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Weak references to every parameter of the models and optimizers,
        # rebuilt only when the signature of what holds them changes.
        self._all_parameters: tuple = ()
        self._all_parameters_signature: tuple | None = None
        # Optimizer state by storage key, read again only after an optimizer
        # step or when an optimizer's state dict changed.
        self._state_table: dict | None = None
        self._state_signature: tuple = ()
        self._known: tuple[dict, dict, dict] | None = None
        # (the tables of _known_tensors, their {key: category}) for apply_known
        self._known_naming: tuple | None = None
        # What a phase boundary must read again (_known_tensors(cached=True)):
        # parameters at each step's start, gradients after a backward and
        # around the optimizer step, the state after an optimizer step.
        self._parameters_stale = True
        self._gradients_stale = True
        self._known_sources: tuple | None = None  # the parameter references read
        self._known_state: dict | None = None  # the state table read
        self._parameters_table: dict = {}
        self._gradients_table: dict = {}
        # Leak walks: end-of-step growth streak and when the next deep walk may run.
        self._growth_streak = 0
        self._growth_counted_for: dict | None = None
        self._next_deep_walk_step = 0
        self._deep_walk_gap = _DEEP_WALK_FIRST_GAP
        self._last_sites_allocated = -1
        # The highest allocation seen at a sampled boundary (peak_sample's own
        # moment may be lower on CUDA: see _sample_peak).
        self._sampled_high = -1
        self._step_timer = _CudaStepTimer() if backend.kind == "cuda" else None
        self.stats = {
            "boundary_samples": 0,
            "site_samples": 0,
            "leak_checks": 0,
            "leak_walks": 0,
            "graph_nodes_walked": 0,
            "parameter_list_builds": 0,
            "state_table_builds": 0,
            "known_tables_reused": 0,
        }
        # Module attribution (oomdoc.capture.modules): the running module's
        # path, and the `modules` table of the last breakdown with sites.
        self.scopes = ModuleScopes()
        self.last_modules: list | None = None
        # Simulated device: who owns the parameters, gradients, state and
        # buffers at the peak mark, for its `modules` table (finish()).
        self._mark_owners: dict | None = None
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
            # Model calls under no_grad/inference_mode or in eval() mode.
            "evaluation_calls": 0,
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
        self._step_alone = self.device_to_itself

    def exclude_seconds(self, seconds: float) -> None:
        """Leave `seconds` (a wait for the device lock) out of the step's duration."""
        self._step_started += seconds

    def _first_step(self) -> None:
        hook, self.on_first_step = self.on_first_step, None
        if hook is not None:
            hook()

    def _step_limit(self) -> int | None:
        """How many steps are closed before the run stops (StopRun), if limited."""
        limit = self.max_steps
        if limit is None or self.stop_after_evaluation is not None:
            return None
        if self.expected_unit is not None and UNITS.index(self.unit) < UNITS.index(
            self.expected_unit
        ):
            return None  # not training in the failing run's unit yet
        if self.unit == "module":
            limit *= self.micro_batches_per_step
        return limit

    def share_device(
        self, alone: Callable[[], None], done: Callable[[], None], autotunes: Callable[[], bool]
    ) -> None:
        """Replays that share the device (oomdoc.capture.gate): `alone` is
        called before the first step whose duration may be used is timed,
        `done` once the last one has been timed. When `autotunes()` at the
        first step, the device is alone from then on: kernels chosen by
        timing them (cuDNN's benchmark mode, torch.compile) must not be
        chosen while others use the device, since they decide the step
        times and workspace memory of every step."""
        self.on_timed_steps, self.on_timed_steps_done = alone, done
        self.device_to_itself = self._step_alone = False
        first_step = self.on_first_step

        def first_step_begins() -> None:
            if first_step is not None:
                first_step()
            if autotunes():
                self._timed_steps_begin()

        self.on_first_step = first_step_begins

    def _timed_steps_begin(self) -> None:
        """The device alone from here on: the steps that start from now on
        may be those whose durations are used (steps_timed in
        oomdoc.replay.batch leaves out only the first step, when later ones
        exist)."""
        hook = self.on_timed_steps
        if hook is not None and not self.device_to_itself:
            hook()
            self.device_to_itself = True

    def timed_steps_done(self) -> None:
        """No step timed from now on has the device alone (oomdoc.capture.gate)."""
        hook = self.on_timed_steps_done
        if hook is not None and self.device_to_itself:
            hook()
            self.device_to_itself = False

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
            if phase == "evaluation":
                self.evaluation_passes += 1
            self._sample_peak()
            self._fold_peak()
            self.phase = phase

    def _sample_peak(self) -> None:
        """Keep the breakdown at the fullest moment seen at a phase boundary.

        Memory peaks at the end of the forward pass or inside the optimizer
        step; sampling at the boundaries costs nothing in between, and the
        breakdown is only recomputed when a new high is reached.
        """
        if self.phase not in _SAMPLED_PHASES:
            return
        self.stats["boundary_samples"] += 1
        backend = self.backend
        allocated = backend.allocated_bytes()
        breakdown = self._breakdown(allocated, cached=True)
        if self.peak_sample is not None and allocated <= self._sampled_high:
            self._fold_category_peaks(breakdown)
            return
        self._sampled_high = allocated
        if backend.per_storage:
            # The sites and modules of this moment are listed when the
            # snapshot is written, from a log of what changes from now on
            # (finish()); who owns the named storages is noted now (O(params)).
            self._fold_category_peaks(breakdown)
            self._mark_owners = self.scopes.owners(
                self._live_optimizers(), storage_key, self._walk_epoch
            )
            backend.mark_peak()
            self.peak_sample = self._peak_entry(allocated, breakdown, None, None)
        elif (
            self.peak_sample is None or allocated >= self._last_sites_allocated * _CUDA_SITES_GROWTH
        ):
            # CUDA: the breakdown, the sites and the modules are read together
            # from one allocator snapshot (costly), so they agree.
            block_breakdown, sites = self._sites(refresh=False)
            breakdown = block_breakdown or breakdown
            self._fold_category_peaks(breakdown)
            self.peak_sample = self._peak_entry(allocated, breakdown, sites, self.last_modules)
            self._last_sites_allocated = allocated
        else:
            # CUDA, a new high within _CUDA_SITES_GROWTH of the last one read:
            # the peak sample stays that moment's (breakdown, sites and modules
            # of one moment), the category peaks still see this one.
            self._fold_category_peaks(breakdown)

    def _peak_entry(self, allocated: int, breakdown: dict, sites, modules) -> dict:
        return {
            "allocated_bytes": int(allocated),
            "step": self.step_index,
            "phase": self.phase,
            "breakdown": breakdown,
            "top_allocations": sites,
            "modules": modules,
        }

    def _fold_category_peaks(self, breakdown: dict) -> None:
        for category, nbytes in breakdown.items():
            if nbytes > self.category_peaks.get(category, 0):
                self.category_peaks[category] = int(nbytes)

    def _close_step(self) -> None:
        self._fold_peak()
        current = self._current
        if current["end_allocated_bytes"] is None:
            current["end_allocated_bytes"] = self.backend.allocated_bytes()
        current["duration_s"] = round(time.perf_counter() - self._step_started, 6)
        if self._step_timer is not None:
            # Step durations are compared between replays: a duration must be
            # the step's kernels, not their launch (events, not a sync).
            self._step_timer.close(current, self._step_started)
        if not (self._step_alone and self.device_to_itself):
            current["device_shared"] = True  # other replays' device work may be in its time
        if "retained_graphs" not in current:  # steps without an optimizer
            current["retained_graphs"] = self._find_retained_graphs(self._deep_walk_due())
        if self.backend.per_storage:
            current["retained_activation_bytes"] = int(
                self.backend.retained_activation_bytes(current["index"])
            )
        self.steps.append(current)
        self._bounded_steps.trim(self.steps)
        self.step_index += 1
        self._pending_close = False
        self._new_step()

    def finish(self) -> None:
        """Close the last step when the script ends (normally or not)."""
        # What the script's frames held is freed once the traceback's cycles
        # are collected: collect now, so the last step's end does not depend
        # on when the garbage collector happens to run.
        gc.collect()
        self._sample_peak()
        current = self._current
        if (
            current["forward_calls"]
            or current["evaluation_calls"]
            or current["optimizer_steps"]
            or current["backward_calls"]
        ):
            self._close_step()
        else:
            self._fold_peak()
            self.peak_outside_steps = (
                int(current["peak_allocated_bytes"]),
                int(current["peak_reserved_bytes"]),
                current["peak_phase"],
            )
        if self._step_timer is not None:
            self._step_timer.collect(block=True)
        sample = self.peak_sample
        if sample is not None and sample["top_allocations"] is None:
            sample["top_allocations"], sample["modules"] = self._marked_sites()

    def capture_stats(self) -> dict:
        """How much work the capture did: leak walks and samples stay far
        below the step count however long the run (docs/snapshot.md)."""
        stats = dict(self.stats)
        backend_stats = getattr(self.backend, "capture_stats", None)
        if backend_stats is not None:
            stats.update(backend_stats())
        return {key: int(value) for key, value in stats.items()}

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
        registration_hooks = 0
        for name in (
            "register_module_parameter_registration_hook",
            "register_module_module_registration_hook",
        ):
            register = getattr(module_hooks, name, None)
            if register is not None:
                self._handles.append(register(self._on_registration))
                registration_hooks += 1
        self._registration_seen = registration_hooks == 2
        self._patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
        self._patch(torch.autograd, "grad", self._wrap_backward(torch.autograd.grad))
        original_init = torch.optim.Optimizer.__init__
        tracker = self

        def optimizer_init(optimizer, *args, **kwargs):
            original_init(optimizer, *args, **kwargs)
            tracker._add_optimizer(optimizer)

        self._patch(torch.optim.Optimizer, "__init__", optimizer_init)
        for owner in (torch.optim.Optimizer, nn.Module):
            self._patch(owner, "zero_grad", self._wrap_zero_grad(owner.zero_grad))
        self.scopes.install(cuda=self.backend.kind == "cuda")
        # A process forked from the script (a DataLoader worker) is not the
        # script's training: its module calls neither step nor stop it.
        # (A weak reference: fork hooks cannot be removed.)
        this = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _uninstall_forked(this()))

    def _wrap_zero_grad(self, original):
        """zero_grad frees or zeroes gradients between phase boundaries (an
        LBFGS closure, a loop that zeroes after its forward): the next
        boundary reads them again."""
        tracker = self

        def zero_grad(owner, *args, **kwargs):
            tracker._gradients_stale = True
            return original(owner, *args, **kwargs)

        zero_grad.__wrapped__ = original  # type: ignore[attr-defined]
        zero_grad.__doc__ = original.__doc__
        return zero_grad

    @staticmethod
    def checkpoint_targets(model: nn.Module) -> list:
        """The blocks activation checkpointing wraps (see checkpoint_targets):
        replayed fixes reach it through the tracker they are given."""
        return checkpoint_targets(model)

    @property
    def in_backward(self) -> bool:
        """Inside torch.autograd.backward or grad (the wrapped ones)."""
        return self._backward_depth > 0

    def _on_registration(self, module, name, value):
        self._registration_epoch += 1

    @property
    def _walk_epoch(self) -> int | None:
        """The registration epoch, when torch reports every registration
        (else None: the models' modules are walked each time)."""
        return self._registration_epoch if self._registration_seen else None

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
                ended = getattr(tracker.backend, "backward_ended", None)
                if ended is not None:
                    ended()
                tracker._backward_depth -= 1
                tracker._gradients_stale = True
                if tracker._backward_depth == 0 and tracker.unit == "backward":
                    tracker._backward_ended()

        wrapped.__wrapped__ = original
        wrapped.__name__ = getattr(original, "__name__", "backward")
        wrapped.__doc__ = getattr(original, "__doc__", None)
        return wrapped

    def _on_forward_pre(self, module, inputs):
        if self._module_depth == 0 and self._backward_depth == 0:
            self._outer_kind = self._call_kind(module)
            if self._outer_kind != _AUXILIARY:
                self._outermost_forward_start(module)
        self._module_depth += 1
        self.scopes.push(module, inputs if self._module_depth == 1 else None)

    def _on_forward_post(self, module, inputs, output):
        self.scopes.pop(output)
        self._module_depth = max(0, self._module_depth - 1)
        if self._module_depth == 0 and self._backward_depth == 0:
            if self._outer_kind == _AUXILIARY:
                return  # a transform or a loss module: not a model call
            _stamp_graph(output, self.step_index)
            if self._outer_kind == _EVALUATION:
                self._evaluation_outputs = [
                    (weakref.ref(tensor), tensor.untyped_storage().nbytes())
                    for tensor in _output_tensors(output)
                ]
            self._sample_peak()
            if self.unit == "module":
                self._current["end_allocated_bytes"] = self.backend.allocated_bytes()

    def _call_kind(self, module) -> int:
        """What an outermost module call is to the step model: a module
        without parameters (a torchvision transform, `nn.CrossEntropyLoss()`)
        is auxiliary; a model call under autograd with parameters that
        require grad is training; any other model call is evaluation."""
        parameters = self._parameters_of(module)
        if not parameters:
            return _AUXILIARY
        if (
            torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            and any(parameter.requires_grad for parameter in parameters)
        ):
            return _TRAINING
        return _EVALUATION

    def _outermost_forward_start(self, module) -> None:
        if self.on_first_step is not None:
            self._first_step()
        training = self._outer_kind == _TRAINING
        current = self._current
        evaluated = (
            training
            and self.stop_after_evaluation is not None
            and self.evaluation_passes >= self.stop_after_evaluation
        )
        if evaluated:
            # The replayed evaluation has run to its end: stop here.
            self._close_step()
            self.timed_steps_done()
            raise StopRun()
        if self._pending_close and training:
            closes = True
        else:
            # Per model call until a backward or an optimizer exists.
            closes = self.unit == "module" and bool(
                current["forward_calls"] or current["evaluation_calls"]
            )
        if closes:
            limit = self._step_limit()
            last = limit is not None and self.step_index + 1 >= limit
            if not last:
                # Taken before this step's end is timed: a wait for it is
                # left out of this step (exclude_seconds), and the next step
                # starts with the device alone.
                self._timed_steps_begin()
            self._close_step()
            if last:
                self.timed_steps_done()
                raise StopRun()
            current = self._current
        self._add_model(module)
        evaluation = not training or not module.training
        self._set_phase("evaluation" if evaluation else "forward")
        # Gradients a script freed or set itself (`p.grad = None`) since the
        # last boundary are read again.
        self._gradients_stale = True
        if current["forward_calls"] == 0 and current["evaluation_calls"] == 0:
            # A new step: a script may have swapped a parameter's data
            # (`param.data = ...`) between steps.
            self._parameters_stale = True
        if current["forward_calls"] == 0 and (training or current["evaluation_calls"] == 0):
            # What is alive when the step's work begins (its first training
            # call, else its first evaluation call): replays use it as the
            # batch-independent part of the step's peaks.
            current["start_allocated_bytes"] = int(self.backend.allocated_bytes())
            if not self.backend.per_storage:
                self._remember_forward_baseline()
        if training:
            current["forward_calls"] += 1
            current["forward_calls_with_grad"] += 1
            if not module.training:
                current["eval_mode_forward_calls_with_grad"] += 1
        else:
            current["evaluation_calls"] += 1
            self._previous_evaluation_outputs = self._evaluation_outputs
            self._evaluation_outputs = []
        for callback in self.forward_start_callbacks:
            callback(module)

    def _on_backward_start(self, roots) -> None:
        if self.on_first_step is not None:
            self._first_step()
        if self.unit == "module":
            self._raise_unit("backward")
        if self._backward_depth == 0:
            _stamp_graph(roots, self.step_index)
            self._set_phase("backward")
            self._current["backward_calls"] += 1
            for callback in self.backward_start_callbacks:
                callback()

    def _backward_ended(self) -> None:
        """Without an optimizer, the end of a backward ends the iteration:
        the step closes at the next training call, and what comes between
        (a manual update, the next batch, an evaluation) is its idle time."""
        self._sample_peak()
        self._fold_peak()
        self._current["end_allocated_bytes"] = self.backend.allocated_bytes()
        self._pending_close = True
        self.phase = "idle"

    def _add_optimizer(self, optimizer) -> None:
        if self.unit != "optimizer":
            # An optimizer that exists makes its step the unit from now on.
            self._raise_unit("optimizer")
        if optimizer not in self.optimizers:
            self.optimizers.add(optimizer)
            self._optimizer_refs.append(weakref.ref(optimizer))
            self.optimizer_classes.add(type(optimizer).__name__)

    def _add_model(self, module) -> None:
        """Remember a model the first time it is called: its size and the
        repeated blocks that activation checkpointing could wrap."""
        if module in self.modules:
            return
        self.modules.add(module)
        self._model_refs.append(weakref.ref(module))
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
        if self.on_first_step is not None:
            self._first_step()
        self._add_optimizer(optimizer)
        self._gradients_stale = True  # gradients a script set without a backward
        with_closure = _with_phased_closure(self, args, kwargs)
        if with_closure is not None:
            # The closure runs the forward and backward inside the step
            # (Lightning's automatic optimization, LBFGS): their phases are
            # their own, the update after the closure is the optimizer's.
            return with_closure
        self._set_phase("optimizer")
        return None

    def _closure_returned(self) -> None:
        self._set_phase("optimizer")

    def _on_optimizer_post(self, optimizer, args, kwargs):
        # The bookkeeping of a finished step happens here rather than when the
        # next step begins: on CUDA the optimizer's kernels are still queued, so
        # this host work overlaps them instead of delaying the next forward.
        self._state_table = None  # the step may have created or replaced state
        self._sample_peak()
        self._fold_peak()
        current = self._current
        current["optimizer_steps"] += 1
        current["end_allocated_bytes"] = self.backend.allocated_bytes()
        retained = current.setdefault("retained_graphs", [])
        known = {(entry["variable"], entry["file"]) for entry in retained}
        retained.extend(
            entry
            for entry in self._find_retained_graphs(self._deep_walk_due())
            if (entry["variable"], entry["file"]) not in known
        )
        if not self.backend.per_storage:
            # _sample_peak() above has just read the state the step made.
            known = self._known if self._known is not None else self._known_tensors()
            self._state_bytes = sum(known[2].values())
        self._pending_close = True
        self.phase = "idle"

    def _raise_unit(self, unit: str) -> None:
        """Move up to a larger step unit. The steps closed in the smaller one
        were all part of the first iteration of the larger one (evaluation,
        warm-up, micro-batches before the first optimizer step): merge them
        into the current step, which becomes step 0. A step already closed
        in the backward unit is kept when an optimizer appears later."""
        previous, self.unit = self.unit, unit
        if not self.steps or previous != "module":
            return
        merged = self._current
        for earlier in self.steps:
            if earlier["peak_allocated_bytes"] > merged["peak_allocated_bytes"]:
                merged["peak_allocated_bytes"] = earlier["peak_allocated_bytes"]
                merged["peak_phase"] = earlier["peak_phase"]
            merged["peak_reserved_bytes"] = max(
                merged["peak_reserved_bytes"], earlier["peak_reserved_bytes"]
            )
            for phase, value in earlier["phase_peaks"].items():
                merged["phase_peaks"][phase] = max(merged["phase_peaks"].get(phase, 0), value)
            for key in (
                "forward_calls",
                "evaluation_calls",
                "forward_calls_with_grad",
                "eval_mode_forward_calls_with_grad",
                "backward_calls",
            ):
                merged[key] += earlier[key]
        # The merged step's work began at the first training call among
        # them, else at the first evaluation call.
        ordered = [*self.steps, merged]
        starts = [step for step in ordered if step.get("start_allocated_bytes") is not None]
        training = [step for step in starts if step["forward_calls"]]
        if starts:
            merged["start_allocated_bytes"] = (training or starts)[0]["start_allocated_bytes"]
        merged["index"] = 0
        self.steps.clear()
        self.step_index = 0

    # ------------------------------------------------------------ leaks
    def _deep_walk_due(self) -> bool:
        """Whether this step's leak check should also walk below the step's
        own graph roots (the deep walk): only while end-of-step memory has
        grown for several steps in a row, and then with doubling gaps."""
        current = self._current
        if self._growth_counted_for is not current:  # once per step, however many optimizers
            previous = self.steps[-1]["end_allocated_bytes"] if self.steps else None
            end = current["end_allocated_bytes"]
            grew = previous is not None and end is not None and end > previous
            self._growth_streak = self._growth_streak + 1 if grew else 0
            self._growth_counted_for = current
        if self._growth_streak < _DEEP_WALK_AFTER_GROWTH:
            return False
        if self.step_index < self._next_deep_walk_step:
            return False
        self._next_deep_walk_step = self.step_index + self._deep_walk_gap
        self._deep_walk_gap = min(2 * self._deep_walk_gap, _DEEP_WALK_MAX_GAP)
        return True

    def _find_retained_graphs(self, deep: bool = False) -> list[dict]:
        """Variables in the user's frames whose autograd graph reaches back into
        an earlier step (e.g. `total += loss`): graphs that outlive their step.

        Every step, the variables are checked down to the nearest graph root
        stamped with a step, which costs what the step added (walks remember
        on each node what lies below it). A variable that is this step's own
        root (the model's output, the loss) is walked below only by the deep
        walk (`deep`), which _deep_walk_due() allows while memory grows."""
        found: list[dict] = []
        if self.step_index == 0:
            return found
        self.stats["leak_checks"] += 1
        if deep:
            self.stats["leak_walks"] += 1
        try:
            user_frames = frames.user_frames(_LEAK_FRAMES, sys._getframe(1))
        except Exception:
            return found
        seen_tensors = set()
        walked = [0]
        for frame in user_frames:
            for name, value in _frame_locals(frame):
                if not isinstance(value, _CANDIDATE_TYPES):
                    continue  # most locals: modules, numbers, functions
                for tensor in _candidate_tensors(value):
                    if id(tensor) in seen_tensors:
                        continue
                    seen_tensors.add(id(tensor))
                    oldest = _oldest_stamp(tensor.grad_fn, self.step_index, deep, walked)
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
        self.stats["graph_nodes_walked"] += walked[0]
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
        if self.phase == "evaluation":
            self.oom["evaluation_pass"] = self.evaluation_passes
            held = self._held_previous_outputs(sys._getframe(1))
            if held is not None:
                self.oom["previous_outputs"] = held

    def _held_previous_outputs(self, frame) -> dict | None:
        """The previous evaluation call's outputs still alive while this one
        runs (`output = model(x)` in a loop keeps the last batch's logits
        until the new ones are assigned): their bytes, and the user's
        variable that holds them when one is found."""
        alive = [
            (tensor, nbytes)
            for reference, nbytes in self._previous_evaluation_outputs
            if (tensor := reference()) is not None
        ]
        if not alive:
            return None
        held: dict = {"bytes": int(sum(nbytes for _tensor, nbytes in alive))}
        ids = {id(tensor) for tensor, _nbytes in alive}
        try:
            user_frames = frames.user_frames(_LEAK_FRAMES, frame)
        except Exception:
            user_frames = []
        for user_frame in user_frames:
            for name, value in _frame_locals(user_frame):
                if isinstance(value, _CANDIDATE_TYPES) and any(
                    id(tensor) in ids for tensor in _output_tensors(value)
                ):
                    held["variable"] = name
                    held["location"] = frames.location_dict(
                        user_frame.f_code.co_filename,
                        user_frame.f_lineno,
                        user_frame.f_code.co_name,
                    )
                    return held
        return held

    # ------------------------------------------------------------ breakdown
    def _live_models(self) -> list:
        return [model for reference in self._model_refs if (model := reference()) is not None]

    def _live_optimizers(self) -> list:
        return [
            optimizer
            for reference in self._optimizer_refs
            if (optimizer := reference()) is not None
        ]

    def _parameters_of(self, module) -> list:
        """The module's parameters, from a list rebuilt only after a parameter
        or module was registered somewhere. Weak references: a parameter the
        script drops is not kept alive (nor counted) by oomdoc."""
        entry = self._module_parameters.get(module)
        if entry is None or entry[0] != self._registration_epoch:
            self.stats["parameter_list_builds"] += 1
            entry = (
                self._registration_epoch,
                tuple(weakref.ref(parameter) for parameter in module.parameters()),
            )
            self._module_parameters[module] = entry
        parameters = [reference() for reference in entry[1]]
        return [parameter for parameter in parameters if parameter is not None]

    def _state_tensors(self) -> dict:
        """Storage key -> bytes of the optimizers' state tensors. Read again
        only after an optimizer step or when an optimizer's state dict was
        replaced or changed size (load_state_dict)."""
        optimizers = self._live_optimizers()
        signature = tuple((id(o), id(o.state), len(o.state)) for o in optimizers)
        if self._state_table is not None and signature == self._state_signature:
            return self._state_table
        self.stats["state_table_builds"] += 1
        tensors = [
            value
            for optimizer in optimizers
            for per_parameter in list(optimizer.state.values())
            if isinstance(per_parameter, dict)
            for value in per_parameter.values()
            if isinstance(value, torch.Tensor)
        ]
        table = self.backend.storage_table(tensors)
        self._state_table, self._state_signature = table, signature
        return table

    def _parameter_references(self) -> tuple:
        """Weak references to the parameters of the models called, then
        those of the optimizers not in a model, each once. Rebuilt only when
        a parameter or module was registered somewhere, a model or optimizer
        came or went, or an optimizer's parameter groups changed."""
        models = self._live_models()
        optimizers = self._live_optimizers()
        signature = (
            self._registration_epoch,
            tuple(map(id, models)),
            tuple(
                (id(group["params"]), len(group["params"]))
                for o in optimizers
                for group in o.param_groups
            ),
        )
        if signature == self._all_parameters_signature:
            return self._all_parameters
        all_parameters = []
        for module in models:
            all_parameters.extend(self._parameters_of(module))
        seen = set(map(id, all_parameters))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                # The optimizer's parameters are mostly the models': once each.
                all_parameters.extend(p for p in group["params"] if id(p) not in seen)
        self._all_parameters = tuple(weakref.ref(parameter) for parameter in all_parameters)
        self._all_parameters_signature = signature
        return self._all_parameters

    def _known_tensors(self, cached: bool = False):
        """Storage keys of parameters, gradients and optimizer state on the device.

        `cached` (a phase boundary): tables nothing could have changed since
        they were read are not read again: parameters are read at each step's
        start, gradients after each backward and at the optimizer step, the
        optimizer state after each optimizer step (see the `_stale` flags).
        Otherwise (an OOM, the sites, the end) all are read now."""
        references = self._parameter_references()
        state = self._state_tensors()
        reuse = cached and self._known is not None and references is self._known_sources
        if reuse and not self._parameters_stale and not self._gradients_stale:
            if state is self._known_state:
                self.stats["known_tables_reused"] += 1
                return self._known
        alive = [p for p in map(_CALL, references) if p is not None]
        table = self.backend.storage_table
        if reuse and not self._parameters_stale:
            parameters = self._parameters_table
        else:
            parameters = self._parameters_table = table(alive)
        if reuse and not self._gradients_stale:
            gradients = self._gradients_table
        else:
            gradients = self._gradients_table = table(map(_GRAD, alive))
        self._parameters_stale = self._gradients_stale = False
        self._known_sources, self._known_state = references, state
        # A storage is counted once, in the first category that claims it.
        if gradients and not gradients.keys().isdisjoint(parameters):
            gradients = {k: v for k, v in gradients.items() if k not in parameters}
        if state and not (
            state.keys().isdisjoint(parameters) and state.keys().isdisjoint(gradients)
        ):
            state = {k: v for k, v in state.items() if k not in parameters and k not in gradients}
        known = (parameters, gradients, state)
        if known != self._known:
            # Read again and the same (most boundaries): the tables stay the
            # same objects, and what was derived from them is reused.
            self._known = known
        return self._known

    def _breakdown(self, allocated: int | None = None, cached: bool = False) -> dict:
        """Live memory split into the five categories: O(parameters and
        optimizer state), whatever else is alive (`cached`: see _known_tensors)."""
        tables = self._known_tensors(cached)
        parameters, gradients, state = tables
        backend = self.backend
        if backend.per_storage:
            # The simulated device keeps bytes per category as storages come
            # and go; it is told which storages are parameters, grads, state
            # (the same dict while the tables are the same: apply_known then
            # costs nothing).
            if self._known_naming is not None and self._known_naming[0] is tables:
                known = self._known_naming[1]
            else:
                known = dict.fromkeys(state, "optimizer_state")
                known.update(dict.fromkeys(gradients, "gradients"))
                known.update(dict.fromkeys(parameters, "parameters"))
                self._known_naming = (tables, known)
            backend.apply_known(known)
            counts = backend.category_bytes()
            return {category: int(counts[category]) for category in CATEGORIES}
        breakdown = {category: 0 for category in CATEGORIES}
        breakdown["parameters"] = sum(parameters.values())
        breakdown["gradients"] = sum(gradients.values())
        breakdown["optimizer_state"] = sum(state.values())
        if allocated is None:
            allocated = backend.allocated_bytes()
        known_bytes = (
            breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]
        )
        baseline = self._forward_baseline
        if baseline is not None:
            grown = allocated - baseline["allocated"]
            grown -= max(0, breakdown["gradients"] - baseline["gradients"])
            grown -= max(0, breakdown["optimizer_state"] - baseline["optimizer_state"])
            breakdown["activations"] = max(0, min(grown, allocated - known_bytes))
        breakdown["other"] = max(0, allocated - known_bytes - breakdown["activations"])
        return {k: int(v) for k, v in breakdown.items()}

    def breakdown_and_sites(
        self, limit: int = 20, with_sites: bool = True
    ) -> tuple[dict, list[dict]]:
        """Live memory split into the five categories, and the largest
        allocation sites (aggregated by user location, shape and dtype).
        Without `with_sites` only the breakdown is computed (no allocator
        snapshot on CUDA), cheap enough for every phase boundary. With them
        the `modules` table of the same moment is kept in `last_modules`;
        on CUDA the breakdown is then the allocator blocks', by the rule the
        sites and the modules use."""
        breakdown = self._breakdown()
        if not with_sites:
            return breakdown, []
        block_breakdown, sites = self._sites(limit, refresh=False)
        return block_breakdown or breakdown, sites

    def _sites(self, limit: int = 20, refresh: bool = True) -> tuple[dict | None, list[dict]]:
        """The largest live allocation sites now (O(live allocations)), with
        the `modules` table of this moment in `last_modules`.

        One category rule (oomdoc.capture.modules.category_of) for all three
        tables: on the simulated device the sites and the modules take each
        storage's category from the counters' naming, so they sum to the
        breakdown (returned as None: the counters already are it); on CUDA
        the allocator's blocks are classified once and the breakdown returned
        is theirs (None without an allocator history)."""
        self.stats["site_samples"] += 1
        backend = self.backend
        if backend.per_storage:
            if refresh:
                self._breakdown()  # names parameters, gradients and state on the device
            items = [(key, record) for key, _nbytes, record in backend.live_storages()]
            owners = self.scopes.owners(self._live_optimizers(), storage_key, self._walk_epoch)
            sites, self.last_modules = self._storage_sites_and_modules(
                items, backend.known_categories(), owners, self.phase, limit
            )
            return None, sites
        if refresh or self._known is None:
            self._known_tensors()
        parameters, gradients, state = self._known
        sites = backend.allocation_sites() or []
        if not sites or "address" not in sites[0]:
            self.last_modules = None
            return None, _group_sites(sites, {}, self.phase, limit)
        addresses = self._address_categories(parameters, gradients, state)
        owners = self.scopes.owners(self._live_optimizers(), self._address_of, self._walk_epoch)
        blocks = block_categories(sites, addresses, owners, self.scopes)
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for site, (path, category, size) in zip(sites, blocks):
            site["category"] = category
            site["module"] = path
            breakdown[category] += size
        self.last_modules = self.scopes.table(blocks)
        return breakdown, _group_sites(sites, {}, self.phase, limit, self.scopes.site_label)

    def _storage_sites_and_modules(self, items, known, owners, phase, limit) -> tuple:
        """Simulated device: (sites, modules) of [(key, StorageRecord)], the
        storages named by `known` ({key: category}), `owners` ({key: path})."""
        modules = self.scopes.table(
            simulated_attribution(
                ((key, record.nbytes, record) for key, record in items), known, owners
            )
        )
        sites = storage_sites(items)
        for site in sites:
            owner = owners.get(site["key"])  # a parameter's, gradient's or state's module
            if owner is not None:
                site["module"] = owner
        return _group_sites(sites, known, phase, limit, self.scopes.site_label), modules

    def _marked_sites(self, limit: int = 20) -> tuple[list[dict], list | None]:
        """The sites and the modules at the simulated device's peak mark (see
        _sample_peak): one listing of the storages live then, when the
        snapshot is written."""
        marked = self.backend.marked_storages() if self.backend.per_storage else None
        if marked is None:
            return [], None
        items, known = marked
        self.stats["site_samples"] += 1
        return self._storage_sites_and_modules(
            items, known, self._mark_owners or {}, self.peak_sample["phase"], limit
        )

    _forward_baseline: dict | None = None

    _state_bytes = 0

    def _remember_forward_baseline(self) -> None:
        """Without per-storage tags (CUDA), activations are what was allocated
        since the step's first forward began, less new gradients and state.

        It only sums gradients; the optimizer state, which changes only
        inside optimizer.step(), was measured after the last step."""
        parameters = [p for module in self._live_models() for p in self._parameters_of(module)]
        gradients = self.backend.storage_table(map(_GRAD, parameters))
        self._forward_baseline = {
            "allocated": self.backend.allocated_bytes(),
            "gradients": sum(gradients.values()),
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
        for module in self._live_models():
            for parameter in module.parameters():
                if category == "parameters":
                    yield parameter
                elif category == "gradients" and parameter.grad is not None:
                    yield parameter.grad
        if category == "optimizer_state":
            for optimizer in self._live_optimizers():
                for per_parameter in list(optimizer.state.values()):
                    if isinstance(per_parameter, dict):
                        for value in per_parameter.values():
                            if isinstance(value, torch.Tensor):
                                yield value


class _CudaStepTimer:
    """CUDA step durations without waiting for the GPU at every step.

    An event is recorded on the current stream at each step boundary; a
    step's duration is the GPU time between its two events (in steady state
    the step's wall time, whether the GPU or the host is the bottleneck),
    read once the later event has completed. The first step, which has no
    event before it, is timed on the host after one synchronize. Until an
    event is read the host-measured duration stands."""

    def __init__(self):
        self._last_event = None
        self._pending: deque = deque()

    def close(self, step: dict, started: float) -> None:
        try:
            event = torch.cuda.Event(enable_timing=True)
            if self._last_event is None:
                torch.cuda.synchronize()
                step["duration_s"] = round(time.perf_counter() - started, 6)
                event.record()
            else:
                event.record()
                self._pending.append((step, self._last_event, event))
            self._last_event = event
            self.collect(block=False)
        except Exception:  # a broken context: keep the host-measured duration
            self._last_event = None

    def collect(self, block: bool) -> None:
        pending = self._pending
        while pending:
            step, start, end = pending[0]
            try:
                if block:
                    end.synchronize()
                elif not end.query():
                    return
                step["duration_s"] = round(start.elapsed_time(end) / 1000.0, 6)
            except Exception:
                pass
            pending.popleft()


_CO_OPTIMIZED = 0x0001


def _uninstall_forked(tracker: Tracker | None) -> None:
    if tracker is not None and (tracker._handles or tracker._originals):
        tracker.uninstall()


def _with_phased_closure(tracker: Tracker, args: tuple, kwargs: dict) -> tuple | None:
    """`optimizer.step(closure)`'s arguments with the closure wrapped so that
    the phase becomes `optimizer` when it returns (None without a closure).
    `args` starts with the optimizer itself. An exception (an OOM) leaves
    the phase where it happened."""
    if callable(kwargs.get("closure")):
        closure = kwargs["closure"]
        kwargs = {**kwargs, "closure": _phased(tracker, closure)}
        return args, kwargs
    if len(args) > 1 and callable(args[1]):
        return (args[0], _phased(tracker, args[1]), *args[2:]), kwargs
    return None


def _phased(tracker: Tracker, closure):
    def closure_in_step(*args, **kwargs):
        result = closure(*args, **kwargs)
        tracker._closure_returned()
        return result

    closure_in_step.__wrapped__ = closure  # type: ignore[attr-defined]
    return closure_in_step


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


_CANDIDATE_TYPES = (torch.Tensor, list, tuple, dict)


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


def _output_tensors(value) -> list:
    """The tensors a model call returned or a variable holds: the value, or
    the last few items of a tuple, list or dict (HF's ModelOutput is one),
    with or without autograd history."""
    if isinstance(value, torch.Tensor):
        items: list = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value[-_CONTAINER_ITEMS:])
    elif isinstance(value, dict):
        items = list(value.values())[-_CONTAINER_ITEMS:]
    else:
        return []
    return [item for item in items if isinstance(item, torch.Tensor) and item.device.type != "meta"]


def _group_sites(sites, known: dict, phase: str, limit: int, label=None) -> list[dict]:
    """Allocation sites grouped by category, user location, module, shape and
    dtype, largest first. Simulated sites carry a storage `key`: its category
    is `known`'s, else category_of(None, the phase it was made in), kept as
    `base_category`. CUDA sites carry the `category` block_categories gave.
    `label(module path)`: the module a site shows (repeated blocks folded),
    so that one line of a script that starts a framework's training loop
    still splits by the layers that allocated."""
    grouped: dict[tuple, dict] = {}
    labels: dict = {}
    for site in sites:
        if "key" in site:
            category = known.get(site["key"]) or site["base_category"]
        else:
            category = site.get("category") or "other"
        location = site.get("location")
        loc_key = (location or {}).get("file"), (location or {}).get("line")
        path = site.get("module")
        module = None
        if label is not None and path is not None:
            module = labels.get(path)
            if module is None:
                module = labels[path] = label(path)
        group_key = (category, loc_key, module, tuple(site.get("shape") or ()), site.get("dtype"))
        entry = grouped.get(group_key)
        if entry is None:
            entry = grouped[group_key] = {
                "bytes": 0,
                "count": 0,
                "category": category,
                "location": location,
                "module": module,
                "shape": site.get("shape"),
                "dtype": site.get("dtype"),
            }
        entry["bytes"] += int(site["bytes"])
        entry["count"] += 1
    return sorted(grouped.values(), key=lambda entry: entry["bytes"], reverse=True)[:limit]


def _node_marks(node) -> tuple:
    """(step stamp, oldest stamp below) recorded on an autograd node, or Nones."""
    try:
        metadata = node.metadata
    except Exception:
        return None, None
    if not metadata:
        return None, None
    return metadata.get(_GRAPH_STAMP), metadata.get(_GRAPH_BELOW)


def _next_nodes(node) -> list:
    try:
        return [next_node for next_node, _ in node.next_functions if next_node is not None]
    except Exception:
        return []


def _stamp_below(start, walked: list) -> int:
    """The oldest step stamp on the graph roots reachable from `start`'s
    inputs without passing another root (_NO_STAMP when none).

    Each node walked remembers its answer in its metadata, so a later walk
    stops there: graphs never change below a node, so per step a walk costs
    what the step added. At most _GRAPH_WALK_LIMIT nodes are expanded; past
    that the oldest stamp seen so far is returned and nothing more is
    remembered (an unfinished node's answer would be wrong)."""
    budget = _GRAPH_WALK_LIMIT
    complete = True
    # Each entry: [node, its inputs, next input to look at, oldest stamp so far].
    stack = [[start, _next_nodes(start), 0, _NO_STAMP]]
    result = _NO_STAMP
    while stack:
        entry = stack[-1]
        node, inputs, index, oldest = entry
        if index < len(inputs):
            entry[2] = index + 1
            child = inputs[index]
            stamp, below = _node_marks(child)
            if stamp is not None:
                if stamp < oldest:
                    entry[3] = stamp
                continue
            if below is not None:
                if below < oldest:
                    entry[3] = below
                continue
            if budget <= 0:
                complete = False
                continue
            budget -= 1
            walked[0] += 1
            stack.append([child, _next_nodes(child), 0, _NO_STAMP])
            continue
        stack.pop()
        if complete:
            try:
                node.metadata[_GRAPH_BELOW] = oldest
            except Exception:
                pass
        if stack:
            if oldest < stack[-1][3]:
                stack[-1][3] = oldest
        else:
            result = oldest
    return result


def _oldest_stamp(grad_fn, current_step: int, deep: bool, walked: list) -> int | None:
    """The earliest step stamp older than the current step reachable from
    `grad_fn`, or None.

    The walk does not go below a stamped root other than the start: below a
    root of this step lies this step's model graph (nothing to find in the
    usual training loop, and costly to walk), below an older root lies the
    older step already found. Below the start itself when it is a root of
    this step only when `deep`.
    """
    if grad_fn is None:
        return None
    stamp, below = _node_marks(grad_fn)
    if stamp is not None:
        if stamp < current_step:
            return stamp
        if not deep:
            return None
    if below is None:
        below = _stamp_below(grad_fn, walked)
    return below if below < current_step else None
