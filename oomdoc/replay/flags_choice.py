"""The choice checked by the script's own flags: where they run out of
memory, or where another configuration could run faster by its flags, the
next choice is measured, and by its flags too.

oomdoc ranks the configurations by its own replays: its autocast, its
checkpointing, its gradient accumulation. The user runs the script's own
switches, which need not cost the same. On an H200 (16 GiB cap) the
Lightning encoder's `--precision bf16-mixed --accumulate-grad-batches 16`
at 16 x 16 ran 497.0 samples/s by its flags, 492.9 in a plain capped run
(benchmarks/plain_step_time.py), and 433.4 in oomdoc's replay of the same
changes (the flags 15% faster). The HF `Trainer` GPT-2's `--bf16` at 8 x 2
ran 123.4 by its flags against 100.7 in oomdoc's replay (23% faster), and
its `--bf16 --gradient_checkpointing` at 16 ran 92.2 against 113.6 (19%
slower): oomdoc's replays ranked the two the wrong way round, and a plain
sweep by hand agreed with the flags (111.1 and 99.0 samples/s). So a rival
whose replay, taken REPLAY_UNDERSTATES faster, beats the choice's flags may
be the faster as the user runs it: it is measured as prescribed and by its
flags as well, and the faster by the flags is prescribed. A rival that only
adds a saver that adds work (checkpointing) shares the choice's switches,
whose flags were just timed against its replay: its replay is scaled so,
and only the switch it adds may differ (EXTRA_WORK_UNDERSTATES). (Before, only a
choice whose flags ran slower than its own replay was checked so: where the
two replays came out closer, the HF `Trainer` was prescribed
`--gradient_checkpointing` in 2 of 6 diagnoses.)

The flags' timings themselves move from one diagnosis to the next by more
than two close configurations differ (FLAGS_NOISE): where the faster by
them has a saver more that only adds work (checkpointing), the one without
it is prescribed unless the flags put the other FLAGS_NOISE ahead
(extra_work_unproven), so that the same script gets the same prescription.
"""

from __future__ import annotations

from typing import Callable, Optional

from oomdoc.model import Prescription
from oomdoc.replay.candidates import Candidate
from oomdoc.replay.own_flags import FLAG_FALLBACKS, flags_disagree, mark_disagreed
from oomdoc.replay.replayer import Replayer, ReplaysInterrupted
from oomdoc.replay.search import extra_savers, fewer_savers, only_adds_work

# How much faster a configuration's own flags may run than oomdoc's replay
# of it: a rival's replay taken this much faster that beats the choice's
# flags is measured by its flags too. Seen above: 15% and 23%; 20% leaves
# out a rival that far below only when its own replay understated it as much,
# since each such check costs a round of two replays (about 10 s on the
# Lightning encoder).
REPLAY_UNDERSTATES = 0.2
# The same, for a rival that has every saver of the choice and more, all of
# which only add work (checkpointing): the savers they share ran by the
# choice's flags as measured (the choice's flags over its replay scale the
# rival's replay), so only the extra saver's switch may differ from oomdoc's.
# The script's own checkpointing against oomdoc's, relative to the
# configuration without it: 1.018 on the Lightning encoder (bf16 +
# checkpointing 423.5 by its flags over 421.0 replayed, against bf16's 487.9
# over 494.0), 0.66 on the HF `Trainer` GPT-2 (92.2/113.6 against
# 123.4/100.7), both on the H200. With 20% here the Lightning encoder's bf16
# at 16 x 16 (flags 0.99 of its replay) sent bf16 + checkpointing (421) to a
# second round of two replays, 11 to 15 s, in 3 of 6 diagnoses; its flags
# never ran faster.
EXTRA_WORK_UNDERSTATES = 0.1
# The choice's flags over its replay scale such a rival's replay down no
# further than this: a flags timing moves up to FLAGS_NOISE from one
# diagnosis to the next, and one that came out low must not hide a rival.
LOWEST_SCALE = 0.9

# How far apart two configurations' own-flags timings must be before the one
# with a saver more that only adds work is taken to be the faster. The HF
# `Trainer` GPT-2 (H200, 16 GiB cap, 2026-11-28 and 29): bf16 at 8 x 2 ran
# 73.5 to 126.7 samples/s by its flags in 22 timings, bf16 + checkpointing at
# 16 70.2 to 115.2 in 21, the second faster in 11 of the 14 diagnoses that
# timed both; plain capped runs by hand, 5 each, put them at 113.8 and 107.3
# on average. Timing both again (with the device to itself) left the choice
# as split, for ~9 s a diagnosis.
FLAGS_NOISE = 0.25


def extra_work_unproven(
    final: Prescription, standing: list[Prescription]
) -> Optional[Prescription]:
    """A standing choice with fewer savers than `final`, those it lacks
    savers that only add work (checkpointing recomputes the forward:
    search.fewer_savers), whose flags ran within FLAGS_NOISE of `final`'s;
    or None. What such savers buy is a larger micro-batch; where the flags'
    timings cannot tell the two apart, that is not shown to pay, and the
    choice without them is prescribed, the same from run to run."""
    speed = final.samples_per_second or 0.0
    fewer = [
        other
        for other in standing
        if fewer_savers(other.fixes, final.fixes)
        and other.samples_per_second
        and other.samples_per_second * (1 + FLAGS_NOISE) >= speed
    ]
    return max(fewer, key=lambda p: p.samples_per_second or 0.0) if fewer else None


def calibrated(chosen: Prescription, rival: Candidate) -> tuple[float, float]:
    """(scale, margin) for the rival's replay against the choice's flags: a
    rival with all of the choice's savers and more that only add work is
    scaled as the choice's flags ran against its replay (LOWEST_SCALE at
    least), with EXTRA_WORK_UNDERSTATES for what it adds; any other, as
    replayed, with REPLAY_UNDERSTATES (where its savers differ, the choice's
    timing says nothing of the switches it lacks)."""
    checked = chosen.verified_by_flags
    flags = checked.samples_per_second if checked is not None else None
    replayed = checked.replay_samples_per_second if checked is not None else None
    extra = extra_savers(chosen.fixes, rival.fixes)
    if (
        not flags
        or not replayed
        or not set(chosen.fixes) < set(rival.fixes)
        or not only_adds_work(extra)
    ):
        return 1.0, REPLAY_UNDERSTATES
    return max(LOWEST_SCALE, flags / replayed), EXTRA_WORK_UNDERSTATES


def chosen_label(chosen: Prescription) -> str:
    return " + ".join(chosen.fixes) or "no fix"


def rival_by_flags(chosen: Prescription, pool: list[Candidate], limit_bytes: int) -> Optional[str]:
    """Why another configuration may be faster than `chosen` as the user
    runs it, or None: its replay (within the margin), taken
    REPLAY_UNDERSTATES faster (or as `calibrated` says), ran faster than
    `chosen` by its flags."""
    checked = chosen.verified_by_flags
    if checked is None or not checked.samples_per_second:
        return None
    flags = checked.samples_per_second

    def reach(candidate: Candidate) -> float:
        # One without savers of `chosen`'s that only add work is prescribed
        # within FLAGS_NOISE of it (extra_work_unproven): it is a rival as far.
        tie = 1 + FLAGS_NOISE if fewer_savers(candidate.fixes, chosen.fixes) else 1.0
        scale, understates = calibrated(chosen, candidate)
        return (candidate.samples_per_second or 0.0) * scale * (1 + understates) * tie

    rivals = [
        candidate
        for candidate in pool
        if candidate.fixes != chosen.fixes
        and candidate.peak_allocated_bytes <= limit_bytes
        and reach(candidate) > flags
    ]
    if not rivals:
        return None
    rival = max(rivals, key=reach)
    replayed = (
        f" (oomdoc's replay of it: {checked.replay_samples_per_second:.1f})"
        if checked.replay_samples_per_second
        else ""
    )
    scale, understates = calibrated(chosen, rival)
    within = f"within the {understates:.0%} oomdoc's replays have run below a script's own flags"
    if understates == EXTRA_WORK_UNDERSTATES:  # scaled as the choice's flags ran
        extra = " + ".join(extra_savers(chosen.fixes, rival.fixes))
        within = (
            f"taken as your flags ran {chosen_label(chosen)} ({scale:.2f} of its replay), "
            f"{within} for {extra}"
        )
    if fewer_savers(rival.fixes, chosen.fixes):
        extra = " + ".join(extra_savers(rival.fixes, chosen.fixes))
        within += f" and the {FLAGS_NOISE:.0%} a flags timing moves, without {extra}'s extra work"
    return (
        f"your script's own flags ran it at {flags:.1f} samples/s{replayed}, and "
        f"{' + '.join(rival.fixes) or 'no fix'}'s replay ran {rival.samples_per_second or 0.0:.1f}: "
        f"{within}, so it was measured by your flags too"
    )


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
    out of memory (flags_disagree) or may run slower than another
    configuration by its flags (rival_by_flags) sets its savers aside and the choice is made again, up to
    FLAG_FALLBACKS times. Of the choices whose flags fit, the fastest by
    its flags is prescribed, unless one without some of its savers ran
    within FLAGS_NOISE of it (extra_work_unproven)."""
    disagreed: dict[tuple, str] = {}  # savers set aside, and why
    fitting: list[Prescription] = []  # choices whose flags fit, set aside as maybe slower
    chosen: Optional[Prescription] = None
    while True:
        # Each candidate as last measured: a bound that an earlier choice's
        # replay measured as prescribed is weighed by that timing (a rival
        # by its flags too) and not replayed again.
        pool = [c.latest() for c in candidates if tuple(c.fixes) not in disagreed]
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
        # The pool as this choice left it: bounds it measured weigh as measured.
        weighed = [c.latest() for c in pool]
        rival = None if disagreement else rival_by_flags(chosen, weighed, limit_bytes)
        if disagreement is None and rival is None:
            break
        disagreed[tuple(chosen.fixes)] = disagreement or rival or ""
        if rival is not None:
            fitting.append(chosen)
    if chosen is None:
        return None
    # Of the choices whose flags fit, the fastest; a choice's throughput is
    # its flags' where they were timed (own_flags.flags_throughput).
    standing = [*fitting, *([chosen] if flags_disagree(chosen) is None else [])]
    final = max(standing, key=lambda p: p.samples_per_second or 0.0) if standing else chosen
    tied: dict[tuple, str] = {}
    without = extra_work_unproven(final, standing)
    if without is not None:
        extra = " + ".join(extra_savers(without.fixes, final.fixes))
        tied[tuple(final.fixes)] = (
            f"{final.samples_per_second or 0.0:.1f} samples/s by your script's own flags "
            f"against {without.samples_per_second or 0.0:.1f} without {extra}: "
            f"within the {FLAGS_NOISE:.0%} those timings move from run to run, and "
            f"{extra} only adds work"
        )
        final = without
    slower_by_flags = {
        tuple(other.fixes): (
            f"slower by your script's own flags: {other.samples_per_second or 0.0:.1f} "
            f"samples/s against {final.samples_per_second or 0.0:.1f}"
        )
        for other in standing
        if other is not final and tuple(other.fixes) not in tied
    }
    for fixes in [*slower_by_flags, *tied, tuple(final.fixes)]:
        disagreed.pop(fixes, None)
    mark_disagreed(final, disagreed)
    mark_disagreed(final, slower_by_flags, verdict="slower_by_flags")
    mark_disagreed(final, tied, verdict="tied_by_flags")
    return final
