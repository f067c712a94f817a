"""The prescription as the user will run it: enough steps for its
accumulation to be measured, the record of that replay, its snippet in the
framework's words, and one replay of the script with its own flags for the
prescribed changes (where it declares them), so that the command printed is
one that was run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from oomdoc.fixes import batch_fix, fix_named
from oomdoc.fixes.base import SnippetContext
from oomdoc.frameworks import context_from_snapshot, framework_of
from oomdoc.frameworks.base import (
    FrameworkContext,
    accumulation_in_effect,
    command_with_option,
    with_enough_steps,
    with_option,
)
from oomdoc.model import ConsideredConfiguration, FlagsCheck, Prescription, Snapshot, parse
from oomdoc.replay import batch as batch_model
from oomdoc.replay.lanes import SPECULATIVE
from oomdoc.replay.plan import ReplayState, searches_evaluation_batch
from oomdoc.replay.replayer import Replay, Replayer
from oomdoc.script_flags import from_command_line


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
        how = state.batch_info.get("source") or ""
        changes.append(batch_fix().name)
        context["micro_batch"] = prescription.batch_size
        context["accumulation_steps"] = prescription.accumulation_steps
        context["how"] = how if from_command_line(how) else ""
    return changes, context


def prescription_snippet(snapshot: Snapshot, prescription: Prescription, state: ReplayState) -> str:
    """The prescribed changes as one block in the framework's own terms, and
    the evaluation's batch where the search was the evaluation's."""
    changes, context = prescription_context(snapshot, prescription, state)
    evaluation = searches_evaluation_batch(snapshot, state.batch_info)
    batch = prescription.batch_size if evaluation else None
    how = state.batch_info.get("source") or ""
    command = context.get("command")
    if batch and from_command_line(how) and command:
        # The savers' command line runs at the prescribed evaluation batch too.
        context["command"] = command_with_option(
            command, how, str(batch), snapshot.script_option_syntax
        )
    blocks = [framework_of(snapshot).prescription_snippet(changes, context)] if changes else []
    if batch:
        blocks.append(evaluation_batch_snippet(snapshot, batch, how))
    return "\n\n".join(blocks)


def evaluation_batch_snippet(snapshot: Snapshot, batch: int, how: str) -> str:
    """The evaluation at `batch` in the framework's knobs (the script's own
    option `how` where the search went through one)."""
    context = context_from_snapshot(snapshot)
    context["how"] = how
    return framework_of(snapshot).evaluation_batch_snippet(batch, context)


@dataclass
class FlagsReplay:
    """The script run with its own flags for a prescription's changes."""

    args: list[str]  # the script's argv with those flags
    replayed_args: list[str]  # the same, its steps flag raised if need be
    raised: Optional[str]  # how the steps flag was raised
    covers: list[str]  # the changes the flags make
    micro_batches: int  # micro-batches per optimizer step
    # The environment of the changes made by it (an allocator setting).
    env: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        setting = "".join(f" with {key}={value}" for key, value in sorted(self.env.items()))
        return "the script's own flags: " + " ".join(self.replayed_args) + setting

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
    env: dict = {}
    for change in changes:
        fix = fix_named(change)
        if fix is not None and fix.by_environment:
            env.update(fix.request(snapshot).env)
            covered.append(change)
            continue
        variant = framework.flag_variant(change, args, snapshot.script_options, context)
        if variant is not None:
            args, covered = variant, [*covered, change]
    source = state.batch_info.get("source") or ""
    evaluation = searches_evaluation_batch(snapshot, state.batch_info)
    if evaluation and from_command_line(source) and prescription.batch_size:
        # The evaluation's batch is not one of the changes (nothing is
        # accumulated), but the prescription runs at it.
        args = with_option(
            args, source, str(prescription.batch_size), snapshot.script_option_syntax
        )
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
    return FlagsReplay(args, replayed_args, raised, covered, micro_batches, env)


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
        extra_env=flags.env or None,
        priority=SPECULATIVE,
        micro_batches_per_step=flags.micro_batches_per_step,
    )


def verify_with_flags(
    replayer: Replayer, snapshot: Snapshot, prescription: Prescription, state: ReplayState
) -> None:
    """Where the script has its own command-line flags for the prescribed
    changes (HfArgumentParser's --gradient_checkpointing, --bf16, ...), one
    replay runs the script with those flags and no fix of oomdoc's: its peak
    is reported next to the prescription's, and its throughput is the
    prescription's (flags_throughput)."""
    flags = flags_replay(replayer, snapshot, state, prescription)
    if flags is None:
        return
    replay = replayer.run(
        None,
        flags.label,
        args=flags.replayed_args,
        extra_env=flags.env or None,
        micro_batches_per_step=flags.micro_batches_per_step,
    )
    record = replay_record(replay, flags.args, flags.raised)
    record["covers"] = flags.covers
    if flags.env:
        record["env"] = flags.env
    if flags.micro_batches <= 1:
        del record["accumulation_covered"]
    checked = prescription.verified_by_flags = parse(FlagsCheck, record)
    if replay.fits and replay.peak_allocated_bytes and prescription.peak_allocated_bytes:
        ratio = replay.peak_allocated_bytes / prescription.peak_allocated_bytes
        checked.peak_ratio = round(ratio, 3)
    flags_throughput(snapshot, state, prescription, replay)


def flags_throughput(
    snapshot: Snapshot, state: ReplayState, prescription: Prescription, replay: Replay
) -> None:
    """The prescription's throughput as its own-flags replay timed it: that
    is the run the user will make. oomdoc's replay of the same changes
    (kept as `replay_samples_per_second`) can differ: the framework's
    switches are not oomdoc's fixes of the same name. Only where a step of
    that replay is one optimizer step of the prescribed micro-batches, and
    not for an evaluation batch (ranked by its training steps)."""
    checked = prescription.verified_by_flags
    capture = replay.capture
    if (
        checked is None
        or not replay.fits
        or not replay.step_s
        or not prescription.batch_size
        or capture is None
        or searches_evaluation_batch(snapshot, state.batch_info)
    ):
        return
    accumulation = max(1, prescription.accumulation_steps)
    if accumulation > 1 and capture.step_unit != "optimizer":
        return  # its steps are micro-batches, or backwards: not what is prescribed
    speed = prescription.batch_size * accumulation / replay.step_s
    checked.samples_per_second = round(speed, 3)
    checked.samples_per_second_noise = replay.step_noise
    before = prescription.samples_per_second
    checked.replay_samples_per_second = before
    prescription.samples_per_second = checked.samples_per_second
    prescription.samples_per_second_noise = replay.step_noise
    prescription.throughput_batch_size = None  # measured at the batch prescribed
    if before and prescription.throughput_ratio:
        prescription.throughput_ratio = round(prescription.throughput_ratio * speed / before, 3)


# Choices given up when the script's own flags for their savers ran out of
# memory where oomdoc's replay of the same configuration fit; after these the
# last choice stands, its check's outcome shown beside it.
FLAG_FALLBACKS = 2


def flags_disagree(prescription: Prescription) -> Optional[str]:
    """Why the script's own flags are not the prescription, or None: they
    ran out of memory where oomdoc's savers fit, so they do not apply the
    savers as oomdoc did (the Trainer's `--bf16` leaves `generate()` out of
    autocast, a flag checkpoints other layers), and telling the user to use
    them would prescribe an OOM. Only for savers the flags make: a batch
    change or an allocator setting is the same either way."""
    checked = prescription.verified_by_flags
    if checked is None or checked.outcome != "oom" or not prescription.fits:
        return None
    savers = [
        name
        for name in checked.covers
        if name in prescription.fixes and not getattr(fix_named(name), "by_environment", False)
    ]
    if not savers:
        return None
    return (
        f"your script's own flags for {' + '.join(savers)} ({' '.join(checked.args or [])}) "
        "ran out of memory where oomdoc's replay of it fit: they do not apply it as oomdoc did"
    )


def mark_disagreed(
    prescription: Prescription, disagreed: dict[tuple, str], verdict: str = "flags_disagree"
) -> None:
    """Each configuration given up for its script flags, in the report's
    list of those weighed, with why (`verdict`: out of memory by them, or
    slower by them: oomdoc.replay.flags_choice)."""
    if prescription.considered is None:
        return
    listed = {tuple(entry.fixes): entry for entry in prescription.considered}
    for fixes, reason in disagreed.items():
        if list(fixes) == prescription.fixes:
            continue  # nothing without it was left: prescribed, its check's OOM shown
        entry = listed.get(fixes)
        if entry is None:
            entry = ConsideredConfiguration(fixes=list(fixes), measured=True)
            prescription.considered.append(entry)
        entry.verdict, entry.reason = verdict, reason
