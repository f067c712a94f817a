"""The snapshot as typed records: parsed once, at the boundary, read by field.

A snapshot file (docs/snapshot.md) is untrusted input. `Snapshot.from_dict`
turns it into the records below: a field of the wrong type becomes its
default (None, 0, an empty list), a list item of the wrong shape is dropped,
and fields this oomdoc does not know are kept in `extra` so that a document
read and written again loses nothing. The few fields every command relies on
are checked first, with a one-line error, by `oomdoc.snapshot.validate`.

Every room after the boundary (diagnosis, replays, reports, check) reads
these fields and the derived values defined here (`Snapshot.needed_bytes`,
`Breakdown.total`, ...) instead of walking dicts. Sizes are int bytes.

Field names follow the JSON keys, except `class`, which is `class_name`
here (the JSON key is given in the field's metadata). A field made with
`when_set` is written only when it differs from its default or the document
it was read from had it: keys the child, the replays or a reporter write
only in some runs (`Device.index`, `Prescription.verified_by_flags`, ...)
stay absent from the others, as when they lived in `extra`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from oomdoc.categories import CATEGORIES  # noqa: F401  (oomdoc.model's API)
from oomdoc.model_data import (  # noqa: F401
    Certificate,
    DataLoaderRecord,
    FilesWritten,
    FirstBatch,
    FlagsCheck,
    Framework,
)
from oomdoc.model_oom import OomsSeen, UncalledModel, WeightCopy  # noqa: F401
from oomdoc.records import parse, to_dict, when_set  # noqa: F401  (oomdoc.model's API)

OUTCOMES = ("oom", "ok", "error", "interrupted")
PHASES = ("setup", "forward", "backward", "optimizer", "idle", "evaluation", "communication")
DEVICE_KINDS = ("cuda", "simulated")


# --------------------------------------------------------------------- parts


@dataclass
class Location:
    """A line of the user's code."""

    file: str = "?"
    line: int = 0
    function: str = "?"
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OtherProcess:
    pid: int = -1
    used_bytes: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Device:
    kind: str = "simulated"
    name: str = "unknown"
    capacity_bytes: int = 0
    total_bytes: Optional[int] = None
    supports_bf16: Optional[bool] = None
    other_processes: List[OtherProcess] = field(default_factory=list)
    # CUDA: the card's index, and what NVML said at capture (the memory of
    # every process on the card): the replays read nvml_free_bytes to decide
    # whether they can share the card when NVML cannot be asked again.
    index: Optional[int] = when_set()
    driver_version: Optional[str] = when_set()
    nvml_used_bytes: Optional[int] = when_set()
    nvml_free_bytes: Optional[int] = when_set()
    # The simulated device: how it counts (every CPU tensor of the process).
    notes: List[str] = when_set(factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def on_cuda(self) -> bool:
        return self.kind == "cuda"


@dataclass
class Host:
    total_bytes: int = 0
    available_bytes: Optional[int] = None
    process_rss_bytes: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ErrorInfo:
    type: Optional[str] = None
    message: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Breakdown:
    """Bytes per category at one moment (oomdoc.categories; one absent from
    an older document is 0)."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    communication: int = 0
    other: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.bytes_of(category) for category in CATEGORIES)

    def bytes_of(self, category: str) -> int:
        return max(0, int(getattr(self, category)))

    def items(self) -> list[tuple[str, int]]:
        return [(category, self.bytes_of(category)) for category in CATEGORIES]

    def largest(self) -> str:
        return max(CATEGORIES, key=self.bytes_of)


@dataclass
class StartedProcesses:
    """Processes the script started itself: captured as ranks (`nprocs`:
    `torch.multiprocessing.spawn`'s, new Python processes, `multiprocessing.Process`
    children that joined the process group) or not (`count`: `multiprocessing.Process`
    children that joined none)."""

    function: str = "?"
    nprocs: int = 0
    count: int = 0
    launcher: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class HeldOutputs:
    """At an OOM in evaluation: the previous evaluation call's outputs that
    were still alive (the variable that held them, where it was read)."""

    bytes: int = 0
    variable: Optional[str] = None
    location: Optional[Location] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Oom:
    step: Optional[int] = None
    phase: Optional[str] = None
    requested_bytes: int = 0
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    free_bytes: int = 0
    capacity_bytes: int = 0
    message: str = ""
    location: Optional[Location] = None
    # In evaluation: which evaluation pass of the run (1-based), and the
    # previous call's outputs still alive then.
    evaluation_pass: Optional[int] = None
    previous_outputs: Optional[HeldOutputs] = None
    # The module whose forward (or backward) asked for the memory, as in
    # `modules`; None outside any module and in older snapshots.
    module: Optional[str] = when_set()
    # Modules with weights on the device that the run never called nor
    # optimised, largest first (absent when none, and in older snapshots).
    uncalled_models: List[UncalledModel] = when_set(factory=list)
    # Plain tensors shaped like a called model's parameters (absent when none).
    weight_copies: List[WeightCopy] = when_set(factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def in_evaluation(self) -> bool:
        return self.phase == "evaluation"

    @property
    def needed_bytes(self) -> int:
        """What the failing moment needed: in use plus the failed request. A
        lower bound of the configuration's real need."""
        return self.allocated_bytes + self.requested_bytes


@dataclass
class Peak:
    allocated_bytes: Optional[int] = None
    reserved_bytes: Optional[int] = None
    step: Optional[int] = None
    phase: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RetainedGraph:
    """A variable whose autograd graph outlives its step (e.g. `total += loss`)."""

    variable: str = "?"
    file: str = "?"
    line: int = 0
    function: str = "?"
    from_step: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def location(self) -> Location:
        return Location(self.file, self.line, self.function)


@dataclass
class Step:
    index: int = -1
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    peak_phase: Optional[str] = None
    end_allocated_bytes: Optional[int] = None
    phase_peaks: Dict[str, int] = field(default_factory=dict)
    start_allocated_bytes: Optional[int] = None
    forward_calls: int = 0
    evaluation_calls: int = 0
    forward_calls_with_grad: int = 0
    eval_mode_forward_calls_with_grad: int = 0
    backward_calls: int = 0
    optimizer_steps: int = 0
    duration_s: Optional[float] = None
    # How long its thread waited for a CPU while runnable (Linux): a step
    # timed with the host busy took longer than the device made it.
    cpu_wait_s: Optional[float] = when_set()
    retained_graphs: List[RetainedGraph] = field(default_factory=list)
    retained_activation_bytes: int = 0
    # A replay side by side with others: the step was timed while their
    # device work may have run too (oomdoc.capture.gate), so its duration is
    # not the step's own (oomdoc.replay.batch.timed_on_a_shared_device).
    device_shared: bool = when_set(False)
    # Began after the replay's steps were done (batches a loop fetched
    # ahead, the steps after its evaluation): left out of its step time.
    after_timed_steps: bool = when_set(False)
    # A training call of the step had input shapes the process had not met:
    # its time holds per-shape warm-up (kernels planned or compiled for them).
    new_shapes: bool = when_set(False)
    # The shapes of the tensors the script passed to its first training
    # model call of the step: positional, then by keyword.
    input_shapes: Optional[List[List[int]]] = when_set()
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Frame:
    """A frame of a site's stack, in oomdoc's keys (file, line, function)
    or PyTorch's (filename, line, name)."""

    file: Optional[str] = None
    filename: Optional[str] = None
    line: Optional[int] = None
    function: Optional[str] = None
    name: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Site:
    """Live allocations grouped by the user's code location, shape and dtype."""

    bytes: int = 0
    count: int = 1
    category: str = "other"
    location: Optional[Location] = None
    shape: Optional[List[Any]] = None
    dtype: Optional[str] = None
    # The module whose forward (or backward) made them, repeated blocks
    # folded (`transformer.h.*.attn`); None outside modules or in old snapshots.
    module: Optional[str] = None
    # The allocation's stack, innermost first, where the source had one.
    stack: List[Frame] = when_set(factory=list)
    frames: List[Frame] = when_set(factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TraceEvent:
    """An allocator event just before the OOM (PyTorch snapshots)."""

    action: str = "?"
    bytes: int = 0
    category: str = "other"
    location: Optional[Location] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RepeatedBlock:
    path: str = "?"
    class_name: str = field(default="?", metadata={"key": "class"})
    count: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelInfo:
    class_name: str = field(default="?", metadata={"key": "class"})
    parameters_bytes: int = 0
    repeated_blocks: List[RepeatedBlock] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)

    def blocks_outermost_first(self) -> list[RepeatedBlock]:
        """Repeated blocks (two or more), the outermost (shortest path) first."""
        blocks = [block for block in self.repeated_blocks if block.count >= 2]
        return sorted(blocks, key=lambda block: (block.path.count("."), -block.count))


@dataclass
class Allocator:
    """The CUDA caching allocator's state (empty on the simulated device)."""

    reserved_bytes: int = 0
    allocated_bytes: int = 0
    inactive_split_bytes: int = 0
    inactive_split_blocks: int = 0
    largest_free_block_bytes: Optional[int] = None
    expandable_segments: Optional[bool] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class FixResult:
    """A fix as measured by a replay, or estimated from the breakdown."""

    name: str = "?"
    rank: Optional[int] = None
    measured: bool = True
    title: Optional[str] = None
    outcome: Optional[str] = None  # fits | oom | timeout | error | grows (measured)
    fits: bool = False
    peak_allocated_bytes: Optional[int] = None
    peak_reserved_bytes: Optional[int] = None
    saved_bytes: Optional[int] = None
    step_time_ratio: Optional[float] = None
    step_s: Optional[float] = None
    replay_s: Optional[float] = None
    detail: Optional[str] = None
    snippet: Optional[str] = None
    # The ratio's relative noise (0.04: +-4%), from how far apart the timed
    # steps behind it were (oomdoc.replay.timing).
    step_time_noise: Optional[float] = when_set()
    # Why step_time_ratio is not given: a ratio that cannot be (a fix that
    # only adds work measured faster than the step without it), with its value.
    step_time_flag: Optional[str] = when_set()
    # Its replay still leaks (grows): by how many steps the fix would postpone the OOM.
    delays_oom_by_steps: Optional[int] = when_set()
    # The batch search's result (the fix that searches the batch): the
    # largest batch that fits, the micro-batch and accumulation steps that
    # keep the user's effective batch, and how the batch is set (the flag
    # spelled with its value, or `DataLoader(batch_size=N)`).
    max_batch_size: Optional[int] = when_set()
    micro_batch_size: Optional[int] = when_set()
    accumulation_steps: Optional[int] = when_set()
    how: Optional[str] = when_set()
    # lighter_optimizer on one process: what sharding the optimizer state
    # over ranks would save per rank (`per_rank_saved_bytes`, by world size)
    # and the static bytes it was computed from (`basis`).
    sharding_estimate: Optional[Dict[str, Any]] = when_set()
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def parts(self) -> list[str]:
        return self.name.split("+")


@dataclass
class Skipped:
    name: str = "?"
    reason: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchSearch:
    source: Optional[str] = None
    original_batch_size: Optional[int] = None
    max_batch_size: Optional[int] = None
    exact: bool = False
    trials: List[List[Any]] = field(default_factory=list)
    stopped: Optional[str] = None
    # The search under the combined savers: which (`a+b`).
    fixes: Optional[str] = when_set()
    # The plain search's largest batch over the whole run
    # (oomdoc.replay.largest_batch): the largest batch certified for it
    # (None: none was), the allocator setting it needs (None: none), and why.
    whole_run_batch_size: Optional[int] = when_set()
    whole_run_setting: Optional[str] = when_set()
    whole_run_note: Optional[str] = when_set()
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ReplaySummary:
    """How the replays went (see docs/snapshot.md, `replay`)."""

    replays: int = 0
    total_s: float = 0.0
    max_steps: Optional[int] = None
    timeout_s: Optional[float] = None
    baseline_need_bytes: Optional[int] = None
    baseline_need_estimated: bool = False
    reference_step_s: Optional[float] = None
    reference: Optional[str] = None
    skipped: List[Skipped] = field(default_factory=list)
    batch_search: Optional[BatchSearch] = None
    runs: List[Dict[str, Any]] = field(default_factory=list)
    # How many replays could run side by side (oomdoc run --replay-jobs).
    jobs: int = 1
    # Replays started ahead that no decision needed (their `runs` records).
    unused_runs: List[Dict[str, Any]] = when_set(factory=list)
    # The batch searches under the memory savers' configurations that did
    # not fit at the user's batch (`fixes`): the one with the most savers
    # here (as before), every one in saver_batch_searches.
    saver_batch_search: Optional[BatchSearch] = when_set()
    saver_batch_searches: Optional[List[BatchSearch]] = when_set()
    # The search of the evaluation's own batch (oomdoc.replay.evaluation_batch).
    evaluation_batch_search: Optional[BatchSearch] = when_set()
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ModuleUsage:
    """Bytes a module (repeated blocks folded into one entry) holds, by category."""

    path: str = "?"
    class_name: str = field(default="?", metadata={"key": "class"})
    blocks: int = 1
    bytes: Breakdown = field(default_factory=Breakdown)
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ConsideredConfiguration:
    """One configuration the prescription's search weighed: its memory
    savers at the micro-batch (and accumulation) it would be prescribed
    with, what its replays measured, and why it was or was not chosen."""

    fixes: List[str] = field(default_factory=list)
    batch_size: Optional[int] = None  # the micro-batch
    accumulation_steps: int = 1
    peak_allocated_bytes: Optional[int] = None
    samples_per_second: Optional[float] = None
    samples_per_second_noise: Optional[float] = None
    # True: measured at exactly this micro-batch and accumulation; False: an
    # estimate (from a larger batch it ran, or not replayed at all).
    measured: bool = False
    # prescribed | slower | over_margin | does_not_fit | not_measured | flags_disagree
    # | slower_by_flags | tied_by_flags
    verdict: str = "not_measured"
    reason: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Prescription:
    """The configuration to use instead: measured by the replays (or, for a
    leak, the code change that stops it)."""

    fixes: List[str] = field(default_factory=list)
    batch_size: Optional[int] = None
    accumulation_steps: int = 1
    peak_allocated_bytes: Optional[int] = None
    # With accumulation_steps > 1: true when the peak was measured with the
    # accumulation running (the later micro-batches' forward with the earlier
    # ones' gradients alive, optimizer steps); false when it is the
    # micro-batch's peak without accumulation. None without accumulation.
    accumulation_measured: Optional[bool] = None
    fits: bool = False
    samples_per_second: Optional[float] = None
    measured: bool = True
    # "config" (a measured configuration) or "leak" (fix the leak first).
    kind: str = "config"
    headroom_bytes: Optional[int] = None
    margin_bytes: Optional[int] = None
    # Throughput relative to the failing configuration at its largest fitting batch.
    throughput_ratio: Optional[float] = None
    detail: Optional[str] = None
    snippet: Optional[str] = None
    # The option that sets `batch_size` when it is an evaluation batch (an
    # OOM in evaluation: nothing is accumulated), e.g. `--eval-batch-size`.
    evaluation_batch_flag: Optional[str] = None
    # A training OOM whose replays then ran out of memory in the evaluation,
    # at the script's own evaluation batch: the evaluation batch every later
    # replay ran with, and the script's option for it
    # (oomdoc.replay.evaluation_batch).
    evaluation_batch_size: Optional[int] = when_set()
    evaluation_batch_option: Optional[str] = when_set()
    # The batch whose replay measured samples_per_second, when it is not
    # batch_size (a micro-batch planned above the batches measured).
    throughput_batch_size: Optional[int] = when_set()
    # The replay of exactly this configuration with its accumulation, and
    # the one with the script's own flags (docs/snapshot.md, `prescription`):
    # `args`, `outcome`, `peak_allocated_bytes`, `accumulation_covered`,
    # `note`; the latter also `covers` and `peak_ratio`.
    accumulation_replay: Optional[Dict[str, Any]] = when_set()
    verified_by_flags: Optional[FlagsCheck] = when_set()
    # The relative noise of samples_per_second (oomdoc.replay.timing).
    samples_per_second_noise: Optional[float] = when_set()
    # Every configuration the search weighed, the prescribed one first.
    considered: Optional[List[ConsideredConfiguration]] = when_set()
    # What its replay measured it to hold for (oomdoc.replay.certificate).
    certificate: Optional[Certificate] = when_set()
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataParallelWrapper:
    """An nn.DataParallel the script called: its model's class and devices."""

    class_name: str = field(default="?", metadata={"key": "class"})
    device_ids: List[int] = field(default_factory=list)
    output_device: Optional[int] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DdpModule:
    """A DistributedDataParallel module's gradient buckets: DDP copies each
    gradient into a flat bucket for the all-reduce."""

    class_name: str = field(default="?", metadata={"key": "class"})
    bucket_cap_bytes: Optional[int] = None
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    trainable_parameter_bytes: int = 0
    # As DDP reports them (None when it does not).
    bucket_sizes_bytes: Optional[List[int]] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Parallel:
    """The data-parallel wrappers the script called (`parallel`)."""

    data_parallel: List[DataParallelWrapper] = field(default_factory=list)
    ddp: List[DdpModule] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class WaitingAt:
    """Where a rank was when the job stopped it: a line of the script, and
    the torch.distributed collective it waited in, if any."""

    file: Optional[str] = None
    line: Optional[int] = None
    function: Optional[str] = None
    collective: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RankEntry:
    """One rank of a distributed job (`ranks`, docs/snapshot.md)."""

    rank: Optional[int] = None
    local_rank: Optional[int] = None
    node_rank: Optional[int] = None
    host: Optional[str] = None
    device: Optional[Device] = None
    captured: bool = True
    outcome: str = "?"
    exit_code: Optional[int] = None
    oom: Optional[Oom] = None
    breakdown: Optional[Breakdown] = None
    peak: Optional[Peak] = None
    steps: List[Step] = field(default_factory=list)
    parallel: Optional[Parallel] = when_set()
    # CUDA: what the rank's caching allocator held (reserved) at the end.
    allocator_reserved_bytes: Optional[int] = when_set()
    waiting_at: Optional[WaitingAt] = when_set()
    # The signal that stopped the rank (SIGTERM from the launcher or oomdoc).
    stopped_by: Optional[str] = when_set()
    # A replay's rank oomdoc ended after its peer reached the step limit.
    ended_with_peers: bool = when_set(False)
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def held_bytes(self) -> Optional[int]:
        """The most it held (allocated, in use): its peak, or at its OOM what
        it held when the request failed (never the request: it was not held,
        and held plus request is above the capacity)."""
        if not self.captured:
            return None
        peak = (self.peak.allocated_bytes if self.peak else None) or 0
        return max(peak, self.oom.allocated_bytes if self.oom else 0)


@dataclass
class Options:
    device: Optional[str] = None
    capacity_bytes: Optional[int] = None
    max_steps: Optional[int] = None
    # A distributed job: its launch options (the snapshot's `launch`).
    distributed: Optional[Dict[str, Any]] = when_set()
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Snapshot:
    """One run (or one PyTorch memory snapshot), as `oomdoc run` writes it."""

    schema_version: int = 1
    oomdoc_version: str = "?"
    created_at: str = ""
    command: List[str] = field(default_factory=list)
    cwd: Optional[str] = None
    python: Optional[str] = None
    torch_version: str = "unknown"
    options: Optional[Options] = None
    device: Device = field(default_factory=Device)
    host: Optional[Host] = None
    outcome: str = "error"
    exit_code: int = 0
    error: Optional[ErrorInfo] = None
    step_unit: Optional[str] = None
    oom: Optional[Oom] = None
    breakdown: Breakdown = field(default_factory=Breakdown)
    breakdown_at: Optional[str] = None
    category_peaks: Optional[Breakdown] = None
    peak: Optional[Peak] = None
    steps: List[Step] = field(default_factory=list)
    # Steps of a long run whose records were not kept (the first, the
    # highest peaks and the last ones are): 0 in older snapshots.
    steps_omitted: int = 0
    top_allocations: List[Site] = field(default_factory=list)
    allocator: Optional[Allocator] = None
    optimizers: List[str] = field(default_factory=list)
    models: List[ModelInfo] = field(default_factory=list)
    artifacts: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    fixes: List[FixResult] = field(default_factory=list)
    max_batch_size: Optional[int] = None
    replay: Optional[ReplaySummary] = None
    timings: Optional[Dict[str, Any]] = None
    modules: List[ModuleUsage] = field(default_factory=list)
    framework: Optional[Framework] = None
    ooms_seen: Optional[OomsSeen] = when_set()  # every OOM raised, where one was caught
    script_options: List[str] = field(default_factory=list)
    spawned_ranks: List[StartedProcesses] = field(default_factory=list)
    uncaptured_processes: List[StartedProcesses] = field(default_factory=list)
    # How the script takes its options (oomdoc.script_flags): `argparse`
    # (`--key value`, `--key=value`, short flags) or `configurator` (only
    # `--key=value`, each key a global of the script's module); None: unknown.
    script_option_syntax: Optional[str] = None
    # Each other spelling of a declared option to the option's name, its
    # first long spelling (argparse `-b/--batch-size`: {"-b": "--batch-size"}).
    script_option_aliases: Dict[str, str] = field(default_factory=dict)
    # Heavy installed packages the script imported, in import order.
    imported_packages: List[str] = field(default_factory=list)
    # Batch sizes of the DataLoaders the script made that a smaller-batch
    # replay could change; None when not known (a replay, an older snapshot).
    dataloader_batch_sizes: Optional[List[int]] = None
    # The num_workers of each DataLoader the script made: each replay's
    # workers take as many cores (oomdoc.replay.lanes.default_jobs); None
    # when not known (a replay, an older snapshot).
    dataloader_workers: Optional[List[int]] = None
    # oomdoc check: the num_workers of each DataLoader made to load in the
    # script's process instead (oomdoc.capture.serial_dataloaders).
    dataloader_workers_removed: List[int] = field(default_factory=list)
    # Of the script's options, those that take a value: to their `choices`
    # (empty when any value goes); the others are switches.
    script_option_values: Dict[str, List[str]] = when_set(factory=dict)
    # Each option's default where the script says it plainly (argparse's
    # `default=`, a configurator script's module-level `NAME = 5 * 8`), as text.
    script_option_defaults: Dict[str, str] = when_set(factory=dict)
    # A replay: what the child recorded of each fix it applied, by fix name
    # (the fix's own record: `patched`, `batch_size`, `models`, ...).
    fix_applied: Optional[Dict[str, Any]] = when_set()
    # Data-parallel wrappers the script called (`data_parallel`, `ddp`).
    parallel: Optional[Parallel] = when_set()
    # A replay: its DataLoaders, longest batches first (oomdoc.capture.whole_run).
    data_loaders: List[DataLoaderRecord] = when_set(factory=list)
    files_written: Optional[FilesWritten] = when_set()  # a replay's: capture.replay_writes
    prescription: Optional[Prescription] = None
    # A distributed job: one entry per rank; the top-level fields are the
    # primary rank's (the first to run out of memory).
    ranks: List[RankEntry] = field(default_factory=list)
    world_size: Optional[int] = None
    first_oom_rank: Optional[int] = None
    # The first rank that failed in any way (an OOM or another error).
    first_failing_rank: Optional[int] = when_set()
    primary_rank: Optional[int] = None
    source: Optional[Dict[str, Any]] = None
    trace_before_oom: Optional[List[TraceEvent]] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> Snapshot:
        return parse(cls, data)

    def to_dict(self) -> dict:
        return to_dict(self)

    def write_every_field(self) -> None:
        """Written, this snapshot has every top-level field, also those the
        document it was parsed from lacked (a new run's snapshot)."""
        self.__dict__.pop("_absent", None)

    # ------------------------------------------------------------ derived
    @property
    def is_oom(self) -> bool:
        return self.outcome == "oom" and self.oom is not None

    @property
    def step_count(self) -> int:
        """How many steps the run closed, kept records or not."""
        return len(self.steps) + max(0, int(self.steps_omitted or 0))

    @property
    def oom_in_evaluation(self) -> bool:
        """The run ran out of memory in an evaluation pass: its batch is an
        evaluation batch, with no gradients to accumulate."""
        return self.is_oom and self.oom is not None and self.oom.in_evaluation

    @property
    def capacity_bytes(self) -> int:
        return self.device.capacity_bytes or (self.oom.capacity_bytes if self.oom else 0)

    @property
    def needed_bytes(self) -> int:
        """At an OOM, in use plus the failed request; else the peak."""
        if self.is_oom:
            assert self.oom is not None
            return self.oom.needed_bytes
        peak = self.peak.allocated_bytes if self.peak else None
        return peak if peak is not None else self.breakdown.total

    @property
    def source_format(self) -> str:
        value = (self.source or {}).get("format")
        return value if isinstance(value, str) else ""

    @property
    def from_pytorch(self) -> bool:
        """A PyTorch memory snapshot converted by oomdoc.loaders."""
        return self.source_format.startswith("torch")

    @property
    def moment_label(self) -> str:
        """When the breakdown was taken, as a phrase."""
        return {
            "oom": "at the OOM",
            "peak": "at the peak",
            "end": "at the end",
            "snapshot": "in the snapshot",
        }.get(self.breakdown_at or "", "at the end")

    @property
    def moment_step(self) -> Optional[int]:
        """The step the breakdown describes, when known."""
        if self.breakdown_at == "oom" and self.oom is not None:
            return self.oom.step
        if self.breakdown_at == "peak" and self.peak is not None:
            return self.peak.step
        return None

    @property
    def parameter_update(self) -> Optional[str]:
        """How the script updates its parameters: `optimizer` (it created a
        torch.optim optimizer), `manual` (backward passes ran and no
        optimizer was created: it updates them by hand), None when unknown
        (no backward ran before the run ended)."""
        if self.optimizers:
            return "optimizer"
        if any(step.backward_calls for step in self.steps):
            return "manual"
        return None

    @property
    def repeated_blocks(self) -> list[RepeatedBlock]:
        """Each model's outermost repeated blocks."""
        return [blocks[0] for model in self.models if (blocks := model.blocks_outermost_first())]

    @property
    def caught_ooms(self) -> int:
        """Out-of-memory errors the script caught and went on from."""
        seen = self.ooms_seen.count if self.ooms_seen is not None else 0
        return max(0, seen - (1 if self.outcome == "oom" else 0))

    def fix_named(self, name: str) -> Optional[FixResult]:
        return next((fix for fix in self.fixes if fix.name == name), None)
