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

import functools
import gc
import os
import sys
import weakref
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

from oomdoc import frames
from oomdoc.capture.attribution import Attribution
from oomdoc.capture.backend_base import StorageTableMemo
from oomdoc.capture.backends import Backend
from oomdoc.capture.compiled_models import fake_tracing, hooked_compile, traced_by_compile
from oomdoc.capture.module_calls import ModuleCalls, registration_hooks
from oomdoc.capture.modules import ModuleScopes
from oomdoc.capture.optimizer_cycle import IterationSteps, OptimizerCycle
from oomdoc.capture.repeated_blocks import checkpoint_targets, repeated_blocks
from oomdoc.capture.retained_graphs import (
    DEEP_WALK_FIRST_GAP,
    LeakChecks,
    output_tensors,
    stamp_graph,
)
from oomdoc.capture.step_limits import UNITS, StepLimits, StopRun
from oomdoc.capture.step_records import BoundedSteps, CudaStepTimer
from oomdoc.snapshot import CATEGORIES


class CaptureFields(Protocol):
    """What adds its own fields to the capture (a protocol: the module that
    provides it, oomdoc.capture.parallel, imports the tracker)."""

    def fields(self) -> dict: ...


# What an outermost module call is to the step model (_call_kind).
_AUXILIARY, _EVALUATION, _TRAINING = 0, 1, 2


class Tracker(Attribution, LeakChecks, StepLimits, IterationSteps):
    def __init__(
        self,
        backend: Backend,
        max_steps: int | None = None,
        micro_batches_per_step: int | None = None,
        expected_unit: str | None = None,
        stop_after_evaluation: int | None = None,
        names_uncalled_models: bool = True,
    ):
        self.backend = backend
        # At an OOM, name the weights outside every called model and optimizer
        # (Attribution.weights_outside_models: a scan of the collector's objects).
        self.names_uncalled_models = names_uncalled_models
        self.max_steps = max_steps
        # A replay knows the failing run's unit: it never stops (max_steps)
        # before it has reached that unit, so a script that evaluates or
        # warms up before it trains runs into its training steps.
        self.expected_unit = expected_unit if expected_unit in UNITS else None
        # A replay of an evaluation OOM stops at the first training call after
        # evaluation pass `stop_after_evaluation` (1-based) has ended, wherever
        # the steps are (a smaller batch moves it to another step index).
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
        self.optimizer_cycle = OptimizerCycle()  # which optimizer's step ends an iteration
        self.models: list[dict] = []
        self._module_depth = 0
        # What the running outermost module call is (_AUXILIARY, ...).
        self._outer_kind = _AUXILIARY
        self._backward_depth = 0
        self._pending_close = False
        # Called with the module at each outermost model call, and with no
        # argument at each outermost backward: replays apply fixes there.
        self.forward_start_callbacks: list = []
        # Asked before the step limit stops a replay: False lets one more step run.
        self.may_stop: Callable[[], bool] | None = None
        self.backward_start_callbacks: list = []
        # What a replayed fix did, by fix name (see oomdoc.capture.child.apply_fix).
        self.fix_applied: dict | None = None
        # Noted for the capture (oomdoc.capture.child): heavy packages imported,
        # DataLoaders' batch sizes (None: not watched, as in a replay), workers
        # removed (oomdoc check), processes started (captured as ranks or not).
        self.imported_packages: list[str] = []
        self.dataloader_batch_sizes: list | None = None
        self.dataloader_workers: list | None = None
        self.dataloader_workers_removed: list = []
        self.spawned_ranks: list[dict] = []
        self.uncaptured_processes: list[dict] = []
        self.parallel_capture: CaptureFields | None = None  # a rank's job fields
        self._handles: list = []
        self._originals: list = []
        self.module_calls = ModuleCalls(self)  # global hooks, or lean in steady steps
        self._lean_entry: nn.Module | None = None  # (module_calls._lean_call)
        self._begin_step_clock()
        # Called once, when the first step begins (the simulated device's
        # lock for replays side by side, oomdoc.capture.gate).
        self.on_first_step: Callable[[], None] | None = None
        # Replays that share the device (share_device). `device_to_itself`:
        # whether a step timed now has the device alone; a step that did not
        # all along is marked `device_shared`.
        self.on_timed_steps: Callable[[], None] | None = None
        self.on_timed_steps_done: Callable[[], None] | None = None
        # A replay that shares the device untimed: called at each step's end.
        self.on_step_end: Callable[[], None] | None = None
        self.sharing_untimed = False  # share_device_untimed, until its steps are done
        self.device_to_itself = True
        self.timed_steps_over = False  # timed_steps_done() was called
        self._step_alone = True
        # The input shapes of every training call so far: a step that meets
        # one the process has not is a warm-up for it (Step.new_shapes).
        self._shapes_met: set[tuple] = set()
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
        self._parameters_memo = StorageTableMemo()
        self._gradients_memo = StorageTableMemo()
        self._state_memo = StorageTableMemo()
        # Leak walks: end-of-step growth streak and when the next deep walk may run.
        self._growth_streak = 0
        self._growth_counted_for: dict | None = None
        self._next_deep_walk_step = 0
        self._deep_walk_gap = DEEP_WALK_FIRST_GAP
        self._last_sites_allocated = -1
        # The highest allocation seen at a sampled boundary (peak_sample's own
        # moment may be lower on CUDA: see _sample_peak).
        self._sampled_high = -1
        self._step_timer = CudaStepTimer() if backend.kind == "cuda" else None
        self.stats = {
            "boundary_samples": 0,
            "steady_samples": 0,
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
        self._current: dict[str, Any] = {
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
        self._begin_step_clock()
        self._step_alone = self.device_to_itself
        if self.timed_steps_over:
            # Past the replay's steps (batches fetched ahead, the steps after
            # its evaluation): not the steps its step time is made of.
            self._current["after_timed_steps"] = True

    def exclude_seconds(self, seconds: float) -> None:
        """Leave `seconds` (a wait for the device lock) out of the step's duration."""
        self._step_started += seconds

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
            self._pause_detail(self.backend.phase_started(phase) is False)

    def _pause_detail(self, paused: bool) -> None:
        """Steady steps: no module scopes, and only outermost calls hooked."""
        self.scopes.set_paused(paused)
        self.module_calls.want_lean(self.scopes.paused)

    def _close_step(self) -> None:
        self._fold_peak()
        current = self._current
        if current["end_allocated_bytes"] is None:
            current["end_allocated_bytes"] = self.backend.allocated_bytes()
        self._end_step_timing()
        if "retained_graphs" not in current:  # steps without an optimizer
            current["retained_graphs"] = self._find_retained_graphs(self._deep_walk_due())
        ledger = self.backend.storage_ledger()
        if ledger is not None:
            current["retained_activation_bytes"] = int(
                ledger.retained_activation_bytes(current["index"])
            )
        self._pause_detail(self.backend.step_closed(current) is False)
        self.steps.append(current)
        self._bounded_steps.trim(self.steps)
        self.step_index += 1
        self._pending_close = False
        self._new_step()
        if self.on_step_end is not None and not (self.timed_steps_over or self.steps_done()):
            self.on_step_end()  # (after the last step, the device is let go instead)

    def finish(self) -> None:
        """Close the last step when the script ends (normally or not)."""
        # What the script's frames held is freed once the traceback's cycles
        # are collected: collect now, not whenever the collector runs.
        gc.collect()
        self._sample_peak()
        current = self._current
        if (
            current["forward_calls"]
            or current["evaluation_calls"]
            or current["optimizer_steps"]
            or current["backward_calls"]
        ):
            self._end_step_timing(at_work_end=True)
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
        stats["module_call_switches"] = self.module_calls.switches
        stats.update(self.backend.capture_stats())
        return {key: int(value) for key, value in stats.items()}

    # ------------------------------------------------------------ hooks
    def install(self) -> None:
        self.module_calls.install()
        import torch.optim.optimizer as optim

        self._handles.append(optim.register_optimizer_step_pre_hook(self._on_optimizer_pre))
        self._handles.append(optim.register_optimizer_step_post_hook(self._on_optimizer_post))
        registrations = registration_hooks(self._on_registration)
        self._handles.extend(registrations)
        self._registration_seen = len(registrations) == 2
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
        if hasattr(nn.Module, "compile"):  # model.compile(): seen from outside
            self._patch(nn.Module, "compile", hooked_compile(self, nn.Module.compile))
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

        @functools.wraps(original)
        def zero_grad(owner, *args, **kwargs):
            tracker._gradients_stale = True
            return original(owner, *args, **kwargs)

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

    def _patch(self, owner, name, replacement) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def uninstall(self) -> None:
        self.scopes.uninstall()
        self.module_calls.uninstall()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def _wrap_backward(self, original):
        tracker = self

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            if fake_tracing():  # AOTAutograd compiling a backward
                return original(*args, **kwargs)
            tracker._on_backward_start(
                args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
            )
            tracker._backward_depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                tracker.backend.backward_ended()
                tracker._backward_depth -= 1
                tracker._gradients_stale = True
                tracker.module_calls.settle()
                if tracker._backward_depth == 0 and tracker.unit == "backward":
                    tracker._backward_ended()

        return wrapped

    def _on_forward_pre(self, module, inputs):
        if traced_by_compile():
            return  # (oomdoc.capture.compiled_models)
        if module is self._lean_entry and self._module_depth == 1:
            return  # the lean call that brought the hooks back has its own
        if self._module_depth == 0 and self._backward_depth == 0:
            self._outer_kind = self._call_kind(module)
            if self._outer_kind != _AUXILIARY:
                self._outermost_forward_start(module, inputs)
        self._module_depth += 1
        if not self.scopes.paused:  # steady steps (stack_recording): no module scopes
            self.scopes.push(module, inputs if self._module_depth == 1 else None)

    def _on_forward_post(self, module, inputs, *rest):
        # (kwargs, output); torch calls an always-called hook without the
        # kwargs when the forward raised (an OOM, StopRun): (output,).
        if traced_by_compile():
            return
        if module is self._lean_entry and self._module_depth == 1:
            self._lean_entry = None
            return
        kwargs, output = rest if len(rest) == 2 else ({}, rest[-1])
        if not self.scopes.paused:
            self.scopes.pop(output)
        self._module_depth = max(0, self._module_depth - 1)
        if self._module_depth == 0 and self._backward_depth == 0:
            self.module_calls.settle()  # (a quiet point: no call under way)
            if self._outer_kind == _AUXILIARY:
                return  # a transform or a loss module: not a model call
            if self._outer_kind == _TRAINING:
                self._note_shapes(inputs, kwargs)
                if kwargs:
                    self._keyword_shapes(kwargs)
            stamp_graph(output, self.step_index)
            if self._outer_kind == _EVALUATION:
                self._evaluation_outputs = [
                    (weakref.ref(tensor), tensor.untyped_storage().nbytes())
                    for tensor in output_tensors(output)
                ]
            self._sample_peak()
            if self.unit == "module":
                self._current["end_allocated_bytes"] = self.backend.allocated_bytes()

    def _note_shapes(self, inputs: tuple, kwargs: dict) -> None:
        """Mark the step `new_shapes` when this training call's tensors have
        shapes no earlier call had: kernels planned or compiled per shape
        (cuDNN attention per sequence length, torch.compile) make such a
        step slower than the same shapes later."""
        signature = (
            *(tuple(value.shape) for value in inputs if isinstance(value, torch.Tensor)),
            *(
                (key, tuple(value.shape))
                for key, value in kwargs.items()
                if isinstance(value, torch.Tensor)
            ),
        )
        if signature not in self._shapes_met:
            self._shapes_met.add(signature)
            self._current["new_shapes"] = True

    def _keyword_shapes(self, kwargs: dict) -> None:
        """Add the tensors a step's first training call got by keyword to
        its input shapes (_outermost_forward_start recorded the positional
        ones), in the order they were passed."""
        current = self._current
        if current["forward_calls"] != 1:  # a later call of the step
            return
        shapes = [list(value.shape) for value in kwargs.values() if isinstance(value, torch.Tensor)]
        if shapes:
            current["input_shapes"] = [*current.get("input_shapes", []), *shapes]

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

    def _outermost_forward_start(self, module, inputs=()) -> None:
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
            self._close_before_next_step()
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
                self._remember_forward_baseline(current["start_allocated_bytes"])
        if training:
            if not current["forward_calls"]:
                # The shapes of the step's first batch as the script passed
                # it: batches that come without a DataLoader (nanoGPT's
                # get_batch) are certified by the shape they keep.
                shapes = [list(value.shape) for value in inputs if isinstance(value, torch.Tensor)]
                if shapes:
                    current["input_shapes"] = shapes
            current["forward_calls"] += 1
            current["forward_calls_with_grad"] += 1
            if not module.training:
                current["eval_mode_forward_calls_with_grad"] += 1
        else:
            if (
                not current["evaluation_calls"]
                and self.steps_done()
                and any(not step["evaluation_calls"] for step in self.steps[1:])
            ):
                # The replay's last step evaluates (asked to at its end): it
                # is not timed (steps without one are), nor is any after it,
                # and the evaluation's warm-up (cuDNN plans for each new
                # length) need not hold the device.
                self.timed_steps_done()
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
            if self._pending_close and not self.modules:
                # No model call seen (one inside a compiled step function:
                # oomdoc.capture.compiled_models): the next step begins here.
                self._close_before_next_step()
            stamp_graph(roots, self.step_index)
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
        if traced_by_compile():  # a compiled optimizer step is not seen
            return None
        if self.on_first_step is not None:
            self._first_step()
        self._add_optimizer(optimizer)
        self._optimizer_about_to_step(optimizer)
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
        # A finished step's bookkeeping is done here, not at the next step's
        # start: on CUDA it overlaps the optimizer's queued kernels.
        if traced_by_compile():
            return
        self._state_table = None  # the step may have created or replaced state
        self._sample_peak()
        self._fold_peak()
        current = self._current
        current["optimizer_steps"] += 1
        current["end_allocated_bytes"] = self.backend.allocated_bytes()
        retained = current.setdefault("retained_graphs", [])
        known = {(entry["variable"], entry["file"]) for entry in retained}
        ends = self.optimizer_cycle.ends_iteration(optimizer)  # (mid-iteration: last one's losses)
        retained.extend(
            entry
            for entry in (self._find_retained_graphs(self._deep_walk_due()) if ends else [])
            if (entry["variable"], entry["file"]) not in known
        )
        if not self.backend.per_storage:
            # _sample_peak() above has just read the state the step made.
            known = self._known if self._known is not None else self._known_tensors()
            self._state_bytes = sum(known[2].values())
        if ends:
            self.step_work_ended()
        self._pending_close = self._pending_close or ends
        self.phase = "idle"
        self.module_calls.settle()

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
        if self.names_uncalled_models and breakdown.get("other"):
            self.oom.update(self.weights_outside_models())
        if self.phase == "evaluation":
            self.oom["evaluation_pass"] = self.evaluation_passes
            held = self._held_previous_outputs(sys._getframe(1))
            if held is not None:
                self.oom["previous_outputs"] = held


def _uninstall_forked(tracker: Tracker | None) -> None:
    if tracker is not None and (
        tracker._handles or tracker._originals or tracker.module_calls.installed
    ):
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
