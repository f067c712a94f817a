"""The whole run in a replay: every DataLoader's longest batches first, and
the script's own evaluation reached.

A replay runs a few steps, but the batch it finds must hold for the whole
run. Two things use more memory later in a run than in its first steps: a
batch of the longest inputs (a collate that pads to the longest sample), and
the evaluation loop (often at a larger batch, after the epoch). So in a
replay, every DataLoader over a map-style dataset yields its batches longest
first (each sample's size read from the dataset, within a time budget; a
training loader's longest again once the optimizer's state exists), and
once the replay's steps are done the training loader ends its epoch, so that
the script's own end-of-epoch work (its evaluation, on its loaders' longest
batches) runs; a framework that evaluates every N steps and can be asked at
a step's end (the HF Trainer: STEP_END_EVALUATION) evaluates there instead,
its epoch not cut. After an evaluation the longest batch trains again (one
step of the next epoch, or two mid-epoch): the allocator's cache then holds
the evaluation's blocks, and a batch that fits a fresh cache can fail on the
one an evaluation left split (the H100 runs of the HF Trainer ran out of
memory so, steps after an evaluation). Then the replay stops. The failing
run itself is never reordered: the user's run sees its data as it would.

Child side only (imports torch). What it did is the capture's
`data_loaders` (docs/snapshot.md).
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
import torch.utils.data

from oomdoc.capture.shared_sizes import SharedSizes
from oomdoc.capture.tracker import StopRun, Tracker

# Seconds spent reading one dataset's sample sizes: a dataset that takes
# longer (decoding images) is ordered by the samples read, and says so.
SCAN_SECONDS = 5.0
# ... or this many, while every sample read has had the same size: images
# drawn or decoded to one shape (the ImageNet-style trainer read 147 of its
# 8192 in 5 s on the H200) give nothing more to order, and every replay that
# starts before the first has read them waits for it (shared_sizes).
FIXED_SCAN_SECONDS = 1.0
# Batches an evaluation loader yields in a replay: its longest, and one more
# (a loop that keeps the previous batch's outputs holds two at once) ...
EVALUATION_BATCHES = 2
# ... and all of them while memory grows from batch to batch by more than
# this: a loop that gathers every batch's logits or predictions (the HF
# Trainer's compute_metrics) peaks only at the end of its pass.
EVALUATION_GROWTH_BYTES = 64 * 1024
# Steps a loop that fetches batches ahead may still train once its
# training epoch was cut (oomdoc's step limit waits for them).
STEPS_AFTER_CUT = 4


def sample_elements(sample: Any, depth: int = 0) -> int:
    """How many elements a sample holds: what padding and memory grow with
    (a tensor's or array's elements, a string's characters, a list of
    numbers' length; containers add up their parts; a number is 0)."""
    if depth > 4:
        return 0
    if isinstance(sample, torch.Tensor):
        return int(sample.numel())
    if isinstance(sample, (str, bytes)):
        return len(sample)
    if isinstance(sample, Mapping):
        return sum(sample_elements(value, depth + 1) for value in sample.values())
    if isinstance(sample, (list, tuple)):
        if all(isinstance(item, (int, float, bool)) for item in sample):
            return len(sample)
        return sum(sample_elements(item, depth + 1) for item in sample)
    size = getattr(sample, "size", None)  # a NumPy array (an int), a PIL image (w, h)
    if isinstance(size, int):
        return size
    if isinstance(size, tuple) and size and all(isinstance(side, int) for side in size):
        product = 1
        for side in size:
            product *= side
        return product
    return 0


class DatasetSizes:
    """The sizes of a map-style dataset's samples, read once per dataset
    (and per diagnosis: oomdoc.capture.shared_sizes)."""

    def __init__(
        self, samples: int, sizes: list[int], error: str | None, seconds: float, shared: bool
    ):
        self.samples = samples
        self.sizes = sizes
        self.error = error
        self.seconds = seconds
        self.shared = shared  # read by an earlier replay of the same diagnosis

    @classmethod
    def read(
        cls,
        dataset: Any,
        budget_s: float = SCAN_SECONDS,
        fixed_budget_s: float = FIXED_SCAN_SECONDS,
    ) -> DatasetSizes:
        samples = len(dataset)
        sizes: list[int] = []
        error = None
        varied = False
        started = time.perf_counter()
        try:
            for index in range(samples):
                sizes.append(sample_elements(dataset[index]))
                varied = varied or sizes[-1] != sizes[0]
                spent = time.perf_counter() - started
                if spent > budget_s or (spent > fixed_budget_s and not varied):
                    break
        except Exception as exc:  # the script's dataset: say why, order nothing
            error = f"reading sample {len(sizes)} failed: {type(exc).__name__}"
        return cls(samples, sizes, error, time.perf_counter() - started, shared=False)

    @classmethod
    def from_record(cls, record: dict) -> DatasetSizes:
        """Sizes an earlier replay read (shared_sizes' file)."""
        sizes = [int(size) for size in record["sizes"]]
        error = record["error"]
        return cls(
            int(record["samples"]),
            sizes,
            None if error is None else str(error),
            float(record["seconds"]),
            shared=True,
        )

    @property
    def complete(self) -> bool:
        return self.error is None and len(self.sizes) == self.samples

    @property
    def fixed(self) -> bool:
        """Every sample read has the same size: the order cannot matter."""
        return len(set(self.sizes)) <= 1

    def size_of(self, index: int) -> int:
        return self.sizes[index] if 0 <= index < len(self.sizes) else 0

    def longest_first(self) -> list[int]:
        """Every index, the longest samples first (unread ones last, as read)."""
        read = sorted(range(len(self.sizes)), key=lambda index: -self.sizes[index])
        return read + list(range(len(self.sizes), self.samples))


class LongestFirstBatches:
    """A batch sampler that yields a DataLoader's batches longest first.

    For torch's own BatchSampler, the batches are the dataset's samples
    sorted longest first, in chunks of its batch size (the first is the
    batch of the longest samples a shuffle can bring together). For a
    script's own batch sampler (bucketing), its batches for one epoch, the
    largest (longest sample times batch length) first. How many of them a
    replay uses is decided where they are taken (WholeRun.next_batch)."""

    def __init__(self, original: Any, record: dict, whole_run: WholeRun):
        self.original = original
        self.record = record
        self.whole_run = whole_run
        self._order: list[list[int]] | None = None

    def __getattr__(self, name: str) -> Any:
        # batch_size, drop_last, sampler: what frameworks read of a batch sampler.
        if name == "original":
            raise AttributeError(name)
        return getattr(self.original, name)

    def __len__(self) -> int:
        return len(self.original)

    def _batches(self) -> list[list[int]]:
        if self._order is not None:
            return self._order
        sizes = self.whole_run.sizes_of(self.record)
        original = self.original
        if sizes is None or sizes.fixed or not sizes.sizes:
            self._order = []
            return self._order
        if type(original) is torch.utils.data.BatchSampler:
            order = sizes.longest_first()
            size = int(original.batch_size)
            batches = [order[start : start + size] for start in range(0, len(order), size)]
            if original.drop_last and batches and len(batches[-1]) < size:
                batches.pop()
        else:
            batches = [list(batch) for batch in original]
            batches.sort(
                key=lambda batch: -max((sizes.size_of(i) for i in batch), default=0) * len(batch)
            )
        self._order = batches
        if batches:
            first = batches[0]
            longest = max(first, key=sizes.size_of)
            self.record["longest_first"] = True
            self.record["first_batch"] = {
                "samples": len(first),
                "longest_sample": int(longest),
                "longest_elements": sizes.size_of(longest),
            }
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        if not batches:
            return iter(self.original)
        # The longest batch again once the optimizer's state exists: the
        # first optimizer step comes after it (and after every micro-batch
        # of its accumulation), and a longest batch later in a run trains
        # with that state alive.
        repeats = self.whole_run.longest_repeats(self.record)
        self.record["longest_repeated"] = repeats
        return self._longest_first(batches, repeats)

    def _longest_first(self, batches: list[list[int]], repeats: int) -> Iterator[list[int]]:
        # An epoch begun after the evaluation starts with the longest anyway.
        self.whole_run.longest_again(self.record)
        yield from [batches[0]] * repeats
        for batch in batches[1:]:
            if self.whole_run.longest_again(self.record):
                # Mid-epoch after an evaluation (the HF Trainer's every N
                # steps): the longest batch again, on the cache it left.
                yield from [batches[0]] * repeats
            yield batch


class _Batches:
    """One iteration over a DataLoader in a replay: its own iterator, with
    WholeRun.next_batch deciding before each batch whether it comes."""

    def __init__(self, iterator: Any, record: dict, whole_run: WholeRun):
        self.iterator = iterator
        self.record = record
        self.whole_run = whole_run
        self.taken = 0
        record["iterations"] += 1
        record["_held"] = {}  # allocated before each evaluation batch of this pass

    def __iter__(self) -> _Batches:
        return self

    def __len__(self) -> int:
        return len(self.iterator)

    def __getattr__(self, name: str) -> Any:
        if name == "iterator":
            raise AttributeError(name)
        return getattr(self.iterator, name)

    def __next__(self) -> Any:
        self.whole_run.next_batch(self.record, self.taken)
        batch = next(self.iterator)
        self.taken += 1
        self.whole_run.taken(self.record)
        return batch


class WholeRun:
    """Installed in a replay's child (ChildConfig.whole_run): see the module."""

    def __init__(
        self, tracker: Tracker, budget_s: float = SCAN_SECONDS, shared: SharedSizes | None = None
    ):
        self.tracker = tracker
        self.budget_s = budget_s
        self.shared = shared
        self.records: list[dict] = []
        self._by_loader: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Sizes by dataset identity: a framework that makes a DataLoader
        # again over the same dataset reads it once.
        self._datasets: dict[int, Any] = {}
        self._sizes: dict[int, DatasetSizes] = {}
        self._last_taken: dict | None = None
        self._epoch_cut = False  # a training epoch was ended early
        self._steps_past_limit = 0  # trained past the step limit (_may_stop)
        # An evaluation ran once the replay's steps were done.
        self._evaluated_after_steps = False
        self._longest_again_served = False
        # The tracker's closed steps when the steps after the evaluation
        # began, and how many of them train before the replay stops.
        self._after_evaluation_from: int | None = None
        self._steps_after_evaluation = 1
        # The framework evaluates at a step's end when asked (the HF
        # Trainer's flow callback): its epoch is not cut (STEP_END_EVALUATION).
        self.evaluates_at_step_end = False
        self._evaluation_asked = False

    # ------------------------------------------------------------ install
    def install(self) -> Callable[[], None]:
        loader_class = torch.utils.data.DataLoader
        original_init, original_iter = loader_class.__init__, loader_class.__iter__
        whole_run = self

        def init(loader: Any, *args: Any, **kwargs: Any) -> None:
            original_init(loader, *args, **kwargs)
            whole_run.wrap(loader)

        def iterate(loader: Any) -> Any:
            record = whole_run._by_loader.get(loader)
            if record is None:
                return original_iter(loader)
            # The longest-first batch sampler only while the iterator is made
            # (it takes its indices from it): a framework that makes the
            # DataLoader again from its attributes (Lightning, accelerate)
            # finds the script's own batch sampler.
            original = loader.batch_sampler
            ordered = whole_run.ordered(record, original)
            if ordered is not None:
                object.__setattr__(loader, "batch_sampler", ordered)
            try:
                iterator = original_iter(loader)
            finally:
                if ordered is not None:
                    object.__setattr__(loader, "batch_sampler", original)
            return _Batches(iterator, record, whole_run)

        init.__wrapped__ = original_init  # type: ignore[attr-defined]
        iterate.__wrapped__ = original_iter  # type: ignore[attr-defined]
        loader_class.__init__ = init  # type: ignore[method-assign,assignment]
        loader_class.__iter__ = iterate  # type: ignore[method-assign]
        self.tracker.backward_start_callbacks.append(self._backward_started)
        self.tracker.forward_start_callbacks.append(self._model_called)
        self.tracker.may_stop = self._may_stop

        def undo() -> None:
            loader_class.__init__ = original_init  # type: ignore[method-assign]
            loader_class.__iter__ = original_iter  # type: ignore[method-assign]
            for callbacks, callback in (
                (self.tracker.backward_start_callbacks, self._backward_started),
                (self.tracker.forward_start_callbacks, self._model_called),
            ):
                if callback in callbacks:
                    callbacks.remove(callback)

        return undo

    def wrap(self, loader: Any) -> None:
        """Note a new DataLoader, and whether its batches can come longest first."""
        dataset = loader.dataset
        record: dict[str, Any] = {
            "loader": len(self.records),
            "dataset": type(dataset).__name__,
            # A DataLoader made with a batch sampler (accelerate's) has none of its own.
            "batch_size": getattr(loader, "batch_size", None)
            or getattr(getattr(loader, "batch_sampler", None), "batch_size", None),
            "role": None,
            "batches_taken": 0,
            "iterations": 0,
            "longest_first": False,
        }
        if isinstance(dataset, torch.utils.data.IterableDataset):
            record["not_ordered"] = "an iterable dataset: its samples come as it yields them"
        elif getattr(loader, "batch_sampler", None) is None:
            record["not_ordered"] = "no batches (batch_size=None): samples come one at a time"
        elif not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            record["not_ordered"] = "a dataset without len() and indexing"
        else:
            record["dataset_key"] = id(dataset)
            self._datasets[id(dataset)] = dataset
        self.records.append(record)
        self._by_loader[loader] = record

    def ordered(self, record: dict, batch_sampler: Any) -> LongestFirstBatches | None:
        """The longest-first batch sampler over `batch_sampler` (made once
        per DataLoader and batch sampler), None when it cannot be ordered."""
        if "dataset_key" not in record or batch_sampler is None:
            return None
        made = record.get("_ordered")
        if made is None or made.original is not batch_sampler:
            made = record["_ordered"] = LongestFirstBatches(batch_sampler, record, self)
        return made

    def sizes_of(self, record: dict) -> DatasetSizes | None:
        key = record.get("dataset_key")
        if key is None or key not in self._datasets:
            return None
        sizes = self._sizes.get(key)
        if sizes is None:
            sizes = self._sizes[key] = self._read_sizes(self._datasets[key])
        record["samples"] = sizes.samples
        record["samples_read"] = len(sizes.sizes)
        record["read_s"] = round(sizes.seconds, 3)
        if sizes.shared:
            record["sizes_shared"] = True
        if sizes.error:
            record["not_ordered"] = sizes.error
        elif sizes.fixed and sizes.sizes:
            record["fixed_elements"] = sizes.sizes[0]
        if sizes.sizes:
            longest = max(range(len(sizes.sizes)), key=sizes.size_of)
            record["longest_sample"] = longest
            record["longest_elements"] = sizes.sizes[longest]
            record["median_elements"] = sorted(sizes.sizes)[len(sizes.sizes) // 2]
        return sizes

    def _read_sizes(self, dataset: Any) -> DatasetSizes:
        if self.shared is None:
            return DatasetSizes.read(dataset, self.budget_s)
        key = self.shared.key(dataset, lambda: sample_elements(dataset[0]))
        found = self.shared.get(
            key, lambda: DatasetSizes.read(dataset, self.budget_s), DatasetSizes.from_record
        )
        assert isinstance(found, DatasetSizes)
        return found

    def longest_repeats(self, record: dict) -> int:
        """How many times a loader yields its longest batch: a training
        loader every micro-batch of the first optimizer step and one more
        after it; once, a loader known not to train (an evaluation loader,
        or one iterated while another is known to be the training loader)."""
        role = record["role"]
        training_known = any(other["role"] == "training" for other in self.records)
        if role == "evaluation" or (role is None and training_known):
            return 1
        return self.tracker.micro_batches_per_step + 1

    def _may_stop(self) -> bool:
        """At the step limit: a loop that fetches batches ahead (the HF
        Trainer) took some before the training epoch was cut; they still
        train (at most STEPS_AFTER_CUT), so that its epoch ends and its
        evaluation comes; a framework asked to evaluate at a step's end
        (STEP_END_EVALUATION) trains on until it has. Any other run stops
        there; the steps after an evaluation (next_batch) stop once closed."""
        started = self._after_evaluation_from
        if started is not None:
            unit = self.tracker.micro_batches_per_step if self.tracker.unit == "module" else 1
            return self.tracker.step_index >= started + self._steps_after_evaluation * unit
        # Past the limit, a few steps at most: after the cut, or while a
        # framework asked to evaluate at this step's end has not yet.
        waiting = self._epoch_cut or (
            self.evaluates_at_step_end and not self._evaluated_after_steps
        )
        if not waiting or self._steps_past_limit >= STEPS_AFTER_CUT:
            return True
        self._steps_past_limit += 1
        return False

    # ------------------------------------------------------------ roles
    def _backward_started(self) -> None:
        if self._last_taken is not None:
            self._last_taken["role"] = "training"

    def _model_called(self, module: Any) -> None:
        last = self._last_taken
        if self.tracker.phase != "evaluation":
            return
        if last is not None and last["role"] is None:
            last["role"] = "evaluation"
        if self._epoch_cut or self.tracker.steps_done():
            self._evaluated_after_steps = True

    # ------------------------------------------------------------ batches
    def next_batch(self, record: dict, taken: int) -> None:
        """Before a DataLoader's next batch in one iteration (`taken` so far):
        an evaluation loader ends after EVALUATION_BATCHES; a training loader
        ends its epoch once the replay's steps are done, so that the script's
        end-of-epoch work runs; iterated again after that (the next epoch),
        it trains one optimizer step more if an evaluation ran (its longest
        batch first, see the module), else it stops the replay (StopRun)."""
        role = record["role"]
        if role == "training" and not self._evaluation_asked:
            for offer in STEP_END_EVALUATION:
                offer(self, record)
        if role == "training" and self._after_evaluation_from is not None:
            return  # the steps after the evaluation: the tracker stops them (_may_stop)
        if role == "training" and self.tracker.steps_done():
            self.tracker.timed_steps_done()
            if self._evaluated_after_steps:
                record["trained_after_evaluation"] = True
                self._after_evaluation_from = self.tracker.step_index
                # A new epoch starts with the longest batch; mid-epoch, a
                # batch fetched before the evaluation may come first.
                self._steps_after_evaluation = 1 if taken == 0 else 2
                return
            if self.evaluates_at_step_end:
                return  # the framework evaluates at this step's end (asked)
            if taken == 0:
                record["stopped_replay"] = True
                raise StopRun()
            record["epoch_ended_early"] = True
            self._epoch_cut = True
            evaluate_at_epoch_end(record)
            raise StopIteration
        if role == "evaluation":
            # Memory before each batch, by batches taken, from when the role
            # is known (after its first model call: a loop that fetches
            # ahead, as accelerate's does, knows it a batch later).
            held = record["_held"]
            earlier = min(held, default=None)
            held[taken] = int(self.tracker.backend.allocated_bytes())
            if taken >= EVALUATION_BATCHES and earlier is not None:
                if held[taken] - held[earlier] > EVALUATION_GROWTH_BYTES:
                    record["evaluation_grows"] = True  # every batch, to the pass's end
                    return
                record["epoch_ended_early"] = True
                raise StopIteration

    def longest_again(self, record: dict) -> bool:
        """Whether a training loader yields its longest batch again now:
        once, after an evaluation that ran once the steps were done."""
        if (
            record["role"] != "training"
            or not self._evaluated_after_steps
            or self._longest_again_served
        ):
            return False
        self._longest_again_served = True
        return True

    def ask_evaluation(self) -> bool:
        """A framework's step end (STEP_END_EVALUATION): whether to evaluate
        now, once the replay's steps are done (once)."""
        self.evaluates_at_step_end = True
        if self._evaluation_asked or not self.tracker.steps_done():
            return False
        self._evaluation_asked = True
        return True

    def taken(self, record: dict) -> None:
        self._last_taken = record
        record["batches_taken"] += 1

    def fields(self) -> list[dict]:
        """The capture's `data_loaders`: those the run iterated, and those it
        never did over a dataset no iterated one reads (a framework's copy
        of a DataLoader over the same dataset is the same loader to the run)."""
        iterated = {record.get("dataset_key") for record in self.records if record["iterations"]}
        return [
            {
                key: value
                for key, value in record.items()
                if not key.startswith(("_", "dataset_key"))
            }
            for record in self.records
            if record["iterations"] or record.get("dataset_key", -1) not in iterated
        ]


def _transformers_flow(hook: str, asks: Callable[[str], str | None], record: dict) -> None:
    """Wrap the HF Trainer's DefaultFlowCallback `hook` (once per process):
    after its own decision, `asks(eval strategy)` may ask for an evaluation
    (the record's `evaluation_asked` says how)."""
    module = sys.modules.get("transformers.trainer_callback")
    flow = getattr(module, "DefaultFlowCallback", None)
    original = getattr(flow, hook, None)
    if original is None or getattr(original, "oomdoc_whole_run", False):
        return

    def wrapped(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control = original(self, args, state, control, **kwargs)
        strategy = getattr(args, "eval_strategy", None) or getattr(
            args, "evaluation_strategy", None
        )
        how = asks(str(getattr(strategy, "value", strategy))) if control is not None else None
        if how:
            control.should_evaluate = True
            record["evaluation_asked"] = how
        return control

    wrapped.oomdoc_whole_run = True  # type: ignore[attr-defined]
    setattr(flow, hook, wrapped)


def _transformers_epoch_end(record: dict) -> None:
    """The HF Trainer evaluates at an epoch's end only with
    `eval_strategy="epoch"`; every N steps, the replay's shortened epoch
    would never reach it. Once the epoch is cut, its flow callback asks for
    the evaluation at the epoch's end whatever the strategy (never `no`)."""

    def asks(strategy: str) -> str | None:
        if strategy in ("no", "None"):
            return None
        return "transformers: at the shortened epoch's end"

    _transformers_flow("on_epoch_end", asks, record)


# Frameworks that evaluate every N steps rather than at an epoch's end: how
# each is asked to evaluate at the end of a replay's shortened epoch.
EPOCH_END_EVALUATION: tuple[Callable[[dict], None], ...] = (_transformers_epoch_end,)


def _transformers_step_end(whole_run: WholeRun, record: dict) -> None:
    """The HF Trainer evaluating every N steps goes on training after its
    evaluation, within the epoch (a `max_steps` run is often one epoch):
    its flow callback is asked to evaluate at the step end once the
    replay's steps are done, and the epoch is not cut."""

    def asks(strategy: str) -> str | None:
        if strategy != "steps" or not whole_run.ask_evaluation():
            return None
        return "transformers: at the step end"

    _transformers_flow("on_step_end", asks, record)


# Frameworks that can evaluate at a step's end when asked, and go on
# training: each is offered the replay (once its training loader is known).
STEP_END_EVALUATION: tuple[Callable[[WholeRun, dict], None], ...] = (_transformers_step_end,)


def evaluate_at_epoch_end(record: dict) -> None:
    for ask in EPOCH_END_EVALUATION:
        ask(record)


def install(
    tracker: Tracker, sizes_folder: str | None = None
) -> tuple[WholeRun, Callable[[], None]]:
    """`sizes_folder`: where the replays of one diagnosis share their
    datasets' sizes (shared_sizes), None to read them here."""
    shared = SharedSizes(sizes_folder) if sizes_folder else None
    whole_run = WholeRun(tracker, shared=shared)
    return whole_run, whole_run.install()
