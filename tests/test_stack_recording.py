"""When the CUDA capture records a stack per allocation (stack_recording)."""

from oomdoc.capture.stack_recording import FirstStepDetail, StackRecording, detail_policy

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
    assert policy.stats() == {"steps_without_stacks": 3}


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
    # Reserved memory near the cap (fragmentation) counts too.
    policy = StackRecording(16 * GIB)
    fragmented = dict(step(10 * GIB, 3 * GIB), peak_reserved_bytes=15 * GIB)
    assert all(decisions(policy, [fragmented] * 8))


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


def test_a_replay_keeps_its_module_scopes_for_its_first_training_step_only():
    policy = FirstStepDetail()
    # A script that evaluates before it trains: that step keeps them.
    assert policy.phase_started("evaluation") is True
    assert policy.step_closed(step(5 * GIB, 3 * GIB, trained=False), True) is True
    assert policy.phase_started("forward") is True
    # The first training step closes: none after it, whatever the memory
    # (near the capacity too: a replay's timed steps cost the same).
    assert (
        decisions(policy, [step(15 * GIB, 3 * GIB), step(15.5 * GIB, 4 * GIB)] * 2) == [False] * 4
    )
    assert policy.phase_started("evaluation") is True
    assert policy.phase_started("forward") is False
    assert policy.stats() == {"steps_without_module_scopes": 3}


def test_the_policy_follows_the_capture(monkeypatch):
    monkeypatch.delenv("OOMDOC_MODULE_SCOPES", raising=False)
    assert isinstance(detail_policy(True, 16 * GIB), StackRecording)
    assert detail_policy(False, 16 * GIB) is None
    from oomdoc.replay.replayer import REPLAY_ENV

    for name, value in REPLAY_ENV.items():
        monkeypatch.setenv(name, value)
    assert isinstance(detail_policy(False, 16 * GIB), FirstStepDetail)


def test_the_cuda_backend_applies_a_policy_without_stacks():
    from oomdoc.capture.cuda import CudaBackend

    backend = CudaBackend(16 * GIB, deferred=True)  # starts nothing
    backend._detail_policy = FirstStepDetail()
    toggled: list[bool] = []
    backend._record_stacks = toggled.append  # type: ignore[method-assign]
    assert backend.phase_started("forward") is True
    assert backend.step_closed(step(5 * GIB, 3 * GIB)) is False
    assert backend.step_closed(step(5 * GIB, 3 * GIB)) is False
    assert backend.phase_started("evaluation") is True
    assert backend.capture_stats() == {"steps_without_module_scopes": 1}
    assert toggled == []  # no history set up: no stacks turned on or off


def test_the_cuda_backend_turns_the_stacks_with_the_detail_and_keeps_them_if_it_cannot():
    from oomdoc.capture.cuda import CudaBackend

    backend = CudaBackend(16 * GIB, deferred=True)  # starts nothing
    backend._recording = True  # as _start leaves it, stacks on
    backend._detail_policy = StackRecording(16 * GIB)
    toggled: list[bool] = []
    backend._record_stacks = toggled.append  # type: ignore[method-assign]
    steady = [step(5 * GIB, 3 * GIB)] * 3
    assert [backend.step_closed(record) for record in steady] == [True, True, False]
    assert toggled == [False]
    assert backend.phase_started("evaluation") is True and toggled == [False, True]

    def refuse(on):
        raise RuntimeError("the allocator refused")

    backend._record_stacks = refuse  # type: ignore[method-assign]
    # Back in training the stacks cannot go off: the detail stays with them.
    assert backend.phase_started("forward") is True
    assert backend.capture_stats() == {"steps_without_stacks": 0}


# ---------------------------------------------------------------- the tracker
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import benchmark_module  # noqa: E402

from oomdoc.capture.tracker import Tracker  # noqa: E402

# CPU tensors as the device, answering as the CUDA backend does on a steady
# run once `steady` is set: the tracker's CUDA code path (host_overhead.py).
SteadyHostBackend = benchmark_module("host_overhead").SteadyHostBackend


class SteadyAfter(SteadyHostBackend):
    """Training steps from `steady_from` on are steady (evaluation is not)."""

    def __init__(self, steady_from: int):
        self.steady_from = steady_from

    def step_closed(self, step):
        self.steady = step["index"] + 1 >= self.steady_from
        return super().step_closed(step)


def test_steady_steps_skip_the_module_scopes_and_keep_the_step_model():
    tracker = Tracker(SteadyAfter(steady_from=2))
    pushes: list[tuple[int, str]] = []
    push = tracker.scopes.push

    def counted_push(module, outermost_inputs=None):
        pushes.append((tracker.step_index, tracker.phase))
        return push(module, outermost_inputs)

    tracker.scopes.push = counted_push
    seen_paths: list = []
    pack_hooks: list[bool] = []
    tracker.install()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        top_hooks = torch._C._autograd._top_saved_tensors_default_hooks

        def seen(*_):
            seen_paths.append(tracker.scopes.path)
            pack_hooks.append(top_hooks(True) is not None)

        model[1].register_forward_hook(seen)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            loss = F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 8))
        model.train()
        loss = F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2))
        loss.backward()
        optimizer.step()
        tracker.finish()
    finally:
        tracker.uninstall()
    training_pushes = sorted({step for step, phase in pushes if phase != "evaluation"})
    # Four modules a call; steps 0 and 1 in detail, then none in training.
    assert training_pushes == [0, 1]
    assert [phase for _step, phase in pushes].count("evaluation") == 4
    # The module path is kept in the detailed steps and the evaluation only
    # (the ReLU's own hook runs after the global post-hook: its parent's).
    assert seen_paths[:2] == ["(root)", "(root)"] and seen_paths[-2] == "(root)"
    assert set(seen_paths[2:5] + seen_paths[-1:]) == {None}
    # The saved-tensors pack hook is set aside with them, and back in evaluation.
    assert pack_hooks == [True, True, False, False, False, True, False]
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    # The step model does not depend on the scopes.
    steps = tracker.steps
    assert [step["optimizer_steps"] for step in steps[:5]] == [1] * 5
    assert [step["forward_calls_with_grad"] for step in steps[:5]] == [1] * 5
    assert sum(step["evaluation_calls"] for step in steps) == 1
    assert tracker.evaluation_passes == 1


class AllocatingSteadyAfter(SteadyAfter):
    """SteadyAfter whose allocator reports what the test sets."""

    allocated = 100_000

    def allocated_bytes(self):
        return self.allocated


def train_with_a_new_high(steady_from: int, steps: int, high_at: int, set_to_none: bool):
    """A tracker over `steps` SGD steps of a small MLP whose allocator reads
    100,000 bytes, and 200,000 from step `high_at`'s backward on (a new
    high); returns it and the steady samples of each step."""
    backend = AllocatingSteadyAfter(steady_from)
    tracker = Tracker(backend)
    tracker.install()
    samples_per_step = []
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        high_in_backward = [False]

        def new_high(grad):
            if high_in_backward[0]:
                backend.allocated = 200_000
            return grad

        model[0].weight.register_hook(new_high)
        for index in range(steps):
            backend.allocated = 100_000
            high_in_backward[0] = index == high_at
            before = tracker.stats["steady_samples"]
            loss = F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            samples_per_step.append(tracker.stats["steady_samples"] - before)
        tracker.finish()
    finally:
        tracker.uninstall()
    return tracker, samples_per_step


def test_steady_steps_read_a_breakdown_only_at_a_new_high():
    tracker, samples_per_step = train_with_a_new_high(
        steady_from=2, steps=6, high_at=4, set_to_none=True
    )
    # Steps 0 and 1 in detail; steady steps skip their boundaries' breakdowns
    # except the new high's (step 4's backward end).
    assert samples_per_step[:2] == [0, 0]
    assert min(samples_per_step[2:]) > 0
    assert samples_per_step[4] < samples_per_step[3]
    sample = tracker.peak_sample
    assert (sample["step"], sample["phase"], sample["allocated_bytes"]) == (4, "backward", 200_000)
    # The step's baseline keeps the gradients the detailed steps started with
    # (none: zero_grad frees them), so the new gradients are not activations.
    gradients = sample["breakdown"]["gradients"]
    assert gradients > 0
    assert sample["breakdown"]["activations"] == 100_000 - gradients
    assert tracker.category_peaks["activations"] == 100_000 - gradients


def test_a_step_after_the_first_does_not_take_the_first_steps_gradients():
    """A replay pauses from its second step (FirstStepDetail): that step
    starts with the gradients the first one's backward left (zeroed, not
    freed), which the first step's own start did not have."""
    tracker, _ = train_with_a_new_high(steady_from=1, steps=3, high_at=1, set_to_none=False)
    sample = tracker.peak_sample
    assert (sample["step"], sample["allocated_bytes"]) == (1, 200_000)
    # The gradients were there when the step began: all of the growth is
    # the step's activations.
    assert sample["breakdown"]["gradients"] > 0
    assert sample["breakdown"]["activations"] == 100_000
