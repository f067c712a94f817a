"""The savers' searches, started while the plain batch search is still
settling its plan.

A saver's search (search.search_under) starts where its replay at the
user's batch puts its largest batch, above the plain largest batch, so it
waited for the plain search's plan. On the H200 (16 GiB) the Lightning
encoder's autocast, checkpointing and combined replays at the user's batch
had all run out of memory 5 s into the replays; three lanes then stood idle
for 8 s while the plain search closed in (24 fit, 27 did not), and the
checkpointing search's chain of halvings (128, 64, 32) started at 16.7 s.
The HF `Trainer`'s autocast trial at batch 8 waited 8 s the same way.

Each saver's search now runs as soon as its replay at the user's batch has
ended, its trials speculative replays, as search.saver_search runs it when
the plain search's first probe (the failing run's estimate of its largest
batch) is the plain largest batch. It stops when the plain search settles:
the decisions then run the searches themselves, and when the guess was
right they find the same trials running or done (the search is
deterministic in its trials' answers); when not, the trials are replays the
decisions never ask for (discarded at the end, listed among the unused
replays) and the decisions are the same.

Only the trials themselves start early, not the batches a search starts
beside its next trial (search_max_batch's `speculate`): those would take the
lanes kept for work started ahead in the order asked, before the trials of
the other savers' searches and before their own search's next trial (all
equally speculative). On the H200 the Lightning encoder's checkpointing
search started 128, 64 and 32 at once, taking all three such lanes, while
autocast's first trial waited behind its own side bets at 64 and 128 and the
combination's search waited 14 s for a lane.

When the plain search's replay at the guessed batch runs out of memory, the
guess is wrong (the savers' searches would start above a batch no fix fits:
a Fabric language model's first probe, 39, did, and its largest batch was
11): the searches started early stop there, their replays left for the
decisions to ask for or discard, and start again, all of them, as soon as a
replay of the plain search fits, from that batch (`rebased_on`). A batch that
fit is no more than the plain largest batch, so a search from it starts no
higher than the decisions' will; its trials are the decisions' own wherever
its first probe lands above the plain largest batch (a saver's estimate, or
the micro-batch of an accumulation plan, is most often well above it). On
the H200 the ImageNet-style trainer's plain search (233 out of memory, then
128, 162, 168, 163, 167, 165 and 164, 15 s in all: its evaluation keeps the
decisions waiting for the exact search) held autocast's search back to 15.1 s,
where 128 had fit at 6.7 s.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable, Optional

from oomdoc.fixes import Fix, fix_named
from oomdoc.model import Snapshot
from oomdoc.replay import batch as batch_model
from oomdoc.replay import limit_estimate
from oomdoc.replay.batch_args import find_search_batch
from oomdoc.replay.lanes import Job
from oomdoc.replay.plan import ReplayState
from oomdoc.replay.replayer import Replay, Replayer, replay_key
from oomdoc.replay.search import (
    by_flag,
    first_saver_trial,
    saver_search,
    saver_trial,
    to_batch_run,
)
from oomdoc.script_flags import EVAL_BATCH_FLAGS

# How often the thread looks at the replays it waits for (and whether the
# plain search has settled).
POLL_S = 0.05


def saver_replays_ahead(
    replayer: Replayer, snapshot: Snapshot, singles: list[str]
) -> list[tuple[Fix, Job]]:
    """The memory savers among `singles`, and all of them together, whose
    replays at the user's batch were started ahead (plan.start_ahead): each
    fix with its job."""
    savers = [
        name
        for name in singles
        if (fix := fix_named(name)) is not None and fix.prescribable and not fix.searches_batch
    ]
    names = [*savers, "+".join(savers)] if len(savers) >= 2 else savers
    found = []
    for name in names:
        fix = fix_named(name)
        if fix is None:
            continue
        request = fix.request(snapshot)  # as plan.start_ahead started it
        job = replayer.started_ahead(replay_key(request.payload, fix.name, None, request.env))
        if job is not None:
            found.append((fix, job))
    return found


def provisional_state(
    snapshot: Snapshot, args: list[str], options: Any
) -> Optional[tuple[ReplayState, Callable[[int], str]]]:
    """What the savers' searches will know once the plain search settles, as
    guessed now: its batch flag and the user's batch (as search.search_batch
    finds them), its largest batch at its first probe; and the label of the
    plain search's replay at a batch. None where the guess cannot be
    made: no batch flag on the command line (a DataLoader's batch is found by
    a replay), or an evaluation batch (the search may turn to the training
    batch, search.training_instead)."""
    found = find_search_batch(args, getattr(options, "batch_arg", None), snapshot)
    if found is None:
        return None
    position, flag, original = found
    if original <= 1 or (flag in EVAL_BATCH_FLAGS and snapshot.oom_in_evaluation):
        return None
    guess = limit_estimate.first_probe_for(snapshot, original)
    probe = by_flag(args, position, flag, snapshot)
    return rebased(original, flag, guess), lambda batch_size: probe(batch_size)[1]


def rebased(original: int, flag: str, plain_largest: int) -> ReplayState:
    """The state the savers' searches start from, with the plain largest
    batch taken as `plain_largest`."""
    return ReplayState(
        skipped=[],
        search=batch_model.SearchResult(original, plain_largest, False, [], []),
        batch_info={"source": flag, "original_batch_size": original},
    )


class Closed(Exception):
    """The plain search has settled, or its replay at the guess ran out of
    memory, or oomdoc stops: the decisions take over."""


class EarlySaverTrials:
    """Threads beside the plain batch search: each saver's search, started
    when its replay at the user's batch ends, until `stop()` (the plain
    search has settled: the decisions then run the searches themselves)."""

    def __init__(self, replayer: Replayer, snapshot: Snapshot, options: Any, singles: list[str]):
        self.replayer, self.snapshot, self.options = replayer, snapshot, options
        self.singles = singles
        self.started: list[str] = []  # the labels of the trials started
        self.errors: list[BaseException] = []
        # The plain fit the searches were started again from, once the guess
        # ran out of memory (None: they were not).
        self.rebased_on: Optional[int] = None
        self._open = threading.Event()
        self._threads: list[threading.Thread] = []
        # The label of the plain search's replay at the guessed batch (None
        # once the searches start from a batch that fit), and at any batch.
        self._guess_label: Optional[str] = None
        self._label_of: Optional[Callable[[int], str]] = None
        self._generation = 0  # the searches of an earlier one stop

    def start(self) -> EarlySaverTrials:
        if self.replayer.lanes is not None:
            self._open.set()
            self._spawn(self._watch)
        return self

    def stop(self) -> None:
        self._open.clear()

    def join(self, timeout: Optional[float] = None) -> None:
        for thread in list(self._threads):
            thread.join(timeout)

    @property
    def open(self) -> bool:
        return self._is_open(self._generation)

    def _is_open(self, generation: int) -> bool:
        return (
            self._open.is_set()
            and not self.replayer.stopped
            and generation == self._generation
            and not self.guess_refuted()
        )

    def _guess_replay(self) -> Optional[Replay]:
        label = self._guess_label
        if label is None:
            return None
        return next((r for r in list(self.replayer.replays) if r.label == label), None)

    def guess_refuted(self) -> bool:
        """The plain search's replay at the guessed batch ran out of memory."""
        replay = self._guess_replay()
        return replay is not None and replay.outcome == "oom"

    def plain_fit_below(self, batch_size: int) -> Optional[int]:
        """The largest batch below `batch_size` that a replay of the plain
        search fit, so far (None: none yet)."""
        label_of = self._label_of
        if label_of is None:
            return None
        best = None
        for replay in list(self.replayer.replays):
            found = _TRAILING_NUMBER.search(replay.label)
            if found is None:
                continue
            batch = int(found.group(1))
            if (
                batch < batch_size
                and (best is None or batch > best)
                and replay.label == label_of(batch)
                and to_batch_run(replay, batch).fits
            ):
                best = batch
        return best

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            except Closed:
                pass
            except Exception as exc:  # speculation only: the decisions never depend on it
                self.errors.append(exc)

        thread = threading.Thread(target=run, name="oomdoc-early-saver-search", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _watch(self) -> None:
        """Each saver's search, once its replay at the user's batch has ended;
        all of them again from the plain search's first fit below the guess
        when the guess ran out of memory."""
        guessed = provisional_state(self.snapshot, list(self.replayer.request.args), self.options)
        if guessed is None:
            return
        state, self._label_of = guessed
        assert state.search is not None
        original, guess = state.search.original_batch_size, state.search.max_batch_size or 0
        self._guess_label = self._label_of(guess)
        waiting = saver_replays_ahead(self.replayer, self.snapshot, self.singles)
        ended: list[tuple[Fix, batch_model.BatchRun]] = []
        while self._open.is_set() and not self.replayer.stopped:
            if self.guess_refuted():
                floor = self.plain_fit_below(guess)
                if floor is not None:
                    state = rebased(original, state.batch_info["source"], floor)
                    self._guess_label, self.rebased_on = None, floor
                    self._generation += 1
                    for fix, at_original in ended:
                        self._search_if_any(state, fix, at_original)
            finished = [(fix, job) for fix, job in waiting if job.finished.is_set()]
            if not finished:
                answered = self._guess_label is None or self._guess_replay() is not None
                if not waiting and answered and not self.guess_refuted():
                    return  # every search started, from a guess that stands
                if waiting:
                    waiting[0][1].finished.wait(POLL_S)
                else:
                    time.sleep(POLL_S)  # for the plain search's answers
                continue
            for fix, job in finished:
                waiting.remove((fix, job))
                if isinstance(job.result, Replay) and not job.cancel.is_set():
                    ended.append((fix, to_batch_run(job.result, original)))
                    if not self.guess_refuted():
                        self._search_if_any(state, fix, ended[-1][1])

    def _search_if_any(
        self, state: ReplayState, fix: Fix, at_original: batch_model.BatchRun
    ) -> None:
        if first_saver_trial(self.snapshot, state, at_original) is not None:
            self._spawn(self._search, state, fix, at_original, self._generation)

    def _search(
        self, state: ReplayState, fix: Fix, at_original: batch_model.BatchRun, generation: int
    ) -> None:
        def start(batch_size: int) -> Optional[tuple]:
            if not self._is_open(generation):
                raise Closed()
            payload, label, args, env = saver_trial(
                self.replayer, self.snapshot, state, fix, batch_size
            )
            key = self.replayer.speculate(payload, label, args=args, extra_env=env)
            if key is not None:
                self.started.append(label)
            return key

        def beside(batch_size: int) -> None:
            pass  # no side bets early (above)

        def trial(batch_size: int) -> batch_model.BatchRun:
            key = start(batch_size)
            job = self.replayer.started_ahead(key) if key is not None else None
            if job is None:
                raise Closed()  # asked for by the decisions already, or no lane
            replay = job.wait()
            if not isinstance(replay, Replay) or replay.cancelled or not self._is_open(generation):
                raise Closed()
            return to_batch_run(replay, batch_size)

        saver_search(self.replayer, self.snapshot, state, at_original, trial, beside)


_TRAILING_NUMBER = re.compile(r"(\d+)\D*$")
