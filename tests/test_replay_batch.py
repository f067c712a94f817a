"""The batch-size model and the max-batch search, on synthetic peak functions.

A synthetic workload produces the same capture a replay would (per-step phase
peaks, the first step's start, the OOM record), so `observe`, the model and
the search are tested exactly as the orchestrator uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
from adapters import median_step_seconds, observe
from hypothesis import given, settings
from hypothesis import strategies as st

from oomdoc.model import Snapshot
from oomdoc.replay.batch import (
    BatchRun,
    Line,
    accumulation_plan,
    bracket_fill,
    fit_model,
    search_max_batch,
)
from oomdoc.replay.limit_estimate import (
    estimated_max_batch,
    first_probe,
    first_probe_for,
    forward_progress,
)

MiB = 1024**2
GiB = 1024**3


@dataclass
class Workload:
    """Memory of a training loop: static parts plus per-sample parts per phase."""

    params: int
    opt_state: int
    opt_temp: int  # the optimizer's temporaries (foreach copies)
    act_forward: int  # per sample, alive at the end of the forward
    act_backward: int  # per sample, extra at the start of the backward
    input_bytes: int = 0  # per sample: the batch itself
    leftover: int = 0  # per sample: last step's outputs alive during the optimizer step
    capacity: int = 16 * GiB
    granule: int = 0  # CUDA-like rounding of every peak
    slack_bytes: int = 0  # CUDA-like fragmentation: reserved but unusable
    slack_per_sample: int = 0  # ... growing with the batch
    constant_oom_need: int | None = None  # an OOM the batch size does not change
    # Non-linear: extra bytes per sample squared (a workspace, attention
    # over a sequence that grows with the batch...).
    act_quadratic: int = 0
    # The forward runs through this many alike blocks (the capture names the
    # block an OOM in the forward came from, as oomdoc's module attribution does).
    blocks: int = 8
    optimizer: str = "AdamW"

    def _round(self, value: int) -> int:
        if not self.granule:
            return value
        return -(-value // self.granule) * self.granule

    def phases(self, b: int):
        """(step index, phase, peak) in the order they happen, two steps."""
        yield from ((index, phase, value) for index, phase, value, _began in self.phases_from(b))

    def phases_from(self, b: int):
        """(step index, phase, peak, allocated when the phase began)."""
        grads = self.params
        optimizer_begins = self.params + grads + self.leftover * b
        optimizer_peak = optimizer_begins + self.opt_state + self.opt_temp
        first_start = self.params + self.input_bytes * b
        first_forward = first_start + self.act_forward * b + self.act_quadratic * b * b
        yield 0, "setup", first_start, self.params
        yield 0, "forward", first_forward, first_start
        yield 0, "backward", first_forward + self.act_backward * b + grads // 8, first_forward
        yield 0, "optimizer", optimizer_peak, optimizer_begins
        steady_start = self.params + self.opt_state + self.input_bytes * b
        steady_forward = steady_start + self.act_forward * b + self.act_quadratic * b * b
        yield 1, "idle", steady_start + self.leftover * b, steady_start
        yield 1, "forward", steady_forward, steady_start
        yield 1, "backward", steady_forward + self.act_backward * b + grads // 8, steady_forward
        yield 1, "optimizer", optimizer_peak, optimizer_begins + self.opt_state

    def fits(self, b: int) -> bool:
        return self.capture(b)["outcome"] == "ok"

    def capture(self, b: int) -> dict:
        steps: dict[int, dict] = {}
        slack = self.slack_bytes + self.slack_per_sample * b
        for index, phase, value, before in self.phases_from(b):
            step = steps.setdefault(
                index,
                {
                    "index": index,
                    "phase_peaks": {},
                    "forward_calls": 1,
                    "duration_s": 0.1 * b + 1,
                    "peak_allocated_bytes": 0,
                    "peak_reserved_bytes": 0,
                },
            )
            if index == 0 and phase == "forward":
                step["start_allocated_bytes"] = self.params + self.input_bytes * b
            value = self._round(value)
            need = (
                value
                if self.constant_oom_need is None or phase != "forward"
                else max(value, self.constant_oom_need)
            )
            if need + slack > self.capacity:
                # Out of memory partway through the phase: the record says
                # what was allocated and what was asked for.
                # The phase grows in 8 allocations from where it began; the
                # first one that does not fit raises.
                limit = self.capacity - slack
                base = min(self._round(before), limit - 4 * MiB)
                chunk = max(8 * MiB, (need - base) // 8)
                allocated = base + ((limit - base) // chunk) * chunk
                requested = chunk
                step["phase_peaks"][phase] = allocated
                # In the forward, each of the 8 allocations is one block's.
                block = min(self.blocks - 1, (allocated - base) // chunk * self.blocks // 8)
                return {
                    **self.described(),
                    "outcome": "oom",
                    "step_unit": "optimizer" if index else "module",
                    "steps": list(steps.values()),
                    "oom": {
                        "step": index,
                        "phase": phase,
                        "allocated_bytes": allocated,
                        "requested_bytes": requested,
                        "reserved_bytes": allocated + slack,
                        "capacity_bytes": self.capacity,
                        "module": f"blocks.{block}.mlp" if phase == "forward" else None,
                    },
                    "peak": {"allocated_bytes": allocated, "reserved_bytes": allocated + slack},
                }
            step["phase_peaks"][phase] = value
            step["peak_allocated_bytes"] = max(step["peak_allocated_bytes"], value)
            step["peak_reserved_bytes"] = max(step["peak_reserved_bytes"], value + slack)
        peak = max(s["peak_allocated_bytes"] for s in steps.values())
        return {
            **self.described(),
            "outcome": "ok",
            "step_unit": "optimizer",
            "steps": list(steps.values()),
            "oom": None,
            "peak": {"allocated_bytes": peak, "reserved_bytes": peak + slack},
        }

    def described(self) -> dict:
        """What a capture says about the device and the model."""
        return {
            "device": {
                "kind": "cuda" if self.granule else "simulated",
                "capacity_bytes": self.capacity,
            },
            "optimizers": [self.optimizer],
            "models": [
                {
                    "class": "Net",
                    "parameters_bytes": self.params,
                    "repeated_blocks": [{"path": "blocks", "class": "Block", "count": self.blocks}],
                }
            ],
            "breakdown": {"parameters": self.params},
        }

    def true_max(self, upper: int) -> int:
        return max((b for b in range(1, upper) if self.fits(b)), default=0)


def run_search(workload: Workload, batch: int, probe: int | None = None, **kwargs):
    """The search from the failing run at `batch`; its first probe is
    first_probe's unless given. (The result, the batches it replayed.)"""
    baseline = observe(workload.capture(batch), batch)
    assert not baseline.fits
    completed = ("first", "backward") in baseline.exact
    calls = []

    def trial(b):
        calls.append(b)
        return observe(workload.capture(b), b)

    if probe is None:
        probe = first_probe(batch, completed)
    result = search_max_batch(batch, workload.capacity, [baseline], trial, probe=probe, **kwargs)
    return result, calls


def run_estimated_search(workload: Workload, batch: int, calls: list | None = None, **kwargs):
    """The search as `oomdoc run` starts it: the first replay at the failing
    run's own estimate of the limit (first_probe_for). `calls`: where the
    batches replayed go, as they are."""
    failing = workload.capture(batch)
    assert failing["outcome"] == "oom"
    calls = [] if calls is None else calls

    def trial(b):
        calls.append(b)
        return observe(workload.capture(b), b)

    result = search_max_batch(
        batch,
        workload.capacity,
        [observe(failing, batch)],
        trial,
        probe=first_probe_for(Snapshot.from_dict(failing), batch),
        **kwargs,
    )
    return result, calls


# The reference GPT (12 x 1024, seq 512, vocab 32000, AdamW fp32) on 16 GiB,
# in round numbers: ~0.9 GB of parameters, ~0.6 GB of forward activations and
# logits per sample, a foreach AdamW that briefly copies the parameters.
GPT_LIKE = Workload(
    params=870 * MiB,
    opt_state=1740 * MiB,
    opt_temp=870 * MiB,
    act_forward=590 * MiB,
    act_backward=130 * MiB,
    input_bytes=8 * 1024,
    leftover=65 * MiB,
)


def test_gpt_like_exact_in_three_replays():
    result, calls = run_search(GPT_LIKE, 32)
    truth = GPT_LIKE.true_max(32)
    assert result.exact and result.max_batch_size == truth
    assert len(calls) <= 3, calls


def test_a_line_through_two_small_batches_is_wrong_but_the_model_is_not():
    """At batch 1 and 2 the optimizer step is the peak: the overall peak
    barely grows, and its line predicts a batch far too large."""
    peaks = {b: GPT_LIKE.capture(b)["peak"]["allocated_bytes"] for b in (1, 2)}
    naive = Line.through(1, peaks[1], 2, peaks[2])
    naive_max = math.floor((GPT_LIKE.capacity - naive.intercept) / naive.slope)
    truth = GPT_LIKE.true_max(64)
    assert naive_max > 3 * truth

    runs = [observe(GPT_LIKE.capture(b), b) for b in (1, 2)]
    model = fit_model(runs)
    assert model.largest_fitting(GPT_LIKE.capacity) in (truth, truth + 1)
    assert model.binding(1)[1] == "optimizer"
    assert model.binding(truth) == ("steady", "backward")


def test_one_probe_predicts_from_the_first_step_slope():
    baseline = observe(GPT_LIKE.capture(32), 32)
    probe = observe(GPT_LIKE.capture(8), 8)
    model = fit_model([baseline, probe])
    assert model.largest_fitting(GPT_LIKE.capacity) == GPT_LIKE.true_max(32)


def test_the_need_far_from_the_runs_is_not_the_slope_of_a_fit_and_an_oom_one_apart():
    """pytorch/examples' DCGAN at 8 GiB: 500 fit, 501 ran out of memory in a
    later step with the allocator fragmented. The line raised through that
    OOM's need finds the limit, and is no slope to take to the user's 1000."""
    failing = BatchRun(
        1000, False, start_bytes=1 * GiB, lower_bounds={("first", "backward"): 8 * GiB}
    )
    fit = BatchRun(
        500,
        True,
        start_bytes=GiB // 2,
        exact={("first", "forward"): 5 * GiB, ("first", "backward"): int(7.63 * GiB)},
    )
    oom = BatchRun(
        501,
        False,
        start_bytes=GiB // 2,
        exact={("first", "forward"): 5 * GiB + 10 * MiB},
        lower_bounds={("first", "backward"): int(8.05 * GiB)},
    )
    model = fit_model([failing, fit, oom])
    assert model.largest_fitting(8 * GiB) == 500
    assert model.need(1000) > 100 * GiB  # the limit's line: 0.42 GiB a sample
    # Through 500's backward, its slope what the step added to its start per
    # sample (500 and 501's forwards are too close to make one).
    assert 12 * GiB < model.need_far(1000) < 20 * GiB
    assert fit_model([failing, fit, oom], far=True).need(1000) == model.need_far(1000)


def test_cuda_like_rounding_and_fragmentation_stay_exact():
    workload = Workload(
        params=870 * MiB,
        opt_state=1740 * MiB,
        opt_temp=870 * MiB,
        act_forward=590 * MiB + 12345,
        act_backward=130 * MiB + 777,
        input_bytes=8 * 1024,
        leftover=65 * MiB,
        granule=2 * MiB,
        slack_bytes=150 * MiB,
        slack_per_sample=9 * MiB,
    )
    result, calls = run_search(workload, 32)
    assert result.exact and result.max_batch_size == workload.true_max(32)
    assert len(calls) <= 4, calls


def test_constant_optimizer_peak_dominating_at_small_batch():
    """A model whose optimizer step needs most of the device: only a few samples fit."""
    workload = Workload(
        params=2 * GiB,
        opt_state=4 * GiB,
        opt_temp=2 * GiB,
        act_forward=300 * MiB,
        act_backward=80 * MiB,
        leftover=10 * MiB,
        capacity=16 * GiB,
        granule=2 * MiB,
    )
    result, calls = run_search(workload, 64)
    assert result.exact and result.max_batch_size == workload.true_max(64)
    assert len(calls) <= 5, calls


def test_nothing_fits():
    workload = Workload(
        params=1 * GiB, opt_state=2 * GiB, opt_temp=0, act_forward=20 * GiB, act_backward=10 * MiB
    )
    result, calls = run_search(workload, 16)
    assert result.max_batch_size is None and not result.exact
    assert calls[-1] == 1


def test_optimizer_state_that_never_fits_stops_after_one_replay():
    """The first optimizer step needs more than the device whatever the batch."""
    workload = Workload(
        params=6 * GiB, opt_state=12 * GiB, opt_temp=0, act_forward=100 * MiB, act_backward=10 * MiB
    )
    result, calls = run_search(workload, 16)
    assert len(calls) == 1 and "does not decide" in result.stopped


def test_an_oom_the_batch_size_does_not_change_stops_the_search():
    workload = Workload(
        params=1 * GiB,
        opt_state=2 * GiB,
        opt_temp=0,
        act_forward=10 * MiB,
        act_backward=1 * MiB,
        constant_oom_need=20 * GiB,
    )
    result, calls = run_search(workload, 64)
    assert len(calls) == 1
    assert "does not decide" in result.stopped
    assert result.max_batch_size is None


def test_an_inconclusive_replay_stops_the_search():
    baseline = observe(GPT_LIKE.capture(32), 32)

    def trial(b):
        return BatchRun(batch_size=b, fits=False, inconclusive=True, note="timed out")

    result = search_max_batch(32, GPT_LIKE.capacity, [baseline], trial, probe=8)
    assert not result.exact and "timed out" in result.stopped


@settings(max_examples=60, deadline=None)
@given(
    params=st.integers(10, 2000),
    opt_ratio=st.sampled_from([0, 1, 2]),
    act=st.integers(1, 800),
    act_backward=st.integers(0, 200),
    leftover=st.integers(0, 100),
    granule=st.sampled_from([0, 2 * MiB]),
    batch=st.integers(2, 4096),
)
def test_search_is_always_exact(params, opt_ratio, act, act_backward, leftover, granule, batch):
    workload = Workload(
        params=params * MiB,
        opt_state=opt_ratio * params * MiB,
        opt_temp=params * MiB // 2,
        act_forward=act * MiB // 16,
        act_backward=act_backward * MiB // 16,
        leftover=leftover * MiB // 64,
        input_bytes=4096,
        granule=granule,
    )
    if workload.fits(batch):
        return
    if not workload.fits(1):
        truth = 0
    else:
        low, high = 1, batch  # fits(low), not fits(high): peaks grow with the batch
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if workload.fits(middle) else (low, middle)
        truth = low
    result, calls = run_search(workload, batch, max_trials=30)
    assert (result.max_batch_size or 0) == truth
    if truth:
        assert result.exact
    assert len(calls) <= 5 + math.ceil(math.log2(batch)) + 1


def test_accumulation_plan_keeps_the_effective_batch():
    assert accumulation_plan(32, 20) == (16, 2)
    assert accumulation_plan(2048, 1450) == (1024, 2)
    assert accumulation_plan(30, 7) == (6, 5)
    micro, steps = accumulation_plan(31, 20)  # prime: just above the original batch
    assert micro <= 20 and micro * steps >= 31


def test_median_step_seconds_skips_the_first_step():
    steps = [
        {"index": 0, "duration_s": 9.0},
        {"index": 1, "duration_s": 1.0},
        {"index": 2, "duration_s": 3.0},
    ]
    assert median_step_seconds(steps) == 2.0
    assert median_step_seconds(steps[:1]) == 9.0
    assert median_step_seconds([]) is None


@pytest.mark.parametrize("completed,expected", [(False, 8), (True, 16)])
def test_first_probe(completed, expected):
    assert first_probe(32, completed) == expected
    assert first_probe(1, completed) == 1


# Typical shapes, in round numbers, each on 16 GiB with CUDA-like rounding of
# every peak to 2 MiB: (workload, failing batch).
TYPICAL = {
    "gpt": (GPT_LIKE, 32),
    "gpt-rounded": (
        replace(
            GPT_LIKE,
            act_forward=590 * MiB + 12345,
            act_backward=130 * MiB + 777,
            granule=2 * MiB,
            blocks=12,
        ),
        32,
    ),
    # A CNN: small weights, SGD with momentum, large feature maps.
    "cnn": (
        Workload(
            params=100 * MiB,
            opt_state=100 * MiB,
            opt_temp=0,
            act_forward=80 * MiB,
            act_backward=6 * MiB,
            input_bytes=600 * 1024,
            granule=2 * MiB,
            blocks=16,
            optimizer="SGD",
        ),
        512,
    ),
    # A 350M-parameter language model: the weights, gradients and AdamW state
    # take a third of the device, a sample 1.6 GB.
    "large-model": (
        Workload(
            params=1350 * MiB,
            opt_state=2700 * MiB,
            opt_temp=1350 * MiB,
            act_forward=1500 * MiB,
            act_backward=150 * MiB,
            leftover=50 * MiB,
            granule=2 * MiB,
            blocks=24,
        ),
        16,
    ),
}


@pytest.mark.parametrize("name", sorted(TYPICAL))
def test_typical_shapes_are_exact_in_three_replays(name):
    workload, batch = TYPICAL[name]
    result, calls = run_estimated_search(workload, batch)
    truth = workload.true_max(batch)
    assert result.exact and result.max_batch_size == truth, (calls, truth)
    assert len(calls) <= 3, (calls, truth)


def test_the_estimate_comes_from_how_far_the_forward_got():
    """At 64 the failing run's forward ran out of memory in block 4 of 12
    (its OOM names the module): about 3/8 of the forward's activations were
    made. The estimate is near the limit, not at the more than twice too
    large batch the bytes made so far would suggest."""
    workload, batch = TYPICAL["gpt-rounded"][0], 64
    failing = Snapshot.from_dict(workload.capture(batch))
    module = failing.oom.module
    block = int(module.split(".")[1])
    made = failing.oom.needed_bytes - failing.steps[0].start_allocated_bytes
    assert forward_progress(failing, made) == pytest.approx((block + 0.5) / workload.blocks)
    truth = workload.true_max(batch)
    estimate = estimated_max_batch(failing, batch)
    assert abs(estimate - truth) <= 0.25 * truth, (estimate, truth)
    # No module attribution: the forward counts as complete (the loss, after
    # the model returned, with only its gradient to come).
    failing.oom.module = None
    assert forward_progress(failing, made) == 1.0
    assert estimated_max_batch(failing, batch) > 1.5 * truth


@pytest.mark.parametrize("wrapper", ["module", "_orig_mod", "module._orig_mod"])
def test_the_forward_s_progress_is_found_through_a_wrapper(wrapper):
    """A DDP-wrapped (or compiled) model's repeated blocks are found on the
    wrapper (`module.blocks`) while module paths are named without it
    (`blocks.4.mlp`): the OOM's block is still found (on two H100s a DDP GPT
    trainer's first replay went to 34 where 14 was the limit, costing three
    replays)."""
    workload, batch = TYPICAL["gpt-rounded"][0], 64
    failing = Snapshot.from_dict(workload.capture(batch))
    block = int(failing.oom.module.split(".")[1])
    made = failing.oom.needed_bytes - failing.steps[0].start_allocated_bytes
    for model in failing.models:
        for group in model.repeated_blocks:
            group.path = f"{wrapper}.{group.path}"
    assert forward_progress(failing, made) == pytest.approx((block + 0.5) / workload.blocks)
    for model in failing.models:
        for group in model.repeated_blocks:
            group.path = "other." + group.path  # not a wrapper: not the OOM's block
    assert forward_progress(failing, made) == 1.0


def test_an_estimate_too_large_costs_replays_not_exactness():
    """Many small samples whose backward needs a third more than their
    forward (the estimate assumes a tenth): the first replay runs out of
    memory in its first step, the next goes to 3/4 of it."""
    workload = Workload(
        params=200 * MiB,
        opt_state=400 * MiB,
        opt_temp=200 * MiB,
        act_forward=3 * MiB,
        act_backward=1 * MiB,
        input_bytes=4096,
        granule=2 * MiB,
    )
    result, calls = run_estimated_search(workload, 8192)
    truth = workload.true_max(8192)
    assert calls[0] > truth and calls[1] == calls[0] * 3 // 4
    assert result.exact and result.max_batch_size == truth, calls
    assert len(calls) <= 5, calls


@pytest.mark.parametrize(
    "quadratic,granule", [(2 * MiB, 0), (6 * MiB, 2 * MiB), (500 * 1024, 2 * MiB)]
)
def test_a_non_linear_workload_stays_exact(quadratic, granule):
    """Activations that grow with the square of the batch (the model's lines
    are wrong at every distance): still exact, with more replays."""
    workload = replace(
        GPT_LIKE,
        act_forward=300 * MiB,
        act_backward=60 * MiB,
        input_bytes=0,
        leftover=20 * MiB,
        granule=granule,
        act_quadratic=quadratic,
    )
    result, calls = run_estimated_search(workload, 64, max_trials=20)
    truth = workload.true_max(64)
    assert result.exact and result.max_batch_size == truth, (calls, truth)
    assert len(calls) <= 8, calls


def test_fragmentation_seen_at_an_oom_in_the_deciding_phase_shrinks_the_device():
    """CUDA-like: reserved-but-unusable bytes at the OOM (here 600 MiB, as the
    H100 runs' 0.1 to 1.6 GB) make the limit lower than the allocated bytes
    say; the search still ends exact."""
    workload = replace(GPT_LIKE, granule=2 * MiB, slack_bytes=600 * MiB)
    result, calls = run_estimated_search(workload, 32)
    assert result.exact and result.max_batch_size == workload.true_max(32), calls
    assert len(calls) <= 4, calls


def test_an_oom_read_without_a_batch_size_has_no_estimate():
    """The orchestrator reads fix replays at batch size 0 (their OOM's
    signature only): nothing to estimate per sample, and no error."""
    workload, batch = TYPICAL["gpt-rounded"]
    run = observe(workload.capture(batch), 0)
    assert run.estimated_max is None and run.oom_signature is not None
    assert observe(workload.capture(batch), batch).estimated_max is not None


@pytest.mark.parametrize("probe", [120, 90])
def test_large_fragmentation_at_later_step_ooms_still_finds_a_fit_in_four_replays(probe):
    """As the Lightning run's autocast+checkpointing search on the H100: every
    OOM in a later step, the allocator losing 2.6 GiB of 16 to fragmentation.
    Halfway into that fragmentation is tried once; when it runs out of memory
    too, the next batch allows for all of it, so the prescription's search
    (4 replays) ends with a batch that fits instead of 85, 84, 83 all failing."""
    workload = replace(
        GPT_LIKE,
        params=1000 * MiB,
        opt_state=2000 * MiB,
        opt_temp=1000 * MiB,
        act_forward=100 * MiB,
        act_backward=40 * MiB,
        leftover=10 * MiB,
        granule=2 * MiB,
        slack_bytes=2600 * MiB,
    )
    result, calls = run_search(workload, 256, probe=probe, max_trials=4)
    truth = workload.true_max(256)
    assert result.max_batch_size is not None and result.max_batch_size <= truth, calls
    assert result.max_batch_size >= 0.95 * truth, calls


def test_a_search_ends_once_enough_says_its_answer_cannot_change():
    """The search under the memory savers is for the prescription's
    micro-batch: the first fit that decides it ends the search (on the H100,
    HF GPT-2-medium at 32: 19 fit and 32 did not, and 25, 26 and 31 followed
    for the same 16 x 2 accumulation steps)."""
    workload = GPT_LIKE
    original = 2 * workload.true_max(256) - 2  # OOMs; half of it fits

    def enough(fit: int, oom: int):
        plan = accumulation_plan(original, fit)
        return "decided" if plan == accumulation_plan(original, oom - 1) else None

    probe = original // 2  # fits: it and every batch up to original - 1 give 2 steps
    full, _calls = run_search(workload, original, probe=probe)
    assert len(full.trials) > 1 and full.exact
    ended, calls = run_search(workload, original, probe=probe, enough=enough)
    assert calls == [probe] and ended.stopped == "decided"
    assert ended.max_batch_size == probe and not ended.exact
    # Without a fit yet, enough is never asked: the search goes on.
    _result, calls = run_search(workload, original, probe=original - 1, enough=enough)
    assert len(calls) > 1


def test_a_search_that_settles_says_so_once_and_goes_on_to_the_exact_batch():
    """The plain search's plan (oomdoc.replay.plain_search): once every batch
    left in the bracket gives one prescription, the search as it stands goes
    to `on_settled`, and the search goes on, the same trials as without it."""
    workload = GPT_LIKE
    original = 2 * workload.true_max(256) - 2

    def plan_settled(fit: int, oom: int):
        plan = accumulation_plan(original, fit)
        return "settled" if plan == accumulation_plan(original, oom - 1) else None

    probe = original // 2
    alone, alone_calls = run_search(workload, original, probe=probe)
    settled = []
    exact, calls = run_search(
        workload, original, probe=probe, settles=plan_settled, on_settled=settled.append
    )
    assert calls == alone_calls and exact.exact and exact.max_batch_size == alone.max_batch_size
    (early,) = settled
    assert early.stopped == "settled" and not early.exact
    assert [run.batch_size for run in early.trials] == [probe]
    assert early.max_batch_size == probe and early.best_run is exact.trials[0]
    assert accumulation_plan(original, early.max_batch_size) == accumulation_plan(
        original, exact.max_batch_size
    )

    # Without accumulation (an evaluation batch) every batch is its own
    # plan: nothing settles before the search is exact.
    def own_plan(fit: int, oom: int):
        same = accumulation_plan(original, fit, False) == accumulation_plan(
            original, oom - 1, False
        )
        return "settled" if same else None

    never: list = []
    run_search(workload, original, probe=probe, settles=own_plan, on_settled=never.append)
    assert never == []


def test_the_bracket_fill_is_the_batches_nearest_the_trial_when_few_are_left():
    assert bracket_fill(162, 168, 163, 3) == [164, 165, 166]
    assert bracket_fill(163, 168, 167, 3) == [166, 165, 164]
    assert bracket_fill(20, 23, 21, 3) == [22]
    assert bracket_fill(20, 22, 21, 3) == []  # nothing else is left
    assert bracket_fill(128, 233, 162, 3) == []  # too many others: a guess
    assert bracket_fill(162, 168, 163, 0) == []  # no spare lane


def search_in_lanes(workload: Workload, batch: int, lanes: int):
    """The search with `lanes`, its probes started ahead recorded: (the
    result, its trials, the trials that started a round: not started ahead
    beside an earlier trial, so the search waited for them)."""
    trials: list[int] = []
    beside: set[tuple[int, int]] = set()  # (batch, the trial it was started beside)

    def speculate(b):
        beside.add((b, len(trials)))

    result, _ = run_estimated_search(
        workload, batch, calls=trials, speculate=speculate, lanes=lanes, max_trials=20
    )
    # A probe runs on while it is started again beside each trial
    # (search.BatchProbes): the one started beside the trial before is taken.
    waited = [b for index, b in enumerate(trials) if (b, index - 1) not in beside]
    return result, trials, waited


def test_spare_lanes_run_the_endgame_beside_it_on_a_fragmenting_allocator():
    """A CUDA-like allocator (2 MiB granules, reserved bytes it cannot use
    near the limit): the search closes in one batch at a time, 56, 57, 59,
    58. With three lanes spare, 59 and 58 were already running beside 57:
    the same trials, two waits fewer."""
    workload = Workload(
        params=767 * MiB,
        opt_state=2956 * MiB,
        opt_temp=591 * MiB,
        act_forward=58 * MiB + 96543,
        act_backward=131 * MiB,
        input_bytes=8 * 1024,
        leftover=19 * MiB,
        granule=2 * MiB,
        slack_bytes=1612 * MiB,
        slack_per_sample=3 * MiB,
    )
    alone, trials_alone, waited_alone = search_in_lanes(workload, 1024, 1)
    result, trials, waited = search_in_lanes(workload, 1024, 4)
    assert trials == trials_alone
    assert result.exact and result.max_batch_size == alone.max_batch_size == workload.true_max(1024)
    assert trials[-4:] == [56, 57, 59, 58], trials
    # (87 and 65 ran beside 117 and 87 either way: a quarter below an
    # estimate from a first forward's OOM.)
    assert waited_alone == [156, 117, 61, 56, 57, 59, 58]
    assert waited == [156, 117, 61, 56, 57]


@settings(max_examples=60, deadline=None)
@given(
    params=st.integers(100, 2000),
    act=st.integers(16, 800),
    slack=st.integers(0, 2000),
    slack_per_sample=st.integers(0, 10),
    batch=st.sampled_from([32, 64, 256, 1024]),
)
def test_spare_lanes_never_change_the_search_and_end_it_in_one_round(
    params, act, slack, slack_per_sample, batch
):
    """Probes beside a trial only save waiting: the trials are the ones
    asked for with one lane. Once a trial's bracket has no more other
    batches than spare lanes, every later trial was started beside it."""
    workload = Workload(
        params=params * MiB,
        opt_state=2 * params * MiB,
        opt_temp=params * MiB // 2,
        act_forward=act * MiB // 16 + 12345,
        act_backward=act * MiB // 64,
        input_bytes=8 * 1024,
        leftover=act * MiB // 256,
        granule=2 * MiB,
        slack_bytes=slack * MiB,
        slack_per_sample=slack_per_sample * MiB,
    )
    if workload.fits(batch) or not workload.fits(1):
        return
    _, trials_alone, _ = search_in_lanes(workload, batch, 1)
    result, trials, waited = search_in_lanes(workload, batch, 4)
    assert trials == trials_alone
    fits = {run.batch_size: run.fits for run in result.trials}
    lo, hi = 0, batch
    for index, b in enumerate(trials):
        if lo > 0 and hi - lo - 2 <= 3:  # at most 3 others beside b: all started
            assert all(later not in waited for later in trials[index + 1 :]), (trials, waited)
            break
        lo, hi = (max(lo, b), hi) if fits[b] else (lo, min(hi, b))


def test_an_oom_asking_for_the_logits_past_the_blocks_counts_their_copies():
    """The H200's Lightning encoder (12 blocks, vocabulary 32000, 16 GiB)
    under checkpointing at batch 256: its first forward ran out of memory in
    the head, asking for 15.6 GiB of logits with 7.3 GiB allocated. The loss's
    copy of them and their gradient were never reached, so the estimate
    counts them (REQUEST_COPIES_PAST_BLOCKS): its largest batch was found
    from 32 to 63, and the estimate without them, 128, cost the search two
    replays (128 and 64) before 32 fit. Outside every module (the loss, the
    model returned) only the gradient is to come; inside the blocks the
    extrapolation over them counts what comes."""
    parameters = 870 * MiB
    requested = int(15.6 * GiB)
    failing = {
        "device": {"kind": "cuda", "capacity_bytes": 16 * GiB},
        "optimizers": ["Adam"],
        "models": [
            {
                "class": "Encoder",
                "parameters_bytes": parameters,
                "repeated_blocks": [
                    {"path": "encoder.layers", "class": "TransformerEncoderLayer", "count": 12}
                ],
            }
        ],
        "breakdown": {"parameters": parameters},
        "outcome": "oom",
        "step_unit": "module",
        "steps": [
            {"index": 0, "phase_peaks": {}, "forward_calls": 1, "start_allocated_bytes": parameters}
        ],
        "oom": {
            "step": 0,
            "phase": "forward",
            "allocated_bytes": int(7.3 * GiB),
            "requested_bytes": requested,
            "reserved_bytes": int(7.3 * GiB),
            "capacity_bytes": 16 * GiB,
            "module": "head",
        },
    }
    estimate = estimated_max_batch(Snapshot.from_dict(failing), 256)
    assert estimate is not None and 32 <= estimate < 64, estimate
    in_the_loss = {**failing, "oom": {**failing["oom"], "module": None}}
    assert 64 <= estimated_max_batch(Snapshot.from_dict(in_the_loss), 256) < 128
    in_a_block = {**failing, "oom": {**failing["oom"], "module": "encoder.layers.11.linear2"}}
    assert estimated_max_batch(Snapshot.from_dict(in_a_block), 256) >= 64
    # Without them (what rules a configuration out): 128 and more, as replayed.
    assert estimated_max_batch(Snapshot.from_dict(failing), 256, to_come=False) >= 128
    run = observe(failing, 256)
    assert run.estimated_max < 64 <= 128 <= run.estimated_max_bound
