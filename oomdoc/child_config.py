"""What the parent tells the capture child: one typed record, sent as JSON.

Every launcher (oomdoc.runner for a run or a replay, oomdoc.distributed.launch
for a torchrun job, oomdoc.capture.spawned for the ranks a script spawns)
builds a ChildConfig and the child (oomdoc.capture.child) reads its fields,
so that a key written by one side and misspelt or forgotten by the other is
an error where it is made, not a silent default in the child. Torch-free:
the parent imports it.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any


class ChildConfigError(ValueError):
    """The configuration file does not match this oomdoc's ChildConfig (a
    parent and a child of different versions, or a hand-written file)."""


@dataclass
class DeviceLock:
    """Replays side by side share the device through this lock file
    (oomdoc.capture.gate): the child takes it before its first device work."""

    path: str
    # Where the child says whether it holds the lock and how long it waited.
    status: str | None = None
    # True: the card has room for every lane's process, so this child's
    # untimed device work holds the lock shared (its timed steps alone);
    # False or None: it keeps the device alone from its first device work.
    shared: bool | None = None
    # The file a shared child passes before it takes the lock (None: unshared).
    turnstile: str | None = None
    # A shared child whose step times are never used (a check of a peak): it
    # never takes the lock alone, and passes it on at each step's end.
    untimed: bool = False
    # Steps a shared, timed child runs sharing the device before the steps it
    # times (oomdoc.capture.step_limits.StepLimits.share_device).
    shared_steps: int = 1


@dataclass
class DistributedJob:
    """The child is one rank of a job: its result and artifact paths hold
    `{rank}` and `{local_rank}`, which it fills in (oomdoc.capture.parallel)."""

    # torchrun's --nproc-per-node (None for ranks spawned by the script).
    nproc_per_node: int | None = None
    # Where the rank writes its pid, so the parent can end a stuck job.
    started_path: str | None = None
    # A rank started by the script's own torch.multiprocessing.spawn.
    spawned: bool = False
    # A rank a launcher started as a new Python process (oomdoc.capture.relaunch):
    # its place in the job is in its environment (LOCAL_RANK, RANK, ...).
    relaunched: bool = False


@dataclass
class ChildConfig:
    """One run of the user's script under capture, as the child sees it."""

    # The script's path, or a module's name when `is_module` (`python -m`).
    target: str
    # Where the child writes its capture (oomdoc.snapshot's JSON).
    result_path: str
    # The script's own command-line arguments.
    args: list[str] = field(default_factory=list)
    is_module: bool = False
    # "cuda", "cpu" (the simulated device) or "auto" (CUDA when there is one).
    device: str = "auto"
    # The capacity to simulate or to cap the card to (None: the card's, or
    # the host's memory on the simulated device).
    capacity_bytes: int | None = None
    # Stop the script (StopRun) after this many steps (None: run to its end).
    max_steps: int | None = None
    # Micro-batches per optimizer step (gradient accumulation): before the
    # first optimizer step, `max_steps` counts this many model calls per step.
    micro_batches_per_step: int | None = None
    # A replay: the failing run's step unit (oomdoc.capture.step_limits.UNITS);
    # `max_steps` counts only once the replay trains in that unit.
    expected_unit: str | None = None
    # A replay of an OOM in evaluation pass N: it stops after that pass (at
    # the next training call) instead of after `max_steps`.
    stop_after_evaluation: int | None = None
    # A replay: DataLoaders yield their longest batches first, and the
    # training epoch ends once the steps are done, so that the script's own
    # evaluation runs (oomdoc.capture.whole_run). Never the failing run.
    whole_run: bool = False
    # A replay with `whole_run`: the folder where the replays of one
    # diagnosis share their datasets' sample sizes, read once
    # (oomdoc.capture.shared_sizes); None: each replay reads its own.
    dataset_sizes: str | None = None
    # A replay: the folder where the replays of one diagnosis note each of
    # the user's files before changing it, for the parent to put back
    # (oomdoc.kept_files); None: not noted (they are still named).
    kept_files: str | None = None
    # A replay: the fix to apply before the script starts (oomdoc.fixes'
    # payload: its `name`, the fixes applied `also`, and the fix's settings).
    fix: dict[str, Any] | None = None
    # Where the child may write files beside its capture (the allocator's
    # snapshot at an OOM).
    artifact_dir: str | None = None
    # oomdoc check: DataLoaders load in the script's process (num_workers=0),
    # so that two runs of the same code count the same batches.
    serial_dataloaders: bool = False
    # When the parent asked for this run (seconds since the epoch): a warm
    # child still importing then starts it later (its `ready_wait_s`).
    asked_at: float | None = None
    device_lock: DeviceLock | None = None
    distributed: DistributedJob | None = None
    # Environment variables a warm child sets before the script starts (it
    # started without them: oomdoc.warm.LATE_ENV), e.g. the allocator's
    # PYTORCH_CUDA_ALLOC_CONF of a replay with expandable segments.
    late_env: dict[str, str] = field(default_factory=dict)
    # A replay: once the capture is written, the process ends without the
    # interpreter's teardown, its atexit handlers run (oomdoc.capture.quick_exit).
    quick_exit: bool = False
    # A replay on CUDA: large CPU tensors' random initialisation is drawn
    # cheaply (oomdoc.capture.quick_init): the model's values change neither
    # its memory nor its step time.
    quick_init: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChildConfig:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ChildConfigError(f"oomdoc: the child's configuration is not JSON: {exc}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: object) -> ChildConfig:
        values = _known_fields(cls, data)
        lock = values.get("device_lock")
        if lock is not None:
            values["device_lock"] = DeviceLock(**_known_fields(DeviceLock, lock))
        job = values.get("distributed")
        if job is not None:
            values["distributed"] = DistributedJob(**_known_fields(DistributedJob, job))
        return cls(**values)


def _known_fields(record: type, data: object) -> dict[str, Any]:
    """`data` as the keyword arguments of the dataclass `record`: a key it
    does not have, or one it needs that is missing, is an error that names it."""
    if not isinstance(data, dict):
        raise ChildConfigError(
            f"oomdoc: the child's configuration has {type(data).__name__} where "
            f"{record.__name__} belongs"
        )
    names = {item.name for item in fields(record)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ChildConfigError(
            f"oomdoc: unknown keys in the child's configuration ({record.__name__}): "
            + ", ".join(unknown)
        )
    required = [
        item.name
        for item in fields(record)
        if item.name not in data and item.default is MISSING and item.default_factory is MISSING
    ]
    if required:
        raise ChildConfigError(
            f"oomdoc: the child's configuration ({record.__name__}) lacks " + ", ".join(required)
        )
    return dict(data)
