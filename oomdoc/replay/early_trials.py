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
decisions to ask for or discard.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from oomdoc.fixes import Fix, fix_named
from oomdoc.model import Snapshot
from oomdoc.replay import batch as batch_model
from oomdoc.replay.lanes import Job
from oomdoc.replay.plan import ReplayState
from oomdoc.replay.replayer import Replay, Replayer, replay_key
from oomdoc.replay.search import (
    by_flag,
    find_search_batch,
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
) -> Optional[tuple[ReplayState, str]]:
    """What the savers' searches will know once the plain search settles, as
    guessed now: its batch flag and the user's batch (as search.search_batch
    finds them), its largest batch at its first probe; and the label of the
    plain search's replay at that probe. None where the guess cannot be
    made: no batch flag on the command line (a DataLoader's batch is found by
    a replay), or an evaluation batch (the search may turn to the training
    batch, search.training_instead)."""
    found = find_search_batch(args, getattr(options, "batch_arg", None), snapshot)
    if found is None:
        return None
    position, flag, original = found
    if original <= 1 or (flag in EVAL_BATCH_FLAGS and snapshot.oom_in_evaluation):
        return None
    guess = batch_model.first_probe_for(snapshot, original)
    state = ReplayState(
        skipped=[],
        search=batch_model.SearchResult(original, guess, False, [], []),
        batch_info={"source": flag, "original_batch_size": original},
    )
    return state, by_flag(args, position, flag, snapshot)(guess)[1]


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
        self._open = threading.Event()
        self._threads: list[threading.Thread] = []
        # The label of the plain search's replay at the guessed batch.
        self._guess_label: Optional[str] = None

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
        return self._open.is_set() and not self.replayer.stopped and not self.guess_refuted()

    def guess_refuted(self) -> bool:
        """The plain search's replay at the guessed batch ran out of memory."""
        label = self._guess_label
        return label is not None and any(
            replay.label == label and replay.outcome == "oom"
            for replay in list(self.replayer.replays)
        )

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
        """Each saver's search, once its replay at the user's batch has ended."""
        guessed = provisional_state(self.snapshot, list(self.replayer.request.args), self.options)
        if guessed is None:
            return
        state, self._guess_label = guessed
        assert state.search is not None
        original = state.search.original_batch_size
        waiting = saver_replays_ahead(self.replayer, self.snapshot, self.singles)
        while waiting and self.open:
            ended = [(fix, job) for fix, job in waiting if job.finished.is_set()]
            if not ended:
                waiting[0][1].finished.wait(POLL_S)
                continue
            for fix, job in ended:
                waiting.remove((fix, job))
                if isinstance(job.result, Replay) and not job.cancel.is_set():
                    at_original = to_batch_run(job.result, original)
                    if first_saver_trial(self.snapshot, state, at_original) is not None:
                        self._spawn(self._search, state, fix, at_original)

    def _search(self, state: ReplayState, fix: Fix, at_original: batch_model.BatchRun) -> None:
        def start(batch_size: int) -> Optional[tuple]:
            if not self.open:
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
            if not isinstance(replay, Replay) or replay.cancelled or not self.open:
                raise Closed()
            return to_batch_run(replay, batch_size)

        saver_search(self.replayer, self.snapshot, state, at_original, trial, beside)
