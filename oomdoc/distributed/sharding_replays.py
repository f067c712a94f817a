"""Measured sharding for a distributed job that ran out of memory.

After the usual replays, the job is replayed twice more through the same
launcher and world size: with FSDP2 (`fsdp`) in place of DDP, and with
ZeroRedundancyOptimizer (`zero_optimizer`) around the script's optimizer (see
oomdoc.capture.sharding). Their peaks per rank are measured, not estimated,
and join the ranked fixes.
"""

from __future__ import annotations

import os

from oomdoc.distributed.launch import run_distributed_child
from oomdoc.replay.orchestrate import REPLAY_ENV, default_timeout, entry_from, keep_log, measure
from oomdoc.replay.progress import Progress
from oomdoc.replay.rank import rank_fixes
from oomdoc.runner import ChildRequest
from oomdoc.sizes import format_bytes

SNIPPETS = {
    "fsdp": """\
from torch.distributed.fsdp import fully_shard   # torch 2.4-2.5: torch.distributed._composable.fsdp
for block in model.{blocks_path}:                 # instead of DistributedDataParallel(model)
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=lr)   # after sharding""",
    "zero_optimizer": """\
from torch.distributed.optim import ZeroRedundancyOptimizer
optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class={optimizer}, lr=lr)""",
}


def measure_sharding(document: dict, options, request: ChildRequest, stderr) -> None:
    """Replay `fsdp` and `zero_optimizer`; add them to document["fixes"]."""
    dist = options.extra["distributed"]
    replay = document.get("replay") or {}
    oom = document.get("oom") or {}
    max_steps = replay.get("max_steps") or max(int(oom.get("step") or 0) + 1, 2)
    timeout = options.replay_timeout_s or replay.get("timeout_s") or default_timeout(document)
    need = replay.get("baseline_need_bytes") or (
        int(oom.get("allocated_bytes") or 0) + int(oom.get("requested_bytes") or 0)
    )
    reference_s = replay.get("reference_step_s")
    progress = Progress(stderr)
    entries = list(document.get("fixes") or [])
    log_dir = request.artifact_dir or os.getcwd()
    for name in ("fsdp", "zero_optimizer"):
        if options.fixes and name not in options.fixes:
            continue
        if name == "fsdp" and (document.get("device") or {}).get("kind") != "cuda":
            replay.setdefault("skipped", []).append(
                {
                    "name": name,
                    "reason": "CUDA only: FSDP2 frees its gathered parameters by resizing their storage, which the simulated device does not see",
                }
            )
            continue
        if name == "fsdp" and not (document.get("parallel") or {}).get("ddp"):
            replay.setdefault("skipped", []).append(
                {"name": name, "reason": "the script wraps no model in DistributedDataParallel"}
            )
            continue
        if name == "zero_optimizer" and not document.get("optimizers"):
            replay.setdefault("skipped", []).append(
                {"name": name, "reason": "the script creates no optimizer"}
            )
            continue
        log_path = os.path.join(log_dir, f"replay-{name}.log")
        os.makedirs(log_dir, exist_ok=True)
        child = ChildRequest(
            target=request.target,
            args=list(request.args),
            device=request.device,
            capacity_bytes=request.capacity_bytes,
            is_module=request.is_module,
            max_steps=max_steps,
            fix={"name": name},
            extra_env=dict(REPLAY_ENV),
            output_path=log_path,
            timeout_s=timeout,
        )
        progress.start(f"{name} (world size {document.get('world_size')})")
        result = run_distributed_child(child, dist)
        measured = measure(result, name, log_path)
        progress.finish(
            f"fits, peak {format_bytes(measured.peak_allocated_bytes)} per rank"
            if measured.fits
            else measured.outcome
        )
        record = measured.applied.get(name) or {}
        context = {"blocks_path": "blocks", "optimizer": "torch.optim.AdamW"}
        if name == "fsdp":
            sharded = record.get("sharded") or []
            if sharded:
                context["blocks_path"] = sharded[0]["path"]
            detail = f"FSDP2 ({record.get('api')}) in place of DDP: " + (
                ", ".join(f"{s['count']} x {s['class']} in {s['path']}" for s in sharded)
                or "the root only"
            )
        else:
            wrapped = sorted(set(record.get("wrapped") or []))
            if wrapped:
                context["optimizer"] = f"torch.optim.{wrapped[0]}"
            detail = f"ZeroRedundancyOptimizer around {', '.join(wrapped) or 'no optimizer'}"
        detail += f"; measured per rank over {document.get('world_size')} ranks"
        if measured.outcome in ("timeout", "error"):
            measured.log_path = keep_log(log_path, request.artifact_dir)
        elif os.path.exists(log_path):
            os.unlink(log_path)
        entry = entry_from(measured, name, detail, SNIPPETS[name].format(**context))
        if entry["fits"] and entry.get("peak_allocated_bytes") is not None:
            entry["saved_bytes"] = int(need - entry["peak_allocated_bytes"])
            if reference_s and entry.get("step_s"):
                entry["step_time_ratio"] = round(entry["step_s"] / reference_s, 3)
        entries.append(entry)
    document["fixes"] = rank_fixes(entries)
    if document["fixes"] and document.get("replay") is not None:
        document["replay"]["replays"] = int(document["replay"].get("replays") or 0) + sum(
            1 for e in entries if e["name"] in ("fsdp", "zero_optimizer")
        )
