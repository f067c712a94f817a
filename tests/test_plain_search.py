"""The plain batch search beside the decisions (oomdoc.replay.plain_search):
with lanes, the decisions take the search as it stood when its plan
settled, and the exact search ends beside them; without, it ends first."""

from __future__ import annotations

import threading

import pytest

from oomdoc.model import Prescription
from oomdoc.replay import plain_search
from oomdoc.replay.batch import BatchRun, SearchResult
from oomdoc.replay.orchestrate import rebase_throughput_ratio
from oomdoc.replay.plain_search import PlainSearch


def result(max_batch: int, exact: bool, runs=()) -> SearchResult:
    return SearchResult(64, max_batch, exact, list(runs), [])


class Scripted:
    """search_batch that settles at 8, then waits for `go` to end exact at 11."""

    def __init__(self):
        self.go = threading.Event()
        self.asked_to_settle: list[bool] = []
        self.error: BaseException | None = None

    def __call__(self, replayer, snapshot, options, on_settled=None):
        self.asked_to_settle.append(on_settled is not None)
        if on_settled is not None:
            on_settled(result(8, False), {"source": "--batch-size"})
        assert self.go.wait(10)
        if self.error is not None:
            raise self.error
        return result(11, True), {"source": "--batch-size"}, None


@pytest.fixture
def scripted(monkeypatch):
    search = Scripted()
    monkeypatch.setattr(plain_search, "search_batch", search)
    return search


def test_beside_the_decisions_they_take_the_settled_search_before_it_ends(scripted):
    plain = PlainSearch(None, None, None, beside=True)
    settled, info, reason = plain.settled()
    assert settled.max_batch_size == 8 and not settled.exact and plain.ahead
    assert info == {"source": "--batch-size"} and reason is None
    scripted.go.set()
    exact, _info, _reason = plain.final()
    assert exact.max_batch_size == 11 and exact.exact


def test_without_lanes_the_search_ends_first_and_settles_nothing(scripted):
    scripted.go.set()
    plain = PlainSearch(None, None, None, beside=False)
    assert scripted.asked_to_settle == [False] and not plain.ahead
    assert plain.settled()[0].max_batch_size == 11 and plain.final()[0].exact


def test_an_error_of_the_search_beside_reaches_the_decisions(scripted):
    scripted.error = RuntimeError("a replay failed")
    plain = PlainSearch(None, None, None, beside=True)
    plain.settled()
    scripted.go.set()
    with pytest.raises(RuntimeError, match="a replay failed"):
        plain.final()
    plain.abandon()


def timed(batch: int, step_s: float) -> BatchRun:
    return BatchRun(batch_size=batch, fits=True, peak_allocated_bytes=1, step_s=step_s)


def test_the_prescriptions_speedup_is_against_the_largest_batch_once_known():
    # Chosen against batch 128 at 1000 samples/s: 1.3x. The exact search's
    # largest batch, 163, ran 1100 samples/s: 1.3 * 1000 / 1100.
    before = timed(128, 0.128)
    after = timed(163, 163 / 1100)
    prescription = Prescription(fixes=["autocast"], batch_size=256, throughput_ratio=1.3)
    rebase_throughput_ratio(
        (prescription,), result(128, False, [before]), result(163, True, [before, after])
    )
    assert prescription.throughput_ratio == round(1.3 * 1000 / 1100, 3)
    # The same largest fit: nothing to change.
    same = Prescription(fixes=[], batch_size=128, throughput_ratio=1.0)
    rebase_throughput_ratio((same,), result(128, True, [before]), result(128, True, [before]))
    assert same.throughput_ratio == 1.0
