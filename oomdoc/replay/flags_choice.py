"""The choice checked by the script's own flags: where they run out of
memory, or run slower than another configuration could, the next choice is
measured, and by its flags too.

oomdoc ranks the configurations by its own replays: its autocast, its
checkpointing, its gradient accumulation. The user runs the script's own
switches, which need not cost the same: on an H200 (16 GiB cap) the
Lightning encoder's `--precision bf16-mixed --accumulate-grad-batches 16`
at 16 x 16 ran 497.0 samples/s in its own-flags replay, 492.9 in a plain
capped run (benchmarks/plain_step_time.py), and 433.4 in oomdoc's replay of
the same changes. There the flags ran faster, and nothing more is needed.
When a choice's flags run slower than its replay (beyond the timing noise)
and another configuration's replay ran faster than those flags, which one is
faster as the user runs it is not known: that one is measured as prescribed
and by its flags as well, and the faster by the flags is prescribed.
"""

from __future__ import annotations

from typing import Callable, Optional

from oomdoc.model import Prescription
from oomdoc.replay.candidates import Candidate
from oomdoc.replay.own_flags import FLAG_FALLBACKS, flags_disagree, mark_disagreed
from oomdoc.replay.replayer import Replayer, ReplaysInterrupted
from oomdoc.replay.timing import UNSEEN_NOISE, ratio_noise

# The least shortfall of the flags against oomdoc's replay that counts as
# slower (the timings' noise, when larger, counts instead).
SLOWER_BY_FLAGS = 0.05


def flags_slower(chosen: Prescription, pool: list[Candidate], limit_bytes: int) -> Optional[str]:
    """Why another configuration may be faster than `chosen` as the user
    runs it, or None: its flags ran slower than oomdoc's replay of it, and
    another configuration (within the margin) ran faster in oomdoc's replay
    than those flags."""
    checked = chosen.verified_by_flags
    if checked is None or not checked.samples_per_second or not checked.replay_samples_per_second:
        return None
    flags, replayed = checked.samples_per_second, checked.replay_samples_per_second
    noise = max(
        SLOWER_BY_FLAGS,
        ratio_noise(checked.samples_per_second_noise, chosen_noise(chosen)),
    )
    if flags >= replayed * (1 - noise):
        return None
    rivals = [
        candidate
        for candidate in pool
        if candidate.fixes != chosen.fixes
        and candidate.peak_allocated_bytes <= limit_bytes
        and (candidate.samples_per_second or 0.0) > flags
    ]
    if not rivals:
        return None
    rival = max(rivals, key=lambda candidate: candidate.samples_per_second or 0.0)
    return (
        f"your script's own flags ran it at {flags:.1f} samples/s, below oomdoc's replay of "
        f"it ({replayed:.1f}) and below {' + '.join(rival.fixes) or 'no fix'}'s replay "
        f"({rival.samples_per_second or 0.0:.1f}): measured by your flags too"
    )


def chosen_noise(chosen: Prescription) -> Optional[float]:
    """The noise of oomdoc's own timing of the choice (its considered entry)."""
    for entry in chosen.considered or []:
        if entry.verdict == "prescribed":
            return entry.samples_per_second_noise
    return UNSEEN_NOISE


def choose_with_flags(
    replayer: Replayer,
    candidates: list[Candidate],
    limit_bytes: int,
    choose: Callable[[list[Candidate]], tuple[Optional[Prescription], bool]],
    complete: Callable[[Prescription], None],
    verify: Callable[[Prescription], None],
) -> Optional[Prescription]:
    """The prescription: `choose` among the candidates, `complete` its
    report, `verify` it by the script's own flags; a choice whose flags ran
    out of memory (flags_disagree) or ran slower than another could
    (flags_slower) sets its savers aside and the choice is made again, up to
    FLAG_FALLBACKS times. Of the choices whose flags fit, the fastest by
    its flags is prescribed."""
    disagreed: dict[tuple, str] = {}  # savers set aside, and why
    fitting: list[Prescription] = []  # choices whose flags fit, set aside as maybe slower
    chosen: Optional[Prescription] = None
    while True:
        pool = [c for c in candidates if tuple(c.fixes) not in disagreed]
        choice, interrupted = choose(pool)
        if choice is None:
            break  # none without those savers: the last choice stands, its check shown
        chosen = choice
        complete(chosen)
        if chosen.fits and not interrupted and not replayer.stopped:
            try:
                verify(chosen)
            except ReplaysInterrupted:
                pass  # Ctrl-C during the check: the prescription stands without it
        if len(disagreed) >= FLAG_FALLBACKS or replayer.stopped:
            break
        disagreement = flags_disagree(chosen)
        slower = None if disagreement else flags_slower(chosen, pool, limit_bytes)
        if disagreement is None and slower is None:
            break
        disagreed[tuple(chosen.fixes)] = disagreement or slower or ""
        if slower is not None:
            fitting.append(chosen)
    if chosen is None:
        return None
    # Of the choices whose flags fit, the fastest; a choice's throughput is
    # its flags' where they were timed (own_flags.flags_throughput).
    standing = [*fitting, *([chosen] if flags_disagree(chosen) is None else [])]
    final = max(standing, key=lambda p: p.samples_per_second or 0.0) if standing else chosen
    slower_by_flags = {
        tuple(other.fixes): (
            f"slower by your script's own flags: {other.samples_per_second or 0.0:.1f} "
            f"samples/s against {final.samples_per_second or 0.0:.1f}"
        )
        for other in standing
        if other is not final
    }
    for fixes in [*slower_by_flags, tuple(final.fixes)]:
        disagreed.pop(fixes, None)
    mark_disagreed(final, disagreed)
    mark_disagreed(final, slower_by_flags, verdict="slower_by_flags")
    return final
