"""Diagnoses of data-parallel runs, each a standalone rule.

Every rule takes a Snapshot (a job with `ranks`, or a single process) and
returns None or a diagnosis in the format of oomdoc.diagnosis (as a dict): {kind, summary, evidence, bytes, fixes, remedy}. Fix names
here (ddp, fsdp, zero_optimizer, gradient_as_bucket_view, ...) are for the
fix catalogue to adopt.
"""

from __future__ import annotations

from oomdoc.categories import COMMUNICATION
from oomdoc.diagnosis.base import TIER_BREAKDOWN, TIER_CONTEXT, TIER_DECISIVE, Diagnosis
from oomdoc.model import DataParallelWrapper, DdpModule, Device, RankEntry, Snapshot
from oomdoc.sizes import format_bytes

MiB = 1024**2
# One rank holds this much more than the others (relative to their highest).
IMBALANCE_SHARE = 0.10
# Memory outside PyTorch's allocator worth a word: this share of the device.
OUTSIDE_ALLOCATOR_SHARE = 0.05
# DDP's second copy of the gradients, worth a word from this share of the peak.
BUCKET_SHARE_OF_PEAK = 0.05

DDP_SNIPPET = """\
# train.py: one process per GPU instead of nn.DataParallel
import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = torch.nn.parallel.DistributedDataParallel(model.cuda(), device_ids=[local_rank])
# and a DistributedSampler for the DataLoader; then launch it with
#   torchrun --nproc-per-node NUM_GPUS train.py   (or: oomdoc run --nproc-per-node NUM_GPUS train.py)"""

BUCKET_SNIPPET = """\
model = torch.nn.parallel.DistributedDataParallel(
    model, device_ids=[local_rank],
    gradient_as_bucket_view=True,  # gradients live in the buckets: one copy, not two
    bucket_cap_mb=25,              # smaller buckets: less in flight at once
)"""


def _diagnosis(kind, summary, evidence, num_bytes, fixes=(), remedy=None) -> dict:
    return {
        "kind": kind,
        "summary": summary,
        "evidence": [line for line in evidence if line],
        "bytes": int(max(0, num_bytes)),
        "fixes": list(fixes),
        "remedy": remedy,
    }


def _name(entry: RankEntry) -> str:
    return f"rank {entry.rank}"


def held_by_moment(entry: RankEntry) -> dict[tuple[int, str], int]:
    """What a rank held (allocated, in use) at each moment of its run: the
    peak of each phase of each step, and at its OOM, what it held when the
    request failed (never the request: that was not held)."""
    held: dict[tuple[int, str], int] = {}
    for step in entry.steps:
        for phase, nbytes in step.phase_peaks.items():
            held[(step.index, phase)] = int(nbytes)
    oom = entry.oom
    if oom is not None and oom.step is not None and oom.phase:
        key = (oom.step, oom.phase)
        held[key] = max(held.get(key, 0), oom.allocated_bytes)
    return held


def rank_imbalance(snapshot: Snapshot) -> dict | None:
    """One rank holds 10% or more above every other rank at the same step
    and phase, and that much of the job's peak (work only one rank does,
    such as evaluation on rank 0, is no common moment). It never contradicts the OOM: when a rank ran out of
    memory first, only that rank can be the one that holds more."""
    ranks = [entry for entry in snapshot.ranks if entry.captured and entry.steps]
    if len(ranks) < 2:
        return None
    moments = [held_by_moment(entry) for entry in ranks]
    common = set(moments[0]).intersection(*moments[1:])
    # A difference worth a word is a share of what the job held at its
    # peak, not of a small moment (a few hundred KiB more during setup).
    job_peak = max(max(held.values(), default=0) for held in moments)
    best = None
    for key in sorted(common):
        order = sorted(range(len(ranks)), key=lambda i: moments[i][key], reverse=True)
        high, runner_up = moments[order[0]][key], moments[order[1]][key]
        if runner_up <= 0 or high < (1 + IMBALANCE_SHARE) * runner_up:
            continue
        if high - runner_up < IMBALANCE_SHARE * job_peak:
            continue
        if best is None or high - runner_up > best[1]:
            best = (key, high - runner_up, order)
    if best is None:
        return None
    (step, phase), excess, order = best
    high_entry = ranks[order[0]]
    if snapshot.first_oom_rank is not None and high_entry.rank != snapshot.first_oom_rank:
        return None
    runner_up = moments[order[1]][(step, phase)]
    evidence = [
        f"held per rank at step {step}, {phase} (allocated, in use): "
        + ", ".join(
            f"{_name(entry)} {format_bytes(moments[i][(step, phase)])}"
            for i, entry in sorted(enumerate(ranks), key=lambda pair: pair[1].rank or 0)
        ),
        f"{_name(high_entry)} holds {format_bytes(excess)} ({100.0 * excess / runner_up:.0f}%) "
        "more than the next rank there",
    ]
    category = _largest_difference(high_entry, [ranks[i] for i in order[1:]], step, phase)
    if category:
        evidence.append(
            f"most of the difference is {category[0]}: {format_bytes(category[1])} more "
            f"on {_name(high_entry)} (the breakdowns at the OOM)"
        )
    if high_entry.outcome == "oom":
        evidence.append(f"{_name(high_entry)} is the rank that ran out of memory first")
    data_parallel = _data_parallel_wrappers(snapshot)
    if data_parallel:
        evidence.append("nn.DataParallel gathers every replica's outputs on device 0")
    evidence.append(
        "typical causes: evaluation, logging or a checkpoint gather done on rank 0 only "
        "(tensors kept there: keep .item() numbers, or move them to the CPU); uneven batches "
        "per rank (DistributedSampler, drop_last); nn.DataParallel gathering outputs on device 0"
    )
    summary = (
        f"{_name(high_entry).capitalize()} holds {format_bytes(excess)} more than the other "
        f"ranks at the same step ({step}, {phase})"
    )
    remedy = (
        "# work done on rank 0 only must not keep device tensors:\n"
        "if dist.get_rank() == 0:\n"
        "    history.append(loss.detach().item())   # a number, not a tensor on the GPU\n"
        "# gather checkpoints to the CPU: torch.distributed.checkpoint, or state_dict() then .cpu()"
    )
    fixes = ["ddp"] if data_parallel else []
    return _diagnosis("rank_imbalance", summary, evidence, excess, fixes=fixes, remedy=remedy)


def _largest_difference(
    high: RankEntry, others: list[RankEntry], step: int, phase: str
) -> tuple[str, int] | None:
    """The category that holds most of what the high rank has more of, when
    every rank's breakdown was taken at an OOM at that same step and phase
    (breakdowns taken at different moments do not compare)."""
    entries = [high, *others]
    if not all(
        e.oom and e.breakdown and (e.oom.step, e.oom.phase) == (step, phase) for e in entries
    ):
        return None
    best: tuple[str, int] | None = None
    for category, nbytes in high.breakdown.items() if high.breakdown else ():
        typical = max(o.breakdown.bytes_of(category) for o in others if o.breakdown)
        if nbytes - typical > (best[1] if best else 0):
            best = (category, nbytes - typical)
    return best


def _data_parallel_wrappers(snapshot: Snapshot) -> list[DataParallelWrapper]:
    wrappers = list(snapshot.parallel.data_parallel if snapshot.parallel else [])
    for entry in snapshot.ranks:
        if entry.captured and entry.parallel:
            wrappers += entry.parallel.data_parallel
    return wrappers


def data_parallel(snapshot: Snapshot) -> dict | None:
    """nn.DataParallel: one process drives every GPU and gathers on device 0."""
    wrappers = _data_parallel_wrappers(snapshot)
    if not wrappers:
        return None
    first = wrappers[0]
    devices = first.device_ids
    output_device = first.output_device if first.output_device is not None else 0
    evidence = [
        f"the script calls nn.DataParallel({first.class_name})"
        + (f" over devices {devices}" if devices else ""),
        "DataParallel replicates the model on every step and gathers all outputs (and the loss) "
        f"on device {output_device}, so that device holds more than the others and runs out first",
        "PyTorch recommends DistributedDataParallel even on one machine: one process per GPU, "
        "each holding only its own batch",
    ]
    summary = "nn.DataParallel: device 0 carries the gathered outputs of every GPU; use DDP"
    return _diagnosis("data_parallel", summary, evidence, 0, fixes=["ddp"], remedy=DDP_SNIPPET)


def _ddp_modules(snapshot: Snapshot) -> list[DdpModule]:
    """The job's DDP modules: the snapshot's own, else the first rank's that has some."""
    if snapshot.parallel and snapshot.parallel.ddp:
        return list(snapshot.parallel.ddp)
    for entry in snapshot.ranks:
        if entry.captured and entry.parallel and entry.parallel.ddp:
            return list(entry.parallel.ddp)
    return []


def ddp_buckets(snapshot: Snapshot) -> dict | None:
    """DDP's gradient buckets: a second copy of the gradients unless
    gradient_as_bucket_view=True."""
    modules = _ddp_modules(snapshot)
    if not modules:
        return None
    evidence = []
    extra = 0
    for module in modules:
        sizes = module.bucket_sizes_bytes
        bucket_bytes = sum(sizes) if sizes else module.trainable_parameter_bytes
        measured = "as DDP reports them" if sizes else "estimated: the trainable parameters' bytes"
        cap = module.bucket_cap_bytes
        evidence.append(
            f"DDP({module.class_name}): {len(sizes) if sizes else '?'} bucket(s), "
            f"{format_bytes(bucket_bytes)} in all ({measured})"
            + (f", bucket_cap_mb={cap / MiB:g}" if cap else "")
        )
        if module.gradient_as_bucket_view:
            evidence.append("gradient_as_bucket_view=True: the gradients are views of the buckets")
        else:
            extra += bucket_bytes
            evidence.append(
                "gradient_as_bucket_view=False: every gradient is also copied into a bucket, "
                f"so {format_bytes(bucket_bytes)} more than the gradients themselves"
            )
    peak = snapshot.peak.allocated_bytes if snapshot.peak else None
    if not extra or extra < BUCKET_SHARE_OF_PEAK * (peak or 0):
        return None  # nothing to gain worth a word
    evidence.extend(_bucket_sites(snapshot, modules))
    summary = f"DDP's gradient buckets hold a second copy of the gradients ({format_bytes(extra)})"
    return _diagnosis(
        "ddp_buckets",
        summary,
        evidence,
        extra,
        fixes=["gradient_as_bucket_view"],
        remedy=BUCKET_SNIPPET,
    )


def _bucket_sites(snapshot: Snapshot, modules: list[DdpModule]) -> list[str]:
    """Where the breakdown put the buckets: its communication bytes, and flat
    tensors of a bucket's size among the allocation sites (`communication`;
    in snapshots from before the category, where they were made)."""
    sizes = {size for module in modules for size in module.bucket_sizes_bytes or []}
    found = []
    for site in snapshot.top_allocations:
        shape = site.shape
        if site.bytes in sizes and isinstance(shape, list) and len(shape) == 1:
            location = site.location
            made_at = f"{location.file}:{location.line}" if location else "?"
            found.append(
                f"the bucket is the flat {shape[0]}-element {site.dtype or ''} tensor the "
                f"breakdown counts under {site.category} (made at {made_at})"
            )
    held = snapshot.breakdown.bytes_of(COMMUNICATION)
    if held:
        found.insert(
            0,
            f"communication buffers {snapshot.moment_label}: {format_bytes(held)} "
            "(the buckets, counted apart from the gradients)",
        )
    return found[:3]


def outside_allocator(snapshot: Snapshot) -> dict | None:
    """CUDA: memory of this GPU that PyTorch's allocator does not hold: the
    CUDA context, NCCL's buffers and other processes (pynvml, per rank)."""
    entries: list[tuple[int | None, Device | None, int]] = [
        (entry.rank, entry.device, entry.allocator_reserved_bytes or 0)
        for entry in snapshot.ranks
        if entry.captured
    ] or [(None, snapshot.device, snapshot.allocator.reserved_bytes if snapshot.allocator else 0)]
    worst = None
    for rank, device, reserved in entries:
        if device is None or device.nvml_used_bytes is None or not device.total_bytes:
            continue
        others = sum(process.used_bytes for process in device.other_processes)
        own_outside = max(0, device.nvml_used_bytes - others - reserved)
        outside = own_outside + others
        if worst is None or outside > worst[0]:
            worst = (outside, own_outside, others, reserved, rank, device.total_bytes)
    if worst is None:
        return None
    outside, own_outside, others, reserved, rank, total = worst
    if outside < OUTSIDE_ALLOCATOR_SHARE * total:
        return None
    where = f"rank {rank}'s GPU" if rank is not None else "the GPU"
    evidence = [
        f"{where}: {format_bytes(outside)} of {format_bytes(total)} is used outside PyTorch's "
        f"caching allocator ({format_bytes(reserved)} reserved by it)",
        f"this process, outside the allocator: {format_bytes(own_outside)} (the CUDA context, "
        "NCCL's communication buffers, cuBLAS workspaces)",
    ]
    if others:
        evidence.append(f"other processes on this GPU: {format_bytes(others)}")
    if snapshot.device.capacity_bytes < total:
        evidence.append(
            "--device-memory caps PyTorch's allocator only: this memory comes on top of the cap"
        )
    summary = f"{format_bytes(outside)} of the GPU is held outside PyTorch's allocator (CUDA context, NCCL, other processes)"
    remedy = (
        "# NCCL's buffers: fewer channels / smaller buffers (test the speed):\n"
        "NCCL_BUFFSIZE=2097152 NCCL_MAX_NCHANNELS=4 torchrun ...\n"
        "# other processes: nvidia-smi, and one job per GPU"
    )
    return _diagnosis("outside_allocator", summary, evidence, outside, remedy=remedy)


RULES = (rank_imbalance, data_parallel, ddp_buckets, outside_allocator)


def diagnose_distributed(snapshot: Snapshot) -> list[dict]:
    """Every rule above that fires, largest first."""
    found = [d for d in (rule(snapshot) for rule in RULES) if d is not None]
    return sorted(found, key=lambda d: -d["bytes"])


# How each finding orders against the other diagnoses (see oomdoc.diagnosis).
TIERS = {
    "rank_imbalance": TIER_DECISIVE,
    "data_parallel": TIER_DECISIVE,
    "ddp_buckets": TIER_BREAKDOWN,
    "outside_allocator": TIER_CONTEXT,
}


def rule(snapshot: Snapshot) -> list[Diagnosis]:
    """The data-parallel diagnoses of a snapshot."""
    return [
        Diagnosis(**found, tier=TIERS[found["kind"]]) for found in diagnose_distributed(snapshot)
    ]
