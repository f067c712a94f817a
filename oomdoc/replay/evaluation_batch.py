"""The evaluation's own batch, searched when the training's fits and the
evaluation's does not.

A script whose evaluation batch is an option of its own (HF's
`per_device_eval_batch_size`, `--eval-batch-size`) and whose training ran
out of memory: a replay at a smaller training batch trains, then runs out
of memory in the evaluation, at a batch no training batch changes. Counted
as it stands, every such replay "does not fit", and the search finds no
training batch at all. So the first replay whose training fits and whose
evaluation (after at least one training step) ran out of memory at the
script's own evaluation batch stops the decisions once: the largest
evaluation batch that fits is searched with that replay's configuration
(replays at the same training batch, the evaluation option changed), kept
below the margin, and from then on every replay runs with it (the
replayer's argument rewrite; replays started ahead with the old value are
dropped). The replay that raised it is run again with it and answers for
it. The prescription prints the option (`Prescription.evaluation_batch_size`).
"""

from __future__ import annotations

import shlex
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from oomdoc.frameworks.base import split_command
from oomdoc.model import BatchSearch, Prescription, Snapshot
from oomdoc.replay.batch_args import find_batch_arg, find_training_batch_arg, with_batch_size
from oomdoc.replay.replayer import Replay, Replayer
from oomdoc.script_flags import EVAL_BATCH_FLAGS, batch_flags, spelled


def evaluation_option(snapshot: Snapshot) -> Optional[str]:
    """The script's own evaluation batch option."""
    if snapshot.oom is None:
        return None
    return next((flag for flag in EVAL_BATCH_FLAGS if flag in snapshot.script_options), None)


def training_batch_size(snapshot: Snapshot) -> Optional[int]:
    """The training batch a search of the evaluation's batch leaves as it is
    (the script's batch option as given, else its default): every
    configuration then trains on it, so it is their samples per step."""
    _head, args = split_command(snapshot.command or [])
    found = find_training_batch_arg(args)
    if found is not None:
        return found[2]
    defaults = snapshot.script_option_defaults or {}
    for flag in batch_flags(snapshot.script_options, snapshot.script_option_aliases):
        value = str(defaults.get(flag) or "")
        if value.isdigit():
            return int(value)
    return None


def only_the_evaluation_ran_out(replay: Replay) -> bool:
    """The replay trained (a step with a backward or an optimizer step) and
    then ran out of memory in an evaluation."""
    capture = replay.capture
    if replay.outcome != "oom" or capture is None or capture.oom is None:
        return False
    if not capture.oom.in_evaluation:
        return False
    return any(step.backward_calls or step.optimizer_steps for step in capture.steps)


def with_evaluation_batch(
    args: list[str], option: str, batch_size: int, syntax: Optional[str]
) -> list[str]:
    """`args` with the evaluation batch set: rewritten where it is given,
    else added at the end."""
    found = find_batch_arg(args, option)
    if found is not None:
        return with_batch_size(args, found[0], option, batch_size)
    return [*args, *spelled(option, batch_size, syntax).split(" ", 1)]


# Replays an evaluation batch search may take (one more runs the replay
# that raised it again, with the batch found).
MAX_TRIALS = 4


@dataclass
class EvaluationSearch:
    """The evaluation batches tried at one training configuration."""

    original: int
    trials: list[tuple[int, bool, Optional[int]]] = field(default_factory=list)  # batch, fits, peak
    chosen: Optional[int] = None  # the largest that fit below the margin (else that fit)
    stopped: str = ""


def _evaluation_base(replay: Replay) -> int:
    """What was allocated when the evaluation began: the start of the step
    it ran in (the model, its gradients and the optimizer's state)."""
    capture = replay.capture
    if capture is None or not capture.steps:
        return 0
    step = next((step for step in capture.steps if step.evaluation_calls), capture.steps[-1])
    return step.start_allocated_bytes or 0


def search_evaluation_batch(
    original: int, failed: Replay, trial: Callable[[int], Replay], limit_bytes: int
) -> EvaluationSearch:
    """The largest evaluation batch under `limit_bytes`, from a replay at
    batch `original` that ran out of memory in its evaluation: each trial
    goes where a line through the evaluation's start and the last need
    (a fit's peak; an OOM's need, a lower bound) reaches the limit, at most
    MAX_TRIALS replays. The evaluation holds no graph: memory grows with its
    batch about linearly, above what training left allocated."""
    search = EvaluationSearch(original)
    base = _evaluation_base(failed)
    fit, fit_peak = 0, 0  # the largest evaluation batch that fit, and its peak
    oom, bound = original, failed.peak_allocated_bytes or 0  # the smallest that did not
    while len(search.trials) < MAX_TRIALS and oom - fit > 1:
        if fit:
            # A fit's peak: the line through it (steeper than the evaluation's
            # own when training made the peak: a smaller, safer batch).
            candidate = int(fit * (limit_bytes - base) / max(1, fit_peak - base))
            if candidate <= fit:
                break
        else:
            # Only OOMs: their need is a lower bound, so at most 3/4 of the
            # smallest (an estimate too large once tends to be again).
            candidate = int(oom * (limit_bytes - base) / max(1, bound - base))
            candidate = min(candidate, oom * 3 // 4)
        candidate = max(1, min(candidate, oom - 1))
        replay = trial(candidate)
        peak = replay.peak_allocated_bytes or 0
        search.trials.append((candidate, replay.fits, peak))
        if not replay.ran:
            search.stopped = f"the replay at evaluation batch {candidate} did not finish"
            break
        if replay.fits:
            fit, fit_peak = candidate, peak
            if peak <= limit_bytes and (oom - fit) * 10 <= fit:
                break  # within a tenth of the smallest OOM, under the margin
        else:
            oom, bound = candidate, peak
    within = [batch for batch, fits, peak in search.trials if fits and (peak or 0) <= limit_bytes]
    fitting = [batch for batch, fits, _peak in search.trials if fits]
    search.chosen = max(within or fitting) if (within or fitting) else None
    if search.chosen is None and not search.stopped:
        search.stopped = f"no evaluation batch fit in {len(search.trials)} replays"
    return search


class EvaluationApart:
    """The replayer's hook (Replayer.settle): searches the evaluation batch
    once, then makes every replay run with it.

    Replays ask from several threads when they run in lanes (the plain
    search beside the decisions, the savers' searches side by side): the
    first whose evaluation alone ran out of memory searches, the others that
    end meanwhile wait for its answer, and one that ran with the old
    evaluation batch and ran out of memory only in its evaluation is run
    again with the batch chosen: no thread counts an evaluation-only OOM as
    a training one."""

    def __init__(self, snapshot: Snapshot, option: str, margin_fraction: float):
        self.snapshot = snapshot
        self.option = option
        self.margin_fraction = margin_fraction
        self.search: Optional[EvaluationSearch] = None
        self.chosen: Optional[int] = None
        self.original: Optional[int] = None
        self.trained_batch: Optional[str] = None  # the label of the replay that raised it
        # The thread searching (its own trials pass through), and the
        # condition the other threads' replays wait on until it has chosen.
        self._searcher: Optional[int] = None
        self._decided = threading.Condition()
        # An OOM in evaluation is searched through this option itself
        # (oomdoc.replay.search.find_search_batch): not settled here, unless
        # its replays showed the training out of memory first (search.training_instead).
        self.armed = not (snapshot.oom is not None and snapshot.oom.in_evaluation)

    def arm(self) -> None:
        """Settle from now on (the search went to the training batch)."""
        self.armed = True

    def rewrite(self, args: list[str]) -> list[str]:
        """A replay's arguments once the evaluation batch is chosen."""
        if self.chosen is None:
            return args
        return with_evaluation_batch(
            args, self.option, self.chosen, self.snapshot.script_option_syntax
        )

    def settle(
        self,
        replayer: Replayer,
        replay: Replay,
        payload: Optional[dict],
        label: str,
        args: Optional[list[str]],
        extra_env: Optional[dict],
        micro_batches_per_step: Optional[int],
    ) -> Replay:
        """`replay` itself, or, when it is the first whose evaluation alone
        ran out of memory (or one that ran with the old evaluation batch
        before it was chosen), the same replay again with the evaluation
        batch searched for it."""

        def again() -> Replay:
            return replayer.run(
                payload,
                label,
                args=None if args is None else self.rewrite(list(args)),
                extra_env=extra_env,
                micro_batches_per_step=micro_batches_per_step,
            )

        if not self.armed:
            return replay
        with self._decided:
            if self._searcher == threading.get_ident():
                return replay  # one of the search's own trials
            while self._searcher is not None:
                self._decided.wait()
            if not only_the_evaluation_ran_out(replay):
                return replay
            base = list(replayer.request.args if args is None else args)
            original = None if self.search is not None else self._evaluation_batch(base, replay)
            if original is None:
                # Searched already: one that ran with the old batch runs
                # again, outside the lock (the other threads' replays go on).
                stale = replay.args is not None and self.rewrite(list(replay.args)) != replay.args
                run_again = self.search is not None and self.chosen is not None and stale
            elif original > 1:
                self._searcher = threading.get_ident()
        if original is None:
            return again() if run_again else replay
        if original <= 1:
            return replay
        try:
            self._search(
                replayer, replay, payload, label, base, original, extra_env, micro_batches_per_step
            )
        finally:
            with self._decided:
                self._searcher = None
                self._decided.notify_all()
        return replay if self.chosen is None else again()

    def _search(
        self,
        replayer: Replayer,
        replay: Replay,
        payload: Optional[dict],
        label: str,
        base: list[str],
        original: int,
        extra_env: Optional[dict],
        micro_batches_per_step: Optional[int],
    ) -> None:
        """Search the evaluation batch from `replay`; once chosen, every
        replay runs with it."""
        syntax = self.snapshot.script_option_syntax
        capacity = self.snapshot.device.capacity_bytes
        limit = capacity - int(self.margin_fraction * capacity)

        def trial(batch_size: int) -> Replay:
            return replayer.run(
                payload,
                f"{label}, evaluation {spelled(self.option, batch_size, syntax)}",
                args=with_evaluation_batch(base, self.option, batch_size, syntax),
                extra_env=extra_env,
                micro_batches_per_step=micro_batches_per_step,
            )

        search = search_evaluation_batch(original, replay, trial, limit)
        self.original, self.trained_batch = original, label
        self.search, self.chosen = search, search.chosen
        if self.chosen is None:
            return
        # Replays started ahead ran with the old evaluation batch.
        replayer.discard_ahead()
        replayer.request = replace(replayer.request, args=self.rewrite(list(replayer.request.args)))

    def _evaluation_batch(self, args: list[str], replay: Replay) -> Optional[int]:
        """The evaluation batch the replay ran with: on its command line,
        else its evaluation DataLoader's, else the option's default."""
        found = find_batch_arg(args, self.option)
        if found is not None:
            return found[2]
        capture = replay.capture
        loaders = [
            loader.batch_size
            for loader in (capture.data_loaders if capture else [])
            if loader.role == "evaluation" and loader.batch_size
        ]
        if loaders:
            return max(loaders)
        default = self.snapshot.script_option_defaults.get(self.option)
        return int(default) if default and str(default).isdigit() else None

    def record(self) -> Optional[BatchSearch]:
        """The search, for the snapshot's replay summary."""
        if self.search is None:
            return None
        fitting = [batch for batch, fits, _peak in self.search.trials if fits]
        largest = max(fitting) if fitting else None
        return BatchSearch(
            source=self.option,
            original_batch_size=self.search.original,
            max_batch_size=self.chosen,
            exact=largest is not None
            and any(not fits and batch == largest + 1 for batch, fits, _ in self.search.trials),
            trials=[[batch, fits] for batch, fits, _peak in self.search.trials],
            stopped=self.search.stopped or None,
        )

    def annotate(self, prescription: Optional[Prescription]) -> None:
        """The prescription ran with the evaluation batch chosen: it says so,
        in its fields and its snippet."""
        if prescription is None or self.chosen is None or prescription.kind == "leak":
            return
        prescription.evaluation_batch_size = self.chosen
        prescription.evaluation_batch_option = self.option
        lines = [self._command_line(line) for line in (prescription.snippet or "").splitlines()]
        prescription.snippet = "\n".join(lines)
        line = (
            f"# and the evaluation batch: "
            f"{spelled(self.option, self.chosen, self.snapshot.script_option_syntax)}"
            f" ({self.original} ran out of memory in the evaluation)"
        )
        prescription.snippet = "\n".join(part for part in (prescription.snippet, line) if part)

    def _command_line(self, line: str) -> str:
        """A snippet's `python script.py ...` line with the evaluation batch
        chosen (the framework writes it from the failing run's command)."""
        if line.lstrip().startswith("#"):
            return line
        try:
            tokens = shlex.split(line)
        except ValueError:
            return line
        if "python" not in tokens:
            return line
        at = tokens.index("python")
        start = at + (3 if tokens[at + 1 : at + 2] == ["-m"] else 2)
        if start > len(tokens):
            return line
        return shlex.join([*tokens[:start], *self.rewrite(tokens[start:])])
