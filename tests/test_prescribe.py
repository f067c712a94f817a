"""The prescription: the measured configuration with the highest throughput
that leaves the safety margin free; no-op fixes are never combined."""

from __future__ import annotations

from oomdoc.replay.prescribe import Candidate, choose, is_no_op

MiB = 1024**2


def test_the_fastest_configuration_within_the_margin_wins():
    plain = Candidate([], 58, 190 * MiB, 10.0, "smaller_batch 58")  # 5.8 samples/s, no margin
    checkpointing = Candidate(["checkpointing"], 64, 88 * MiB, 12.0, "checkpointing")  # 5.33
    autocast = Candidate(["autocast"], 64, 145 * MiB, 8.0, "autocast")  # 8.0
    small = Candidate([], 32, 120 * MiB, 7.0, "smaller_batch 32")  # 4.57
    chosen = choose([plain, checkpointing, autocast, small], 64, 192 * MiB, 0.05, reference=plain)
    assert chosen is not None and chosen.fits and chosen.fixes == ["autocast"]
    assert chosen.batch_size == 64 and chosen.accumulation_steps == 1
    assert chosen.samples_per_second == 8.0 and chosen.throughput_ratio == round(8.0 / 5.8, 3)
    assert chosen.headroom_bytes == 47 * MiB and chosen.margin_bytes == int(0.05 * 192 * MiB)


def test_a_smaller_batch_gets_gradient_accumulation_for_the_effective_batch():
    chosen = choose([Candidate([], 20, 15 * MiB, 1.0, "b20")], 64, 20 * MiB, 0.05, reference=None)
    # 64 samples in 4 micro-batches of 16 (a divisor of 64 that fits under 20).
    assert (chosen.batch_size, chosen.accumulation_steps) == (16, 4)


def test_the_micro_batch_prescribed_is_the_one_measured():
    """A search replay at 20 prescribes micro-batches of 16 (4 x 16 = 64):
    once a replay ran at 16, its peak and throughput are the prescription's,
    even where the replay at 20 ran faster."""
    at_20 = Candidate([], 20, 15 * MiB, 1.0, "b20")
    at_16 = Candidate([], 16, 12 * MiB, 1.0, "b16")
    chosen = choose([at_20, at_16], 64, 20 * MiB, 0.05, reference=None)
    assert (chosen.batch_size, chosen.accumulation_steps) == (16, 4)
    assert chosen.peak_allocated_bytes == 12 * MiB and chosen.samples_per_second == 16.0
    assert "'b16'" in chosen.detail
    # With other fixes, the replay at 16 measures another configuration.
    with_fix = Candidate(["checkpointing"], 16, 12 * MiB, 1.0, "checkpointing b16")
    chosen = choose([at_20, with_fix], 64, 20 * MiB, 0.05, reference=None)
    assert chosen.fixes == [] and chosen.peak_allocated_bytes == 15 * MiB


def test_without_room_for_the_margin_the_lowest_peak_is_offered_and_says_so():
    tight = Candidate(["checkpointing"], 64, 190 * MiB, 1.0, "checkpointing")
    tighter = Candidate(["autocast"], 64, 189 * MiB, 2.0, "autocast")
    chosen = choose([tight, tighter], 64, 192 * MiB, 0.05, reference=None)
    assert not chosen.fits and chosen.fixes == ["autocast"]
    assert "safety margin" in chosen.detail
    assert choose([], 64, 192 * MiB, 0.05, reference=None) is None


def test_no_op_fixes():
    need = 100 * MiB
    assert is_no_op(99.5 * MiB, True, None, None, need)  # fits but saved 0.5%
    assert not is_no_op(90 * MiB, True, None, None, need)
    failing = (0, "backward", 16 * MiB, 180 * MiB)
    assert is_no_op(None, False, (0, "backward", 16 * MiB, 180 * MiB + 1000), failing, need)
    # Out of memory later, or with less in use: it helped.
    assert not is_no_op(None, False, (1, "forward", 16 * MiB, 180 * MiB), failing, need)
    assert not is_no_op(None, False, (0, "backward", 16 * MiB, 150 * MiB), failing, need)
