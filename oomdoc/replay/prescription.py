"""Building the prescription: the configuration to use instead, chosen among
measured ones, and the replays that measure it.

A configuration is a set of memory-saving fixes (those that save memory at
any batch size: autocast, checkpointing, a lighter optimizer) and a
micro-batch, with gradient accumulation making up the user's effective
batch. Every candidate was replayed: the failing configuration at the
batches the batch search tried, each fix at the failing batch, the combined
savers at the failing batch and, when that does not fit, at the batches a
second search tried. The prescription is the candidate with the highest
measured training throughput (samples per second at the user's effective
batch) whose peak leaves the safety margin free.

Its micro-batch may be larger than the batch the candidate ran: up to the
largest batch that the candidate's peak and the next batch measured with the
same fixes predict to leave the margin free (`plan_limit`). The replay of the
prescription with its gradient accumulation then measures exactly that.

Here: the candidates and the choice among them (pure), then the replays that
measure the chosen one with its gradient accumulation and with the script's
own flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from oomdoc.diagnosis.leak import rule as leak_rule
from oomdoc.fixes import batch_fix, fix_named
from oomdoc.fixes.base import SnippetContext
from oomdoc.frameworks import context_from_snapshot, framework_of
from oomdoc.frameworks.base import FrameworkContext, accumulation_in_effect, with_enough_steps
from oomdoc.model import (
    FlagsCheck,
    Prescription,
    Snapshot,
    parse,
)
from oomdoc.replay import batch as batch_model
from oomdoc.replay.lanes import (
    SPECULATIVE,
)
from oomdoc.replay.plan import (
    ReplayState,
    is_prescribable,
)
from oomdoc.replay.replayer import (
    Replay,
    Replayer,
    ReplaysInterrupted,
    summarise,
)
from oomdoc.replay.search import (
    batch_size_in,
    saver_first_probe,
    saver_trial,
)
from oomdoc.script_flags import (
    EVAL_BATCH_FLAGS,
)
from oomdoc.sizes import format_bytes


@dataclass
class Candidate:
    """One measured configuration."""

    fixes: list[str]
    batch_size: int  # what the replay ran
    peak_allocated_bytes: int
    step_s: Optional[float]
    label: str = ""
    notes: list[str] = field(default_factory=list)
    # The largest micro-batch a prescription from this candidate may plan
    # (see plan_limits); None: the batch it ran.
    plan_limit: Optional[int] = None

    @property
    def samples_per_second(self) -> Optional[float]:
        if not self.step_s:
            return None
        return self.batch_size / self.step_s


def plan_limits(
    candidates: list[Candidate], points: list[tuple[tuple, int, int]], limit_bytes: int
) -> None:
    """Set each candidate's `plan_limit`: between its batch and the next larger
    batch measured with the same fixes (`points`: (fixes, batch, peak, or the
    need a batch that ran out of memory showed)) whose peak goes past
    `limit_bytes`, the largest batch whose linearly interpolated peak stays
    within it. Peaks grow about linearly with the batch between two measured
    batches; the prescription's own replay checks the one planned."""
    for candidate in candidates:
        if candidate.peak_allocated_bytes > limit_bytes:
            continue
        larger = [
            (batch, peak)
            for fixes, batch, peak in points
            if tuple(fixes) == tuple(candidate.fixes) and batch > candidate.batch_size
        ]
        if not larger:
            continue
        batch, peak = min(larger)
        if peak <= limit_bytes or peak <= candidate.peak_allocated_bytes:
            continue  # that batch is a candidate of its own, or no slope to go by
        per_sample = (peak - candidate.peak_allocated_bytes) / (batch - candidate.batch_size)
        planned = candidate.batch_size + int(
            (limit_bytes - candidate.peak_allocated_bytes) // per_sample
        )
        candidate.plan_limit = max(candidate.batch_size, min(planned, batch - 1))


def choose(
    candidates: list[Candidate],
    original_batch_size: int,
    capacity_bytes: int,
    margin_fraction: float,
    reference: Optional[Candidate],
) -> Optional[Prescription]:
    """The candidate with the highest throughput that leaves the margin free;
    without one, the fitting candidate with the lowest peak (said so)."""
    picked = pick(candidates, capacity_bytes, margin_fraction)
    if picked is None:
        return None
    best, fits = picked
    return prescription_from(
        best, fits, original_batch_size, capacity_bytes, margin_fraction, reference
    )


def pick(
    candidates: list[Candidate], capacity_bytes: int, margin_fraction: float
) -> Optional[tuple[Candidate, bool]]:
    """(the candidate to prescribe, whether it leaves the margin free)."""
    if not candidates:
        return None
    limit = capacity_bytes - int(margin_fraction * capacity_bytes)

    def throughput(candidate: Candidate) -> float:
        return candidate.samples_per_second or 0.0

    within = [c for c in candidates if c.peak_allocated_bytes <= limit]
    if within:
        # Highest throughput; then fewer changes; then the lower peak.
        best = max(within, key=lambda c: (throughput(c), -len(c.fixes), -c.peak_allocated_bytes))
        return best, True
    return min(candidates, key=lambda c: c.peak_allocated_bytes), False


def prescription_from(
    best: Candidate,
    fits: bool,
    original_batch_size: int,
    capacity_bytes: int,
    margin_fraction: float,
    reference: Optional[Candidate],
    accumulates: bool = True,
) -> Prescription:
    """The prescription of one candidate: its micro-batch and accumulation
    keep the user's effective batch (`accumulates`: else the batch that
    fits, an evaluation batch)."""
    margin = int(margin_fraction * capacity_bytes)
    largest = max(best.batch_size, best.plan_limit or 0)
    micro, steps = batch_model.accumulation_plan(
        original_batch_size, min(largest, original_batch_size), accumulates
    )
    ratio = None
    if reference is not None and best.samples_per_second and reference.samples_per_second:
        ratio = round(best.samples_per_second / reference.samples_per_second, 3)
    detail = f"measured in the replay {best.label!r}: peak at batch {best.batch_size}" + (
        f", {best.samples_per_second:.1f} samples/s" if best.samples_per_second else ""
    )
    if not fits:
        detail += f"; no measured configuration leaves the {margin_fraction:.0%} safety margin free"
    prescription = Prescription(
        fixes=list(best.fixes),
        batch_size=micro,
        accumulation_steps=steps,
        peak_allocated_bytes=best.peak_allocated_bytes,
        fits=fits,
        samples_per_second=round(best.samples_per_second, 3) if best.samples_per_second else None,
        measured=True,
        kind="config",
        headroom_bytes=capacity_bytes - best.peak_allocated_bytes,
        margin_bytes=margin,
        throughput_ratio=ratio,
        detail=detail + "".join(f"; {note}" for note in best.notes),
    )
    if best.samples_per_second and micro != best.batch_size:
        # The throughput is the batch the candidate ran, not the micro-batch.
        prescription.throughput_batch_size = best.batch_size
    return prescription


def parameter_update(
    snapshot: Snapshot, search: Optional[batch_model.SearchResult]
) -> Optional[str]:
    """How the script updates its parameters (Snapshot.parameter_update):
    as the failing run showed, else as the largest fitting batch's replay
    did (a run that failed in its first forward ran no backward)."""
    best = search.best_run if search is not None else None
    replay = getattr(best, "replay", None)
    capture = replay.capture if replay is not None else None
    return snapshot.parameter_update or (capture.parameter_update if capture else None)


def prescription_for(
    snapshot: Snapshot, replayer: Replayer, state: ReplayState
) -> Optional[Prescription]:
    """The leak's remedy under a leak; else the measured configuration with
    the highest throughput that leaves the margin free."""
    if replayer.leak:
        leak = leak_rule(snapshot)
        return Prescription(
            fixes=[],
            batch_size=None,
            measured=False,
            fits=False,
            kind="leak",
            detail=(leak.summary if leak else "a leak decides this OOM")
            + "; no configuration fixes a leak: every fix only delays the OOM (see the fixes below)",
            snippet=leak.remedy if leak else None,
        )
    search = state.search
    original = search.original_batch_size if search is not None else None
    candidates: list[Candidate] = []
    reference = None
    best_plain = search.best_run if search is not None else None
    for run in search.trials if search is not None else []:
        if run.fits and run.peak_allocated_bytes is not None and run.replay is not None:
            candidate = Candidate(
                [], run.batch_size, run.peak_allocated_bytes, run.step_s, run.replay.label
            )
            candidates.append(candidate)
            if run is best_plain:
                reference = candidate
    for result in state.results:
        if not result.measured or not result.fits or result.peak_allocated_bytes is None:
            continue
        fix = fix_named(result.name)
        if fix is None or fix.searches_batch:
            continue
        candidates.append(
            Candidate(
                result.parts, original or 1, result.peak_allocated_bytes, result.step_s, result.name
            )
        )
    if state.saver_search is not None and state.saver_fix is not None:
        parts = [part.name for part in state.saver_fix.parts]
        for run in state.saver_search.trials:
            if run.fits and run.peak_allocated_bytes is not None and run.replay is not None:
                candidates.append(
                    Candidate(
                        parts,
                        run.batch_size,
                        run.peak_allocated_bytes,
                        run.step_s,
                        run.replay.label,
                    )
                )
    if original is not None:
        capacity = snapshot.device.capacity_bytes
        margin = float(getattr(replayer.options, "margin_fraction", 0.05))
        plan_limits(candidates, measured_points(state), capacity - int(margin * capacity))
    chosen, interrupted = measured_choice(
        replayer, snapshot, state, candidates, original, reference
    )
    if chosen is None:
        return None
    source = state.batch_info.get("source") or ""
    if snapshot.oom_in_evaluation and source in EVAL_BATCH_FLAGS and chosen.batch_size:
        chosen.evaluation_batch_flag = source
    chosen.snippet = prescription_snippet(snapshot, chosen, state)
    if chosen.fits and not interrupted and not replayer.stopped:
        try:
            verify_with_flags(replayer, snapshot, chosen, state)
        except ReplaysInterrupted:
            pass  # Ctrl-C during the check: the prescription stands without it
    return chosen


def measured_points(state: ReplayState) -> list[tuple[tuple, int, int]]:
    """(fixes, batch, peak) of every batch the searches ran; for a batch that
    ran out of memory, the most it was seen to need."""
    points = []
    searches: list[tuple[tuple, Optional[batch_model.SearchResult]]] = [((), state.search)]
    if state.saver_search is not None and state.saver_fix is not None:
        searches.append((tuple(part.name for part in state.saver_fix.parts), state.saver_search))
    for fixes, search in searches:
        for run in search.trials if search is not None else []:
            peak = run.peak_allocated_bytes
            if not run.fits:
                peak = max([*run.lower_bounds.values(), peak or 0])
            if peak:
                points.append((fixes, run.batch_size, int(peak)))
    return points


# At most this many replays measure a prescription with gradient
# accumulation (the next candidate is tried when one does not fit).
PRESCRIPTION_REPLAYS = 2


def measured_choice(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    candidates: list[Candidate],
    original: Optional[int],
    reference: Optional[Candidate],
) -> tuple[Optional[Prescription], bool]:
    """The prescription among the candidates, and whether Ctrl-C stopped its
    replay. A candidate was measured at one batch without accumulation; when
    its prescription accumulates, one more replay runs exactly the prescribed
    configuration, accumulation included (the later micro-batches' forward
    runs with the earlier ones' gradients alive, which can peak higher): its
    peak is the prescription's. One that then leaves the margin no longer
    free gives way to a smaller micro-batch or the next candidate. A
    micro-batch larger than the candidate's (planned from its `plan_limit`)
    is prescribed only as that replay measured it."""
    capacity = snapshot.device.capacity_bytes
    margin = float(getattr(replayer.options, "margin_fraction", 0.05))
    limit = capacity - int(margin * capacity)
    remaining = list(candidates)
    rejected: list[str] = []
    replays = 0
    interrupted = False

    def prescription_of(candidate: Candidate, fits: bool) -> Prescription:
        return prescription_from(
            candidate,
            fits,
            original or 1,
            capacity,
            margin,
            reference,
            accumulates=not snapshot.oom_in_evaluation,
        )

    while True:
        picked = pick(remaining, capacity, margin)
        if picked is None:
            return None, interrupted
        candidate, fits = picked
        chosen = prescription_of(candidate, fits)
        if original is None:
            chosen.batch_size, chosen.accumulation_steps = None, 1
        if chosen.batch_size is None or (
            chosen.accumulation_steps <= 1 and chosen.batch_size == candidate.batch_size
        ):
            break  # measured as it is prescribed
        micro = chosen.batch_size
        planned = micro > candidate.batch_size
        if planned and (not fits or replays >= PRESCRIPTION_REPLAYS):
            candidate.plan_limit = None  # not measured: only the batch it ran
            continue
        without = f"the peak is batch {candidate.batch_size}'s without accumulation"
        if not fits or replays >= PRESCRIPTION_REPLAYS:
            chosen.accumulation_measured = False
            chosen.detail = f"{chosen.detail}; {without}"
            break
        replays += 1
        # Should the replay with accumulation confirm it, verify_with_flags
        # asks for this one next: it runs beside it.
        start_flags_ahead(replayer, snapshot, state, chosen)
        try:
            replay = replay_prescription(replayer, snapshot, state, chosen)
        except ReplaysInterrupted:
            if planned:
                candidate.plan_limit = None
                chosen = prescription_of(candidate, fits)
            interrupted, chosen.accumulation_measured = True, False
            chosen.detail = (
                f"{chosen.detail}; its replay with accumulation was interrupted: {without}"
            )
            break
        if replay.outcome in ("timeout", "error") and planned:
            candidate.plan_limit = None  # measure the batch it ran instead
            continue
        if replay.outcome in ("timeout", "error"):
            chosen.accumulation_measured = False
            chosen.detail = (
                f"{chosen.detail}; its replay with {chosen.accumulation_steps} accumulation steps "
                f"failed ({replay.message}): {without}"
            )
            break
        if replay.fits and replay.peak_allocated_bytes is not None:
            if replay.peak_allocated_bytes <= limit:
                with_accumulation(chosen, candidate, replay, capacity)
                break
        rejected.append(
            f"{' + '.join(chosen.fixes) or 'no fix'} at batch {chosen.batch_size} x "
            f"{chosen.accumulation_steps} accumulation steps: {summarise(replay)}"
            + ("" if replay.outcome == "grows" else ", over the margin")
        )
        if planned:
            # Plan below the micro-batch that went over, down to the batch it ran.
            below = micro - 1
            candidate.plan_limit = below if below > candidate.batch_size else None
        # With the same fixes, accumulating over a micro-batch at least as
        # large would not fit either (the user's own batch, measured without
        # accumulation, stays a candidate).
        remaining = [
            other
            for other in remaining
            if other.fixes != candidate.fixes or not micro <= other.batch_size < (original or 1)
        ]
    if rejected:
        chosen.detail = (
            f"{chosen.detail}; replayed with accumulation and not prescribed: "
            + "; ".join(rejected)
        )
    return chosen, interrupted


def replay_prescription(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, prescription: Prescription
) -> Replay:
    """One replay of exactly the prescribed configuration: its fixes, its
    micro-batch, and the batch fix's gradient accumulation (batch_fix), long
    enough for two optimizer steps (the script's steps flag raised if need be)."""
    payload, label, args, env, micro_batches, raised = prescription_replay(
        replayer,
        snapshot,
        state,
        prescription.fixes,
        int(prescription.batch_size or 1),
        prescription.accumulation_steps,
    )
    replay = replayer.run(
        payload, label, args=args, extra_env=env, micro_batches_per_step=micro_batches
    )
    prescription.accumulation_replay = replay_record(replay, args, raised)
    return replay


def prescription_replay(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    fixes: list[str],
    micro: int,
    steps: int,
) -> tuple[dict, str, list[str], dict, int, Optional[str]]:
    """(payload, label, args, env, micro-batches per optimizer step, the
    steps flag raised) of the replay of `fixes` at micro-batch `micro` with
    `steps` accumulation steps: one place, so that one started ahead
    (start_savers_ahead) is the one replay_prescription asks for."""
    payload: dict = {"name": batch_fix().name}
    env: dict = {}
    if fixes:
        fix = fix_named("+".join(fixes))
        assert fix is not None
        request = fix.request(snapshot)
        payload, env = dict(request.payload, also=[batch_fix().name]), request.env
    payload.update(batch_size=micro, accumulation_steps=steps)
    rewritten, _flag = batch_size_in(replayer, state, payload, micro)
    args = rewritten if rewritten is not None else list(replayer.request.args)
    micro_batches = steps * accumulation_in_effect(
        args, snapshot.script_options, snapshot.script_option_defaults
    )
    args, raised = enough_steps(replayer, snapshot, args, micro_batches)
    label = f"the prescription ({' + '.join(fixes) or 'no fix'}, batch {micro} x {steps} accumulation steps)"
    return payload, label, args, env, micro_batches, raised


def enough_steps(
    replayer: Replayer, snapshot: Snapshot, args: list[str], micro_batches: int
) -> tuple[list[str], Optional[str]]:
    """args with the script's steps flag raised so that a replay with
    `micro_batches` micro-batches per optimizer step runs its steps, whether
    the script counts optimizer steps or micro-batches."""
    if micro_batches <= 1 or not snapshot.script_options:
        return args, None
    needed = replayer.max_steps * micro_batches
    args, raised = with_enough_steps(
        args, snapshot.script_options, context_from_snapshot(snapshot), needed
    )
    if raised:
        raised += (
            f" so that the replay runs {replayer.max_steps} optimizer steps of "
            f"{micro_batches} micro-batches"
        )
    return args, raised


def accumulation_covered(capture: Optional[Snapshot]) -> bool:
    """Whether a replay ran an optimizer step and then at least two more
    micro-batches (a forward with the gradients and the optimizer state alive)."""
    if capture is None or capture.step_unit != "optimizer":
        return False
    return any(step.index >= 1 and step.forward_calls >= 2 for step in capture.steps)


def replay_record(replay: Replay, args: list[str], raised: Optional[str]) -> dict:
    """A replay of the prescription, for the snapshot: what ran and what it
    measured, and how its steps were made long enough."""
    record: dict[str, Any] = {
        "args": args,
        "outcome": replay.outcome,
        "peak_allocated_bytes": replay.peak_allocated_bytes,
        "accumulation_covered": accumulation_covered(replay.capture),
    }
    if raised:
        record["note"] = raised
    return record


def with_accumulation(
    prescription: Prescription, candidate: Candidate, replay: Replay, capacity: int
) -> None:
    """The prescription's peak as its replay with the accumulation running
    measured it. The throughput stays the candidate's: the same micro-batches
    (a step of the replay also holds the script's data loading and epoch ends,
    which its few steps do not average out)."""
    assert replay.peak_allocated_bytes is not None
    peak = replay.peak_allocated_bytes
    prescription.peak_allocated_bytes = peak
    prescription.headroom_bytes = capacity - peak
    if prescription.accumulation_steps > 1:
        prescription.accumulation_measured = True
    record = prescription.accumulation_replay or {}
    throughput = (
        f", {candidate.samples_per_second:.1f} samples/s" if candidate.samples_per_second else ""
    )
    detail = (
        f"peak measured in the replay {replay.label!r}, with the accumulation running; "
        f"batch {candidate.batch_size} without accumulation in {candidate.label!r}: "
        f"peak {format_bytes(candidate.peak_allocated_bytes)}{throughput}"
    )
    if not record.get("accumulation_covered"):
        detail += "; the replay ended before an optimizer step and two more micro-batches: the peak may be low"
    prescription.detail = detail + "".join(f"; {note}" for note in candidate.notes)


def prescription_context(
    snapshot: Snapshot, prescription: Prescription, state: ReplayState
) -> tuple[list[str], FrameworkContext]:
    """The prescription's changes (the batch change as batch_fix's name) and
    what their replays learned, for the framework units."""
    changes = list(prescription.fixes)
    context = context_from_snapshot(snapshot)
    context["update"] = parameter_update(snapshot, state.search)
    for name in prescription.fixes:
        context.update(state.contexts.get(name) or SnippetContext())
    if prescription.batch_size and prescription.accumulation_steps > 1:
        how = state.batch_info.get("source") or "batch_size"
        changes.append(batch_fix().name)
        context["micro_batch"] = prescription.batch_size
        context["accumulation_steps"] = prescription.accumulation_steps
        context["how"] = how if how.startswith("-") else "batch_size"
    return changes, context


def prescription_snippet(snapshot: Snapshot, prescription: Prescription, state: ReplayState) -> str:
    """The prescribed changes as one block in the framework's own terms."""
    changes, context = prescription_context(snapshot, prescription, state)
    if not changes:
        return ""
    return framework_of(snapshot).prescription_snippet(changes, context)


@dataclass
class FlagsReplay:
    """The script run with its own flags for a prescription's changes."""

    args: list[str]  # the script's argv with those flags
    replayed_args: list[str]  # the same, its steps flag raised if need be
    raised: Optional[str]  # how the steps flag was raised
    covers: list[str]  # the changes the flags make
    micro_batches: int  # micro-batches per optimizer step

    @property
    def label(self) -> str:
        return "the script's own flags: " + " ".join(self.replayed_args)

    @property
    def micro_batches_per_step(self) -> Optional[int]:
        return self.micro_batches if self.micro_batches > 1 else None


def flags_replay(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, prescription: Prescription
) -> Optional[FlagsReplay]:
    """The replay verify_with_flags runs for `prescription` (only its fixes,
    batch size and accumulation steps are read), or None where the script
    has no flag for one of its changes: one place, so that one started ahead
    is the one later asked for."""
    changes, context = prescription_context(snapshot, prescription, state)
    if not changes or not snapshot.script_options:
        return None
    framework = framework_of(snapshot)
    args = list(replayer.request.args)
    covered: list[str] = []
    for change in changes:
        variant = framework.flag_variant(change, args, snapshot.script_options, context)
        if variant is not None:
            args, covered = variant, [*covered, change]
    if len(covered) < len(changes):
        # Without a flag for every change the run is not the prescription
        # (it would lack the others): nothing to verify by the script's flags.
        return None
    micro_batches = 1
    if batch_fix().name in covered:
        micro_batches = accumulation_in_effect(
            args, snapshot.script_options, snapshot.script_option_defaults
        )
    replayed_args, raised = enough_steps(replayer, snapshot, args, micro_batches)
    return FlagsReplay(args, replayed_args, raised, covered, micro_batches)


def start_flags_ahead(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, prescription: Prescription
) -> Optional[tuple]:
    """Start the script's-own-flags replay of a prescription that is likely
    (its replay with accumulation still to confirm it) in a free lane, so
    that it runs beside that replay instead of after it; its key."""
    flags = flags_replay(replayer, snapshot, state, prescription)
    if flags is None:
        return None
    return replayer.ahead(
        None,
        flags.label,
        flags.replayed_args,
        priority=SPECULATIVE,
        micro_batches_per_step=flags.micro_batches_per_step,
    )


def verify_with_flags(
    replayer: Replayer, snapshot: Snapshot, prescription: Prescription, state: ReplayState
) -> None:
    """Where the script has its own command-line flags for the prescribed
    changes (HfArgumentParser's --gradient_checkpointing, --bf16, ...), one
    replay runs the script with those flags and no fix of oomdoc's: its peak
    is reported next to the prescription's."""
    flags = flags_replay(replayer, snapshot, state, prescription)
    if flags is None:
        return
    replay = replayer.run(
        None,
        flags.label,
        args=flags.replayed_args,
        micro_batches_per_step=flags.micro_batches_per_step,
    )
    record = replay_record(replay, flags.args, flags.raised)
    record["covers"] = flags.covers
    if flags.micro_batches <= 1:
        del record["accumulation_covered"]
    checked = prescription.verified_by_flags = parse(FlagsCheck, record)
    if replay.fits and replay.peak_allocated_bytes and prescription.peak_allocated_bytes:
        ratio = replay.peak_allocated_bytes / prescription.peak_allocated_bytes
        checked.peak_ratio = round(ratio, 3)


def start_savers_ahead(
    replayer: Replayer, snapshot: Snapshot, options: Any, state: ReplayState, combination: str
) -> list[Optional[tuple]]:
    """While the combined savers' replay runs: should it not fit at the
    user's batch, the search under them asks first for its probe (known
    from the plain search), and most likely prescribes that probe's
    micro-batch with gradient accumulation, then checks that prescription
    with the script's own flags. All start now in free lanes; their keys
    (probe first), for discard_ahead to keep. Not when one saver
    alone fit with the margin free: together they fit too, and no search
    follows (replays run for nothing compete for the card)."""
    fix = fix_named(combination)
    search = state.search
    capacity = snapshot.device.capacity_bytes
    limit = capacity - int(getattr(options, "margin_fraction", 0.05) * capacity)
    one_fits = any(
        result.fits
        and result.peak_allocated_bytes is not None
        and result.peak_allocated_bytes <= limit
        for result in state.results
        if "+" not in result.name and is_prescribable(result.name)
    )
    if (
        replayer.lanes is None
        or fix is None
        or search is None
        or one_fits
        or not state.batch_info.get("source")
        or not all(is_prescribable(part.name) for part in fix.parts)
    ):
        return []
    probe = saver_first_probe(search)
    if probe < 1:
        return []
    payload, label, args, env = saver_trial(replayer, snapshot, state, fix, probe)
    keys = [replayer.ahead(payload, label, args, env, priority=SPECULATIVE)]
    micro, steps = batch_model.accumulation_plan(
        search.original_batch_size, probe, not snapshot.oom_in_evaluation
    )
    if steps > 1:
        fixes = [part.name for part in fix.parts]
        payload, label, args, env, micro_batches, _raised = prescription_replay(
            replayer, snapshot, state, fixes, micro, steps
        )
        keys.append(
            replayer.ahead(
                payload,
                label,
                args,
                env,
                priority=SPECULATIVE,
                micro_batches_per_step=micro_batches,
            )
        )
        likely = Prescription(fixes=fixes, batch_size=micro, accumulation_steps=steps)
        flags_key = start_flags_ahead(replayer, snapshot, state, likely)
        if flags_key is not None:
            keys.append(flags_key)
    return keys
