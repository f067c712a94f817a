"""The plain search's largest batch over the whole run
(oomdoc.replay.largest_batch): certified as its replay measured it, or, on
CUDA when only the allocator's drift refused it, searched upwards with
expandable segments."""

from __future__ import annotations

from types import SimpleNamespace

from test_certificate import MIB, step
from test_fragmentation import CAPACITY, DRIFTING, FAILING, STEADY, cuda_capture

from oomdoc.analysis import analyse
from oomdoc.model import BatchSearch, ReplaySummary, Snapshot
from oomdoc.replay import batch as batch_model
from oomdoc.replay.largest_batch import LargestBatchCheck
from oomdoc.replay.orchestrate import batch_search_record
from oomdoc.replay.plan import ReplayState
from oomdoc.replay.replayer import Replay
from oomdoc.replay.search import to_batch_run
from oomdoc.reporters.tables import replay_summary_lines


class FakeReplayer:
    """Answers each replay from `answers` by batch size, recording the asks."""

    def __init__(self, answers: dict[int, Replay], fixes=None):
        self.answers = answers
        self.options = SimpleNamespace(whole_run=True, fixes=fixes)
        self.request = SimpleNamespace(args=["--batch-size", "16"])
        self.ahead_asked: list[tuple[int, dict]] = []
        self.run_asked: list[tuple[int, dict]] = []

    @staticmethod
    def _batch(args) -> int:
        return int(args[args.index("--batch-size") + 1])

    def ahead(self, payload, label, args=None, extra_env=None, **_):
        self.ahead_asked.append((self._batch(args), extra_env))

    def run(self, payload, label, args=None, extra_env=None, **_):
        batch = self._batch(args)
        self.run_asked.append((batch, extra_env))
        return self.answers[batch]


def state_with_largest(largest: int, capture: Snapshot) -> ReplayState:
    """A plain search that found `largest` exactly (largest + 1 ran out of
    memory), its need 10 MiB a sample over 0."""
    fit = to_batch_run(
        Replay("plain", outcome="fits", peak_allocated_bytes=80 * MIB, capture=capture), largest
    )
    oom = batch_model.BatchRun(batch_size=largest + 1, fits=False)
    search = batch_model.SearchResult(16, largest, True, [fit, oom], [None, None])
    search.model = batch_model.BatchModel(
        {("steady", "forward"): batch_model.Line(0.0, 10 * MIB)}, None, {}
    )
    state = ReplayState(skipped=[])
    state.search = search
    state.batch_info = {"source": "--batch-size", "original_batch_size": 16}
    return state


def fits(capture: Snapshot = STEADY) -> Replay:
    return Replay("with es", outcome="fits", peak_allocated_bytes=81 * MIB, capture=capture)


OOM = Replay("with es", outcome="oom", capture=cuda_capture([step(0, 99 * MIB, 99 * MIB)]))


def test_a_largest_batch_whose_replay_is_certified_stands_as_it_is():
    replayer = FakeReplayer({})
    check = LargestBatchCheck(replayer, FAILING, state_with_largest(7, STEADY))  # type: ignore[arg-type]
    check.start()
    result = check.settle()
    assert result is not None and (result.batch_size, result.setting) == (7, None)
    assert replayer.ahead_asked == [] and replayer.run_asked == []


def test_a_drift_refusal_searches_upwards_with_expandable_segments():
    # 8 and 9 are certified with the setting; 10's need (100 MiB, the
    # batch model's) is not above the capacity, but it runs out of memory.
    replayer = FakeReplayer({8: fits(), 9: fits(), 10: OOM})
    check = LargestBatchCheck(replayer, FAILING, state_with_largest(7, DRIFTING))  # type: ignore[arg-type]
    check.start()
    assert [batch for batch, _ in replayer.ahead_asked] == [8]  # started at once
    env = replayer.ahead_asked[0][1]
    assert env["PYTORCH_CUDA_ALLOC_CONF"].endswith("expandable_segments:True")
    result = check.settle()
    assert result is not None and result.batch_size == 9
    assert result.setting == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert "grew 8.00 MiB a step" in result.note
    assert [batch for batch, _ in replayer.run_asked] == [8, 9, 10]


def test_no_batch_past_what_the_model_puts_above_the_capacity_is_replayed():
    replayer = FakeReplayer({8: fits(), 9: fits(), 10: fits()})
    state = state_with_largest(7, DRIFTING)
    assert state.search is not None
    state.search.model = batch_model.BatchModel(
        {("steady", "forward"): batch_model.Line(0.0, 12 * MIB)}, None, {}
    )  # 9 needs 108 MiB of the 100
    check = LargestBatchCheck(replayer, FAILING, state)  # type: ignore[arg-type]
    check.start()
    result = check.settle()
    assert result is not None and result.batch_size == 8
    assert [batch for batch, _ in replayer.run_asked] == [8]


def test_the_largest_batch_itself_with_the_setting_when_the_one_above_does_not_fit():
    replayer = FakeReplayer({8: OOM, 7: fits()})
    check = LargestBatchCheck(replayer, FAILING, state_with_largest(7, DRIFTING))  # type: ignore[arg-type]
    check.start()
    result = check.settle()
    assert result is not None and (result.batch_size, result.setting is not None) == (7, True)
    assert [batch for batch, _ in replayer.run_asked] == [8, 7]


def test_none_certified_says_so():
    replayer = FakeReplayer({8: OOM, 7: fits(DRIFTING)})
    check = LargestBatchCheck(replayer, FAILING, state_with_largest(7, DRIFTING))  # type: ignore[arg-type]
    check.start()
    result = check.settle()
    assert result is not None and result.batch_size is None
    assert "was not certified either" in result.note


def test_without_the_setting_among_the_fixes_asked_for_nothing_is_replayed():
    replayer = FakeReplayer({}, fixes=["smaller_batch", "autocast"])
    check = LargestBatchCheck(replayer, FAILING, state_with_largest(7, DRIFTING))  # type: ignore[arg-type]
    check.start()
    assert replayer.ahead_asked == []
    result = check.settle()
    assert result is not None and result.batch_size is None
    assert "grew 8.00 MiB a step" in result.note and "where it stops" in result.note
    assert "above the capacity" not in result.note  # the edge's own margin goes unsaid


def test_the_report_and_the_record_carry_the_whole_run_batch():
    replayer = FakeReplayer({8: fits(), 9: OOM})
    state = state_with_largest(7, DRIFTING)
    check = LargestBatchCheck(replayer, FAILING, state)  # type: ignore[arg-type]
    check.start()
    result = check.settle()
    assert result is not None and state.search is not None
    record: BatchSearch = batch_search_record(state.search, "--batch-size")
    record.whole_run_batch_size, record.whole_run_setting = result.batch_size, result.setting
    record.whole_run_note = result.note
    snapshot = Snapshot.from_dict(
        {"outcome": "oom", "device": {"kind": "cuda", "capacity_bytes": CAPACITY}}
    )
    snapshot.max_batch_size = 7
    snapshot.replay = ReplaySummary(replays=3, batch_search=record)
    line = next(
        line for line in replay_summary_lines(analyse(snapshot)) if line.startswith("Largest")
    )
    assert "for the whole run: 8 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line
    again = Snapshot.from_dict(snapshot.to_dict())
    assert again.replay is not None and again.replay.batch_search is not None
    assert again.replay.batch_search.whole_run_batch_size == 8
