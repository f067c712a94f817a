"""Replaying the failing step with fixes, in fresh child processes: the
decisions, one replay at a time, and the ranked results.

replay_fixes runs what oomdoc.replay.plan chose (each single fix; the batch
search of oomdoc.replay.search for the fix that `searches_batch`; the
combination worth measuring), through oomdoc.replay.replayer, then ranks
the results and records them with the prescription
(oomdoc.replay.prescription) in the snapshot.

The orchestrator knows no fix by name: it asks each fix in the catalogue
(oomdoc.fixes) whether it is worth a replay, what to send the child, and how
to describe what the replay did.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Optional, TextIO

from oomdoc.diagnosis.leak import rule as leak_rule
from oomdoc.fixes import FIXES, Fix, fix_named
from oomdoc.fixes.base import SnippetContext
from oomdoc.fixes.optimizer import optimizer_state_estimate
from oomdoc.fixes.ranking import rank_fixes
from oomdoc.frameworks import context_from_snapshot, framework_of, preimports
from oomdoc.model import (
    BatchSearch,
    Breakdown,
    FixResult,
    Prescription,
    ReplaySummary,
    Skipped,
    Snapshot,
)
from oomdoc.replay import batch as batch_model
from oomdoc.replay.certificate import measured_margin_fraction
from oomdoc.replay.early_trials import EarlySaverTrials
from oomdoc.replay.evaluation_batch import EvaluationApart, evaluation_option
from oomdoc.replay.largest_batch import LargestBatchCheck, WholeRunLargest
from oomdoc.replay.own_flags import evaluation_batch_snippet, parameter_update
from oomdoc.replay.plain_search import PlainSearch
from oomdoc.replay.plan import (
    LEAK_NO_BATCH_SEARCH,
    ReplayState,
    check_replay_options,
    combination_to_measure,
    parse_fix_names,
    plan,
    searches_evaluation_batch,
    start_ahead,
)
from oomdoc.replay.prescription import prescription_for
from oomdoc.replay.progress import Progress
from oomdoc.replay.replayer import (
    REPLAY_ENV,
    Launch,
    Replay,
    Replayer,
    ReplaysInterrupted,
    early_lanes,
    replay_jobs,
    warm_pool,
)
from oomdoc.replay.search import search_configurations
from oomdoc.replay.timing import (
    WARMUP_RATIO,
    StepTiming,
    cannot_be_faster,
    ratio_noise,
    shape_warmup,
    step_timing,
)
from oomdoc.replay.written import put_back_written
from oomdoc.runner import ChildRequest, ChildSignals, WarmPool
from oomdoc.script_flags import from_command_line, spelled

# The entry points callers import from here (oomdoc.cli, oomdoc.session,
# oomdoc.distributed.session, the benchmarks).
__all__ = [
    "REPLAY_ENV",
    "Replayer",
    "check_replay_options",
    "early_lanes",
    "replay_fixes",
    "warm_pool",
]


def replay_fixes(
    snapshot: Snapshot,
    options: Any,
    request: ChildRequest,
    stderr: TextIO | None = None,
    pool: WarmPool | None = None,
    launch: Launch | None = None,
) -> None:
    """Measure the fixes for an OOM, store them ranked in `snapshot`, and
    the prescription. `pool`: warm children started earlier (one is made
    when not given). `launch`: how each replay's child runs when not by
    oomdoc.runner.run_child (a distributed job's launcher)."""
    stderr = stderr or sys.stderr
    if getattr(options, "margin_fraction", None) is None:
        # `--margin auto`: what the failing run's allocator measured.
        options = copy.copy(options)
        options.margin_fraction = measured_margin_fraction(snapshot)
    own_pool = pool is None
    pool = pool or warm_pool(request)
    requested = parse_fix_names(options.fixes)
    singles, skipped = plan(snapshot, requested)
    combinations = [name for name in (requested or []) if "+" in name]
    progress = Progress(stderr)
    progress.header("replaying the failing step with fixes (OOMDOC_REPLAY=1 is set in replays)")
    leak = leak_rule(snapshot) is not None
    jobs = replay_jobs(snapshot, options)
    if getattr(options, "distributed", None) is None:
        # One warm child per lane, each importing the script's framework while it waits.
        pool.configure(size=jobs, preimports=preimports(snapshot))
    state = ReplayState(skipped=skipped)
    # Ctrl-C and SIGTERM are handled once for all the replays, which may run
    # side by side: Ctrl-C stops them all and keeps what was measured.
    with ChildSignals() as signals:
        replayer = Replayer(
            snapshot,
            options,
            request,
            progress,
            pool,
            leak=leak,
            jobs=jobs,
            signals=signals,
            launch=launch,
        )
        option = evaluation_option(snapshot)
        if option is not None:
            # Replays that train and then run out of memory in the
            # evaluation at the script's own evaluation batch (oomdoc.replay.evaluation_batch).
            replayer.settler = EvaluationApart(snapshot, option, options.margin_fraction)
        largest: Optional[LargestBatchCheck] = None
        plain: Optional[PlainSearch] = None
        try:
            interrupted = False
            started = start_ahead(
                replayer, snapshot, singles, combinations, automatic=requested is None
            )
            # The decisions, one replay at a time; a replay started ahead
            # answers at once. After Ctrl-C, only replays that already ended
            # are read: each step below is skipped without them.
            for name in singles:
                fix = fix_named(name)
                assert fix is not None
                try:
                    if fix.searches_batch:
                        if leak:
                            skipped.append(Skipped(name, LEAK_NO_BATCH_SEARCH))
                            continue
                        # With lanes, the decisions go on once its plan is
                        # known, the exact search beside them (plain_search).
                        beside = replayer.lanes is not None
                        # The savers' searches, speculatively, while its plan settles.
                        early = EarlySaverTrials(replayer, snapshot, options, singles)
                        if requested is None:
                            early.start()
                        try:
                            plain = PlainSearch(replayer, snapshot, options, beside)
                            state.search, state.batch_info, reason = plain.settled()
                        finally:
                            early.stop()
                        if early.errors:
                            snapshot.notes.append(
                                "The savers' searches started early failed "
                                f"({type(early.errors[0]).__name__}: {early.errors[0]}); "
                                "they ran once the batch search had settled."
                            )
                        if reason:
                            skipped.append(Skipped(name, reason))
                        continue
                    replay_single(replayer, fix, snapshot, state)
                except ReplaysInterrupted:
                    interrupted = True
            if requested is None and not leak:
                combination = combination_to_measure(snapshot, state)
                if combination is not None:
                    combinations.append(combination)
            for name in combinations:
                fix = fix_named(name)
                assert fix is not None
                try:
                    replay_single(replayer, fix, snapshot, state)
                except ReplaysInterrupted:
                    interrupted = True
            # A speculative combination no decision wanted goes.
            replayer.discard(started)
            ahead = plain is not None and plain.ahead
            if state.search is not None and not interrupted and not ahead:
                # Its replays with expandable segments run beside the savers' searches.
                largest = LargestBatchCheck(replayer, snapshot, state)
                largest.start()
            if requested is None and not leak and not interrupted:
                try:
                    search_configurations(replayer, snapshot, options, state)
                except ReplaysInterrupted:
                    interrupted = True
            prescribed: Optional[tuple[Optional[Prescription]]] = None
            if plain is not None and ahead:
                # The prescription too, from the settled plan; then the exact search.
                settled = state.search
                if not interrupted:
                    prescribed = (prescription_for(snapshot, replayer, state),)
                try:
                    state.search = plain.final()[0]
                except ReplaysInterrupted:
                    interrupted = True
                rebase_throughput_ratio(prescribed, settled, state.search)
                if state.search is not None and not interrupted:
                    largest = LargestBatchCheck(replayer, snapshot, state)
                    largest.start()
            whole_run_largest = None
            if largest is not None and not interrupted:
                try:
                    whole_run_largest = largest.settle()
                except ReplaysInterrupted:
                    interrupted = True
            if interrupted or replayer.stopped:
                snapshot.notes.append(
                    "Replays were interrupted: the fixes below are those measured before."
                )
            finish(snapshot, replayer, state, progress, whole_run_largest, prescribed)
        except Exception as exc:  # the snapshot of the OOM must be written whatever happens here
            progress.header(f"replays failed: {type(exc).__name__}: {exc}")
            snapshot.notes.append(
                f"Replays failed ({type(exc).__name__}: {exc}); no fixes were measured."
            )
            snapshot.fixes, snapshot.max_batch_size = [], None
        finally:
            replayer.close()
            if plain is not None:
                plain.abandon()
            # Every replay has ended: the user's files as the run left them.
            written = put_back_written(snapshot, replayer, request.artifact_dir)
            if written:
                snapshot.notes.append(written)
            if own_pool:
                pool.close()


def replay_single(replayer: Replayer, fix: Fix, snapshot: Snapshot, state: ReplayState) -> None:
    """Replay one fix (or combination) and add its result, or say why it
    changed nothing."""
    request = fix.request(snapshot)
    replay = replayer.run(request.payload, fix.name, extra_env=request.env)
    ran = replay.ran
    reason = fix.not_applied(replay.applied) if ran else None
    if reason:
        state.skipped.append(Skipped(fix.name, reason))
        return
    detail = fix.describe(replay.applied, request)
    state.contexts[fix.name] = request.context
    result = result_from(
        replay, fix, detail, snippet_in_framework(snapshot, fix.name, request.context)
    )
    state.results.append(result)
    state.replays[fix.name] = replay
    if ran:
        state.applied.add(fix.name)


def result_from(replay: Replay, fix: Fix, detail: str, snippet: str) -> FixResult:
    """A fix's result as its replay measured it (one that still leaks, its
    outcome `grows`, says how and by how many steps it delays the OOM)."""
    if replay.outcome != "fits" and replay.message:
        detail = f"{replay.message}; {detail}" if detail else replay.message
    if replay.outcome in ("timeout", "error") and replay.log_path:
        detail += f" (its output: {replay.log_path})"
    return FixResult(
        name=fix.name,
        title=fix.title,
        outcome=replay.outcome,
        fits=replay.fits,
        peak_allocated_bytes=replay.peak_allocated_bytes,
        peak_reserved_bytes=replay.peak_reserved_bytes,
        saved_bytes=None,
        step_time_ratio=None,
        step_s=replay.step_s,
        replay_s=round(replay.wall_s, 2),
        detail=detail,
        snippet=snippet,
        measured=True,
        delays_oom_by_steps=replay.leaks.delays_oom_by_steps if replay.leaks else None,
    )


FAILING_STEPS = "the failing run's completed steps"


def reference_step_seconds(
    snapshot: Snapshot, search: Optional[batch_model.SearchResult]
) -> tuple[Optional[StepTiming], str]:
    """What a step of the failing run would take if it fit: its own complete
    steady steps when it had any, else the largest fitting smaller batch's
    step scaled per sample."""
    oom_step = (snapshot.oom.step if snapshot.oom else None) or 0
    steady = [step for step in snapshot.steps if 0 < step.index < oom_step and step.duration_s]
    timing = step_timing(steady) if steady else None
    if timing is not None:
        return timing, FAILING_STEPS
    best = search.best_run if search is not None else None
    if search is not None and best is not None and best.step_s:
        scaled = best.step_s * search.original_batch_size / best.batch_size
        return StepTiming(scaled, best.step_noise, 1), (
            f"a step at batch size {best.batch_size} scaled to {search.original_batch_size} samples (an estimate)"
        )
    return None, "no step of the failing configuration completed"


def time_ratio(
    result: FixResult, fix: Optional[Fix], reference: StepTiming, noise: float, same_batch: bool
) -> None:
    """The result's step time over the failing run's, with its noise; for a
    fix that only adds work, timed against the failing run's own steps at the
    same batch (`same_batch`), a ratio below 1 by more than the noise cannot
    be: flagged and not given. (Against a smaller batch scaled up, a larger
    batch can truly run faster per sample.)"""
    if result.step_time_ratio is None and result.step_s:
        result.step_time_ratio = round(result.step_s / reference.step_s, 3)
    if result.step_time_ratio is None:
        return
    result.step_time_noise = noise
    only_adds_work = (
        same_batch
        and fix is not None
        and fix.speed_cost >= 1
        and not fix.speeds_up
        and not fix.searches_batch
    )
    if only_adds_work and cannot_be_faster(result.step_time_ratio, noise):
        result.step_time_flag = (
            f"measured {result.step_time_ratio:.2f}x (+-{noise:.0%}): {result.name} only adds "
            "work, so a step faster than the failing run's is timing noise; not used"
        )
        result.step_time_ratio = None


def batch_noise(search: Optional[batch_model.SearchResult]) -> Optional[float]:
    best = search.best_run if search is not None else None
    return best.step_noise if best is not None else None


def batch_search_result(
    snapshot: Snapshot,
    fix: Fix,
    search: batch_model.SearchResult,
    info: dict,
    reference_s: float | None,
    largest: Optional[WholeRunLargest] = None,
) -> Optional[FixResult]:
    best = search.best_run
    if best is None:
        last = search.trials[-1] if search.trials else None
        replay = getattr(last, "replay", None) if last else None
        if replay is None:
            return None
        result = result_from(
            replay, fix, search.stopped or "no smaller batch fits", fix.snippet({})
        )
        result.fits = False
        return result
    original = search.original_batch_size
    maximum = search.max_batch_size
    assert maximum is not None
    micro, steps = batch_model.accumulation_plan(
        original, maximum, accumulates=not searches_evaluation_batch(snapshot, info)
    )
    how = info.get("source", "batch size")
    how_text = (
        spelled(how, maximum, snapshot.script_option_syntax)
        if from_command_line(how)
        else f"DataLoader(batch_size={maximum})"
    )
    exactness = (
        f"exact: {maximum + 1} ran out of memory"
        if search.exact
        else f"not proven exact: {search.stopped}"
    )
    detail = f"largest batch that fits: {maximum} ({exactness}; {len(search.trials)} replays)"
    if largest is not None:
        detail += f"; {whole_run_text(largest)}"
    if searches_evaluation_batch(snapshot, info):
        detail += f"; an evaluation batch of {micro} ({how_text})"
    else:
        detail += (
            f"; keep the effective batch of {original} with {steps} accumulation steps of {micro}"
        )
    if searches_evaluation_batch(snapshot, info):
        snippet = evaluation_batch_snippet(snapshot, micro, how)
    else:
        snippet = snippet_in_framework(
            snapshot,
            fix.name,
            {
                "micro_batch": micro,
                "accumulation_steps": steps,
                "how": how if from_command_line(how) else "",
                "update": parameter_update(snapshot, search),
            },
        )
    result = result_from(best.replay, fix, detail, snippet)
    result.max_batch_size, result.micro_batch_size = maximum, micro
    result.accumulation_steps, result.how = steps, how_text
    if reference_s and best.step_s:
        # Accumulation processes the original batch in `steps` micro-steps.
        result.step_time_ratio = round(steps * best.step_s * (micro / maximum) / reference_s, 3)
    return result


def whole_run_text(largest: WholeRunLargest) -> str:
    """What the largest batch's certificate found, in a phrase."""
    if largest.batch_size is None:
        return f"not certified for the whole run: {largest.note}"
    if largest.setting is None:
        return "certified for the whole run"
    return (
        f"for the whole run {largest.batch_size} with {largest.setting} (certified; {largest.note})"
    )


def static_breakdown(snapshot: Snapshot, replayer: Replayer) -> Breakdown:
    """Parameters, gradients and optimizer state at their largest, from the
    failing run and every replay that kept the script's optimizer."""
    static = Breakdown(
        parameters=snapshot.breakdown.parameters,
        gradients=snapshot.breakdown.gradients,
        optimizer_state=snapshot.breakdown.optimizer_state,
    )
    for replay in replayer.replays:
        fix = fix_named(replay.fix_name)
        # Only the batch search's replays keep the script's own model and optimizer.
        if replay.capture is None or fix is None or not fix.searches_batch:
            continue
        measured = replay.capture.breakdown
        static.parameters = max(static.parameters, measured.parameters)
        static.gradients = max(static.gradients, measured.gradients)
        static.optimizer_state = max(static.optimizer_state, measured.optimizer_state)
    if not static.optimizer_state:
        static.optimizer_state = optimizer_state_estimate(snapshot)
    if not static.gradients:
        static.gradients = static.parameters
    return static


def finish(
    snapshot: Snapshot,
    replayer: Replayer,
    state: ReplayState,
    progress: Progress,
    largest: Optional[WholeRunLargest] = None,
    prescribed: Optional[tuple[Optional[Prescription]]] = None,
) -> None:
    """Rank what the replays measured, choose the prescription, and record
    both in the snapshot. `largest`: the largest batch certified for the
    whole run (oomdoc.replay.largest_batch). `prescribed`: the prescription,
    when it was chosen already (beside the plain search's end)."""
    search = state.search
    results = state.results
    lower_bound = snapshot.oom.needed_bytes if snapshot.oom else 0
    need, estimated = lower_bound, False
    if search is not None and search.model is not None:
        predicted = search.model.need_far(search.original_batch_size)
        if predicted is not None and predicted > lower_bound:
            need, estimated = int(predicted), True
    reference, reference_text = reference_step_seconds(snapshot, search)
    reference_s = reference.step_s if reference is not None else None
    if search is not None:
        searcher = next(fix for fix in FIXES if fix.searches_batch)
        found = batch_search_result(
            snapshot, searcher, search, state.batch_info, reference_s, largest
        )
        if found is not None:
            results.insert(0, found)
    static = static_breakdown(snapshot, replayer)
    for result in results:
        fix = fix_named(result.name)
        if result.fits and result.peak_allocated_bytes is not None:
            result.saved_bytes = int(need - result.peak_allocated_bytes)
            replay = state.replays.get(result.name)
            if reference is not None:
                own = replay.step_noise if replay is not None else batch_noise(search)
                noise = ratio_noise(own, reference.noise)
                same_batch = reference_text == FAILING_STEPS
                time_ratio(result, fix, reference, noise, same_batch)
        if fix is not None:
            fix.annotate(result, static, snapshot)
    snapshot.fixes = rank_fixes(results)
    snapshot.max_batch_size = search.max_batch_size if search is not None and search.exact else None
    snapshot.prescription = (
        prescribed[0] if prescribed is not None else prescription_for(snapshot, replayer, state)
    )
    evaluation = replayer.settler if isinstance(replayer.settler, EvaluationApart) else None
    if evaluation is not None:
        evaluation.annotate(snapshot.prescription)
    warmup = shape_warmup_note(snapshot, replayer)
    if warmup:
        snapshot.notes.append(warmup)
    leaking = [(replay.label, replay.leaks) for replay in replayer.replays if replay.leaks]
    if leaking and not replayer.leak:
        # The failing run ended too early to show its leak; a replay did.
        label, leaks = leaking[0]
        snapshot.notes.append(
            f"The replay {label!r} leaks ({leaks.text}): "
            "no configuration fits until the leak is fixed; each only delays the OOM."
        )
    summary = ReplaySummary(
        replays=len(replayer.replays),
        total_s=round(progress.total(), 2),
        max_steps=replayer.max_steps,
        timeout_s=replayer.timeout_s,
        baseline_need_bytes=int(need),
        baseline_need_estimated=estimated,
        reference_step_s=reference_s,
        reference=reference_text,
        skipped=state.skipped,
        runs=[replay.timing() for replay in replayer.replays],
        jobs=replayer.jobs,
    )
    # Every decision is made: replays still started ahead (a runner-up that
    # was not needed) are stopped, and reported with the others unused.
    replayer.discard_ahead()
    unused = replayer.unused_runs()
    if unused:
        summary.unused_runs = unused
    if search is not None:
        summary.batch_search = batch_search_record(search, state.batch_info.get("source"))
        if largest is not None:
            summary.batch_search.whole_run_batch_size = largest.batch_size
            summary.batch_search.whole_run_setting = largest.setting
            summary.batch_search.whole_run_note = largest.note or None
    saver_searches = []
    for fixes, saver_search in state.saver_searches.items():
        record = batch_search_record(saver_search, state.batch_info.get("source"))
        record.fixes = "+".join(fixes)
        saver_searches.append(record)
    if saver_searches:
        summary.saver_batch_searches = saver_searches
        summary.saver_batch_search = max(
            saver_searches, key=lambda record: len((record.fixes or "").split("+"))
        )
    if evaluation is not None:
        summary.evaluation_batch_search = evaluation.record()
    snapshot.replay = summary
    side_by_side = f", up to {replayer.jobs} side by side" if replayer.jobs > 1 else ""
    progress.header(f"{len(replayer.replays)} replays in {progress.total():.1f} s{side_by_side}")


def rebase_throughput_ratio(
    prescribed: Optional[tuple[Optional[Prescription]]],
    settled: Optional[batch_model.SearchResult],
    exact: Optional[batch_model.SearchResult],
) -> None:
    """A prescription chosen from the plain search as it stood when its plan
    settled compared its throughput with that search's largest fit: now with
    the largest batch that fits (its `throughput_ratio`)."""
    prescription = prescribed[0] if prescribed is not None else None
    if prescription is None or prescription.throughput_ratio is None:
        return
    before = settled.best_run if settled is not None else None
    after = exact.best_run if exact is not None else None
    if before is None or after is None or before is after or not before.step_s or not after.step_s:
        return
    ratio = prescription.throughput_ratio * (before.batch_size / before.step_s)
    prescription.throughput_ratio = round(ratio / (after.batch_size / after.step_s), 3)


def shape_warmup_note(snapshot: Snapshot, replayer: Replayer) -> Optional[str]:
    """What the replays' steps on new input shapes cost over those on shapes
    met before, when it is large (WARMUP_RATIO): step times leave them out,
    but the user's run pays it once for every new shape."""
    worst: Optional[tuple[float, float, str]] = None
    for replay in replayer.replays:
        found = shape_warmup(replay.capture.steps) if replay.capture is not None else None
        if found is None or found[1] <= 0:
            continue
        if worst is None or found[0] / found[1] > worst[0] / worst[1]:
            worst = (*found, replay.label)
    if worst is None or worst[0] < WARMUP_RATIO * worst[1]:
        return None
    new_s, met_s, label = worst
    text = (
        f"Steps on input shapes met for the first time took {new_s:.2f} s against "
        f"{met_s:.2f} s on shapes met before (replay {label!r}): a warm-up for each new "
        "shape, which the step times here leave out and a run pays once per shape"
    )
    if snapshot.device.kind == "cuda":
        text += (
            " (on CUDA this is typically cuDNN attention, which builds a plan for each "
            "new sequence length: torch.backends.cuda.enable_cudnn_sdp(False) turns it off)"
        )
    return text + "."


def batch_search_record(search: batch_model.SearchResult, source: Optional[str]) -> BatchSearch:
    return BatchSearch(
        source=source,
        original_batch_size=search.original_batch_size,
        max_batch_size=search.max_batch_size,
        exact=search.exact,
        trials=[[run.batch_size, run.fits] for run in search.trials],
        stopped=search.stopped or None,
    )


def snippet_in_framework(snapshot: Snapshot, name: str, context: SnippetContext) -> str:
    """A fix's snippet in the knobs of the framework the run went through
    (torch code for a plain loop)."""
    full = context_from_snapshot(snapshot)
    full.update(context)
    return framework_of(snapshot).snippet(name, full)
