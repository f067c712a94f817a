"""What to replay, in which order, and why not: the fixes worth a replay
for this OOM (each fix in the catalogue, oomdoc.fixes, says whether it
applies and why not), the combination worth measuring after them, the
replays worth starting ahead, and what the replays have measured so far
(ReplayState).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from oomdoc.errors import UsageError
from oomdoc.fixes import FIXES, Combination, Fix, fix_named
from oomdoc.fixes.base import SnippetContext
from oomdoc.model import (
    FixResult,
    Skipped,
    Snapshot,
)
from oomdoc.replay import batch as batch_model
from oomdoc.replay.lanes import (
    SPECULATIVE,
)
from oomdoc.replay.limit_estimate import failing_batch_need
from oomdoc.replay.rank import best_pair
from oomdoc.replay.replayer import (
    Replay,
    Replayer,
)
from oomdoc.script_flags import is_override_key
from oomdoc.sizes import format_bytes

# A fix that saves less than this share of the failing run's need is a no-op:
# it is never combined with another.
NO_OP_SHARE = 0.01


def is_no_op(
    peak_bytes: Optional[int], fits: bool, oom_signature, failing_signature, need: int
) -> bool:
    """A fix that changed (almost) nothing: it saved under 1% of the need when
    it fit, or ran out of memory at the same point, with the same memory in
    use, as the failing run."""
    if fits:
        return peak_bytes is None or need - peak_bytes < NO_OP_SHARE * need
    if oom_signature is None or failing_signature is None:
        return False
    step, phase, requested, allocated = oom_signature
    f_step, f_phase, f_requested, f_allocated = failing_signature
    return (step, phase, requested) == (f_step, f_phase, f_requested) and abs(
        allocated - f_allocated
    ) <= NO_OP_SHARE * max(allocated, f_allocated, 1)


def replayable() -> list[Fix]:
    """The fixes a replay can measure, in the order they are tried."""
    return sorted(FIXES, key=lambda fix: fix.replay_priority)


def parse_fix_names(names: list[str] | None) -> list[str] | None:
    """Validate `--fixes`: catalogue names, or `a+b` for a compatible pair."""
    if not names:
        return None
    known = ", ".join(fix.name for fix in replayable())
    valid = []
    for name in names:
        fix = fix_named(name)
        if fix is None:
            if "+" in name:
                raise UsageError(
                    f"--fixes: {name!r} is not a combination oomdoc can measure (two compatible fixes a+b from: {known})"
                )
            raise UsageError(f"--fixes: unknown fix {name!r} (known: {known}, or a+b)")
        if isinstance(fix, Combination) and any(part.searches_batch for part in fix.parts):
            raise UsageError(
                f"--fixes: {name!r}: combinations are measured at the failing batch size, so "
                f"{next(part.name for part in fix.parts if part.searches_batch)} cannot be part of one"
            )
        valid.append(fix.name)
    return list(dict.fromkeys(valid))


def check_replay_options(
    fixes: str | None,
    replay_timeout_s: float | None,
    batch_arg: str | None,
    replay: bool,
    replay_jobs: int | None = None,
) -> list[str] | None:
    """Validate --fixes, --replay-timeout, --replay-jobs and --batch-arg
    before anything runs."""
    names = (
        [name.strip() for name in fixes.split(",") if name.strip()] if fixes is not None else None
    )
    if fixes is not None and not names:
        raise UsageError("--fixes: give at least one fix name")
    if not replay and names:
        raise UsageError("--fixes has no effect with --no-replay")
    if replay_jobs is not None and (isinstance(replay_jobs, bool) or replay_jobs < 1):
        raise UsageError(f"--replay-jobs must be a positive whole number, not {replay_jobs}")
    if not replay and replay_jobs is not None:
        raise UsageError("--replay-jobs has no effect with --no-replay")
    if replay_timeout_s is not None and not replay_timeout_s > 0:
        raise UsageError(
            f"--replay-timeout must be a positive number of seconds, not {replay_timeout_s:g}"
        )
    if batch_arg is not None and not (
        (batch_arg.startswith("-") and len(batch_arg) >= 2 and "=" not in batch_arg)
        # (a bare word, `batch`, is more likely a flag missing its dashes)
        or (is_override_key(batch_arg) and "." in batch_arg)
    ):
        raise UsageError(
            f"--batch-arg: {batch_arg!r} is not an option name "
            "(e.g. --micro-batch, -b, or a Hydra override's dotted key: data.bs)"
        )
    return parse_fix_names(names)


def plan(snapshot: Snapshot, requested: list[str] | None) -> tuple[list[str], list[Skipped]]:
    """The single fixes worth a replay, and the others with the reason."""
    explicit = set(requested or [])
    names = (
        [name for name in requested if "+" not in name]
        if requested
        else [fix.name for fix in replayable()]
    )
    chosen, skipped = [], []
    for name in names:
        fix = fix_named(name)
        assert fix is not None, name  # --fixes was validated
        if not fix.applies_to(snapshot) and name not in explicit:
            continue
        reason = fix.skip_reason(snapshot, explicit=name in explicit)
        if not reason and fix.rearranges_cache and name not in explicit:
            reason = beyond_the_cache(snapshot)
        if reason:
            skipped.append(Skipped(name, reason))
        else:
            chosen.append(name)
    return chosen, skipped


# How much larger than the failing run's estimate (limit_estimate) the room
# an allocator setting could give must be before it is ruled out: the
# estimate reckons every block alike, which overstates a CNN's later blocks
# (pytorch/examples' ImageNet trainer: 69 estimated, 191 by hand).
CACHE_ALLOWANCE = 4


def beyond_the_cache(snapshot: Snapshot) -> Optional[str]:
    """Why no allocator setting can fit the failing batch, when its first
    forward ran out of memory far from the end: the step needs more than
    CACHE_ALLOWANCE times the room the capacity and the reserved but
    unallocated bytes leave (an allocator setting gives back no more than
    those). On the H200 pytorch/examples' ImageNet trainer (ResNet-50, batch
    1024, 16 GiB) ran out of memory in its first bottleneck with 12.15 GiB
    allocated and 1.36 GiB unallocated: its expandable-segments and
    empty_cache replays ran out of memory after 14 and 18 s, in two of its
    three lanes, before the savers' searches could start. None when one
    might (or the failing run cannot tell)."""
    oom = snapshot.oom
    capacity = snapshot.device.capacity_bytes
    if oom is None or (oom.step or 0) != 0 or oom.phase != "forward" or not capacity:
        return None
    need = failing_batch_need(snapshot, to_come=False)
    if need is None:
        return None
    fixed, batch_bytes = need
    unused = max(0, oom.reserved_bytes - oom.allocated_bytes)
    room = capacity + unused - fixed
    if room > 0 and CACHE_ALLOWANCE * room >= batch_bytes:
        return None
    return (
        f"its first forward ran out of memory early on: by how far it got, the failing "
        f"batch needs about {format_bytes(int(batch_bytes))} beside the "
        f"{format_bytes(fixed)} any batch needs, over {CACHE_ALLOWANCE} times the "
        f"{format_bytes(max(room, 0))} that the capacity and the {format_bytes(unused)} "
        "reserved but unallocated leave: no allocator setting gives back more than those"
    )


LEAK_NO_BATCH_SEARCH = (
    "a leak decides this OOM: a smaller batch only delays it (see the leak diagnosis)"
)


@dataclass
class ReplayState:
    """What the replays of one run have measured so far."""

    skipped: list[Skipped]
    results: list[FixResult] = field(default_factory=list)
    # The replay behind each result, by fix name.
    replays: dict[str, Replay] = field(default_factory=dict)
    # Fixes that ran with the fix in effect (fit or not).
    applied: set[str] = field(default_factory=set)
    search: Optional[batch_model.SearchResult] = None
    batch_info: dict = field(default_factory=dict)
    # What each fix's replay learned for its snippet (blocks, dtype, ...).
    contexts: dict[str, SnippetContext] = field(default_factory=dict)
    # The largest batch under each configuration of memory savers that did
    # not fit at the user's batch (oomdoc.replay.search.search_configurations),
    # by its fixes; and the configurations not searched, with the reason.
    saver_searches: dict[tuple[str, ...], batch_model.SearchResult] = field(default_factory=dict)
    not_searched: dict[tuple[str, ...], str] = field(default_factory=dict)
    # How much the plain largest batch's reserved memory grew a step at the
    # allocator's defaults, when that drift alone refused its certificate
    # (oomdoc.replay.largest_batch): a configuration near it likely drifts too.
    defaults_drift_bytes: int = 0
    # That largest batch's peak.
    defaults_drift_peak_bytes: int = 0


def searches_evaluation_batch(snapshot: Snapshot, info: dict) -> bool:
    """The batch searched is an evaluation's (an OOM in evaluation, searched
    through the script's evaluation option or loader): nothing is
    accumulated. Not once the replays showed the training itself out of
    memory and the search went to the training batch (`training_instead`,
    oomdoc.replay.search.search_batch)."""
    return snapshot.oom_in_evaluation and not info.get("training_instead")


def failing_signature(snapshot: Snapshot) -> Optional[tuple]:
    oom = snapshot.oom
    return (oom.step, oom.phase, oom.requested_bytes, oom.allocated_bytes) if oom else None


def helpful(snapshot: Snapshot, state: ReplayState, name: str) -> bool:
    """The fix applied and saved at least 1% of the failing run's need."""
    replay = state.replays.get(name)
    if name not in state.applied or replay is None:
        return False
    signature = batch_model.observe(replay.capture, 0).oom_signature if replay.capture else None
    return not is_no_op(
        replay.peak_allocated_bytes,
        replay.fits,
        signature,
        failing_signature(snapshot),
        snapshot.oom.needed_bytes if snapshot.oom else 0,
    )


def worth_combining(snapshot: Snapshot, state: ReplayState, name: str) -> bool:
    """A fix the prescription's configurations may hold: one that saved at
    least 1% of the failing run's need, or one that can make a step faster
    (`speeds_up`: bf16 autocast) and applied, whatever it did alone (autocast
    that ran out of memory early in the forward may still fit, and be the
    fastest, beside checkpointing)."""
    fix = fix_named(name)
    if fix is None:
        return False
    return helpful(snapshot, state, name) or (fix.speeds_up and name in state.applied)


def combination_to_measure(snapshot: Snapshot, state: ReplayState) -> Optional[str]:
    """Every memory saver worth combining, together (autocast+checkpointing
    is the pair most likely to fit at the user's own batch); else the two
    helpful fixes with the lowest peaks. Never a fix that saved under 1%
    (unless it can speed a step up)."""
    useful = [
        result
        for result in state.results
        if "+" not in result.name and worth_combining(snapshot, state, result.name)
    ]
    savers = {result.name for result in useful if is_prescribable(result.name)}
    if len(savers) >= 2:
        return "+".join(fix.name for fix in replayable() if fix.name in savers)
    pair = best_pair([result for result in useful if helpful(snapshot, state, result.name)])
    return "+".join(pair) if pair is not None else None


def is_prescribable(name: str) -> bool:
    fix = fix_named(name)
    return fix is not None and fix.prescribable


def start_ahead(
    replayer: Replayer,
    snapshot: Snapshot,
    singles: list[str],
    combinations: list[str],
    automatic: bool,
) -> list[tuple]:
    """With lanes to spare, start now the replays the decisions will ask for
    whatever the others measure: each single fix and each combination asked
    for by name (the batch search is a chain: its probes run in the lane kept
    for what the decisions wait for). With `automatic` choices (no --fixes),
    also every memory saver that shrinks what held memory at the OOM,
    together: the combination most likely to be wanted (a lighter optimizer
    cannot help an OOM before the first optimizer step). Its answer is used
    only when combination_to_measure asks for it. Returns their keys
    (Replayer.ahead)."""
    if replayer.lanes is None:
        return []
    keys = []
    for name in [*singles, *combinations]:
        fix = fix_named(name)
        if fix is None or fix.searches_batch:
            continue
        request = fix.request(snapshot)  # as replay_single asks for it
        keys.append(replayer.ahead(request.payload, fix.name, extra_env=request.env))
    held = snapshot.breakdown
    savers = [
        fix.name
        for name in singles
        if (fix := fix_named(name)) is not None
        and fix.prescribable
        and any(getattr(held, category, 0) for category in fix.addresses)
    ]
    likely = fix_named("+".join(savers)) if automatic and not replayer.leak else None
    if len(savers) >= 2 and likely is not None:
        request = likely.request(snapshot)
        keys.append(
            replayer.ahead(
                request.payload, likely.name, extra_env=request.env, priority=SPECULATIVE
            )
        )
    return [key for key in keys if key is not None]
