"""The choice checked by the script's own flags (oomdoc.replay.flags_choice):
a choice whose flags another configuration's replay could beat (taken
REPLAY_UNDERSTATES faster) is measured against that one by its flags too,
and the faster by the flags is prescribed."""

from __future__ import annotations

from types import SimpleNamespace

from oomdoc.model import ConsideredConfiguration, FlagsCheck, Prescription
from oomdoc.replay.candidates import Candidate
from oomdoc.replay.flags_choice import (
    FLAGS_NOISE,
    choose_with_flags,
    extra_work_unproven,
    rival_by_flags,
)

MiB = 1 << 20
LIMIT = 100 * MiB


def lightning_case(flags_speeds: dict[tuple, float]):
    """The Lightning encoder on the H200: oomdoc's replays put autocast at
    16 x 16 (464 samples/s) above bf16 + checkpointing at 32 (404 at most);
    `flags_speeds`: what each ran by the script's own flags."""
    candidates = [
        Candidate(["autocast"], 16, 60 * MiB, 16 / 464.0, "autocast 16"),
        Candidate(["autocast", "checkpointing"], 32, 58 * MiB, 32 / 404.0, "both 32"),
        Candidate([], 16, 90 * MiB, 16 / 73.0, "b24"),
    ]
    chosen_pools, verified = [], []

    def choose(pool):
        chosen_pools.append([tuple(c.fixes) for c in pool])
        return fastest_of(pool, weighed=candidates), False

    verify = flags_verifier(flags_speeds, verified)
    replayer = SimpleNamespace(stopped=False)
    final = choose_with_flags(replayer, candidates, LIMIT, choose, lambda p: None, verify)
    return final, chosen_pools, verified


def fastest_of(pool: list[Candidate], weighed: list[Candidate]) -> Prescription:
    """As measured_choice would prescribe: the fastest of `pool` at the
    effective batch 256, `weighed` listed under it."""
    best = max(pool, key=lambda c: c.samples_per_second or 0.0)
    prescription = Prescription(
        fixes=list(best.fixes),
        batch_size=best.batch_size,
        accumulation_steps=256 // best.batch_size,
        fits=True,
        samples_per_second=best.samples_per_second,
    )
    prescription.considered = [
        ConsideredConfiguration(
            fixes=list(c.fixes),
            samples_per_second=c.samples_per_second,
            samples_per_second_noise=0.01,
            verdict="prescribed" if c is best else "slower",
        )
        for c in weighed
    ]
    return prescription


def flags_verifier(flags_speeds: dict[tuple, float], verified: list):
    """verify_with_flags, scripted: each choice's flags ran `flags_speeds`."""

    def verify(prescription):
        verified.append(tuple(prescription.fixes))
        speed = flags_speeds[tuple(prescription.fixes)]
        prescription.verified_by_flags = FlagsCheck(
            args=["--flags"],
            outcome="fits",
            samples_per_second=speed,
            samples_per_second_noise=0.01,
            replay_samples_per_second=prescription.samples_per_second,
        )
        prescription.samples_per_second = speed  # as own_flags.flags_throughput does

    return verify


def verdicts(prescription):
    return {tuple(entry.fixes): entry.verdict for entry in prescription.considered}


def test_a_choice_slower_by_its_flags_than_another_could_be_gives_way_to_the_faster_by_flags():
    both = ("autocast", "checkpointing")
    final, pools, verified = lightning_case({("autocast",): 300.0, both: 409.0})
    assert verified == [("autocast",), both]
    assert ("autocast",) not in pools[1]  # its savers set aside for the second choice
    assert tuple(final.fixes) == both and final.samples_per_second == 409.0
    assert verdicts(final)[("autocast",)] == "slower_by_flags"
    reason = next(e.reason for e in final.considered if e.fixes == ["autocast"])
    assert "300.0 samples/s against 409.0" in reason


def test_the_first_choice_stands_when_the_other_is_slower_by_its_flags_too():
    both = ("autocast", "checkpointing")
    final, _pools, verified = lightning_case({("autocast",): 380.0, both: 350.0})
    assert verified == [("autocast",), both]
    assert final.fixes == ["autocast"] and final.samples_per_second == 380.0
    assert verdicts(final)[both] == "slower_by_flags"


def test_flags_no_rivals_replay_could_beat_need_no_second_choice():
    # bf16 + checkpointing's replay, 404 samples/s, taken 20% faster: 484.8.
    final, pools, verified = lightning_case({("autocast",): 497.0})
    assert verified == [("autocast",)] and len(pools) == 1
    assert final.fixes == ["autocast"]


def test_a_rival_with_a_saver_more_that_only_adds_work_is_weighed_as_the_choices_flags_ran():
    """The Lightning encoder on the H200: bf16 at 16 x 16 ran 487.9 samples/s
    by its flags and 494.0 replayed; bf16 + checkpointing's replay (421),
    taken 20% faster, beat those flags, and a second round of two replays
    (11 to 15 s) measured its flags: 423.5. The savers they share ran by the
    choice's flags as replayed; only checkpointing's switch may differ from
    oomdoc's (EXTRA_WORK_UNDERSTATES). Here 404 x 0.98 x 1.1 = 435.6 < 455,
    where 404 x 1.2 = 484.8 was a rival."""
    both = ("autocast", "checkpointing")
    final, pools, verified = lightning_case({("autocast",): 455.0, both: 600.0})
    assert verified == [("autocast",)] and len(pools) == 1
    assert final.fixes == ["autocast"]


def test_a_rival_calibrated_by_the_choices_flags_says_so_and_stays_a_rival_within_reach():
    chosen = Prescription(fixes=["autocast"], batch_size=16, samples_per_second=455.0)
    chosen.verified_by_flags = FlagsCheck(
        outcome="fits", samples_per_second=455.0, replay_samples_per_second=464.0
    )
    near = Candidate(["autocast", "checkpointing"], 32, 58 * MiB, 32 / 430.0, "both 32")
    reason = rival_by_flags(chosen, [near], LIMIT) or ""  # 430 x 0.98 x 1.1 = 463.6
    assert "taken as your flags ran autocast (0.98 of its replay)" in reason
    assert (
        "within the 10% oomdoc's replays have run below a script's own flags for checkpointing"
        in reason
    )
    chosen.verified_by_flags.samples_per_second = 464.0  # its flags as its replay: scaled by 1
    reason = rival_by_flags(chosen, [near], LIMIT) or ""  # 430 x 1.1 = 473
    assert "taken as your flags ran autocast (1.00 of its replay)" in reason


def test_a_rival_whose_extra_saver_may_speed_steps_up_keeps_the_whole_margin():
    """As on the HF `Trainer` on the H200, where bf16's flags ran 23% faster
    than oomdoc's autocast: a rival that adds autocast to the choice is not
    scaled by the choice's flags, and gets REPLAY_UNDERSTATES."""
    chosen = Prescription(fixes=["checkpointing"], batch_size=16, samples_per_second=100.0)
    chosen.verified_by_flags = FlagsCheck(
        outcome="fits", samples_per_second=100.0, replay_samples_per_second=100.0
    )
    faster = Candidate(["autocast", "checkpointing"], 16, 58 * MiB, 16 / 90.0, "both 16")
    reason = rival_by_flags(chosen, [faster], LIMIT) or ""  # 90 x 1.2 = 108
    assert "within the 20%" in reason and "taken as" not in reason
    slower = Candidate(["autocast", "checkpointing"], 16, 58 * MiB, 16 / 80.0, "both 16")
    assert rival_by_flags(chosen, [slower], LIMIT) is None  # 96


def test_flags_far_below_the_choices_replay_scale_a_rival_down_no_further_than_the_floor():
    """A flags timing that came out low (they move 25% between diagnoses)
    must not hide a rival: the scale stops at LOWEST_SCALE."""
    chosen = Prescription(fixes=["autocast"], batch_size=16, samples_per_second=300.0)
    chosen.verified_by_flags = FlagsCheck(
        outcome="fits", samples_per_second=300.0, replay_samples_per_second=464.0
    )
    both = Candidate(["autocast", "checkpointing"], 32, 58 * MiB, 32 / 310.0, "both 32")
    # 310 x 0.9 x 1.1 = 306.9 > 300; scaled by 300/464 it would be 220.
    assert "(0.90 of its replay)" in (rival_by_flags(chosen, [both], LIMIT) or "")


def test_no_second_choice_when_no_other_configuration_ran_faster_than_the_flags():
    chosen = Prescription(fixes=["autocast"], batch_size=16, samples_per_second=300.0)
    chosen.verified_by_flags = FlagsCheck(
        outcome="fits", samples_per_second=300.0, replay_samples_per_second=464.0
    )
    slow = Candidate(["checkpointing"], 32, 50 * MiB, 32 / 58.0, "ckpt 32")
    assert rival_by_flags(chosen, [slow], LIMIT) is None
    fast = Candidate(["autocast", "checkpointing"], 32, 58 * MiB, 32 / 404.0, "both 32")
    assert "measured by your flags too" in (rival_by_flags(chosen, [slow, fast], LIMIT) or "")
    over = Candidate(["autocast", "checkpointing"], 32, 120 * MiB, 32 / 404.0, "both 32")
    assert rival_by_flags(chosen, [over], LIMIT) is None  # over the margin: not a rival


def test_a_saver_more_that_its_flags_cannot_show_faster_is_not_prescribed():
    """The HF `Trainer` on the H200: bf16 + checkpointing at 16 ran 98.2
    samples/s by its flags, bf16 at 8 x 2 86.3, in one diagnosis; plain runs
    by hand put them at 107.3 and 113.8 on average, and one configuration's
    flags timings move 25% between diagnoses. Checkpointing adds work at a
    given batch: within that noise the choice without it is prescribed, in
    every run alike."""
    both = ("autocast", "checkpointing")
    final, _pools, verified = lightning_case({("autocast",): 86.3 * 4, both: 98.2 * 4})
    assert verified == [("autocast",), both]
    assert final.fixes == ["autocast"] and final.samples_per_second == 86.3 * 4
    assert verdicts(final)[both] == "tied_by_flags"
    reason = next(e.reason for e in final.considered if tuple(e.fixes) == both)
    assert reason.startswith("392.8 samples/s by your script's own flags against 345.2 without")
    assert "within the 25%" in reason and "checkpointing only adds work" in reason


def test_only_a_choice_with_fewer_savers_breaks_a_tie():
    def timed(fixes, speed):
        return Prescription(fixes=fixes, samples_per_second=speed)

    both = timed(["autocast", "checkpointing"], 100.0)
    within = 100.0 / (1 + FLAGS_NOISE) + 0.1
    assert extra_work_unproven(both, [both, timed(["autocast"], within)]).fixes == ["autocast"]
    assert extra_work_unproven(both, [both, timed(["autocast"], within - 0.2)]) is None
    # Other savers, not fewer: the faster stands.
    assert extra_work_unproven(both, [both, timed(["offload"], 99.0)]) is None
    alone = timed(["checkpointing"], 100.0)
    assert extra_work_unproven(alone, [alone, timed(["autocast"], 99.0)]) is None
    # Fewer savers, but what it lacks speeds steps up (autocast): the faster stands.
    assert extra_work_unproven(both, [both, timed(["checkpointing"], 99.0)]) is None
    # No saver at all (a smaller batch with accumulation) has fewer too.
    assert extra_work_unproven(alone, [alone, timed([], 90.0)]).fixes == []
    assert extra_work_unproven(alone, [alone, timed([], None)]) is None  # untimed


def test_a_rival_without_a_saver_that_only_adds_work_is_measured_by_its_flags_further_off():
    """bf16 + checkpointing's flags at 115 samples/s; bf16 alone's replay at
    90, taken 20% faster, is 108: not a rival by REPLAY_UNDERSTATES, but
    it would be prescribed within FLAGS_NOISE of 115 (extra_work_unproven),
    so it is measured by its flags too."""
    chosen = Prescription(fixes=["autocast", "checkpointing"], samples_per_second=115.0)
    chosen.verified_by_flags = FlagsCheck(outcome="fits", samples_per_second=115.0)
    without = Candidate(["autocast"], 8, 60 * MiB, 8 / 90.0, "autocast 8")
    reason = rival_by_flags(chosen, [without], LIMIT) or ""
    assert "without checkpointing's extra work, so it was measured by your flags too" in reason
    other = Candidate(["offload"], 8, 60 * MiB, 8 / 90.0, "offload 8")
    assert rival_by_flags(chosen, [other], LIMIT) is None
    slow = Candidate(["autocast"], 8, 60 * MiB, 8 / 70.0, "autocast 8")  # 70 x 1.2 x 1.25 = 105
    assert rival_by_flags(chosen, [slow], LIMIT) is None


def test_a_choice_measured_slower_than_its_bound_stays_a_rival_by_that_measurement():
    """The Lightning encoder on the H200: autocast at 16 (untimed: its search
    fit no batch) was measured as prescribed, 16 x 16, at 321.1 samples/s in
    a noisy replay, so bf16 + checkpointing at 32 x 8 (401.8) was chosen and
    its flags ran 422.8; autocast's own flags had run 489.9. The measured
    candidate took the bound's place (measured_as): it is weighed again by
    that timing, a rival within the 20% x 25% reach, measured by its flags,
    and prescribed; the bound is never chosen, nor replayed, again."""
    both = ("autocast", "checkpointing")
    bound = Candidate(["autocast"], 16, 60 * MiB, None, "autocast 16", untimed=True)
    measured = Candidate(["autocast"], 16, 60 * MiB, 16 / 321.1, "16 x 16", exact=True)
    candidates = [bound, Candidate(list(both), 32, 58 * MiB, 32 / 404.6, "both 32")]
    flags_speeds = {("autocast",): 489.9, both: 422.8}
    pools, verified = [], []

    def choose(pool):
        pools.append([(tuple(c.fixes), c.untimed) for c in pool])
        if bound.measured_as is None:  # measured_choice's first round replays the bound
            bound.measured_as = measured
            pool = [c.latest() for c in pool]
        return fastest_of(pool, weighed=pool), False

    verify = flags_verifier(flags_speeds, verified)
    replayer = SimpleNamespace(stopped=False)
    final = choose_with_flags(replayer, candidates, LIMIT, choose, lambda p: None, verify)
    assert verified == [both, ("autocast",)]
    assert pools[1] == [(("autocast",), False)]  # the measurement, not the untimed bound
    assert final.fixes == ["autocast"] and final.samples_per_second == 489.9
    assert verdicts(final)[both] == "slower_by_flags"
