"""The batch searches: the largest batch that fits (the fix that
`searches_batch`, through the script's batch flag or its DataLoader), and
the largest batch under the combined memory savers when they do not fit at
the user's own batch. The search itself is oomdoc.replay.batch; this module
runs its trials as replays.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from oomdoc.fixes import Fix, batch_fix, fix_named
from oomdoc.model import (
    FixResult,
    Snapshot,
)
from oomdoc.replay import batch as batch_model
from oomdoc.replay import limit_estimate
from oomdoc.replay.batch_args import (
    find_batch_arg,
    find_search_batch,
    find_training_batch_arg,
    script_batch_flags,
    with_batch_size,
)
from oomdoc.replay.lanes import SPECULATIVE
from oomdoc.replay.plan import (
    ReplayState,
    is_prescribable,
    searches_evaluation_batch,
    worth_combining,
)
from oomdoc.replay.replayer import (
    Replay,
    Replayer,
)
from oomdoc.script_flags import (
    DATALOADER_SOURCE,
    EVAL_BATCH_FLAGS,
    from_command_line,
    listed,
    spelled,
)


def no_batch_size() -> str:
    """Why the smaller batch cannot be searched: no flag, no DataLoader."""
    return (
        f"the script has no batch-size flag on its command line ({listed()}, "
        "or one named with --batch-arg) and creates no DataLoader with a batch size"
    )


def by_flag(
    args: list[str], position: int, flag: str, snapshot: Snapshot
) -> Callable[[int], tuple[dict, str, Optional[list[str]]]]:
    """The replay of batch size b given by the script's own flag (BatchProbes)."""
    batch = batch_fix()

    def probe(batch_size: int) -> tuple[dict, str, Optional[list[str]]]:
        payload = {"name": batch.name, "batch_mode": "argv", "batch_size": batch_size}
        label = f"{batch.name} ({spelled(flag, batch_size, snapshot.script_option_syntax)})"
        return payload, label, with_batch_size(args, position, flag, batch_size)

    return probe


class BatchProbes:
    """The batch search's replays, one per batch size (`probe_of(b)`: the
    payload, label and arguments of its replay), and the probes started ahead
    (search_max_batch's `speculate`, beside the trial it asks for next): one
    the search asks for after that trial is taken from its lane; one it does
    not ask for then (or started again since) is stopped."""

    def __init__(
        self,
        replayer: Replayer,
        probe_of: Callable[[int], tuple[dict, str, Optional[list[str]]]],
        extra_env: Optional[dict] = None,
    ):
        self.replayer, self.probe_of, self.extra_env = replayer, probe_of, extra_env
        self.trials = 0  # trials asked for so far
        # Batch size -> (its replay's key, the trials asked for when it started).
        self.keys: dict[int, tuple[tuple, int]] = {}

    def trial(self, batch_size: int) -> batch_model.BatchRun:
        self.drop_others(batch_size)
        return self._replay(batch_size)

    def _replay(self, batch_size: int) -> batch_model.BatchRun:
        """The replay at `batch_size`, asked for (one started ahead is taken)."""
        payload, label, args = self.probe_of(batch_size)
        replay = self.replayer.run(payload, label, args=args, extra_env=self.extra_env)
        return to_batch_run(replay, batch_size)

    def speculate(self, batch_size: int) -> None:
        payload, label, args = self.probe_of(batch_size)
        key = self.replayer.ahead(payload, label, args=args, extra_env=self.extra_env)
        if key is not None:  # (None: no lane to start it in)
            self.keys[batch_size] = (key, self.trials)

    def finished(self, lo: int, hi: int) -> list[batch_model.BatchRun]:
        """The probes started ahead between `lo` and `hi` that have ended
        (search_max_batch's `harvest`): taken as a trial takes them, so that
        they count as asked for. (Those outside, no longer news, are dropped
        with the others.)"""
        ended = []
        for size, (key, _when) in list(self.keys.items()):
            if not lo < size < hi:
                continue
            job = self.replayer.started_ahead(key)
            replay = job.result if job is not None and job.finished.is_set() else None
            if not isinstance(replay, Replay) or not replay.ran or replay.cancelled:
                continue
            del self.keys[size]
            ended.append(self._replay(size))
        return ended

    def drop_others(self, batch_size: int) -> None:
        """The search asks for `batch_size`: probes started before the trial
        before this one, for another batch, are no longer wanted."""
        stale = [
            size
            for size, (_key, when) in self.keys.items()
            if size != batch_size and when < self.trials
        ]
        self.keys.pop(batch_size, None)
        if stale:
            self.replayer.discard([self.keys.pop(size)[0] for size in stale])
        self.trials += 1

    def drop_all(self) -> None:
        """The search has ended: the probes still started ahead are stopped."""
        if self.keys:
            self.replayer.discard([key for key, _when in self.keys.values()])
            self.keys.clear()


def search_batch(
    replayer: Replayer,
    snapshot: Snapshot,
    options: Any,
    on_settled: Optional[Callable[[batch_model.SearchResult, dict], None]] = None,
) -> tuple[Optional[batch_model.SearchResult], dict, Optional[str]]:
    """The largest batch size that fits. Returns (search result or None,
    information for the report, reason when it could not be searched).
    `on_settled(search so far, information)`: once its plan is known (any
    largest batch left in the bracket gives the same micro-batch and
    accumulation steps), while it goes on to the exact batch."""
    args = list(replayer.request.args)
    found = find_search_batch(args, options.batch_arg, snapshot)
    baseline = batch_model.observe(snapshot, 0)
    batch = batch_fix()
    info: dict = {}
    if found is not None:
        position, flag, original = found
        info.update(source=flag, original_batch_size=original)

        probes = BatchProbes(replayer, by_flag(args, position, flag, snapshot))
        runs = []
        if flag in EVAL_BATCH_FLAGS and snapshot.oom_in_evaluation and not options.batch_arg:
            probe = limit_estimate.first_probe_for(snapshot, original)
            first = probes.trial(probe)
            switched = training_instead(replayer, snapshot, args, first)
            if switched is not None:
                return switched
            runs = [first]
    else:
        if options.batch_arg:
            replayer.progress.header(
                f"{options.batch_arg} is not on the command line: trying the DataLoader's batch size"
            )
        if snapshot.dataloader_batch_sizes == []:
            # The failing run made no DataLoader a replay could change.
            return None, info, no_batch_size()
        divisor = limit_estimate.probe_divisor(snapshot)
        probe_replay = replayer.run(
            {"name": batch.name, "batch_mode": "dataloader", "batch_divisor": divisor},
            f"{batch.name} (DataLoader batch / {divisor})",
        )
        record = probe_replay.applied.get(batch.name) or {}
        if probe_replay.ran and not record.get("patched"):
            return None, info, no_batch_size()
        if not record.get("original_batch_size") or not record.get("batch_size"):
            return None, info, f"the first smaller-batch replay failed: {probe_replay.message}"
        original = int(record["original_batch_size"])
        info.update(source=DATALOADER_SOURCE, original_batch_size=original)

        def in_dataloader(batch_size: int) -> tuple[dict, str, Optional[list[str]]]:
            payload = {
                "name": batch.name,
                "batch_mode": "dataloader",
                "batch_size": batch_size,
                "original_batch_size": original,
            }
            return payload, f"{batch.name} (DataLoader batch {batch_size})", None

        probes = BatchProbes(replayer, in_dataloader)
        runs = [to_batch_run(probe_replay, int(record["batch_size"]))]
    if original <= 1:
        return None, info, "the batch size is already 1"
    baseline.batch_size = original

    def settled(search: batch_model.SearchResult) -> None:
        assert on_settled is not None
        search.trials[:0] = runs
        on_settled(search, info)

    result = batch_model.search_max_batch(
        original,
        snapshot.device.capacity_bytes,
        [baseline, *runs],
        probes.trial,
        probe=limit_estimate.first_probe_for(snapshot, original),
        speculate=probes.speculate,
        # Beside each trial near the limit only when the replays share the
        # device: taking it in turn, a probe beside the trial could hold it first.
        lanes=replayer.jobs if replayer.share_device else 1,
        settles=plan_settled(original, not searches_evaluation_batch(snapshot, info)),
        on_settled=settled if on_settled is not None else None,
        harvest=probes.finished,
    )
    probes.drop_all()
    result.trials[:0] = runs  # the DataLoader probe was a trial too
    return result, info, None


def training_instead(
    replayer: Replayer, snapshot: Snapshot, args: list[str], first: batch_model.BatchRun
) -> Optional[tuple[batch_model.SearchResult, dict, None]]:
    """An OOM in evaluation whose first replay, at a smaller evaluation batch,
    ran out of memory in training: on the longest batch, which the replays
    train on first and the failing run had not met before its evaluation.
    No evaluation batch helps that: the training batch is searched instead
    (with the user's effective batch kept by accumulation), and the
    evaluation's once a replay trains (oomdoc.replay.evaluation_batch)."""
    replay = first.replay
    capture = replay.capture if replay is not None else None
    if first.fits or first.inconclusive or capture is None or capture.oom is None:
        return None
    training = find_training_batch_arg(args, script_batch_flags(snapshot))
    if capture.oom.in_evaluation or training is None:
        return None
    position, flag, original = training
    if original <= 1:
        return None
    replayer.progress.header(
        f"the replay at evaluation batch {first.batch_size} ran out of memory in training, "
        f"on its longest batch: searching the training batch ({flag}) first"
    )
    if replayer.settler is not None:
        replayer.settler.arm()
    trial = BatchProbes(replayer, by_flag(args, position, flag, snapshot)).trial
    # The first replay trained at the user's training batch: it did not fit.
    known = to_batch_run(replay, original) if replay is not None else first
    result = batch_model.search_max_batch(
        original,
        snapshot.device.capacity_bytes,
        [known],
        trial,
        probe=known.estimated_max or original // 2,
    )
    result.trials[:0] = [known]
    info = {
        "source": flag,
        "original_batch_size": original,
        "training_instead": True,
    }
    return result, info, None


def to_batch_run(replay: Replay, batch_size: int) -> batch_model.BatchRun:
    if replay.capture is None or replay.outcome in ("timeout", "error"):
        run = batch_model.BatchRun(
            batch_size=batch_size, fits=False, inconclusive=True, note=replay.message
        )
    else:
        run = batch_model.observe(replay.capture, batch_size, still_leaks=replay.leaks)
    run.wall_s = replay.wall_s
    run.replay = replay
    return run


def saver_configurations(snapshot: Snapshot, state: ReplayState) -> list[tuple[str, ...]]:
    """The configurations of memory savers replayed at the user's batch
    (each saver alone, and together), those worth combining only
    (plan.worth_combining), fewest fixes first."""
    found = []
    for result in state.results:
        parts = tuple(result.parts)
        if parts in found or not result.measured:
            continue
        if all(is_prescribable(part) and worth_combining(snapshot, state, part) for part in parts):
            found.append(parts)
    return sorted(found, key=len)


def fits_within(result: FixResult | None, limit_bytes: int) -> bool:
    return (
        result is not None
        and result.fits
        and result.peak_allocated_bytes is not None
        and result.peak_allocated_bytes <= limit_bytes
    )


def only_adds_work(fixes: tuple[str, ...]) -> bool:
    """Fixes that cost time and never save any (checkpointing recomputes)."""
    found = [fix_named(name) for name in fixes]
    return bool(found) and all(
        fix is not None and fix.speed_cost >= 1 and not fix.speeds_up for fix in found
    )


def extra_savers(fixes: Sequence[str], than: Sequence[str]) -> tuple[str, ...]:
    """The savers of `than` that `fixes` lacks, in `than`'s order."""
    return tuple(name for name in than if name not in fixes)


def fewer_savers(fixes: Sequence[str], than: Sequence[str]) -> bool:
    """`fixes` are some of `than`'s savers, and those it lacks only add work."""
    return set(fixes) < set(than) and only_adds_work(extra_savers(fixes, than))


def dominated(fixes: tuple[str, ...], fitting: list[tuple[str, ...]]) -> Optional[str]:
    """Why the configuration `fixes` cannot be the fastest, when it cannot:
    fewer of its savers already fit at the user's batch, and the rest only
    add work."""
    for smaller in fitting:
        if fewer_savers(smaller, fixes):
            extra = extra_savers(smaller, fixes)
            own = " + ".join(smaller) or "no fix"
            return (
                f"{own} already fits at the user's batch and {' + '.join(extra)} only adds "
                "work: it cannot be faster"
            )
    return None


def search_configurations(
    replayer: Replayer, snapshot: Snapshot, options: Any, state: ReplayState
) -> None:
    """For each configuration of memory savers that does not fit at the
    user's batch with the margin free, the largest batch under it (the
    prescription then accumulates micro-batches of it), unless it cannot be
    the fastest (`dominated`, recorded in state.not_searched)."""
    if state.search is None or not state.batch_info.get("source"):
        return
    capacity = snapshot.device.capacity_bytes
    limit = capacity - int(getattr(options, "margin_fraction", 0.05) * capacity)
    by_parts = {tuple(result.parts): result for result in state.results}
    with SaverSearches(replayer, snapshot, state, by_parts, limit) as searches:
        for fixes, found in not_fitting(snapshot, state, by_parts, limit):
            if isinstance(found, str):
                state.not_searched[fixes] = found
                searches.drop(fixes)
            elif found is not None:
                search = searches.result(fixes, *found)
                if search is not None:
                    state.saver_searches[fixes] = search


class SearchDropped(Exception):
    """A saver's search running beside the others is no longer wanted."""


class SaverSearches:
    """The savers' searches side by side, one thread each, when replays run
    in lanes: each one's later trials no longer wait for the searches before
    it to end (on the H200 the Lightning encoder's autocast + checkpointing
    search waited 11 s for checkpointing's). Every configuration the
    decisions could search is started; the decisions still take them in
    order, as one after another would (searchable, with what the searches
    before found), and a search they rule out is stopped at its next trial
    and its result left out: the same decisions, sooner. Beside the
    evaluation batch's search too (EvaluationApart waits and runs again
    what its choice changes)."""

    def __init__(
        self,
        replayer: Replayer,
        snapshot: Snapshot,
        state: ReplayState,
        by_parts: dict[tuple[str, ...], FixResult],
        limit: int,
    ):
        self.replayer, self.snapshot, self.state = replayer, snapshot, state
        self.running: dict[tuple[str, ...], tuple[Future, threading.Event]] = {}
        self.pool: Optional[ThreadPoolExecutor] = None
        eager = list(searchable_now(snapshot, state, by_parts, limit))
        if replayer.lanes is None or len(eager) < 2:
            start_saver_searches_ahead(replayer, snapshot, state, eager)
            return
        self.pool = ThreadPoolExecutor(len(eager), thread_name_prefix="oomdoc-saver-search")
        for fixes, fix, at_original in eager:
            dropped = threading.Event()
            future = self.pool.submit(
                search_under, replayer, snapshot, state, fix, at_original, dropped
            )
            self.running[fixes] = (future, dropped)

    def result(
        self, fixes: tuple[str, ...], fix: Fix, at_original: batch_model.BatchRun
    ) -> Optional[batch_model.SearchResult]:
        """The search under `fixes`: the one running beside, else run now."""
        started = self.running.pop(fixes, None)
        if started is None:
            return search_under(self.replayer, self.snapshot, self.state, fix, at_original)
        return started[0].result()

    def drop(self, fixes: tuple[str, ...]) -> None:
        started = self.running.pop(fixes, None)
        if started is not None:
            started[1].set()

    def __enter__(self) -> SaverSearches:
        return self

    def __exit__(self, *exc_info) -> None:
        """Those the decisions never asked for are stopped; all have ended."""
        for _future, dropped in self.running.values():
            dropped.set()
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def searchable(
    fixes: tuple[str, ...], state: ReplayState, fitting: list[tuple[str, ...]]
) -> tuple[Fix, batch_model.BatchRun] | str | None:
    """Whether the configuration `fixes`, which does not fit at the user's
    batch, is searched (`fitting`: those that do, so far): its fix and its
    replay at the user's batch when it is; why not, when that is worth
    recording (state.not_searched); None when it has nothing to search from
    (no such fix, or no replay of it). One test for search_configurations and
    for start_saver_searches_ahead, so that the replays started ahead are the
    searches' own."""
    assert state.search is not None
    original = state.search.original_batch_size
    reason = dominated(fixes, fitting)
    if reason:
        return reason
    fix = fix_named("+".join(fixes))
    replay = state.replays.get("+".join(fixes))
    if fix is None or replay is None or replay.capture is None:
        return None
    at_original = to_batch_run(replay, original)
    if at_original.inconclusive:
        return f"its replay at the user's batch failed: {replay.message}"
    reason = estimated_no_larger(fixes, at_original, micro_batches(state), original)
    return reason or (fix, at_original)


def start_saver_searches_ahead(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    eager: list[tuple[tuple[str, ...], Fix, batch_model.BatchRun]],
) -> None:
    """Start every saver search's first replay at once, in free lanes
    (speculative), instead of each after the search before it, where the
    searches themselves go in order (SaverSearches; `eager`: its
    searchable_now): on the H100 the HF Trainer's two searches ran one after
    another. A configuration that an earlier search turns out to rule out
    (estimated_no_larger) asks for none: its replay is wasted, the decisions
    are the same."""
    if replayer.lanes is None:
        return  # no lane to start them in
    for _fixes, fix, at_original in eager:
        batch_size = first_saver_trial(snapshot, state, at_original)
        if batch_size is not None:
            payload, label, args, env = saver_trial(replayer, snapshot, state, fix, batch_size)
            replayer.ahead(payload, label, args=args, extra_env=env, priority=SPECULATIVE)


def searchable_now(
    snapshot: Snapshot,
    state: ReplayState,
    by_parts: dict[tuple[str, ...], FixResult],
    limit: int,
):
    """(fixes, its fix, its replay at the user's batch) of each configuration
    searchable with what is known before any saver's search: those the
    decisions search are among them (a search's result only rules more out)."""
    for fixes, found in not_fitting(snapshot, state, by_parts, limit):
        if isinstance(found, tuple):
            yield (fixes, *found)


def not_fitting(
    snapshot: Snapshot,
    state: ReplayState,
    by_parts: dict[tuple[str, ...], FixResult],
    limit: int,
):
    """(fixes, searchable(fixes)) of each configuration that does not fit at
    the user's batch with the margin free, in order, each judged when taken
    (with the searches recorded in `state` by then)."""
    fitting: list[tuple[str, ...]] = []
    for fixes in saver_configurations(snapshot, state):
        if fits_within(by_parts.get(fixes), limit):
            fitting.append(fixes)
            continue
        yield fixes, searchable(fixes, state, fitting)


# An estimated largest batch is taken this much larger before it is trusted
# to rule a configuration out (estimated_no_larger).
ESTIMATE_ALLOWANCE = 1.25


def micro_batches(state: ReplayState) -> dict[tuple[str, ...], int]:
    """The micro-batch each configuration searched so far would be
    prescribed with (no fix: the plain batch search's)."""
    assert state.search is not None
    original = state.search.original_batch_size
    known = {}
    for fixes, search in [((), state.search), *state.saver_searches.items()]:
        if search.max_batch_size:
            known[fixes] = batch_model.accumulation_plan(original, search.max_batch_size)[0]
    return known


def estimated_no_larger(
    fixes: tuple[str, ...],
    at_original: batch_model.BatchRun,
    known_micro: dict[tuple[str, ...], int],
    original: int,
) -> Optional[str]:
    """Why searching `fixes` cannot find the fastest configuration, when its
    replay at the user's batch estimates (estimated_max_batch, taken
    ESTIMATE_ALLOWANCE larger) a largest batch whose micro-batch is no larger
    than that of a configuration with fewer of its savers, the rest of which
    only add work (checkpointing that leaves the logits, which fill the
    memory, as they were)."""
    # Without the tensors still to come past the blocks: ruled out only by
    # what its OOM showed (BatchRun.estimated_max_bound).
    estimate = at_original.estimated_max_bound
    if estimate is None:
        estimate = at_original.estimated_max
    if estimate is None:
        return None
    generous = min(original, max(1, int(estimate * ESTIMATE_ALLOWANCE)))
    micro = batch_model.accumulation_plan(original, generous)[0]
    for smaller, smaller_micro in known_micro.items():
        if fewer_savers(smaller, fixes) and smaller_micro >= micro:
            extra = extra_savers(smaller, fixes)
            own = " + ".join(smaller) or "no fix"
            return (
                f"its largest batch, estimated at {estimate} from its replay at the user's batch, "
                f"gives micro-batches of {micro} at most, as {own} does ({smaller_micro}), and "
                f"{' + '.join(extra)} only adds work"
            )
    return None


def search_under(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    fix: Fix,
    at_original: batch_model.BatchRun,
    dropped: Optional[threading.Event] = None,
) -> Optional[batch_model.SearchResult]:
    """The largest batch under `fix` (a saver or a combination), starting
    where its own replay at the user's batch puts it (saver_probe), until the
    prescription it gives is settled. `dropped`: set when it is no longer
    wanted (SaverSearches): its next trial ends it."""
    probes = BatchProbes(
        replayer,
        lambda batch_size: saver_trial(replayer, snapshot, state, fix, batch_size)[:3],
        fix.request(snapshot).env,
    )

    def trial(batch_size: int) -> batch_model.BatchRun:
        if dropped is not None and dropped.is_set():
            raise SearchDropped()
        return probes.trial(batch_size)

    try:
        return saver_search(
            replayer, snapshot, state, at_original, trial, probes.speculate, probes.finished
        )
    finally:
        probes.drop_all()


def saver_search(
    replayer: Replayer,
    snapshot: Snapshot,
    state: ReplayState,
    at_original: batch_model.BatchRun,
    trial: Callable[[int], batch_model.BatchRun],
    speculate: Callable[[int], None],
    harvest: Optional[Callable[[int, int], list[batch_model.BatchRun]]] = None,
) -> Optional[batch_model.SearchResult]:
    """search_max_batch as a saver's search runs it, with its trials given:
    one place, so that the trials started early (oomdoc.replay.early_trials)
    are the ones the search asks for."""
    assert state.search is not None
    probe = saver_probe(state.search, at_original)
    if probe < 1:
        return None
    # A saver fits at least where no fix fits (it only takes memory away):
    # the search stays above the plain largest batch.
    return batch_model.search_max_batch(
        state.search.original_batch_size,
        snapshot.device.capacity_bytes,
        [at_original],
        trial,
        probe=probe,
        max_trials=4,
        enough=settled_by_accumulation(snapshot, state),
        floor=state.search.max_batch_size or 0,
        snap=smallest_with_its_plan(snapshot, state),
        speculate=speculate,
        lanes=replayer.jobs if replayer.share_device else 1,
        harvest=harvest,
    )


def smallest_with_its_plan(
    snapshot: Snapshot, state: ReplayState
) -> Callable[[int, int, int], int]:
    """The savers' searches' `snap`: a batch b stands for every batch with
    b's prescription (micro-batch and accumulation steps), and the smallest
    of them answers whether the saver gives it, with the least memory: on
    the Lightning encoder the searches replayed 17, 11 and 8 under autocast
    for a batch of 64, when only 16 and 8 could change the prescription.
    A batch whose prescription is no better than the fit's (lo) becomes the
    smallest that would change it. Without accumulation (an evaluation
    batch) each batch is its own prescription."""
    assert state.search is not None
    original = state.search.original_batch_size
    accumulates = not searches_evaluation_batch(snapshot, state.batch_info)

    def snap(batch_size: int, lo: int, hi: int) -> int:
        if not accumulates:
            return batch_size
        micro = batch_model.accumulation_plan(original, batch_size)[0]
        if lo < micro < hi:
            return micro
        plans = (batch_model.accumulation_plan(original, b)[0] for b in range(lo + 1, hi))
        return next((plan for plan in plans if plan > lo), batch_size)

    return snap


def settled_by_accumulation(
    snapshot: Snapshot, state: ReplayState
) -> Callable[[int, int], Optional[str]]:
    """The savers' searches' `enough`: the search is for the prescription,
    whose gradient accumulation makes up the user's batch, so once every
    batch from the fit to below the OOM gives the same micro-batch, no probe
    can change it."""
    assert state.search is not None
    accumulates = not searches_evaluation_batch(snapshot, state.batch_info)
    return plan_settled(state.search.original_batch_size, accumulates)


def plan_settled(original: int, accumulates: bool) -> Callable[[int, int], Optional[str]]:
    """Whether a batch that fits and a larger one that does not already give
    the prescription's micro-batch and accumulation steps (every batch
    between them gives the same), and which: why no probe can change it."""

    def enough(fit: int, oom: int) -> Optional[str]:
        plan = batch_model.accumulation_plan(original, fit, accumulates)
        if plan != batch_model.accumulation_plan(original, oom - 1, accumulates):
            return None
        return (
            f"any largest batch from {fit} to {oom - 1} gives the same prescription, "
            f"{plan[0]} x {plan[1]} accumulation steps"
        )

    return enough


def first_saver_trial(
    snapshot: Snapshot, state: ReplayState, at_original: batch_model.BatchRun
) -> Optional[int]:
    """The batch search_under replays first for a configuration whose
    replay at the user's batch is `at_original` (None: it replays none), as
    search_max_batch picks it: so that it can start ahead."""
    assert state.search is not None
    original = state.search.original_batch_size
    floor = state.search.max_batch_size or 0
    probe = saver_probe(state.search, at_original)
    if probe < 1 or at_original.fits or at_original.still_leaks is not None:
        return None
    if original - floor <= 1:
        return None
    if floor > 0 and settled_by_accumulation(snapshot, state)(floor, original):
        return None
    return smallest_with_its_plan(snapshot, state)(min(probe, original - 1), floor, original)


def saver_probe(search: batch_model.SearchResult, at_original: batch_model.BatchRun) -> int:
    """Where the search under a configuration of savers starts: where its
    own replay at the user's batch puts its largest batch, when that replay
    ran out of memory in its first step (limit_estimate.estimated_max_batch, from the
    activations it had made: a saver that leaves the logits alone, say,
    saves little), at least one above the plain largest batch; else
    saver_first_probe."""
    estimate = at_original.estimated_max
    if estimate is None:
        return saver_first_probe(search)
    plain_max = search.max_batch_size or 0
    return max(1, min(search.original_batch_size - 1, max(plain_max + 1, estimate)))


def saver_first_probe(search: batch_model.SearchResult) -> int:
    """Where the search under the savers starts: halfway from the plain
    largest batch to the user's, at least one above it."""
    original = search.original_batch_size
    plain_max = search.max_batch_size or 0
    return min(original - 1, max(plain_max + 1, (plain_max + original) // 2))


def batch_size_in(
    replayer: Replayer, state: ReplayState, payload: dict, batch_size: int
) -> tuple[Optional[list[str]], Optional[str]]:
    """Say in `payload` how a replay sets `batch_size`: through the script's
    batch flag the batch search found, else its DataLoader. (The script's
    args with that flag rewritten, the flag), or (None, None)."""
    args = list(replayer.request.args)
    source = state.batch_info.get("source") or ""
    # The flag the batch search changed (the training's, when an OOM in
    # evaluation turned out to be the training's first: training_instead).
    found = find_batch_arg(args, source) if from_command_line(source) else None
    if found is None:
        payload.update(
            batch_mode="dataloader", original_batch_size=state.batch_info.get("original_batch_size")
        )
        return None, None
    position, flag, _value = found
    payload["batch_mode"] = "argv"
    return with_batch_size(args, position, flag, batch_size), flag


def saver_trial(
    replayer: Replayer, snapshot: Snapshot, state: ReplayState, fix: Fix, batch_size: int
) -> tuple[dict, str, Optional[list[str]], dict]:
    """(payload, label, args, env) of the replay of `fix` at `batch_size`:
    one place, so that a replay started ahead is the one later asked for."""
    request = fix.request(snapshot)
    payload = dict(request.payload, also=[batch_fix().name], batch_size=batch_size)
    args, flag = batch_size_in(replayer, state, payload, batch_size)
    how = (
        spelled(flag, batch_size, snapshot.script_option_syntax)
        if flag
        else f"DataLoader batch {batch_size}"
    )
    return payload, f"{fix.name} ({how})", args, request.env
