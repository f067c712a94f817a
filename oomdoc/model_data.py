"""Typed records of a replay's data and of the whole-run certificate
(docs/snapshot.md: `data_loaders`, `prescription.certificate`).

A replay orders every DataLoader's batches longest first and reaches the
script's own evaluation (oomdoc.capture.whole_run); what it did is a
`DataLoaderRecord` each. The prescription's `Certificate` says what its
measurement covers: the longest input, the evaluation batch, the optimizer
steps, the ranks, and the margin measured from the allocator's drift; the
prescription's own-flags replay is a `FlagsCheck`; the `Framework` the run
went through, with the autocast its training forward ran under. Part of oomdoc.model
(which imports them): parsed the same way, by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from oomdoc.records import when_set


@dataclass
class FirstBatch:
    """The first batch a replay's DataLoader yielded: its longest."""

    samples: int = 0
    longest_sample: Optional[int] = None  # the dataset index
    longest_elements: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataLoaderRecord:
    """One DataLoader a replay iterated, and how its batches were ordered."""

    loader: int = 0  # in the order the script made them
    dataset: str = "?"  # the dataset's class
    batch_size: Optional[int] = None
    # What its batches fed: `training` (a backward), `evaluation` (model
    # calls without autograd), None (neither seen).
    role: Optional[str] = None
    batches_taken: int = 0
    iterations: int = 0  # epochs begun
    # Its batches came longest first (else `not_ordered` or `fixed_elements` says why not).
    longest_first: bool = False
    samples: Optional[int] = None  # len(dataset)
    samples_read: Optional[int] = None  # whose sizes were read (a time budget)
    read_s: Optional[float] = None
    # Its sizes were read by an earlier replay of the same diagnosis (and
    # `read_s` is that read's), shared with this one (oomdoc.capture.shared_sizes).
    sizes_shared: bool = when_set(False)
    longest_sample: Optional[int] = None
    longest_elements: Optional[int] = None
    median_elements: Optional[int] = None
    # Every sample read had this many elements: the order cannot matter.
    fixed_elements: Optional[int] = when_set()
    not_ordered: Optional[str] = when_set()
    first_batch: Optional[FirstBatch] = when_set()
    # How many times it yielded its longest batch (a training loader's: every
    # micro-batch of the first optimizer step and one more, with the
    # optimizer's state alive).
    longest_repeated: Optional[int] = when_set()
    # The replay ended its epoch early (its steps were done, or an
    # evaluation loader's longest batches were taken).
    epoch_ended_early: bool = when_set(False)
    # An evaluation loader whose pass kept memory growing from batch to
    # batch (it gathers outputs): it yielded every batch, to the pass's end.
    evaluation_grows: bool = when_set(False)
    # A framework that evaluates every N steps was asked to evaluate at the
    # replay's last step end, or at the end of the shortened epoch (how).
    evaluation_asked: Optional[str] = when_set()
    # Iterated again once the steps were done (the next epoch): the replay stopped there.
    stopped_replay: bool = when_set(False)
    # After the evaluation the replay trained on (its longest batch again)
    # on the cache the evaluation left: a step of the next epoch, or two mid-epoch.
    trained_after_evaluation: bool = when_set(False)
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every sample's size was read."""
        return self.samples is not None and self.samples_read == self.samples


@dataclass
class Certificate:
    """What the prescription's own replay measured it to hold for, and
    what it does not cover (`gaps`): certified only with no gap."""

    certified: bool = False
    # The longest sample in the first (largest) training batch replayed.
    longest_input_elements: Optional[int] = None
    longest_input_sample: Optional[int] = None
    median_input_elements: Optional[int] = None
    samples_read: Optional[int] = None
    samples: Optional[int] = None
    # `longest_first`, `fixed` (every sample the same size),
    # `fixed_as_seen` (no DataLoader, every batch seen had one shape), or
    # `as_they_came` (an iterable dataset, no DataLoader).
    shapes: str = "as_they_came"
    # fixed_as_seen: the shapes of the model's tensor arguments (the replay's
    # batch), and in how many steps of the failing run and the replay.
    input_shapes: Optional[List[List[int]]] = when_set()
    shape_steps: Optional[int] = when_set()
    evaluation_batch_size: Optional[int] = None
    evaluation_peak_bytes: Optional[int] = None
    training_peak_bytes: Optional[int] = None
    # The replay trained the longest batch again after the evaluation (the
    # cache holding the blocks the evaluation left).
    trained_after_evaluation: bool = when_set(False)
    optimizer_steps: int = 0
    ranks: int = 1
    # The margin the configuration leaves free, and what it is made of: the
    # allocator's overhead at the peak (reserved over allocated), its growth
    # per step over the replay's steps, and the spread of the peak between
    # replays of the same configuration.
    margin_bytes: int = 0
    allocator_overhead_bytes: int = 0
    drift_bytes_per_step: int = 0
    spread_bytes: int = 0
    # The allocator setting the certificate holds with, and why
    # (oomdoc.replay.fragmentation): e.g. expandable segments, without which
    # the replay's reserved memory drifted.
    allocator_setting: Optional[str] = when_set()
    gaps: List[str] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class FlagsCheck:
    """The prescription replayed with the script's own flags and no fix of
    oomdoc's (`prescription.verified_by_flags`)."""

    args: Optional[List[str]] = None
    outcome: Optional[str] = None
    peak_allocated_bytes: Optional[int] = None
    # How the replay's steps flag was raised to run enough steps.
    note: Optional[str] = when_set()
    # The environment it ran with, for a change no flag makes (an allocator
    # setting: PYTORCH_CUDA_ALLOC_CONF).
    env: Optional[Dict[str, str]] = when_set()
    # False: the replay ended before an optimizer step and two more micro-batches.
    accumulation_covered: Optional[bool] = when_set()
    # The prescribed changes the flags make.
    covers: List[str] = when_set(factory=list)
    # Its peak over the prescription's.
    peak_ratio: Optional[float] = when_set()
    # Its throughput, timed as the user will run it (the prescription's
    # samples_per_second then), its noise, and what oomdoc's own replay of
    # the same changes measured: a framework's switch need not cost what
    # oomdoc's fix of the same name does (on an H200 the Lightning encoder's
    # bf16-mixed at 16 x 16: 497.0 by its flags, 492.9 in a plain run,
    # 433.4 in oomdoc's replay).
    samples_per_second: Optional[float] = when_set()
    samples_per_second_noise: Optional[float] = when_set()
    replay_samples_per_second: Optional[float] = when_set()
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def settings(self) -> list[str]:
        """The environment as `NAME=value` words, to go before the command."""
        return [f"{key}={value}" for key, value in sorted((self.env or {}).items())]


@dataclass
class FilesWritten:
    """The files a replay opened to write (oomdoc.capture.replay_writes):
    what running the script again did besides the measurement."""

    paths: List[str] = field(default_factory=list)  # absolute, the first ones
    count: int = 0  # all of them
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Framework:
    """The training framework the run used: `transformers`, `lightning`,
    `accelerate` or `plain` (a loop of the user's own)."""

    name: str = "plain"
    version: Optional[str] = None
    entry: Optional[str] = None  # Trainer, Fabric, Accelerator...
    # The import name the evidence came from (`transformers`, `lightning`,
    # `pytorch_lightning`, `lightning_fabric`, `accelerate`), and when it
    # was first seen (`forward`, `backward`, `optimizer_step`, `oom`).
    module: Optional[str] = when_set()
    seen_at: Optional[str] = when_set()
    # Device type -> dtype of the autocast the first training model call ran
    # under ({} none; None not known: an older snapshot, no training call).
    autocast: Optional[Dict[str, str]] = when_set()
    # Module class -> calls of it that began a torch.utils.checkpoint region
    # in the first training model call ({} none; None not known).
    checkpointed: Optional[Dict[str, int]] = when_set()
    extra: Dict[str, Any] = field(default_factory=dict)
