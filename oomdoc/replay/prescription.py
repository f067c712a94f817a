"""Building the prescription: the configuration to use instead, chosen among
measured ones, and the replays that measure it.

A configuration is a set of memory-saving fixes (those that save memory at
any batch size: autocast, checkpointing, a lighter optimizer) and a
micro-batch, with gradient accumulation making up the user's effective
batch. Every candidate was replayed: the failing configuration at the
batches the batch search tried, each fix at the failing batch, the combined
savers at the failing batch and, when that does not fit, at the batches a
second search tried. The prescription is the candidate with the highest
measured training throughput whose peak leaves the safety margin free.

Its micro-batch may be larger than the batch the candidate ran: up to the
largest batch that the candidate's peak and the next batch measured with the
same fixes predict to leave the margin free (`plan_limit`), which the
prescription's replay with its gradient accumulation then measures.

Here: the candidates, the choice, the replays that measure it; its snippet
and its replay with the script's own flags (which, where they run out of
memory, send the choice to the next configuration) are oomdoc.replay.own_flags.
"""

from __future__ import annotations

from typing import Callable, Optional

from oomdoc.diagnosis.leak import rule as leak_rule
from oomdoc.fixes import Fix, batch_fix, fix_named
from oomdoc.frameworks.base import accumulation_in_effect
from oomdoc.model import (
    Prescription,
    Snapshot,
)
from oomdoc.replay import batch as batch_model
from oomdoc.replay.accumulated import (
    claimed_peak,
    held_gradients_peak,
    measured_as_prescribed,
    uncovered_note,
)
from oomdoc.replay.candidates import (
    Candidate,
    considered,
    pick,
    plan_below,
    plan_limits,
    planned_below,
    prescription_from,
)
from oomdoc.replay.certificate import certify_choice
from oomdoc.replay.evaluation_batch import training_batch_size
from oomdoc.replay.flags_choice import choose_with_flags
from oomdoc.replay.fragmentation import (
    certify_with_expandable_segments,
    expandable_applies,
    expandable_left_out,
    with_expandable_segments,
)
from oomdoc.replay.lanes import SPECULATIVE
from oomdoc.replay.own_flags import (
    enough_steps,
    prescription_snippet,
    replay_record,
    start_flags_ahead,
    verify_with_flags,
)
from oomdoc.replay.plan import (
    ReplayState,
    searches_evaluation_batch,
)
from oomdoc.replay.replayer import (
    Replay,
    Replayer,
    ReplaysInterrupted,
    summarise,
)
from oomdoc.replay.search import (
    batch_size_in,
    extra_savers,
    fewer_savers,
    micro_batches,
    saver_configurations,
)
from oomdoc.replay.timing import RETIME_NOISE, pooled
from oomdoc.script_flags import (
    EVAL_BATCH_FLAGS,
)


def prescription_for(
    snapshot: Snapshot, replayer: Replayer, state: ReplayState
) -> Optional[Prescription]:
    """The leak's remedy under a leak; else the measured configuration with
    the highest throughput that leaves the margin free."""
    leaking = next((replay for replay in replayer.replays if replay.leaks is not None), None)
    if replayer.leak or leaking is not None:
        # A leak the failing run showed, or one only the replays ran long
        # enough to show (its rule on that replay's capture).
        leak = leak_rule(snapshot)
        if leak is None and leaking is not None and leaking.capture is not None:
            leak = leak_rule(leaking.capture)
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
    for fixes, searched in [((), search), *state.saver_searches.items()]:
        for run in searched.trials if searched is not None else []:
            if run.fits and run.peak_allocated_bytes is not None and run.replay is not None:
                candidate = Candidate(
                    list(fixes),
                    run.batch_size,
                    run.peak_allocated_bytes,
                    run.step_s,
                    run.replay.label,
                    step_noise=run.step_noise,
                    capture=run.replay.capture,
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
        replay = state.replays.get(result.name)
        candidates.append(
            Candidate(
                result.parts,
                original or 1,
                result.peak_allocated_bytes,
                result.step_s,
                result.name,
                step_noise=replay.step_noise if replay is not None else None,
                exact=True,  # at the user's batch, as it is prescribed
                remeasure=remeasure_fix(replayer, snapshot, fix),
                capture=replay.capture if replay is not None else None,
            )
        )
    if original is not None:
        capacity = snapshot.device.capacity_bytes
        margin = float(getattr(replayer.options, "margin_fraction", 0.05))
        limit = capacity - int(margin * capacity)
        points = measured_points(state)
        plan_limits(candidates, points, limit)
        if not searches_evaluation_batch(snapshot, state.batch_info):
            candidates += planned_below(candidates, points, original, limit)
        candidates += untimed_savers(
            state, original, not searches_evaluation_batch(snapshot, state.batch_info)
        )
    if searches_evaluation_batch(snapshot, state.batch_info):
        trained = training_batch_size(snapshot)
        for candidate in candidates:
            candidate.trained_per_step = trained
    measured: list[Candidate] = []
    capacity = snapshot.device.capacity_bytes
    limit = capacity - int(float(getattr(replayer.options, "margin_fraction", 0.05)) * capacity)
    return choose_with_flags(
        replayer,
        candidates,
        limit,
        lambda pool: measured_choice(
            replayer, snapshot, state, pool, original, reference, measured
        ),
        lambda chosen: complete_choice(
            replayer, snapshot, state, chosen, candidates + measured, original
        ),
        lambda chosen: verify_with_flags(replayer, snapshot, chosen, state),
    )


def complete_choice(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    chosen: Prescription,
    weighed: list[Candidate],
    original: Optional[int],
) -> None:
    """What a choice's report holds besides its measurement (weighed, certified, snippet)."""
    evaluation = searches_evaluation_batch(snapshot, state.batch_info)
    if original is not None and chosen.kind == "config":
        capacity = snapshot.device.capacity_bytes
        limit = capacity - int(float(getattr(replayer.options, "margin_fraction", 0.05)) * capacity)
        chosen.considered = considered(
            [(), *saver_configurations(snapshot, state), *state.not_searched],
            weighed,
            chosen,
            state.not_searched,
            original,
            limit,
            accumulates=not evaluation,
        )
    if chosen.fits and chosen.kind == "config" and getattr(replayer.options, "whole_run", True):
        # (--first-batches replays the data as it comes: no certificate)
        chosen.certificate = certify_choice(
            chosen, weighed, snapshot, snapshot.device.capacity_bytes
        )
        certify_with_expandable_segments(
            chosen,
            snapshot,
            # Its certificate is read, never its step times.
            lambda trial: replay_prescription(replayer, snapshot, state, trial, timed=False),
            getattr(replayer.options, "fixes", None),
            ahead=lambda trial: start_flags_ahead(replayer, snapshot, state, trial),
        )
    source = state.batch_info.get("source") or ""
    if evaluation and source in EVAL_BATCH_FLAGS and chosen.batch_size:
        chosen.evaluation_batch_flag = source
    chosen.snippet = prescription_snippet(snapshot, chosen, state)


def untimed_savers(state: ReplayState, original: int, accumulates: bool) -> list[Candidate]:
    """A candidate for each configuration of savers whose search found no
    batch that fits above the plain largest batch, at the micro-batch that
    batch gives: assumed to fit there (a saver takes memory away), its
    throughput unknown, so measured before it can be prescribed; unless it
    cannot be faster than a configuration with fewer of its savers at a
    micro-batch as large (the rest only adding work), said in not_searched."""
    search = state.search
    plain = search.best_run if search is not None else None
    if search is None or plain is None or plain.peak_allocated_bytes is None:
        return []
    micro, _steps = batch_model.accumulation_plan(original, plain.batch_size, accumulates)
    known = micro_batches(state)
    untimed = []
    for fixes, searched in state.saver_searches.items():
        if any(run.fits for run in searched.trials):
            continue
        for smaller, smaller_micro in known.items():
            if fewer_savers(smaller, fixes) and smaller_micro >= micro:
                extra = extra_savers(smaller, fixes)
                state.not_searched[fixes] = (
                    f"no batch above {plain.batch_size} fit under it, and at micro-batches of "
                    f"{micro} {' + '.join(extra)} only adds work to {' + '.join(smaller) or 'no fix'}"
                )
                break
        else:
            untimed.append(
                Candidate(
                    list(fixes),
                    micro,
                    plain.peak_allocated_bytes,
                    None,
                    f"{' + '.join(fixes)} at no fix's batch {plain.batch_size}",
                    notes=[
                        f"no batch above {plain.batch_size} fit under it: measured at the "
                        "micro-batch no fix's largest batch gives"
                    ],
                    untimed=True,
                )
            )
    return untimed


def measured_points(state: ReplayState) -> list[tuple[tuple, int, int]]:
    """(fixes, batch, peak) of every batch the searches ran; for a batch that
    ran out of memory, the most it was seen to need."""
    points = []
    searches: list[tuple[tuple, Optional[batch_model.SearchResult]]] = [
        ((), state.search),
        *state.saver_searches.items(),
    ]
    for fixes, search in searches:
        for run in search.trials if search is not None else []:
            peak = run.peak_allocated_bytes
            if not run.fits:
                peak = max([*run.lower_bounds.values(), peak or 0])
            if peak:
                points.append((fixes, run.batch_size, int(peak)))
    return points


# At most this many replays measure a prescription with gradient
# accumulation (the next candidate is tried when one does not fit, or when
# one measured slower than another could be).
PRESCRIPTION_REPLAYS = 4


def measured_choice(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    candidates: list[Candidate],
    original: Optional[int],
    reference: Optional[Candidate],
    measured: Optional[list[Candidate]] = None,
) -> tuple[Optional[Prescription], bool]:
    """The prescription among the candidates, and whether Ctrl-C stopped its
    replay (the candidates it measured as prescribed, and those it planned
    on the way, are added to `measured`: the report lists what was weighed).

    A candidate was measured at one batch without accumulation; when
    its prescription accumulates, one more replay runs exactly the prescribed
    configuration, accumulation included (the later micro-batches' forward
    runs with the earlier ones' gradients alive, which can peak higher): its
    peak and its throughput are the prescription's. The throughput at the
    batch a candidate ran bounds the one at a smaller micro-batch from above,
    so once measured a candidate may give way to another that can still be
    faster: the choice is made again until the one picked was measured as it
    is prescribed. One that leaves the margin no longer free gives way to a
    smaller micro-batch or the next candidate. A micro-batch larger than the
    candidate's (planned from its `plan_limit`) is prescribed only as that
    replay measured it."""
    capacity = snapshot.device.capacity_bytes
    margin = float(getattr(replayer.options, "margin_fraction", 0.05))
    limit = capacity - int(margin * capacity)
    remaining = list(candidates)
    rejected: list[str] = []
    replays = retimes = 0
    points = measured_points(state)
    interrupted = False
    unmeasured_note = ""
    # The replays started ahead to check each choice measured, by its configuration.
    checks: dict[tuple, list] = {}
    # The configurations measured as prescribed within the margin: should
    # the flags rule (flags_choice) come back to one, its checks that have run
    # are kept for it (on the H200 a Lightning encoder's own-flags run, 489.9
    # samples/s, was thrown away with its choice, measured slower, 321.1).
    fitting: set[tuple] = set()
    accumulates = not searches_evaluation_batch(snapshot, state.batch_info)

    def prescription_of(candidate: Candidate, fits: bool) -> Prescription:
        return prescription_from(
            candidate,
            fits,
            original or 1,
            capacity,
            margin,
            reference,
            accumulates=accumulates,
        )

    while True:
        picked = pick(remaining, capacity, margin, original, accumulates)
        if picked is None:
            return None, interrupted
        candidate, fits = picked
        chosen = prescription_of(candidate, fits)
        if original is None:
            chosen.batch_size, chosen.accumulation_steps = None, 1
        if candidate.exact:
            if retimes < RETIMES and close_rival(candidate, remaining, limit):
                retimes += 1
                try:
                    retime(candidate)
                except ReplaysInterrupted:
                    interrupted = True
                continue  # chosen again with the timing pooled
            if candidate.accumulation_record is not None:
                with_accumulation(chosen, candidate, capacity)
            break
        out_of_replays = replays >= PRESCRIPTION_REPLAYS or interrupted
        if out_of_replays and any(
            other.exact and other.peak_allocated_bytes <= limit for other in remaining
        ):
            # No replay left to measure a bound: the measured ones decide.
            remaining = [other for other in remaining if other.exact]
            continue
        if candidate.untimed and (out_of_replays or not fits):
            remaining.remove(candidate)  # never prescribed unmeasured
            continue
        if chosen.batch_size is None or (
            chosen.accumulation_steps <= 1
            and chosen.batch_size == candidate.batch_size
            and not candidate.untimed
        ):
            break  # measured as it is prescribed
        micro = chosen.batch_size
        planned = micro > candidate.batch_size
        if planned and (not fits or replays >= PRESCRIPTION_REPLAYS):
            candidate.plan_limit = None  # not measured: only the batch it ran
            continue
        without = f"the peak is batch {candidate.batch_size}'s without accumulation"
        if not fits or replays >= PRESCRIPTION_REPLAYS or interrupted:
            chosen.accumulation_measured = False
            chosen.detail = f"{chosen.detail}; {unmeasured_note or without}"
            break
        replays += 1
        # Should the replay with accumulation confirm it, these are asked
        # for next: they run beside it. Those of an earlier choice stay:
        # measured again after this one, it may still be prescribed (on the
        # H100 the first choice was, after a noisy runner-up).
        if configuration_of(chosen) not in checks:
            checks[configuration_of(chosen)] = start_checks_ahead(replayer, snapshot, state, chosen)
        if replays < PRESCRIPTION_REPLAYS and not checks[configuration_of(chosen)]:
            # Should this one be measured slower, or not fit, the next choice
            # is asked for next: it starts ahead too, but only on a device
            # that no check of this one shares. A runner-up's timed steps
            # take the device in turns with the choice's replay and its
            # checks: on the H100 the HF Trainer's (autocast + checkpointing
            # 16 x 2) was never used, and the prescription's replays took
            # 16.0 to 18.5 s with it, 12.0 to 12.7 s without (alternating
            # runs), the choice's own throughput measured 64.9 against 77.9
            # samples/s. With step times of shapes met before
            # (timing.timed_steps) the first choice held in 14 of 14 H100
            # diagnoses of that script.
            others = [other for other in remaining if other is not candidate]
            runner_up = pick(others, capacity, margin, original, accumulates)
            if runner_up is not None and not runner_up[0].exact and runner_up[1]:
                start_prescription_ahead(
                    replayer, snapshot, state, runner_up[0], prescription_of(*runner_up)
                )
        try:
            replay = replay_prescription(replayer, snapshot, state, chosen)
        except ReplaysInterrupted:
            if planned:
                candidate.plan_limit = None
            interrupted = True
            unmeasured_note = f"its replay with accumulation was interrupted: {without}"
            continue
        if replay.outcome in ("timeout", "error") and planned:
            candidate.plan_limit = None  # measure the batch it ran instead
            continue
        if replay.outcome in ("timeout", "error") and candidate.untimed:
            remaining.remove(candidate)  # never prescribed unmeasured
            candidate.rejected = summarise(replay)
            rejected.append(
                f"{' + '.join(chosen.fixes)} at batch {chosen.batch_size} x "
                f"{chosen.accumulation_steps} accumulation steps: {candidate.rejected}"
            )
            continue
        if replay.outcome in ("timeout", "error"):
            chosen.accumulation_measured = False
            chosen.detail = (
                f"{chosen.detail}; its replay with {chosen.accumulation_steps} accumulation steps "
                f"failed ({replay.message}): {without}"
            )
            break
        covered = (chosen.accumulation_replay or {}).get("accumulation_covered")
        guessed = candidate.planned_from is not None or candidate.untimed
        if (
            replay.fits
            and guessed
            and chosen.accumulation_steps > 1
            and not covered
            and held_gradients_peak(replay) is None
        ):
            # A micro-batch no batch search ran: only a replay that ran an
            # optimizer step and two more micro-batches shows its peak (the
            # later forwards run with the gradients alive), or for a script
            # that updates by hand its own peak and the gradients'.
            remaining.remove(candidate)
            candidate.rejected = (
                "its replay ended before an optimizer step and two more micro-batches, "
                "so its peak is not known"
            )
            rejected.append(
                f"{' + '.join(chosen.fixes) or 'no fix'} at batch {chosen.batch_size} x "
                f"{chosen.accumulation_steps} accumulation steps: {candidate.rejected}"
            )
            continue
        if replay.fits and replay.peak_allocated_bytes is not None:
            if claimed_peak(candidate, chosen, replay) <= limit:
                # Measured as prescribed: it takes the place of the bound,
                # and the choice is made again.
                exact = measured_as_prescribed(candidate, chosen, replay)
                exact.remeasure = remeasure_prescription(replayer, snapshot, state, chosen)
                remaining.remove(candidate)
                remaining.append(exact)
                candidate.measured_as = exact
                fitting.add(configuration_of(chosen))
                if measured is not None:
                    measured.append(exact)
                continue
        rejected.append(
            f"{' + '.join(chosen.fixes) or 'no fix'} at batch {chosen.batch_size} x "
            f"{chosen.accumulation_steps} accumulation steps: {summarise(replay)}"
            + ("" if replay.outcome == "grows" else ", over the margin")
        )
        over = None
        if replay.fits and replay.peak_allocated_bytes is not None:
            over = measured_as_prescribed(candidate, chosen, replay)
            if measured is not None:
                measured.append(over)  # for the report: measured, over the margin
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
            if other.fixes != candidate.fixes
            or other.exact
            or not micro <= other.batch_size < (original or 1)
        ]
        if (
            over is not None
            and original
            and not searches_evaluation_batch(snapshot, state.batch_info)
        ):
            # The next smaller micro-batch of the same fixes, down from this one.
            if not any(
                other.fixes == candidate.fixes and other.peak_allocated_bytes <= limit
                for other in remaining
            ):
                smaller = plan_below(over, points, original, limit)
                if smaller is not None:
                    remaining.append(smaller)
                    if measured is not None:
                        measured.append(smaller)  # weighed, as the report says
    if rejected:
        chosen.detail = (
            f"{chosen.detail}; replayed with accumulation and not prescribed: "
            + "; ".join(rejected)
        )
    for configuration, keys in checks.items():
        if configuration != configuration_of(chosen):
            # Another configuration's: no check asks for them, unless the
            # flags rule comes back to one measured within the margin
            # (flags_choice): what of its checks has run is kept for it.
            replayer.discard(keys, keep_finished=configuration in fitting)
    return chosen, interrupted


def configuration_of(prescription: Prescription) -> tuple:
    """What makes two prescriptions the same configuration to replay."""
    return (tuple(prescription.fixes), prescription.batch_size, prescription.accumulation_steps)


# At most this many candidates are timed again (oomdoc.replay.timing.RETIME_NOISE).
RETIMES = 2


def close_rival(candidate: Candidate, others: list[Candidate], limit_bytes: int) -> bool:
    """Whether `candidate`'s timing is noisy (over RETIME_NOISE, never taken
    again) and another candidate within the limit is within that noise of
    it: which one is faster is then not yet known."""
    noise = candidate.step_noise
    speed = candidate.samples_per_second
    if candidate.retimed or candidate.remeasure is None or noise is None or not speed:
        return False
    if noise <= RETIME_NOISE:
        return False
    return any(
        other is not candidate
        and other.peak_allocated_bytes <= limit_bytes
        and (other.samples_per_second or 0.0) >= speed * (1 - noise)
        for other in others
    )


def retime(candidate: Candidate) -> None:
    """Run the candidate's replay once more and pool the two timings."""
    assert candidate.remeasure is not None
    candidate.retimed = True
    replay = candidate.remeasure()
    steps = max(1, candidate.accumulation_steps)
    if not replay.fits or not replay.step_s or not candidate.step_s:
        candidate.notes.append(f"timed again: {summarise(replay)}, no second timing")
        return
    first = candidate.step_s
    candidate.step_s, candidate.step_noise = pooled(
        first, candidate.step_noise, replay.step_s / steps, replay.step_noise
    )
    candidate.notes.append(
        f"timed twice (its first timing was noisy): {first:.4g} s and "
        f"{replay.step_s / steps:.4g} s per batch of {candidate.batch_size}"
    )


def remeasure_fix(replayer: Replayer, snapshot: Snapshot, fix: Fix) -> Callable[[], Replay]:
    """The replay of `fix` at the user's batch again (for retime)."""
    request = fix.request(snapshot)
    return lambda: replayer.run(request.payload, f"{fix.name} (timed again)", extra_env=request.env)


def remeasure_prescription(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, prescription: Prescription
) -> Callable[[], Replay]:
    """The replay of exactly `prescription` again (for retime)."""
    again = Prescription(
        fixes=list(prescription.fixes),
        batch_size=prescription.batch_size,
        accumulation_steps=prescription.accumulation_steps,
    )
    return lambda: replay_prescription(replayer, snapshot, state, again, timed_again=True)


def start_prescription_ahead(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    candidate: Candidate,
    prescription: Prescription,
) -> None:
    """Start, in a free lane, the replay of `prescription` that
    measured_choice would ask for next (the candidate not measured as it is
    prescribed: with accumulation, or at another micro-batch)."""
    micro = prescription.batch_size
    if micro is None or micro > candidate.batch_size:
        return  # planned above what ran: only measured once asked for
    if prescription.accumulation_steps <= 1 and micro == candidate.batch_size:
        if not candidate.untimed:
            return  # measured as it is prescribed already
    replay_ahead(
        replayer, snapshot, state, prescription.fixes, micro, prescription.accumulation_steps
    )


def replay_ahead(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    fixes: list[str],
    micro: int,
    steps: int,
    timed: bool = True,
) -> Optional[tuple]:
    """Start, speculatively, the replay replay_prescription would run for
    `fixes` at micro-batch `micro` with `steps` accumulation steps; its key."""
    payload, label, args, env, micro_batches, _raised = prescription_replay(
        replayer, snapshot, state, fixes, micro, steps
    )
    return replayer.ahead(
        payload,
        label,
        args=args,
        extra_env=env,
        priority=SPECULATIVE,
        micro_batches_per_step=micro_batches,
        timed=timed,
    )


# A configuration whose peak is at least this share of the plain largest
# batch's, which drifted, is expected to drift as well (start_checks_ahead):
# on the H100, no fix at 8 x 4 (0.92 of batch 9's peak) did.
NEAR_DRIFT_SHARE = 0.85


def start_checks_ahead(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, prescription: Prescription
) -> list:
    """Start, beside the replay of `prescription` with accumulation, the
    replays that will check it if it is confirmed: its script's-own-flags
    replay; or, when the plain largest batch's drift at the allocator's
    defaults refused it (ReplayState.defaults_drift_bytes) and this one may
    drift as well, the replay with expandable segments that the drift's
    refusal asks for (certify_with_expandable_segments) and that one's own
    flags. On the H100 those were otherwise two replays one after another at
    the end of the diagnosis. Only for a configuration whose peak comes
    near that largest batch's (NEAR_DRIFT_SHARE): there autocast +
    checkpointing at half its peak did not drift. Their keys, for
    Replayer.discard should another configuration be prescribed."""
    near = NEAR_DRIFT_SHARE * state.defaults_drift_peak_bytes
    if (
        state.defaults_drift_bytes > 0
        and (prescription.peak_allocated_bytes or 0) >= near
        and prescription.batch_size
        and expandable_applies(prescription.fixes, snapshot)
        and not expandable_left_out(getattr(replayer.options, "fixes", None))
    ):
        trial = with_expandable_segments(prescription)
        keys = [
            replay_ahead(
                replayer,
                snapshot,
                state,
                trial.fixes,
                int(prescription.batch_size),
                trial.accumulation_steps,
                timed=False,  # a check of its certificate (certify_with_expandable_segments)
            ),
            start_flags_ahead(replayer, snapshot, state, trial),
        ]
    else:
        keys = [start_flags_ahead(replayer, snapshot, state, prescription)]
    return [key for key in keys if key is not None]


def replay_prescription(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    prescription: Prescription,
    timed_again: bool = False,
    timed: bool = True,
) -> Replay:
    """One replay of exactly the prescribed configuration: its fixes, its
    micro-batch, and the batch fix's gradient accumulation (batch_fix), long
    enough for two optimizer steps (the script's steps flag raised if need be).
    `timed=False`: a check of its peak, whose step times are never used."""
    payload, label, args, env, micro_batches, raised = prescription_replay(
        replayer,
        snapshot,
        state,
        prescription.fixes,
        int(prescription.batch_size or 1),
        prescription.accumulation_steps,
    )
    if timed_again:
        label += " (timed again)"
    replay = replayer.run(
        payload,
        label,
        args=args,
        extra_env=env,
        micro_batches_per_step=micro_batches,
        timed=timed,
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
    (replay_ahead) is the one replay_prescription asks for."""
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


def with_accumulation(prescription: Prescription, candidate: Candidate, capacity: int) -> None:
    """The prescription of a candidate measured by its replay with the
    accumulation running (measured_as_prescribed): that replay's peak and
    throughput, and what the batch it was planned from measured."""
    peak = candidate.peak_allocated_bytes
    prescription.headroom_bytes = capacity - peak
    prescription.accumulation_replay = candidate.accumulation_record
    if prescription.accumulation_steps > 1:
        prescription.accumulation_measured = True
    record = candidate.accumulation_record or {}
    throughput = (
        f", {candidate.samples_per_second:.1f} samples/s" if candidate.samples_per_second else ""
    )
    detail = (
        f"peak{' and throughput' if throughput else ''} measured in the replay "
        f"{candidate.label!r}, with the accumulation running{throughput}; "
        f"planned from {candidate.accumulation_label}"
    )
    if not record.get("accumulation_covered"):
        detail += f"; {uncovered_note(candidate.capture)}"
    prescription.detail = detail + "".join(f"; {note}" for note in candidate.notes)
