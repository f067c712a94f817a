"""What the live memory is made of: the breakdown attribution.

Which category (parameters, gradients, optimizer state, activations, other)
and which module each block of memory belongs to, at phase boundaries, at
the peak and at an OOM: the five-category breakdown, the allocation sites
grouped by user location, and the `modules` table (through
oomdoc.capture.modules' one category rule). A mixin of the Tracker, which
holds the models, optimizers and backend it reads.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter, OrderedDict
from operator import attrgetter
from typing import Any

import torch
import torch.nn as nn

from oomdoc.capture.backend_base import Backend, StorageTableMemo, storage_key, storage_sites
from oomdoc.capture.holders import holder_names
from oomdoc.capture.modules import ModuleScopes, block_categories, simulated_attribution
from oomdoc.snapshot import CATEGORIES

# On CUDA, the allocation sites of a new high are read again (an allocator
# snapshot, costly) only when it is this much above the last one read.
_CUDA_SITES_GROWTH = 1.25
_SAMPLED_PHASES = frozenset(("forward", "backward", "optimizer", "evaluation"))
_CALL = weakref.ref.__call__  # map(_CALL, references): what they refer to, or None
_GRAD = attrgetter("grad")


class Attribution:
    """The Tracker's breakdown attribution. What it reads of the tracker's
    state is declared here (the Tracker sets it up)."""

    backend: Backend
    stats: dict[str, int]
    phase: str
    step_index: int
    scopes: ModuleScopes
    category_peaks: dict[str, int]
    # The breakdown, sites and modules at the fullest phase boundary.
    peak_sample: dict | None
    last_modules: list | None
    _model_refs: list[weakref.ref[nn.Module]]
    _optimizer_refs: list[weakref.ref[torch.optim.Optimizer]]
    _module_parameters: weakref.WeakKeyDictionary[nn.Module, tuple[int, tuple]]
    _registration_epoch: int
    _registration_seen: bool
    _sampled_high: int
    _last_sites_allocated: int
    _mark_owners: dict | None
    _state_table: dict | None
    _state_signature: tuple
    _all_parameters: tuple
    _all_parameters_signature: tuple | None
    _known: tuple[dict, dict, dict] | None
    _known_naming: tuple | None
    _parameters_stale: bool
    _gradients_stale: bool
    _known_sources: tuple | None
    _known_state: dict | None
    _parameters_table: dict
    _gradients_table: dict
    _parameters_memo: StorageTableMemo
    _gradients_memo: StorageTableMemo
    _state_memo: StorageTableMemo

    @property
    def _walk_epoch(self) -> int | None:
        """The registration epoch, when torch reports every registration
        (else None: the models' modules are walked each time)."""
        return self._registration_epoch if self._registration_seen else None

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
        if self.scopes.paused and self.peak_sample is not None and allocated <= self._sampled_high:
            # A steady step (oomdoc.capture.stack_recording): its boundaries
            # repeat the steps before, whose breakdowns were folded; only a
            # new high is read (the breakdown is most of a boundary's cost).
            self.stats["steady_samples"] += 1
            return
        breakdown = self._breakdown(allocated, cached=True)
        if self.peak_sample is not None and allocated <= self._sampled_high:
            self._fold_category_peaks(breakdown)
            return
        self._sampled_high = allocated
        ledger = backend.storage_ledger()
        if ledger is not None:
            # The sites and modules of this moment are listed when the
            # snapshot is written, from a log of what changes from now on
            # (finish()); who owns the named storages is noted now (O(params)).
            self._fold_category_peaks(breakdown)
            self._mark_owners = self.scopes.owners(
                self._live_optimizers(), storage_key, self._walk_epoch
            )
            ledger.mark_peak()
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

    # ------------------------------------------------------------ breakdown
    def _live_models(self) -> list:
        return [model for reference in self._model_refs if (model := reference()) is not None]

    def _live_optimizers(self) -> list:
        return [
            optimizer
            for reference in self._optimizer_refs
            if (optimizer := reference()) is not None
        ]

    def weights_outside_models(self, limit: int = 5) -> dict:
        """At an OOM, whose weights the device holds outside every called
        model and optimizer, for the report to say, not guess a dataset:

        - `uncalled_models`: the outermost modules holding parameters or
          buffers on the device that no model call and no optimizer made
          known, largest first: an EMA copy (AveragedModel, timm's
          ModelEmaV2, YOLO's deepcopy), a model kept for later, or, before
          any call, the model being built or moved to the device; each with
          `bytes` (on the device) and `weights_bytes` (all its parameters
          and buffers, wherever they are) and, where it can be named,
          `held_by`: where the script keeps it (oomdoc.capture.holders);
        - `weight_copies`: plain tensors shaped like a called model's
          parameters (at least 80% of its shapes matched): a saved
          `copy.deepcopy(model.state_dict())`, diffusers' EMAModel's shadow
          weights; each with the model's class (`of`), how many `copies`
          of its shapes, `tensors`, `bytes` and, where it can be named,
          `held_by`.

        One scan of the collector's objects (0.26 s in a transformers
        process of 400k objects): at an OOM only. Empty fields are left out; a failure of
        the scan leaves them all out, never the OOM's record."""
        try:
            return self._weights_outside_models(limit)
        except Exception:
            return {}

    def _weights_outside_models(self, limit: int) -> dict:
        parameters, gradients, state = self._known_tensors()
        known = parameters.keys() | gradients.keys() | state.keys()
        backend = self.backend
        models = self._live_models()
        called = {id(module) for model in models for module in model.modules()}
        held: dict[int, tuple[nn.Module, dict]] = {}  # with its weights' storage table
        tensors: list = []
        containers: list = []  # dicts and lists whose first value is a tensor
        for candidate in gc.get_objects():
            kind = type(candidate)  # type(), not isinstance(): no attribute of
            # a stranger's object is read (a deprecated alias warns when it is)
            try:
                if kind is torch.Tensor or kind is nn.Parameter:  # (a subclass's
                    tensors.append(candidate)  # attributes may run its code)
                    continue
                if kind in _PLAIN_CONTAINERS:  # exactly: a subclass's values() may do
                    # anything (transformers' lazy auto mappings import every model)
                    if len(candidate) >= COPY_MIN_TENSORS and candidate is not tensors:
                        first = type(next(iter(_values(candidate))))
                        if first is torch.Tensor or first is nn.Parameter:
                            containers.append(candidate)
                    continue
                if not issubclass(kind, nn.Module) or id(candidate) in called:
                    continue
                weights = backend.storage_table(list(candidate.parameters()))
                if not weights or not weights.keys() - known:
                    continue  # no weights of its own on the device
                weights.update(backend.storage_table(list(candidate.buffers())))
            except Exception:  # a half-built module, an object lying about its class
                continue
            held[id(candidate)] = (candidate, weights)
        inner = {
            id(child)
            for module, _bytes in held.values()
            for child in module.modules()
            if child is not module
        }
        outermost = [
            (module, weights, sum(n for key, n in weights.items() if key not in known))
            for key, (module, weights) in held.items()
            if key not in inner
        ]
        outermost.sort(key=lambda entry: -entry[2])
        fields: dict = {}
        if outermost:
            fields["uncalled_models"] = [
                {
                    "class": type(module).__name__,
                    "bytes": int(unknown),
                    "weights_bytes": _weights(module),
                    **_held_by([module], {id(held)}),
                }
                for module, _weights_table, unknown in outermost[:limit]
            ]
        named: set = set()  # the named modules' weights, the called ones' buffers
        for _module, weights, _unknown in outermost:
            named.update(weights)
        named.update(backend.storage_table([b for model in models for b in model.buffers()]))
        copies = _weight_copies(backend, models, tensors, containers, known | named)
        if copies:
            fields["weight_copies"] = copies[:limit]
        return fields

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
        # An optimizer step updates its state in place: the same storages.
        table = self._state_memo.read(self.backend, tensors)
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

    def _known_tensors(self, cached: bool = False) -> tuple[dict, dict, dict]:
        """Storage keys of parameters, gradients and optimizer state on the device.

        `cached` (a phase boundary): tables nothing could have changed since
        they were read are not read again: parameters are read at each step's
        start, gradients after each backward and at the optimizer step, the
        optimizer state after each optimizer step (see the `_stale` flags).
        Otherwise (an OOM, the sites, the end) all are read now."""
        references = self._parameter_references()
        state = self._state_tensors()
        previous = self._known
        reuse = cached and previous is not None and references is self._known_sources
        if previous is not None and reuse and not self._parameters_stale:
            if not self._gradients_stale and state is self._known_state:
                self.stats["known_tables_reused"] += 1
                return previous
        alive = [p for p in map(_CALL, references) if p is not None]
        backend = self.backend
        if reuse and not self._parameters_stale:
            parameters = self._parameters_table
        else:
            parameters = self._parameters_table = self._parameters_memo.read(backend, alive)
        if reuse and not self._gradients_stale:
            gradients = self._gradients_table
        else:
            gradients = self._gradients_table = self._gradients_memo.read(
                backend, map(_GRAD, alive)
            )
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
        if previous is not None and known == previous:
            # Read again and the same (most boundaries): the tables stay the
            # same objects, and what was derived from them is reused.
            return previous
        self._known = known
        return known

    def _breakdown(self, allocated: int | None = None, cached: bool = False) -> dict:
        """Live memory split into the categories (oomdoc.categories): O(parameters and
        optimizer state), whatever else is alive (`cached`: see _known_tensors)."""
        tables = self._known_tensors(cached)
        parameters, gradients, state = tables
        backend = self.backend
        ledger = backend.storage_ledger()
        if ledger is not None:
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
            ledger.apply_known(known)
            counts = ledger.category_bytes()
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
            if baseline["gradients"] is None:  # the forward's first breakdown
                baseline["gradients"] = sum(self._gradients_table.values())
            grown = allocated - baseline["allocated"]
            grown -= max(0, breakdown["gradients"] - baseline["gradients"])
            grown -= max(0, breakdown["optimizer_state"] - baseline["optimizer_state"])
            breakdown["activations"] = max(0, min(grown, allocated - known_bytes))
        breakdown["other"] = max(0, allocated - known_bytes - breakdown["activations"])
        return {k: int(v) for k, v in breakdown.items()}

    def breakdown_and_sites(
        self, limit: int = 20, with_sites: bool = True
    ) -> tuple[dict, list[dict]]:
        """Live memory split into the categories, and the largest
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
        ledger = backend.storage_ledger()
        if ledger is not None:
            if refresh:
                self._breakdown()  # names parameters, gradients and state on the device
            items = [(key, record) for key, _nbytes, record in ledger.live_storages()]
            owners = self.scopes.owners(self._live_optimizers(), storage_key, self._walk_epoch)
            sites, self.last_modules = self._storage_sites_and_modules(
                items, ledger.known_categories(), owners, self.phase, limit
            )
            return None, sites
        known = self._known_tensors() if refresh or self._known is None else self._known
        parameters, gradients, state = known
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
        ledger = self.backend.storage_ledger()
        marked = ledger.marked_storages() if ledger is not None else None
        if marked is None:
            return [], None
        items, known = marked
        self.stats["site_samples"] += 1
        return self._storage_sites_and_modules(
            items,
            known,
            self._mark_owners or {},
            self.peak_sample["phase"] if self.peak_sample is not None else self.phase,
            limit,
        )

    _forward_baseline: dict | None = None

    _state_bytes = 0

    def _remember_forward_baseline(self, allocated: int) -> None:
        """Without per-storage tags (CUDA), activations are what was allocated
        since the step's first forward began, less new gradients and state.

        The optimizer state, which changes only inside optimizer.step(), was
        measured after the last step. The gradients, which a forward does not
        change, are summed at the first breakdown after it begins (None until
        then): this runs before the forward's first kernel, where a script
        that waits for the GPU each step pays for every microsecond (0.3 ms
        of ResNet-50's step on an H200)."""
        previous = self._forward_baseline
        # A steady step's boundaries may read no breakdown (_sample_peak): it
        # starts with the gradients the step before started with, unless that
        # was the first (which starts before any backward made them).
        gradients = None
        if self.scopes.paused and previous is not None and previous["step"] > 0:
            gradients = previous["gradients"]
        self._forward_baseline = {
            "allocated": allocated,
            "gradients": gradients,
            "optimizer_state": self._state_bytes,
            "step": self.step_index,
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


def _weights(module: nn.Module) -> int:
    """The bytes of a module's parameters and buffers, wherever they are
    (each storage once)."""
    sizes: dict = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        try:
            storage = tensor.untyped_storage()
            sizes[storage._cdata] = storage.nbytes()
        except Exception:  # storage-less layouts (sparse, meta)
            sizes[id(tensor)] = tensor.numel() * tensor.element_size()
    return int(sum(sizes.values()))


def _held_by(objects: list, ignore: set[int], each: int = 2) -> dict:
    """{"held_by": where the script keeps `objects`, up to `each` names
    apiece} where that can be named, else {}."""
    names = [name for obj in objects for name in holder_names(obj, ignore, limit=each)]
    return {"held_by": names} if names else {}


# The containers a copy of weights is looked for in: a state_dict (an
# OrderedDict), a dict, a list; exactly these types, read with their own
# methods.
_PLAIN_CONTAINERS = (dict, OrderedDict, list)


def _values(container) -> Any:
    return dict.values(container) if isinstance(container, dict) else container


# A container (a dict, a list) of plain tensors on the device is taken for a
# copy of a called model's weights when its tensors match at least this share
# of the model's parameter shapes ...
COPY_SHAPE_SHARE = 0.8
# ... and are at least this many (a tiny model's shapes can be met by chance).
COPY_MIN_TENSORS = 4


def _weight_copies(
    backend, models: list, tensors: list, containers: list, excluded: set
) -> list[dict]:
    """Copies of each called model's weights kept in a dict or a list (a
    saved state_dict, an EMA's shadow weights; `containers`: those whose
    first value is a tensor): plain tensors on the device, outside
    `excluded` storages, neither requiring grad nor made by autograd (the
    forward's activations are, or are held by autograd, not by a dict or a
    list of the script's). {of, copies, tensors, bytes, held_by: where the
    script keeps the first three copies, when that can be named}, largest first."""
    shapes = {tuple(parameter.shape) for model in models for parameter in model.parameters()}
    tensors = [tensor for tensor in tensors if tuple(tensor.shape) in shapes]
    table = backend.storage_table(tensors)  # on this device only
    plain = {  # id -> (storage key, shape)
        id(tensor): (key, tuple(tensor.shape))
        for tensor in tensors
        if type(tensor) is not nn.Parameter
        and not tensor.requires_grad
        and tensor.grad_fn is None
        and (key := storage_key(tensor)) in table
        and key not in excluded
    }
    if not plain:
        return []
    held = []  # each dict or list that holds some, with their (key, shape)
    for container in containers:
        values = _values(container)
        inside = [plain[id(value)] for value in values if id(value) in plain]
        if len(inside) >= COPY_MIN_TENSORS:
            held.append((container, inside))
    found, used = [], set()
    for model in models:
        wanted = Counter(tuple(parameter.shape) for parameter in model.parameters())
        total = sum(wanted.values())
        copies, keys, holding = 0, [], []
        for container, inside in held:
            left, matched = Counter(wanted), []
            for key, shape in inside:
                if left[shape] > 0 and key not in used:
                    left[shape] -= 1
                    matched.append(key)
            if len(matched) >= COPY_MIN_TENSORS and len(matched) >= COPY_SHAPE_SHARE * total:
                copies += 1
                keys += matched
                used.update(matched)
                holding.append(container)
        if copies:
            entry = {
                "of": type(model).__name__,
                "copies": copies,
                "tensors": len(keys),
                "bytes": int(sum(table[key] for key in set(keys))),
            }
            found.append({**entry, **_held_by(holding[:3], {id(containers), id(held)}, each=1)})
    return sorted(found, key=lambda entry: -entry["bytes"])
