"""Module attribution: which `nn.Module` made (or owns) each live byte.

Three questions, answered with one set of rules so that the breakdown, the
allocation sites and the modules of one capture agree:

* **Which category?** `category_of`: a parameter, gradient or optimizer-state
  storage is that (found by identity); anything else is `activations` when it
  was made during a step's forward, backward or optimizer phase, else `other`
  (inputs loaded between steps, buffers, data moved to the device up front).
* **Which module made it?** `ModuleScopes` keeps the path of the innermost
  module whose forward is running (`push`/`pop` from the tracker's global
  module hooks; paths come from `named_modules()` of each model, computed once
  when the model is first called). For backward it keeps a timeline of
  autograd sequence numbers at each push/pop: a node made during a module's
  forward has a sequence number inside that module's span, so the module whose
  backward is running is the one whose forward made the executing node
  (`torch._C._current_autograd_node()`). Parameters, buffers, their gradients
  and their optimizer state belong to the module that owns the parameter.
* **How is it shown?** `module_table`: bytes are attributed to the innermost
  module, then repeated blocks are folded: the same-class children of one
  `nn.ModuleList`/`nn.Sequential` (`transformer.h.0` .. `transformer.h.23`)
  become one entry `transformer.h` with `blocks=24` and their bytes summed,
  the outermost such container winning (as activation checkpointing wraps
  it). A folded entry keeps its innermost detail in `inner` (paths relative
  to a block, e.g. `attn.c_attn`, summed over the blocks). Entries partition
  the bytes: every category sums, over the entries, to the breakdown's.

The simulated device sees every storage at its creation, so attribution there
is exact. On CUDA the allocator knows blocks by address, so storages are
mapped to modules by data pointer when they are created or saved: tensors
saved for backward (a saved-tensors pack hook, the activations that matter)
and module outputs. The map holds ints and weak references only (an entry
goes when its storage dies), never a tensor. At the OOM or the peak the
allocator's blocks are joined with it; blocks it does not know are classified
by their allocation stack (no Python frames: the autograd engine's thread, so
backward; under `torch/optim`: the optimizer step; under a module call:
forward; else made outside a step).
"""

from __future__ import annotations

import bisect
import os
import weakref
from typing import Any

import torch
import torch.nn as nn

from oomdoc.capture import WRAPPER_ATTRIBUTES
from oomdoc.capture.compiled_models import traced_by_compile
from oomdoc.categories import COMMUNICATION, is_communication_frame
from oomdoc.snapshot import CATEGORIES

# Entries that are not modules.
OUTSIDE = "(outside modules)"
REMAINDER = "(other modules)"
ROOT = "(root)"
# How many modules `modules` lists before folding the rest into REMAINDER,
# and how many inner modules a folded entry details.
TOP_MODULES = 30
TOP_INNER = 8

STEP_PHASES = frozenset(("forward", "backward", "optimizer", "evaluation"))
_TIMELINE_LIMIT = 1 << 18
_Tensor = torch.Tensor
_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None) or (lambda: -1)
_current_node = getattr(torch._C, "_current_autograd_node", None)
# Wrappers whose own path component is not the user's: torch.compile,
# DistributedDataParallel, DataParallel.
_WRAPPER_CLASSES = ("OptimizedModule", "DistributedDataParallel", "DataParallel")


def category_of(known: str | None, phase: str | None) -> str:
    """The one category rule for the breakdown, the sites and the modules.

    `known`: `parameters`, `gradients` or `optimizer_state` when the storage
    is one (by identity), else None; `phase`: the phase it was made in
    (`communication`: buffers made for collectives, oomdoc.capture.communication;
    a known category wins, e.g. the sharded gradient FSDP2's reduce-scatter
    writes)."""
    if known:
        return known
    if phase == COMMUNICATION:
        return COMMUNICATION
    return "activations" if phase in STEP_PHASES else "other"


def phase_from_frames(frames) -> str | None:
    """CUDA: the phase a block was allocated in, from its allocation stack.

    A block allocated with no Python frame at all was allocated by a thread
    that runs no Python: the autograd engine's device thread, i.e. backward.
    """
    if not frames:
        return "backward"
    in_module = False
    for frame in frames:
        filename = (frame.get("filename") or "").replace("\\", "/")
        name = frame.get("name")
        if is_communication_frame(filename, name):
            return COMMUNICATION  # DDP's buckets, FSDP2's collective buffers (oomdoc.categories)
        if "/torch/optim/" in filename:
            return "optimizer"
        if name == "backward" and filename.endswith(("torch/_tensor.py", "autograd/__init__.py")):
            return "backward"
        if filename.endswith("torch/nn/modules/module.py") and name in (
            "_call_impl",
            "_wrapped_call_impl",
        ):
            in_module = True
    return "forward" if in_module else None


class _StorageRef(weakref.ref):
    """A weak reference to a CUDA storage that knows its data pointer."""

    __slots__ = ("ptr",)
    ptr: int


class ModuleScopes:
    """The module path stack, the backward timeline and (CUDA) the map of
    storages to the modules that made them."""

    def __init__(self) -> None:
        # The innermost running module's path: read for every new storage.
        self.path: str | None = None
        self._stack: list = []
        self._paths: dict[int, str] = {}  # id(module) -> path
        self._classes: dict[str, str] = {}  # path -> class name
        # path -> (entry path, entry class, blocks, path inside the block or None)
        self._folds: dict[str, tuple] = {}
        self._models: list = []  # weak references to models, in the order seen
        self._model_roots: dict[int, str] = {}  # id(model) -> its path prefix
        # Autograd sequence numbers at each push/pop, and the path from then on.
        self._seqs: list[int] = []
        self._seq_paths: list = []
        # CUDA: data pointer -> (path, weak reference to the storage).
        self.cuda = False
        # Tests on machines without CUDA set this to map CPU storages too.
        self.any_device = False
        self._saved: dict[int, tuple] = {}
        self._inputs: frozenset = frozenset()
        self._hooks_pushed = False
        self._original_disable = None
        # CUDA, steady training steps (oomdoc.capture.stack_recording): no
        # push/pop, no saved tensors noted; their storages go unattributed.
        self.paused = False
        self._hooks_set_aside = False  # the pack hook, popped while paused
        self.buffer_keys: set = set()
        # owners(): the last walk over the models' modules, and what it depended on.
        self._walk: list = []
        self._walk_signature: tuple | None = None

    # ------------------------------------------------------------ naming
    def add_model(self, model: nn.Module) -> None:
        """Name every module of a model the first time the model is called.

        Paths are bare (`transformer.h.3`). The first model is `(root)`; a
        later one is named by its class, which also prefixes its paths when
        they would clash with another model's. A model seen before as part of
        a bigger one keeps the bigger one's names; a model first called alone
        and later found inside a bigger one is renamed."""
        if id(model) in self._model_roots:
            return
        named = list(model.named_modules())
        members = {id(module) for _name, module in named}
        # A model called before on its own, now found inside this one: rename it.
        for root_id in list(self._model_roots):
            if root_id in members:
                del self._model_roots[root_id]
        if id(model) in self._paths and self._models:
            return  # part of a model already named
        wrapper = _wrapped_attribute(model)
        names = []
        for name, module in named:
            if wrapper and (name == wrapper or name.startswith(wrapper + ".")):
                name = name[len(wrapper) + 1 :]
            names.append((name, module))
        others = bool(self._model_roots)
        prefix = ""
        if others and any(name and name in self._classes for name, _module in names):
            prefix = type(model).__name__
        self._model_roots[id(model)] = prefix
        self._models.append(weakref.ref(model))
        root = prefix or (type(model).__name__ if others else ROOT)
        for name, module in names:
            path = ".".join(part for part in (prefix, name) if part)
            self._remember_module(module, path or root)
        self._fold(model)

    def _remember_module(self, module: nn.Module, path: str) -> None:
        key = id(module)
        if key not in self._paths:
            paths = self._paths
            weakref.finalize(module, paths.pop, key, None)
        self._paths[key] = path
        self._classes[path] = type(module).__name__

    def _fold(self, model: nn.Module) -> None:
        """Fold repeated blocks: same-class children (at least two) of an
        nn.ModuleList or nn.Sequential; the outermost container wins."""
        folded_roots: list[tuple[str, str, int]] = []
        for _name, container in model.named_modules():
            if not isinstance(container, (nn.ModuleList, nn.Sequential)):
                continue
            groups: dict[type, list[nn.Module]] = {}
            for child in container.children():
                groups.setdefault(type(child), []).append(child)
            container_path = self._paths.get(id(container), ROOT)
            for block_class, blocks in groups.items():
                if len(blocks) < 2:
                    continue
                if any(
                    outer == ROOT or container_path.startswith(outer + ".")
                    for outer, _cls, _n in folded_roots
                    if outer != container_path
                ):
                    continue
                folded_roots.append((container_path, block_class.__name__, len(blocks)))
                for block in blocks:
                    block_path = self._paths.get(id(block))
                    if block_path is None:
                        continue
                    for inner_name, inner in block.named_modules():
                        path = self._paths.get(id(inner))
                        if path is not None:
                            self._folds[path] = (
                                container_path,
                                block_class.__name__,
                                len(blocks),
                                inner_name,
                            )

    def path_of(self, module: nn.Module) -> str:
        return self._paths.get(id(module)) or type(module).__name__

    # ------------------------------------------------------------ hot path
    def push(self, module: nn.Module, outermost_inputs=None) -> None:
        """A module's forward begins (the tracker's global pre-hook);
        `outermost_inputs`: the arguments of an outermost call, else None."""
        if outermost_inputs is not None:
            self._outermost(outermost_inputs)
        self._stack.append(self.path)
        self.path = path = self._paths.get(id(module)) or type(module).__name__
        self._seqs.append(_get_sequence_nr())
        self._seq_paths.append(path)

    def pop(self, output=None) -> None:
        """A module's forward ended, normally or not (the global post-hook)."""
        if self.cuda and isinstance(output, _Tensor) and (output.is_cuda or self.any_device):
            self._remember_storage(output)
        stack = self._stack
        self.path = path = stack.pop() if stack else None
        self._seqs.append(_get_sequence_nr())
        self._seq_paths.append(path)

    def _outermost(self, inputs) -> None:
        """An outermost call begins: nothing is left on the stack from a call
        that failed without its post-hook, the timeline is kept bounded, and
        (CUDA) the call's tensor arguments are noted."""
        self._stack.clear()
        self.path = None
        if len(self._seqs) > _TIMELINE_LIMIT:
            del self._seqs[: _TIMELINE_LIMIT // 2]
            del self._seq_paths[: _TIMELINE_LIMIT // 2]
        if self.cuda:
            self._note_inputs(inputs)

    def allocation_path(self) -> str | None:
        """The module a storage made now belongs to: the innermost running
        forward, else (in backward) the module whose forward made the
        autograd node being executed."""
        path = self.path
        if path is not None or _current_node is None:
            return path
        node = _current_node()
        if node is None:
            return None
        return self.node_path(node)

    def node_path(self, node) -> str | None:
        try:
            sequence_nr = node._sequence_nr()
        except Exception:
            return None
        return self.path_at_sequence(sequence_nr)

    def path_at_sequence(self, sequence_nr: int) -> str | None:
        """The module whose forward ran when the autograd node numbered
        `sequence_nr` was made."""
        index = bisect.bisect_right(self._seqs, sequence_nr) - 1
        return self._seq_paths[index] if index >= 0 else None

    # ------------------------------------------------------------ CUDA
    def install(self, cuda: bool) -> None:
        """On CUDA, learn the data pointers of tensors saved for backward
        (through a saved-tensors pack hook that saves the tensor detached)
        and of module outputs. OOMDOC_MODULE_HOOKS=0 turns the pack hook off."""
        self.cuda = cuda
        if not cuda or os.environ.get("OOMDOC_MODULE_HOOKS", "1") == "0":
            return
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, _unpack)
            self._hooks_pushed = True
        except Exception:
            return
        # torch.func.grad, vjp, jacrev and hessian refuse to run while default
        # saved-tensor hooks are set:
        # step aside while it runs.
        import torch.autograd.graph as graph

        original = getattr(graph, "disable_saved_tensors_hooks", None)
        if original is not None:
            scopes = self

            def disable_saved_tensors_hooks(error_message):
                return _StepAside(scopes, original(error_message))

            self._original_disable = original
            graph.disable_saved_tensors_hooks = disable_saved_tensors_hooks

    def uninstall(self) -> None:
        if self._original_disable is not None:
            import torch.autograd.graph as graph

            graph.disable_saved_tensors_hooks = self._original_disable
            self._original_disable = None
        if self._hooks_pushed and self._ours_on_top():
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._hooks_pushed = False

    def set_paused(self, paused: bool) -> None:
        """Pause or resume the scopes (at a step or phase boundary). Paused,
        the pack hook is popped too: with a default saved-tensors hook set,
        autograd calls into Python for every tensor it saves."""
        if paused == self.paused:
            return
        self.paused = paused
        if paused:
            if self._hooks_pushed and self._ours_on_top():
                torch._C._autograd._pop_saved_tensors_default_hooks()
                self._hooks_pushed, self._hooks_set_aside = False, True
        elif self._hooks_set_aside:
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, _unpack)
            self._hooks_pushed, self._hooks_set_aside = True, False

    def _ours_on_top(self) -> bool:
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None:
            return True
        try:
            hooks = top(True)
        except TypeError:
            hooks = top()
        except Exception:
            return False
        return bool(hooks) and getattr(hooks[0], "__self__", None) is self

    def _pack(self, tensor):
        """Remembers the storage of a tensor saved for backward, and saves it
        detached: autograd hands a pack hook an op's output with its grad_fn,
        so keeping that tensor would make the node hold itself, and a graph
        dropped without a backward (a `netG(fixed_noise)` for a sample image,
        an evaluation without no_grad) would keep its saved outputs for good.
        On pytorch/examples' DCGAN that made batch 501 run out of memory under
        capture where it fits without oomdoc. Unpacking gives autograd the
        detached tensor back, which it wraps with the saved grad_fn, as it does
        for any object a pack hook returns. Its version goes with it: autograd
        does not check a hooked tensor's version, so _unpack does, or a script
        that modifies a saved tensor in place would train on wrong gradients
        under capture where it fails without oomdoc."""
        if traced_by_compile():
            return tensor
        if not self.paused and (tensor.is_cuda or self.any_device):
            self._remember_storage(tensor)
        return _DETACH(tensor), tensor._version

    def _note_inputs(self, inputs) -> None:
        """The outermost model's tensor arguments were made before the step's
        work (a batch): they are not activations, even when saved."""
        pointers = set()
        for item in inputs if isinstance(inputs, (tuple, list)) else (inputs,):
            if isinstance(item, _Tensor) and (item.is_cuda or self.any_device):
                try:
                    pointers.add(item.untyped_storage().data_ptr())
                except Exception:
                    pass
        self._inputs = frozenset(pointers)

    def _remember_storage(self, tensor) -> None:
        try:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
        except Exception:
            return
        saved = self._saved
        if not pointer or pointer in saved or pointer in self._inputs:
            return
        try:
            ref = _StorageRef(storage, self._forget)
        except TypeError:
            return
        ref.ptr = pointer
        saved[pointer] = (self.path, ref)

    def _forget(self, ref) -> None:
        """A remembered storage died: its address may now hold anything."""
        saved = self._saved
        entry = saved.get(ref.ptr)
        if entry is not None and entry[1] is ref:
            del saved[ref.ptr]

    def saved_path(self, pointer) -> tuple[bool, str | None]:
        """(known, path) for a block address made in a forward."""
        entry = self._saved.get(pointer)
        if entry is None:
            return False, None
        return True, entry[0]

    # ------------------------------------------------------------ owners
    def owners(self, optimizers, key_of, epoch=None) -> dict:
        """key_of(tensor) -> owning module path, for parameters, buffers,
        their gradients and the optimizer state of those parameters. The
        buffers' keys are also in `self.buffer_keys` (CUDA: a buffer saved
        for backward is still not an activation). `epoch`: a number that
        changes whenever a module or parameter is registered anywhere; with
        it the walk over the models' modules is kept between calls."""
        owners: dict = {}
        buffers: set = set()
        by_parameter: dict[int, str] = {}

        def own(tensor, path):
            if isinstance(tensor, _Tensor):
                key = key_of(tensor)
                if key is not None and key not in owners:
                    owners[key] = path

        for path, module_ref in self._named_modules(epoch):
            module = module_ref()
            if module is None:
                continue
            for parameter in module._parameters.values():
                if parameter is None:
                    continue
                by_parameter.setdefault(id(parameter), path)
                own(parameter, path)
                if parameter.grad is not None:
                    own(parameter.grad, path)
            for buffer in module._buffers.values():
                own(buffer, path)
                if isinstance(buffer, _Tensor):
                    buffers.add(key_of(buffer))
        for optimizer in list(optimizers):
            for parameter, per_parameter in list(optimizer.state.items()):
                path = by_parameter.get(id(parameter))
                if path is None or not isinstance(per_parameter, dict):
                    continue
                for value in per_parameter.values():
                    own(value, path)
        self.buffer_keys = buffers
        return owners

    def _named_modules(self, epoch) -> list:
        """[(path, weak reference)] of the named modules of the models, in
        the models' order; walked again unless `epoch` and the models are
        the ones of the last walk."""
        models = [model for reference in self._models if (model := reference()) is not None]
        signature = (epoch, tuple(map(id, models)), len(self._paths))
        if epoch is not None and signature == self._walk_signature:
            return self._walk
        walk = []
        for model in models:
            for module in model.modules():
                path = self._paths.get(id(module))
                if path is not None:
                    walk.append((path, weakref.ref(module)))
        self._walk, self._walk_signature = walk, signature
        return walk

    # ------------------------------------------------------------ tables
    def fold(self, path: str | None) -> tuple:
        """(entry path, class, blocks, inner path or None) of a module path."""
        if path is None:
            return OUTSIDE, None, 0, None
        folded = self._folds.get(path)
        if folded is not None:
            return folded
        return path, self._classes.get(path, path), 1, None

    def site_label(self, path: str | None) -> str | None:
        """An allocation site's module: its path with repeated blocks folded
        (`transformer.h.3.attn` -> `transformer.h.*.attn`), None outside modules."""
        if path is None:
            return None
        entry_path, _class, blocks, inner = self.fold(path)
        if blocks > 1:
            return f"{entry_path}.*" + (f".{inner}" if inner else "")
        return entry_path

    def table(self, attributed, limit: int = TOP_MODULES) -> list[dict]:
        """`modules` from (path, category, bytes) triples; see module_table."""
        return module_table(attributed, self.fold, limit)


class _StepAside:
    """Wraps torch.autograd.graph.disable_saved_tensors_hooks: our pack hook
    is popped while it runs, and pushed back after."""

    def __init__(self, scopes: ModuleScopes, inner):
        self.scopes, self.inner, self.popped = scopes, inner, False

    def __enter__(self):
        if self.scopes._hooks_pushed and self.scopes._ours_on_top():
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.popped = True
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            if self.popped:
                torch._C._autograd._push_saved_tensors_default_hooks(self.scopes._pack, _unpack)


_DETACH = torch.Tensor.detach


def _unpack(packed):
    """The tensor _pack saved, refused as autograd refuses one modified in
    place since it was saved (the same message)."""
    if type(packed) is not tuple:
        return packed  # saved while torch.compile traced
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead. Hint: enable anomaly "
            "detection to find the operation that failed to compute its gradient, with "
            "torch.autograd.set_detect_anomaly(True)."
        )
    return tensor


def _wrapped_attribute(model: nn.Module) -> str | None:
    """`_orig_mod` of a torch.compile'd model, `module` of a (D)DP one."""
    if type(model).__name__ not in _WRAPPER_CLASSES:
        return None
    for attribute in WRAPPER_ATTRIBUTES:
        if attribute in model._modules:
            return attribute
    return None


def module_table(attributed, fold, limit: int = TOP_MODULES) -> list[dict]:
    """Bytes per module and category, repeated blocks folded, largest first.

    `attributed`: (module path or None, category, bytes) for each live
    storage; `fold(path)` -> (entry path, class, blocks, inner path). The
    first `limit` entries by total bytes are listed, the rest summed into
    one `(other modules)` entry (its `blocks` is how many entries it holds),
    so that each category sums, over the list, to what was attributed.
    Storages made outside any module forward (a loss computed in the
    training loop, a batch, a dataset on the device) are `(outside modules)`.
    """
    entries: dict[tuple, dict] = {}
    for path, category, nbytes in attributed:
        if not nbytes:
            continue
        entry_path, class_name, blocks, inner = fold(path)
        key = (entry_path, class_name)
        entry = entries.get(key)
        if entry is None:
            entry = entries[key] = {
                "path": entry_path,
                "class": class_name,
                "blocks": blocks,
                "bytes": dict.fromkeys(CATEGORIES, 0),
                "_inner": {},
            }
        entry["bytes"][category] += int(nbytes)
        if inner is not None:
            inner_key = inner or "(block)"
            entry["_inner"][inner_key] = entry["_inner"].get(inner_key, 0) + int(nbytes)
    ordered = sorted(
        entries.values(), key=lambda entry: (-sum(entry["bytes"].values()), entry["path"])
    )
    shown, rest = ordered[:limit], ordered[limit:]
    listed = []
    for entry in shown:
        inner = entry.pop("_inner")
        if inner:
            entry["inner"] = [
                {"path": inner_path, "bytes": nbytes}
                for inner_path, nbytes in sorted(inner.items(), key=lambda item: -item[1])[
                    :TOP_INNER
                ]
            ]
        listed.append(entry)
    if rest:
        remainder: dict[str, Any] = {
            "path": REMAINDER,
            "class": None,
            "blocks": len(rest),
            "bytes": dict.fromkeys(CATEGORIES, 0),
        }
        for entry in rest:
            for category, nbytes in entry["bytes"].items():
                remainder["bytes"][category] += nbytes
        listed.append(remainder)
    return listed


def simulated_attribution(per_storage, known: dict, owners: dict):
    """(path, category, bytes) per live storage on the simulated device."""
    for key, nbytes, record in per_storage:
        category = category_of(known.get(key), record.phase if record is not None else None)
        path = owners.get(key)
        if path is None and record is not None:
            path = getattr(record, "module", None)
        yield path, category, nbytes


def block_categories(sites, addresses: dict, owners: dict, scopes: ModuleScopes) -> list[tuple]:
    """CUDA: (path, category, bytes) per live block, in the order of `sites`.

    A block is a parameter, gradient or optimizer state by address; else an
    activation when its address was saved for backward or output by a module
    (its module known), else by the phase its allocation stack shows."""
    result = []
    for site in sites:
        address = site.get("address")
        known = addresses.get(address)
        made_in_forward, path = scopes.saved_path(address)
        if address in scopes.buffer_keys:
            made_in_forward = False
        phase = "forward" if made_in_forward else site.get("phase")
        path = owners.get(address, path)
        result.append(
            (path, category_of(known, phase), int(site.get("size") or site.get("bytes") or 0))
        )
    return result
