"""The savers' searches started while the plain batch search settles
(oomdoc.replay.early_trials): each runs the trials its search asks for
when the plain search's first probe is its largest batch, starts only once
its replay at the user's batch has run out of memory, and only while the
plain search is open; a replay the decisions asked for is never started again."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from oomdoc.fixes import fix_named
from oomdoc.model import Snapshot
from oomdoc.replay import batch as batch_model
from oomdoc.replay import early_trials, limit_estimate, search
from oomdoc.replay.early_trials import EarlySaverTrials, provisional_state
from oomdoc.replay.lanes import Job
from oomdoc.replay.plan import ReplayState
from oomdoc.replay.replayer import Replay, replay_key

GiB, MiB = 1 << 30, 1 << 20
ARGS = ["train.py", "--batch-size", "256", "--steps", "6"]
SINGLES = ["smaller_batch", "autocast", "checkpointing"]
# The largest batch each configuration fits, and the largest its replay at
# the user's batch estimates (the Lightning encoder's shape: the plain
# largest batch 24, the failing run's first probe).
FITS_UP_TO = {"autocast": 16, "checkpointing": 40, "autocast+checkpointing": 60}
ESTIMATES = {"autocast": 20, "checkpointing": 128, "autocast+checkpointing": 150}


def answer(label: str) -> Replay:
    """A replay of `label`, as the device answers it (FITS_UP_TO)."""
    fix, _, batch = label.partition(" (--batch-size ")
    fits = bool(batch) and int(batch.rstrip(")")) <= FITS_UP_TO[fix]
    return Replay(label=label, outcome="ok" if fits else "oom")


def finished(replay: Replay | None) -> Job:
    job = Job(lambda job: None, 2)
    job.result = replay
    if replay is not None:
        job.finished.set()
    return job


class AheadReplayer:
    """The Replayer's side the threads use: the replays at the user's batch
    started ahead (each ends when the test says), and the trials they start
    (each answered at once)."""

    request = SimpleNamespace(args=list(ARGS))
    lanes, stopped, jobs, share_device = object(), False, 4, True

    def __init__(self, snapshot: Snapshot, names: list[str]):
        self.at_original: dict[str, Job] = {}
        self.keys: dict[tuple, Job] = {}
        for name in names:
            fix = fix_named(name)
            assert fix is not None
            request = fix.request(snapshot)
            self.at_original[name] = finished(None)
            self.keys[replay_key(request.payload, fix.name, None, request.env)] = self.at_original[
                name
            ]
        self.speculated: list[str] = []
        self.replays: list[Replay] = []  # those the decisions asked for

    def started_ahead(self, key):
        return self.keys.get(key)

    def speculate(self, payload, label, args=None, extra_env=None):
        key = replay_key(payload, label, args, extra_env)
        if key not in self.keys:
            self.keys[key] = finished(answer(label))
            self.speculated.append(label)
        return key

    def end(self, name: str) -> None:
        job = self.at_original[name]
        job.result = Replay(label=name, outcome="oom")
        job.finished.set()


class AskingReplayer(AheadReplayer):
    """The Replayer's side a saver's search uses once the plain search has
    settled: the trials it asks for."""

    def __init__(self):
        self.asked: list[str] = []

    def run(self, payload, label, args=None, extra_env=None):
        self.asked.append(label)
        return answer(label)

    def ahead(self, payload, label, args=None, extra_env=None):
        return (label,)

    def started_ahead(self, key):
        return None  # those started ahead are still running

    def discard(self, keys, keep_finished=False):
        pass


@pytest.fixture(autouse=True)
def batch_runs(monkeypatch):
    """A replay's BatchRun: its batch, fit or not; at the user's batch, the
    estimate of its largest batch (limit_estimate.estimated_max_batch)."""

    def to_batch_run(replay, batch_size):
        if replay.label in ESTIMATES:
            return batch_model.BatchRun(
                batch_size=batch_size, fits=False, estimated_max=ESTIMATES[replay.label]
            )
        run = batch_model.BatchRun(
            batch_size=batch_size, fits=replay.outcome == "ok", peak_allocated_bytes=None
        )
        if run.fits:
            run.peak_allocated_bytes = batch_size * 200 * MiB
        else:
            run.lower_bounds[("first", "forward")] = 16 * GiB + MiB
        return run

    monkeypatch.setattr(early_trials, "to_batch_run", to_batch_run)
    monkeypatch.setattr(search, "to_batch_run", to_batch_run)
    # The failing run estimated the plain largest batch at 24.
    monkeypatch.setattr(limit_estimate, "first_probe_for", lambda snapshot, original: 24)


def snapshot() -> Snapshot:
    return Snapshot.from_dict({"device": {"capacity_bytes": 16 * GiB}})


def asked_by_the_search(snap: Snapshot, name: str, plain_largest: int) -> list[str]:
    """The trials the saver's search asks for once the plain search has
    settled at `plain_largest` (search.search_under)."""
    fix = fix_named(name)
    assert fix is not None
    state = ReplayState(
        skipped=[],
        search=batch_model.SearchResult(256, plain_largest, True, [], []),
        batch_info={"source": "--batch-size", "original_batch_size": 256},
    )
    replayer = AskingReplayer()
    at_original = search.to_batch_run(Replay(label=name, outcome="oom"), 256)
    search.search_under(replayer, snap, state, fix, at_original)  # type: ignore[arg-type]
    return replayer.asked


def by_fix(labels: list[str], name: str) -> list[str]:
    return [label for label in labels if re.match(re.escape(name) + r" \(", label)]


def test_each_savers_search_runs_when_its_replay_at_the_users_batch_ends():
    snap = snapshot()
    names = ["autocast", "checkpointing", "autocast+checkpointing"]
    replayer = AheadReplayer(snap, names)
    guessed = provisional_state(snap, ARGS, SimpleNamespace(batch_arg=None))
    assert guessed is not None
    state, label_of = guessed
    assert state.search is not None and label_of(24) == "smaller_batch (--batch-size 24)"
    assert state.search.max_batch_size == 24  # the plain search's first probe
    early = EarlySaverTrials(replayer, snap, None, SINGLES).start()  # type: ignore[arg-type]
    replayer.end("checkpointing")
    replayer.end("autocast")
    asked = {name: asked_by_the_search(snap, name, 24) for name in ("autocast", "checkpointing")}
    deadline = time.monotonic() + 30  # (the watcher waits on the combination's replay)
    while time.monotonic() < deadline and any(
        len(by_fix(replayer.speculated, name)) < len(labels) for name, labels in asked.items()
    ):
        time.sleep(0.02)
    time.sleep(0.2)  # nothing more comes
    for name, labels in asked.items():
        # The trials themselves, in order, and no side bets (early_trials).
        assert labels and by_fix(replayer.speculated, name) == labels, name
    # autocast's estimate, 20, is below the guess: its search starts at 32,
    # the smallest batch above 24 with a micro-batch of its own.
    assert asked["autocast"][0] == "autocast (--batch-size 32)"
    assert asked["checkpointing"][:2] == [
        "checkpointing (--batch-size 128)",
        "checkpointing (--batch-size 64)",
    ]
    assert not by_fix(replayer.speculated, "autocast+checkpointing")
    early.stop()  # the plain search settles: the decisions take over
    replayer.end("autocast+checkpointing")
    early.join(5)
    assert not by_fix(replayer.speculated, "autocast+checkpointing") and early.errors == []


def test_nothing_starts_for_a_saver_that_fit_or_once_the_plain_search_settled():
    snap = snapshot()
    replayer = AheadReplayer(snap, ["autocast", "checkpointing"])
    early = EarlySaverTrials(replayer, snap, None, SINGLES).start()  # type: ignore[arg-type]
    job = replayer.at_original["autocast"]
    job.result = Replay(label="fits", outcome="ok")
    job.finished.set()
    early.stop()
    replayer.end("checkpointing")
    early.join(5)
    assert replayer.speculated == [] and early.errors == []


def test_no_guess_without_the_batch_flag_or_at_an_evaluation_batch():
    snap = snapshot()
    options = SimpleNamespace(batch_arg=None)
    assert provisional_state(snap, ["train.py", "--steps", "6"], options) is None
    evaluation = Snapshot.from_dict(
        {
            "device": {"capacity_bytes": 16 * GiB},
            "oom": {"phase": "forward", "in_evaluation": True},
        }
    )
    args = ["train.py", "--per_device_eval_batch_size", "64"]
    assert provisional_state(evaluation, args, options) is None


def test_a_replay_the_decisions_asked_for_is_never_started_again():
    """Replayer.speculate beside the decisions: once `run` has taken a
    replay (started ahead or not), speculating it again starts nothing; one
    not asked for yet goes to the lanes at once once the decisions ask."""
    import threading

    from oomdoc.replay.replayer import Replayer

    class Lanes:
        def __init__(self):
            self.ran: list[str] = []

        def submit(self, job):
            job.run()

        def promote(self, job, priority):
            pass

    replayer = object.__new__(Replayer)
    lanes = Lanes()
    replayer.lanes, replayer.signals, replayer.settler = lanes, None, None
    replayer._interrupted, replayer._lock = False, threading.RLock()
    replayer._ahead, replayer._unsubmitted, replayer._asked, replayer.replays = {}, [], set(), []

    def execute(job, payload, label, *rest):
        lanes.ran.append(label)
        return Replay(label=label, outcome="ok")

    replayer._execute = execute  # type: ignore[method-assign]
    early = replayer.speculate({"name": "autocast"}, "autocast (--batch-size 32)")
    assert early is not None and lanes.ran == []  # nothing asked yet: it waits
    replayer.run({"name": "autocast"}, "autocast (--batch-size 128)")
    # The one asked for first, then those waiting.
    assert lanes.ran == ["autocast (--batch-size 128)", "autocast (--batch-size 32)"]
    assert replayer.speculate({"name": "autocast"}, "autocast (--batch-size 128)") is None
    assert replayer.speculate({"name": "autocast"}, "autocast (--batch-size 64)") is not None
    assert lanes.ran[-1] == "autocast (--batch-size 64)"  # into the lanes at once


def test_a_failure_of_the_early_searches_is_kept_for_the_report(monkeypatch):
    """Speculation only: an error there never reaches the decisions, and is
    kept (the orchestrator notes it in the snapshot)."""

    def broken(*args):
        raise ValueError("no guess")

    monkeypatch.setattr(early_trials, "provisional_state", broken)
    snap = snapshot()
    early = EarlySaverTrials(AheadReplayer(snap, []), snap, None, SINGLES).start()  # type: ignore[arg-type]
    early.join(5)
    early.stop()
    assert [str(error) for error in early.errors] == ["no guess"]


def test_the_searches_stop_once_the_plain_search_ran_out_of_memory_at_the_guess():
    """The guess (the plain search's first probe, 24) ran out of memory: the
    plain largest batch is below it, and the savers' searches would start
    above a batch no fix fits (a Fabric language model: first probe 39,
    largest batch 11). Nothing more starts early while no plain replay fit."""
    snap = snapshot()
    replayer = AheadReplayer(snap, ["autocast", "checkpointing"])
    early = EarlySaverTrials(replayer, snap, None, SINGLES).start()  # type: ignore[arg-type]
    replayer.end("autocast")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not by_fix(replayer.speculated, "autocast"):
        time.sleep(0.02)
    assert by_fix(replayer.speculated, "autocast")  # started while the guess stood
    replayer.replays.append(Replay(label="smaller_batch (--batch-size 24)", outcome="oom"))
    assert early.guess_refuted() and not early.open
    replayer.end("checkpointing")
    early.join(5)
    assert not by_fix(replayer.speculated, "checkpointing") and early.errors == []


def test_after_the_guess_ran_out_of_memory_they_start_again_from_the_first_plain_fit():
    """The ImageNet-style trainer's shape: the guess out of memory, then a
    plain replay below it fits (12 here): every saver's search starts again
    from there. Checkpointing's first probe (its estimate, 128) is above the
    plain largest batch (16, once the plain search settles): its trials are
    the decisions' own. autocast's (20, whose micro-batch is 16) is not:
    from 12 its search replays 16, which the decisions' search, from 16,
    never asks for (a replay wasted, the decisions the same)."""
    snap = snapshot()
    replayer = AheadReplayer(snap, ["autocast", "checkpointing"])
    early = EarlySaverTrials(replayer, snap, None, SINGLES).start()  # type: ignore[arg-type]
    replayer.replays.append(Replay(label="smaller_batch (--batch-size 24)", outcome="oom"))
    replayer.end("autocast")
    replayer.end("checkpointing")
    time.sleep(0.3)
    assert replayer.speculated == [] and early.rebased_on is None  # no fit known yet
    # An out-of-memory replay below the guess and a fit above it are no floor.
    replayer.replays.append(Replay(label="smaller_batch (--batch-size 20)", outcome="oom"))
    replayer.replays.append(Replay(label="smaller_batch (--batch-size 12)", outcome="ok"))
    asked = asked_by_the_search(snap, "checkpointing", 16)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        len(by_fix(replayer.speculated, "checkpointing")) < len(asked)
        or not by_fix(replayer.speculated, "autocast")
    ):
        time.sleep(0.02)
    early.stop()
    early.join(5)
    assert early.rebased_on == 12 and early.errors == []
    assert asked and by_fix(replayer.speculated, "checkpointing") == asked
    assert by_fix(replayer.speculated, "autocast")[0] == "autocast (--batch-size 16)"
    assert asked_by_the_search(snap, "autocast", 16)[0] == "autocast (--batch-size 32)"
