"""Replaying the failing step with fixes, in fresh child processes.

Each replay runs the same script with the same arguments on the same device
and capacity, with one fix applied from the start, until the failing step has
completed and at least two full steps have run (the optimizer creates its
state in the first step, so the second usually peaks higher), then the
tracker stops it cleanly. Replays set OOMDOC_REPLAY=1 so that a script can
skip side effects, and send the script's output to a log.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from oomdoc.errors import UsageError
from oomdoc.fixes import CUDA_ONLY, FIXES, REPLAYABLE, combination_parts, fix_info, render_snippet
from oomdoc.replay import batch as batch_model
from oomdoc.replay.progress import Progress
from oomdoc.replay.rank import best_pair, rank_fixes
from oomdoc.runner import ChildRequest, WarmPool, run_child
from oomdoc.sizes import format_bytes

BATCH_FLAGS = ("--batch-size", "--batch_size", "--bs", "--per_device_train_batch_size")
# State per parameter, in parameter sizes, when the optimizer has not stepped yet.
OPTIMIZER_STATE_FACTORS = {
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Adadelta": 2,
    "RMSprop": 1,
    "Adagrad": 1,
}
# Below this share of the capacity, reserved-but-unallocated memory is not worth a replay.
FRAGMENTATION_SHARE = 0.02
OPTIMIZER_SHARE_OF_CAPACITY = 0.10
OPTIMIZER_SHARE_OF_NEED = 0.25
MIN_REPLAY_TIMEOUT_S = 120.0
# Every replay's environment: scripts may skip side effects under
# OOMDOC_REPLAY=1; a replay needs peaks and step times, not allocation sites,
# and without the allocator's history (and the _snapshot() calls it feeds)
# each CUDA replay starts and runs faster.
REPLAY_ENV = {"OOMDOC_REPLAY": "1", "OOMDOC_ALLOCATION_HISTORY": "0"}


def parse_fix_names(names: list[str] | None) -> list[str] | None:
    """Validate `--fixes`: catalogue names, or `a+b` for a compatible pair."""
    if not names:
        return None
    valid = []
    for name in names:
        if name in REPLAYABLE:
            valid.append(name)
            continue
        parts = combination_parts(name)
        if parts is None:
            known = ", ".join(REPLAYABLE)
            if "+" in name:
                raise UsageError(
                    f"--fixes: {name!r} is not a combination oomdoc can measure (two compatible fixes a+b from: {known})"
                )
            raise UsageError(f"--fixes: unknown fix {name!r} (known: {known}, or a+b)")
        if "smaller_batch" in parts:
            raise UsageError(
                f"--fixes: {name!r}: combinations are measured at the failing batch size, so smaller_batch cannot be part of one"
            )
        valid.append("+".join(parts))
    return list(dict.fromkeys(valid))


def check_replay_options(
    fixes: str | None, replay_timeout_s: float | None, batch_arg: str | None, replay: bool
) -> list[str] | None:
    """Validate --fixes, --replay-timeout and --batch-arg before anything runs."""
    names = (
        [name.strip() for name in fixes.split(",") if name.strip()] if fixes is not None else None
    )
    if fixes is not None and not names:
        raise UsageError("--fixes: give at least one fix name")
    if not replay and names:
        raise UsageError("--fixes has no effect with --no-replay")
    if replay_timeout_s is not None and not replay_timeout_s > 0:
        raise UsageError(
            f"--replay-timeout must be a positive number of seconds, not {replay_timeout_s:g}"
        )
    if batch_arg is not None and (
        not batch_arg.startswith("-") or len(batch_arg) < 2 or "=" in batch_arg
    ):
        raise UsageError(
            f"--batch-arg: {batch_arg!r} is not an option name (e.g. --micro-batch or -b)"
        )
    return parse_fix_names(names)


def find_batch_arg(args: list[str], flag: str | None = None) -> tuple[int, str, int] | None:
    """(index of the value, flag, batch size) of the last batch-size flag on
    the command line, as `--batch-size 64` or `--batch-size=64`."""
    flags = (flag,) if flag else BATCH_FLAGS
    found = None
    for index, arg in enumerate(args):
        for name in flags:
            if arg == name and index + 1 < len(args) and args[index + 1].isdigit():
                found = (index + 1, name, int(args[index + 1]))
            elif arg.startswith(name + "=") and arg[len(name) + 1 :].isdigit():
                found = (index, name, int(arg[len(name) + 1 :]))
    return found


def with_batch_size(args: list[str], position: int, flag: str, batch_size: int) -> list[str]:
    rewritten = list(args)
    rewritten[position] = (
        f"{flag}={batch_size}" if rewritten[position].startswith(flag + "=") else str(batch_size)
    )
    return rewritten


@dataclass
class Replay:
    """One replay's outcome, measured."""

    label: str
    outcome: str  # fits | oom | timeout | error
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    step_s: float | None = None
    wall_s: float = 0.0
    capture: dict | None = None
    message: str = ""
    log_path: str | None = None
    applied: dict = field(default_factory=dict)
    warm: bool = False

    def timing(self) -> dict:
        """Where the replay's time went, for the snapshot's replay summary."""
        timings = (self.capture or {}).get("timings") or {}
        return {
            "label": self.label,
            "outcome": self.outcome,
            "wall_s": round(self.wall_s, 2),
            "warm": self.warm,
            **timings,
        }

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"


class ReplaysInterrupted(Exception):
    """Ctrl-C reached a replay: stop replaying, keep what was measured."""


class Replayer:
    """Runs replays like the failing run, with a fix, and measures them."""

    def __init__(
        self, document: dict, options, request: ChildRequest, progress: Progress, pool: WarmPool
    ):
        self.document = document
        self.options = options
        self.request = request
        self.progress = progress
        self.pool = pool
        self.log_dir = pool.log_dir
        oom = document.get("oom") or {}
        self.failing_step = int(oom.get("step") or 0)
        self.max_steps = max(self.failing_step + 1, 2)
        if options.max_steps:
            self.max_steps = min(self.max_steps, max(options.max_steps, 1))
        self.timeout_s = options.replay_timeout_s or default_timeout(document)
        self.replays: list[Replay] = []

    def run(
        self, fix: dict, label: str, args: list[str] | None = None, extra_env: dict | None = None
    ) -> Replay:
        index = len(self.replays) + 1
        log_path = os.path.join(self.log_dir, f"replay-{index}-{fix['name'].replace('+', '-')}.log")
        env = dict(REPLAY_ENV)
        env.update(extra_env or {})
        child = ChildRequest(
            target=self.request.target,
            args=list(self.request.args if args is None else args),
            device=self.request.device,
            capacity_bytes=self.request.capacity_bytes,
            is_module=self.request.is_module,
            max_steps=self.max_steps,
            fix=fix,
            extra_env=env,
            output_path=log_path,
            timeout_s=self.timeout_s,
        )
        self.progress.start(label)
        distributed = (getattr(self.options, "extra", None) or {}).get("distributed")
        if distributed is not None:  # the same launcher and world size (oomdoc.distributed)
            from oomdoc.distributed.launch import run_distributed_child

            result = run_distributed_child(child, distributed)
        else:
            result = run_child(child, pool=self.pool)
        replay = measure(result, label, log_path)
        if not result.timed_out and (
            result.exit_code == 130 or (result.capture or {}).get("outcome") == "interrupted"
        ):
            self.progress.finish("interrupted")
            raise ReplaysInterrupted()
        if replay.outcome in ("timeout", "error"):
            replay.log_path = keep_log(log_path, self.request.artifact_dir)
        self.replays.append(replay)
        self.progress.finish(summarise(replay))
        return replay


def warm_pool(request: ChildRequest) -> WarmPool:
    """Warm children for the replays of `request`, the first one starting now."""
    pool = WarmPool(request.device, REPLAY_ENV)
    pool.fill()
    return pool


def default_timeout(document: dict) -> float:
    """Generous: four times what the failing run's steps took, plus start-up."""
    spent = sum(step.get("duration_s") or 0.0 for step in document.get("steps") or [])
    return max(MIN_REPLAY_TIMEOUT_S, 4 * (spent + 15))


def measure(result, label: str, log_path: str) -> Replay:
    capture = result.capture
    replay = Replay(
        label=label,
        outcome="error",
        wall_s=result.wall_s,
        capture=capture,
        log_path=log_path,
        warm=result.warm,
    )
    if result.timed_out:
        replay.outcome = "timeout"
        replay.message = f"killed after {result.wall_s:.0f} s (--replay-timeout)"
        return replay
    if capture is None:
        replay.message = f"the replay ended without a capture (exit status {result.exit_code})"
        return replay
    replay.applied = capture.get("fix_applied") or {}
    peak = capture.get("peak") or {}
    outcome = capture.get("outcome")
    if outcome == "ok":
        replay.outcome = "fits"
        replay.peak_allocated_bytes = int(peak.get("allocated_bytes") or 0)
        replay.peak_reserved_bytes = int(peak.get("reserved_bytes") or 0)
        replay.step_s = batch_model.median_step_seconds(capture.get("steps") or [])
    elif outcome == "oom":
        oom = capture.get("oom") or {}
        replay.outcome = "oom"
        # What it needed when it failed: a lower bound of its peak.
        replay.peak_allocated_bytes = int(oom.get("allocated_bytes") or 0) + int(
            oom.get("requested_bytes") or 0
        )
        replay.message = f"ran out of memory in step {oom.get('step')} during {oom.get('phase')}"
    else:
        error = capture.get("error") or {}
        replay.message = f"{error.get('type', outcome)}: {error.get('message', '')}".strip().rstrip(
            ":"
        )
    return replay


def summarise(replay: Replay) -> str:
    if replay.outcome == "fits":
        return f"fits, peak {format_bytes(replay.peak_allocated_bytes)}"
    if replay.outcome == "oom":
        return f"out of memory (needs more than {format_bytes(replay.peak_allocated_bytes)})"
    if replay.outcome == "timeout":
        return "timed out"
    return f"failed: {replay.message[:120]}"


# ---------------------------------------------------------------- planning


def optimizer_state_estimate(document: dict) -> int:
    breakdown = document.get("breakdown") or {}
    measured = int(breakdown.get("optimizer_state") or 0)
    parameters = int(breakdown.get("parameters") or 0) or sum(
        m.get("parameters_bytes", 0) for m in document.get("models") or []
    )
    factor = max(
        [OPTIMIZER_STATE_FACTORS.get(name, 0) for name in document.get("optimizers") or []],
        default=0,
    )
    return max(measured, factor * parameters)


def plan(document: dict, requested: list[str] | None) -> tuple[list[str], list[dict]]:
    """The single fixes worth a replay, and the others with the reason."""
    device = document.get("device") or {}
    on_cuda = device.get("kind") == "cuda"
    capacity = int(device.get("capacity_bytes") or 0)
    oom = document.get("oom") or {}
    explicit = set(requested or [])
    names = [name for name in (requested or REPLAYABLE) if "+" not in name]
    chosen, skipped = [], []
    models = document.get("models") or []
    need = int(oom.get("allocated_bytes") or 0) + int(oom.get("requested_bytes") or 0)
    for name in names:
        reason = None
        if name in CUDA_ONLY and not on_cuda:
            reason = "CUDA only: the simulated device has no caching allocator"
        elif name == "expandable_segments":
            unused = int(oom.get("reserved_bytes") or 0) - int(oom.get("allocated_bytes") or 0)
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
            if "expandable_segments:true" in conf:
                reason = "PYTORCH_CUDA_ALLOC_CONF already sets expandable_segments:True"
            elif name not in explicit and unused < FRAGMENTATION_SHARE * capacity:
                reason = (
                    f"only {format_bytes(max(unused, 0))} was reserved but unallocated at the OOM"
                )
        elif name == "checkpointing":
            if not models:
                reason = "no model ran a forward pass before the OOM"
            elif not any(model.get("repeated_blocks") for model in models):
                reason = "the model has no repeated blocks (same-class children of an nn.ModuleList or nn.Sequential)"
        elif name == "autocast" and not models:
            reason = "no model ran a forward pass before the OOM"
        elif name == "lighter_optimizer":
            heavy = [o for o in document.get("optimizers") or [] if o in OPTIMIZER_STATE_FACTORS]
            state = optimizer_state_estimate(document)
            if not heavy:
                optimizers = ", ".join(document.get("optimizers") or []) or "none"
                reason = f"the script's optimizers ({optimizers}) are not Adam-like optimizers with large state"
            elif (
                name not in explicit
                and state < OPTIMIZER_SHARE_OF_CAPACITY * capacity
                and state < OPTIMIZER_SHARE_OF_NEED * need
            ):
                reason = (
                    f"optimizer state (about {format_bytes(state)}) is a small share of the memory"
                )
        if reason:
            skipped.append({"name": name, "reason": reason})
        else:
            chosen.append(name)
    return chosen, skipped


# ---------------------------------------------------------------- the replays


def replay_fixes(
    document: dict, options, request: ChildRequest, stderr=None, pool: WarmPool | None = None
) -> None:
    """Measure the fixes for an OOM and store them, ranked, in `document`.
    `pool`: warm children started earlier (one is made when not given)."""
    import sys

    stderr = stderr or sys.stderr
    own_pool = pool is None
    pool = pool or warm_pool(request)
    requested = parse_fix_names(options.fixes)
    singles, skipped = plan(document, requested)
    combinations = [name for name in (requested or []) if "+" in name]
    progress = Progress(stderr)
    progress.header("replaying the failing step with fixes (OOMDOC_REPLAY=1 is set in replays)")
    replayer = Replayer(document, options, request, progress, pool)
    device = document.get("device") or {}
    entries: list[dict] = []
    search = None
    batch_info: dict = {}
    try:
        try:
            if "smaller_batch" in singles:
                search, batch_info, reason = search_batch(replayer, document, options)
                if reason:
                    skipped.append({"name": "smaller_batch", "reason": reason})
            for name in singles:
                if name == "smaller_batch":
                    continue
                entry = replay_single(replayer, name, device, skipped)
                if entry is not None:
                    entries.append(entry)
            if requested is None:
                pair = best_pair([entry for entry in entries if entry.get("_applied")])
                if pair is not None:
                    combinations.append("+".join(pair))
            for name in combinations:
                entry = replay_single(replayer, name, device, skipped)
                if entry is not None:
                    entries.append(entry)
        except ReplaysInterrupted:
            document.setdefault("notes", []).append(
                "Replays were interrupted: the fixes below are those measured before."
            )
        finish(document, replayer, entries, search, batch_info, skipped, progress)
    except Exception as exc:  # the snapshot of the OOM must be written whatever happens here
        progress.header(f"replays failed: {type(exc).__name__}: {exc}")
        document.setdefault("notes", []).append(
            f"Replays failed ({type(exc).__name__}: {exc}); no fixes were measured."
        )
        document["fixes"], document["max_batch_size"] = [], None
    finally:
        if own_pool:
            pool.close()


def fix_request(name: str, device: dict) -> tuple[dict, dict, dict]:
    """(fix for the child, extra environment, context for the snippet)."""
    fix: dict = {"name": name}
    env: dict = {}
    context: dict = {}
    parts = name.split("+")
    if "autocast" in parts:
        on_cuda = device.get("kind") == "cuda"
        dtype = "bfloat16" if (not on_cuda or device.get("supports_bf16")) else "float16"
        fix.update(device_type="cuda" if on_cuda else "cpu", dtype=dtype)
        context.update(device_type=fix["device_type"], dtype=dtype)
    if "expandable_segments" in parts:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
            p for p in (conf, "expandable_segments:True") if p
        )
    # lighter_optimizer: the child picks the optimizer its torch has (the
    # parent does not import torch) and records it.
    return fix, env, context


def not_applied(name: str, applied: dict) -> str | None:
    """Why a fix changed nothing in the replay, from what the child recorded."""
    for part in name.split("+"):
        record = applied.get(part) or {}
        if part == "autocast" and record.get("already_enabled") and not record.get("regions"):
            return "the script already runs its forward pass under autocast"
        if part == "autocast" and not record.get("regions"):
            return "no model forward pass ran"
        if part == "checkpointing" and not record.get("wrapped"):
            return "no repeated blocks were found to wrap"
        if part == "lighter_optimizer" and not record.get("replaced"):
            return "the script created no Adam-like optimizer"
        if part == "empty_cache" and not record.get("calls"):
            return "CUDA was never initialised in the replay"
    return None


def replay_single(replayer: Replayer, name: str, device: dict, skipped: list) -> dict | None:
    fix, env, context = fix_request(name, device)
    replay = replayer.run(fix, name, extra_env=env)
    reason = not_applied(name, replay.applied) if replay.outcome in ("fits", "oom") else None
    if reason:
        skipped.append({"name": name, "reason": reason})
        return None
    details = []
    for part in name.split("+"):
        record = replay.applied.get(part) or {}
        if part == "autocast":
            details.append(
                f"{record.get('dtype', fix.get('dtype'))} autocast on {record.get('device_type', fix.get('device_type'))}"
            )
            if fix.get("dtype") == "float16":
                details.append("float16 needs torch.amp.GradScaler (loss scaling)")
        elif part == "checkpointing":
            wrapped = record.get("wrapped") or []
            details.append(
                "checkpointed "
                + ", ".join(f"{w['count']} x {w['class']} in {w['path']}" for w in wrapped)
            )
            if wrapped:
                context.update(
                    blocks_path=wrapped[0]["path"],
                    blocks_class=wrapped[0]["class"],
                    blocks_count=wrapped[0]["count"],
                )
        elif part == "lighter_optimizer":
            context["optimizer"] = record.get("optimizer")
            replaced = sorted(set(record.get("replaced") or []))
            details.append(
                f"measured torch.optim.{record.get('optimizer')} in place of {', '.join(replaced)}"
            )
        elif part == "expandable_segments":
            details.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        elif part == "empty_cache":
            details.append("torch.cuda.empty_cache() before each forward pass")
    entry = entry_from(replay, name, "; ".join(details), render_snippet(name, context))
    entry["_applied"] = replay.outcome in ("fits", "oom")
    return entry


def entry_from(replay: Replay, name: str, detail: str, snippet: str) -> dict:
    if replay.outcome != "fits" and replay.message:
        detail = f"{replay.message}; {detail}" if detail else replay.message
    if replay.outcome in ("timeout", "error") and replay.log_path:
        detail += f" (its output: {replay.log_path})"
    return {
        "name": name,
        "title": (fix_info(name).title if fix_info(name) else name),
        "outcome": replay.outcome,
        "fits": replay.fits,
        "peak_allocated_bytes": replay.peak_allocated_bytes,
        "peak_reserved_bytes": replay.peak_reserved_bytes,
        "saved_bytes": None,
        "step_time_ratio": None,
        "step_s": replay.step_s,
        "replay_s": round(replay.wall_s, 2),
        "detail": detail,
        "snippet": snippet,
        "measured": True,
    }


# ---------------------------------------------------------------- batch size


def search_batch(replayer: Replayer, document: dict, options):
    """The largest batch size that fits. Returns (search result or None,
    information for the report, reason when it could not be searched)."""
    args = list(replayer.request.args)
    found = find_batch_arg(args, options.batch_arg)
    baseline = batch_model.observe(document, 0)
    info: dict = {}
    if found is not None:
        position, flag, original = found
        info.update(source=flag, original_batch_size=original)

        def trial(batch_size: int) -> batch_model.BatchRun:
            fix = {"name": "smaller_batch", "batch_mode": "argv", "batch_size": batch_size}
            replay = replayer.run(
                fix,
                f"smaller_batch ({flag} {batch_size})",
                args=with_batch_size(args, position, flag, batch_size),
            )
            return to_batch_run(replay, batch_size)

        runs = []
    else:
        if options.batch_arg:
            replayer.progress.header(
                f"{options.batch_arg} is not on the command line: trying the DataLoader's batch size"
            )
        divisor = batch_model.probe_divisor(document)
        probe_replay = replayer.run(
            {"name": "smaller_batch", "batch_mode": "dataloader", "batch_divisor": divisor},
            f"smaller_batch (DataLoader batch / {divisor})",
        )
        record = probe_replay.applied.get("smaller_batch") or {}
        if probe_replay.outcome in ("fits", "oom") and not record.get("patched"):
            return (
                None,
                info,
                (
                    "the script has no batch-size flag on its command line (--batch-size, --batch_size, --bs, "
                    "--per_device_train_batch_size or one named with --batch-arg) and creates no DataLoader with a batch size"
                ),
            )
        if not record.get("original_batch_size") or not record.get("batch_size"):
            return None, info, f"the first smaller-batch replay failed: {probe_replay.message}"
        original = int(record["original_batch_size"])
        info.update(source="DataLoader", original_batch_size=original)

        def trial(batch_size: int) -> batch_model.BatchRun:
            fix = {
                "name": "smaller_batch",
                "batch_mode": "dataloader",
                "batch_size": batch_size,
                "original_batch_size": original,
            }
            return to_batch_run(
                replayer.run(fix, f"smaller_batch (DataLoader batch {batch_size})"), batch_size
            )

        runs = [to_batch_run(probe_replay, int(record["batch_size"]))]
    if original <= 1:
        return None, info, "the batch size is already 1"
    baseline.batch_size = original
    capacity = int((document.get("device") or {}).get("capacity_bytes") or 0)
    result = batch_model.search_max_batch(
        original,
        capacity,
        [baseline, *runs],
        trial,
        probe=batch_model.first_probe_for(document, original),
    )
    result.trials[:0] = runs  # the DataLoader probe was a trial too
    return result, info, None


def to_batch_run(replay: Replay, batch_size: int) -> batch_model.BatchRun:
    if replay.capture is None or replay.outcome in ("timeout", "error"):
        run = batch_model.BatchRun(
            batch_size=batch_size, fits=False, inconclusive=True, note=replay.message
        )
    else:
        run = batch_model.observe(replay.capture, batch_size)
    run.wall_s = replay.wall_s
    run.replay = replay
    return run


# ---------------------------------------------------------------- results


def reference_step_seconds(document: dict, search) -> tuple[float | None, str]:
    """What a step of the failing run would take if it fit: its own complete
    steady steps when it had any, else the largest fitting smaller batch's
    step scaled per sample."""
    oom_step = (document.get("oom") or {}).get("step")
    steady = [
        s
        for s in document.get("steps") or []
        if 0 < s.get("index", 0) < (oom_step or 0) and s.get("duration_s")
    ]
    if steady:
        return batch_model.median_step_seconds(steady), "the failing run's completed steps"
    if search is not None and search.best_run is not None and search.best_run.step_s:
        best = search.best_run
        return best.step_s * search.original_batch_size / best.batch_size, (
            f"a step at batch size {best.batch_size} scaled to {search.original_batch_size} samples (an estimate)"
        )
    return None, "no step of the failing configuration completed"


def smaller_batch_entry(search, info: dict, reference_s: float | None) -> dict | None:
    best = search.best_run
    if best is None:
        last = search.trials[-1] if search.trials else None
        replay = getattr(last, "replay", None) if last else None
        if replay is None:
            return None
        entry = entry_from(
            replay,
            "smaller_batch",
            search.stopped or "no smaller batch fits",
            FIXES["smaller_batch"].snippet,
        )
        entry["fits"] = False
        return entry
    original = search.original_batch_size
    maximum = search.max_batch_size
    micro, steps = batch_model.accumulation_plan(original, maximum)
    how = info.get("source", "batch size")
    how_text = f"{how} {maximum}" if how.startswith("-") else f"DataLoader(batch_size={maximum})"
    exactness = (
        f"exact: {maximum + 1} ran out of memory"
        if search.exact
        else f"not proven exact: {search.stopped}"
    )
    detail = (
        f"largest batch that fits: {maximum} ({exactness}; {len(search.trials)} replays); "
        f"keep the effective batch of {original} with {steps} accumulation steps of {micro}"
    )
    snippet = render_snippet(
        "smaller_batch",
        {
            "micro_batch": micro,
            "accumulation_steps": steps,
            "how": how if how.startswith("-") else "batch_size",
        },
    )
    entry = entry_from(best.replay, "smaller_batch", detail, snippet)
    entry.update(
        max_batch_size=maximum, micro_batch_size=micro, accumulation_steps=steps, how=how_text
    )
    if reference_s and best.step_s:
        # Accumulation processes the original batch in `steps` micro-steps.
        entry["step_time_ratio"] = round(steps * best.step_s * (micro / maximum) / reference_s, 3)
    return entry


def sharding_estimate(static: dict) -> dict:
    """Per-rank bytes saved by sharding over 2, 4 and 8 GPUs, from the
    breakdown (an estimate: communication buffers and the gathered layer of
    FSDP are not counted)."""
    parameters, gradients, state = (
        static.get(k, 0) for k in ("parameters", "gradients", "optimizer_state")
    )
    stages = {
        "zero1_optimizer_state": state,
        "zero2_plus_gradients": state + gradients,
        "fsdp_full_shard": state + gradients + parameters,
    }
    return {
        stage: {str(n): int(total * (1 - 1 / n)) for n in (2, 4, 8)}
        for stage, total in stages.items()
    }


def static_breakdown(document: dict, replayer: Replayer) -> dict:
    """Parameters, gradients and optimizer state at their largest, from the
    failing run and every replay that kept the script's optimizer."""
    static = {
        key: int((document.get("breakdown") or {}).get(key) or 0)
        for key in ("parameters", "gradients", "optimizer_state")
    }
    for replay in replayer.replays:
        if (
            replay.capture is None
            or "lighter_optimizer" in replay.applied
            or "smaller_batch" not in replay.applied
        ):
            continue
        breakdown = replay.capture.get("breakdown") or {}
        for key in static:
            static[key] = max(static[key], int(breakdown.get(key) or 0))
    if not static["optimizer_state"]:
        static["optimizer_state"] = optimizer_state_estimate(document)
    if not static["gradients"]:
        static["gradients"] = static["parameters"]
    return static


def finish(document, replayer, entries, search, batch_info, skipped, progress) -> None:
    oom = document.get("oom") or {}
    lower_bound = int(oom.get("allocated_bytes") or 0) + int(oom.get("requested_bytes") or 0)
    need, estimated = lower_bound, False
    if search is not None and search.model is not None:
        predicted = search.model.need(search.original_batch_size)
        if predicted is not None and predicted > lower_bound:
            need, estimated = int(predicted), True
    reference_s, reference_text = reference_step_seconds(document, search)
    if search is not None:
        entry = smaller_batch_entry(search, batch_info, reference_s)
        if entry is not None:
            entries.insert(0, entry)
    for entry in entries:
        if entry["fits"] and entry.get("peak_allocated_bytes") is not None:
            entry["saved_bytes"] = int(need - entry["peak_allocated_bytes"])
            if entry["name"] != "smaller_batch" and reference_s and entry.get("step_s"):
                entry["step_time_ratio"] = round(entry["step_s"] / reference_s, 3)
        if entry["name"] == "lighter_optimizer":
            static = static_breakdown(document, replayer)
            estimate = sharding_estimate(static)
            entry["sharding_estimate"] = {"per_rank_saved_bytes": estimate, "basis": static}
            full = estimate["fsdp_full_shard"]
            entry["detail"] += (
                "; ESTIMATE (not measured), per-rank saving of sharding over 2/4/8 GPUs: "
                f"ZeRO-1 {'/'.join(format_bytes(v) for v in estimate['zero1_optimizer_state'].values())}, "
                f"ZeRO-2 {'/'.join(format_bytes(v) for v in estimate['zero2_plus_gradients'].values())}, "
                f"FSDP/ZeRO-3 {'/'.join(format_bytes(v) for v in full.values())}"
            )
        entry.pop("_applied", None)
    document["fixes"] = rank_fixes(entries)
    document["max_batch_size"] = (
        search.max_batch_size if search is not None and search.exact else None
    )
    summary = {
        "replays": len(replayer.replays),
        "total_s": round(progress.total(), 2),
        "max_steps": replayer.max_steps,
        "timeout_s": replayer.timeout_s,
        "baseline_need_bytes": int(need),
        "baseline_need_estimated": estimated,
        "reference_step_s": reference_s,
        "reference": reference_text,
        "skipped": skipped,
        "runs": [replay.timing() for replay in replayer.replays],
    }
    if search is not None:
        summary["batch_search"] = {
            "source": batch_info.get("source"),
            "original_batch_size": search.original_batch_size,
            "max_batch_size": search.max_batch_size,
            "exact": search.exact,
            "trials": [[run.batch_size, run.fits] for run in search.trials],
            "stopped": search.stopped or None,
        }
    document["replay"] = summary
    progress.header(f"{len(replayer.replays)} replays in {progress.total():.1f} s")


def keep_log(log_path: str, artifact_dir: str | None) -> str | None:
    """A replay that failed or hung keeps its output next to the snapshot."""
    if not artifact_dir or not os.path.exists(log_path):
        return None
    os.makedirs(artifact_dir, exist_ok=True)
    destination = os.path.join(artifact_dir, os.path.basename(log_path))
    shutil.copyfile(log_path, destination)
    return destination
