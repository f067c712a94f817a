"""When the CUDA capture records a stack per allocation (stack_recording)."""

from oomdoc.capture.stack_recording import StackRecording

GIB = 1 << 30


def step(peak, end, trained=True, index=0):
    return {
        "index": index,
        "peak_allocated_bytes": peak,
        "end_allocated_bytes": end,
        "optimizer_steps": int(trained),
        "backward_calls": int(trained),
    }


def decisions(policy, steps):
    recorded, out = True, []
    for record in steps:
        recorded = policy.step_closed(record, recorded)
        out.append(recorded)
    return out


def test_stacks_stop_after_two_steady_steps_and_count_the_steps_without():
    policy = StackRecording(16 * GIB)
    # Step 0 builds the optimizer state (a higher peak from step 1 on).
    steps = [step(4 * GIB, 2 * GIB), step(5 * GIB, 3 * GIB)] + [step(5 * GIB, 3 * GIB)] * 5
    assert decisions(policy, steps) == [True, True, True, False, False, False, False]
    # The steps after the third steady one ran without stacks.
    assert policy.steps_without_stacks == 3


def test_a_new_high_or_growth_turns_them_back_on():
    policy = StackRecording(16 * GIB)
    steady = [step(5 * GIB, 3 * GIB)] * 4
    assert decisions(policy, steady)[-1] is False
    # A longer batch: a peak above the highest by more than the tolerance.
    assert policy.step_closed(step(6 * GIB, 3 * GIB), False) is True
    assert decisions(policy, [step(6 * GIB, 3 * GIB)] * 2) == [True, False]
    # A leak: more left allocated at the end of two steps in a row, however
    # little (a few hundred KiB a step beside a peak of GiBs).
    leak = [step(6 * GIB, 3 * GIB + n * 200 * 1024) for n in range(1, 6)]
    assert decisions(policy, leak) == [False, True, True, True, True]


def test_noise_at_the_end_of_steps_is_not_growth():
    """A Lightning bf16 step on an H200: the end moves by hundreds of KiB
    either way, the peak by a few hundred KiB (the values of one run)."""
    policy = StackRecording(16 * GIB)
    measured = [
        (7626195456, 3538408448),
        (9358043648, 3538703360),
        (9357945344, 3538637824),
        (9357093376, 3538605056),
        (9358141952, 3539325952),
        (9358076416, 3539162112),
        (9358338560, 3538605056),
        (9357683200, 3538572288),
    ]
    steps = [step(peak, end) for peak, end in measured]
    assert decisions(policy, steps) == [True] * 3 + [False] * 5


def test_varying_peaks_keep_them_on():
    policy = StackRecording(16 * GIB)
    peaks = [5, 4, 5, 3, 5, 4, 5, 3]
    steps = [step(p * GIB, 2 * GIB) for p in peaks]
    # A lower peak than the highest is not steady either (variable-length
    # batches: the next may be the longest yet).
    assert all(decisions(policy, steps))


def test_near_capacity_they_stay_on():
    policy = StackRecording(16 * GIB)
    assert all(decisions(policy, [step(14 * GIB, 3 * GIB)] * 8))


def test_steps_that_do_not_train_are_not_steady():
    policy = StackRecording(16 * GIB)
    assert decisions(policy, [step(5 * GIB, 3 * GIB)] * 3) == [True, True, False]
    assert policy.step_closed(step(5 * GIB, 3 * GIB, trained=False), False) is True
    assert decisions(policy, [step(5 * GIB, 3 * GIB)] * 2) == [True, False]


def test_evaluation_records_them_and_training_returns_to_the_decision():
    policy = StackRecording(16 * GIB)
    decisions(policy, [step(5 * GIB, 3 * GIB)] * 4)
    assert policy.phase_started("forward") is False
    assert policy.phase_started("evaluation") is True
    assert policy.phase_started("forward") is False
