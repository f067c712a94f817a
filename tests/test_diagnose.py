"""Each diagnosis rule: a snapshot that triggers it and one that must not;
the ordering; estimated fixes."""

from __future__ import annotations

import pickle

import pytest
from adapters import analysis, diagnose, estimate_fixes, fixes_for, render_markdown, render_text
from suggest_builders import GiB, MiB, oom_document, oomdoc_document, step, torch_snapshot

from oomdoc.loaders import load_bytes


def kinds(document) -> list[str]:
    return [d["kind"] for d in diagnose(document)]


def find(document, kind) -> dict | None:
    return next((d for d in diagnose(document) if d["kind"] == kind), None)


# --------------------------------------------------------------------- leak

TOTAL_LOSS = {
    "variable": "total_loss",
    "file": "/work/train.py",
    "line": 30,
    "function": "main",
    "from_step": 0,
}


def test_leak_from_a_retained_graph_is_first_and_named():
    steps = [step(0, end=400 * MiB)] + [
        step(i, end=400 * MiB, retained_graphs=[TOTAL_LOSS]) for i in range(1, 6)
    ]
    document = oomdoc_document(steps=steps)
    diagnosis = diagnose(document)[0]
    assert diagnosis["kind"] == "leak"
    assert "`total_loss`" in diagnosis["summary"] and "since step 0" in diagnosis["summary"]
    assert any("train.py:30" in line for line in diagnosis["evidence"])
    assert "total_loss += loss.item()" in diagnosis["remedy"]


def test_leak_from_steady_growth_alone():
    steps = [step(i, end=400 * MiB + i * 8 * MiB) for i in range(8)]
    diagnosis = find(oomdoc_document(steps=steps), "leak")
    assert diagnosis is not None
    assert diagnosis["bytes"] == 6 * 8 * MiB  # steps 1..7: the first step is warm-up
    assert "8.00 MiB per step" in diagnosis["evidence"][0]
    assert kinds(oomdoc_document(steps=steps))[0] == "leak"


@pytest.mark.parametrize(
    "ends",
    [
        [400 * MiB] * 8,  # flat
        [100 * MiB, 400 * MiB]
        + [400 * MiB] * 6,  # warm-up growth in step 0 only (grads, optimizer state)
        [400 * MiB + (i % 2) * 64 * MiB for i in range(8)],  # up and down
        [400 * MiB + i * 1024 for i in range(8)],  # a few bytes: noise, not a leak
    ],
)
def test_no_leak_without_growth_or_retained_graph(ends):
    steps = [step(i, end=end) for i, end in enumerate(ends)]
    assert "leak" not in kinds(oomdoc_document(steps=steps))


def test_too_few_steps_is_not_a_leak():
    steps = [step(i, end=400 * MiB + i * 64 * MiB) for i in range(3)]
    assert "leak" not in kinds(oomdoc_document(steps=steps))


# ------------------------------------------------------------- grad_in_eval


def eval_steps(count, **kwargs):
    return [
        step(
            i,
            end=50 * MiB,
            with_grad=1,
            backward=0,
            optimizer_steps=0,
            peak_phase="forward",
            **kwargs,
        )
        for i in range(count)
    ]


def test_pure_evaluation_under_autograd():
    document = oomdoc_document(steps=eval_steps(5), optimizers=[], step_unit="module")
    diagnosis = diagnose(document)[0]
    assert diagnosis["kind"] == "grad_in_eval"
    assert "5 forward pass(es)" in diagnosis["evidence"][0]
    assert "torch.no_grad()" in diagnosis["remedy"]


def test_evaluation_that_ooms_in_its_first_forward():
    """A model in eval mode under autograd, dying in its first forward."""
    document = oom_document(
        allocated=900 * MiB,
        requested=200 * MiB,
        phase="forward",
        steps=eval_steps(1, eval_mode=1),
        optimizers=[],
        step_unit="module",
    )
    assert kinds(document)[0] == "grad_in_eval"
    assert estimate_fixes(document) == []  # no training fix applies; no_grad does
    assert "Fixes" not in render_text(document)


def test_a_script_without_optimizer_dying_in_its_first_training_forward_is_no_bug():
    """A model in train mode without an optimizer that dies in its first
    forward may be a manual-update trainer (pytorch/examples' word language
    model) that never reached its backward: not called grad_in_eval."""
    document = oom_document(
        allocated=900 * MiB,
        requested=200 * MiB,
        phase="forward",
        steps=eval_steps(1),
        optimizers=[],
        step_unit="module",
    )
    assert "grad_in_eval" not in kinds(document)


def test_eval_mode_passes_inside_training():
    steps = [step(i, end=400 * MiB) for i in range(6)]
    steps[3] = step(3, end=400 * MiB, with_grad=5, backward=1, eval_mode=4)
    diagnosis = diagnose(oomdoc_document(steps=steps))[0]
    assert diagnosis["kind"] == "grad_in_eval"
    assert "4 forward pass(es)" in diagnosis["evidence"][0]
    assert "eval mode" in diagnosis["evidence"][1]


def test_irregular_forwards_without_eval_mode():
    steps = [step(i, end=400 * MiB) for i in range(6)]
    steps[4] = step(4, end=400 * MiB, with_grad=3, backward=1)
    assert kinds(oomdoc_document(steps=steps))[0] == "grad_in_eval"


def test_no_grad_in_eval_for_training():
    assert "grad_in_eval" not in kinds(oomdoc_document())


def test_two_forwards_per_backward_every_step_is_not_evaluation():
    steps = [step(i, end=400 * MiB, with_grad=2, backward=1) for i in range(6)]
    assert "grad_in_eval" not in kinds(oomdoc_document(steps=steps))


def test_training_step_that_oomed_before_its_backward_is_not_evaluation():
    steps = [step(0, end=0, with_grad=1, backward=0, optimizer_steps=0, peak_phase="forward")]
    document = oom_document(allocated=900 * MiB, requested=200 * MiB, phase="forward", steps=steps)
    assert "grad_in_eval" not in kinds(document)


def test_evaluation_with_no_grad_is_fine():
    steps = [step(i, end=50 * MiB, with_grad=0, backward=0, optimizer_steps=0) for i in range(5)]
    assert "grad_in_eval" not in kinds(
        oomdoc_document(steps=steps, optimizers=[], step_unit="module")
    )


def test_graphs_kept_by_evaluation_put_grad_in_eval_before_leak():
    collected = {
        "variable": "outputs",
        "file": "/work/eval.py",
        "line": 9,
        "function": "main",
        "from_step": 0,
    }
    steps = [
        step(
            i,
            end=50 * MiB + i * 20 * MiB,
            with_grad=1,
            backward=0,
            optimizer_steps=0,
            retained_graphs=[collected] if i else [],
        )
        for i in range(6)
    ]
    document = oomdoc_document(steps=steps, optimizers=[], step_unit="module")
    assert kinds(document)[:2] == ["grad_in_eval", "leak"]
    assert any("`outputs`" in line for line in find(document, "grad_in_eval")["evidence"])


# ------------------------------------------------------------ fragmentation


def cuda_document(allocator, **kwargs):
    return oom_document(
        allocated=allocator["allocated_bytes"],
        requested=kwargs.pop("requested", 512 * MiB),
        capacity=16 * GiB,
        allocator=allocator,
        device={
            "kind": "cuda",
            "name": "NVIDIA H100",
            "capacity_bytes": 16 * GiB,
            "total_bytes": 80 * GiB,
        },
        **kwargs,
    )


def test_fragmentation_that_decided_the_oom():
    allocator = {
        "reserved_bytes": 15 * GiB,
        "allocated_bytes": 12 * GiB,
        "inactive_split_bytes": 3 * GiB,
        "inactive_split_blocks": 180,
        "segments": 40,
    }
    document = cuda_document(allocator)
    document["oom"]["free_bytes"] = 100 * MiB
    diagnosis = diagnose(document)[0]
    assert diagnosis["kind"] == "fragmentation"
    assert "decided the OOM" in diagnosis["summary"]
    assert diagnosis["bytes"] == 3 * GiB
    assert diagnosis["fixes"] == ["expandable_segments", "empty_cache"]
    assert "expandable_segments" in [fix["name"] for fix in estimate_fixes(document)]


def test_no_fragmentation_when_reserved_is_used():
    allocator = {
        "reserved_bytes": 15 * GiB,
        "allocated_bytes": 15 * GiB - 20 * MiB,
        "inactive_split_bytes": 20 * MiB,
        "inactive_split_blocks": 3,
        "segments": 40,
    }
    document = cuda_document(allocator)
    document["oom"]["free_bytes"] = 100 * MiB
    assert "fragmentation" not in kinds(document)
    assert "fragmentation" not in kinds(oomdoc_document())  # the simulated device has no allocator


def test_pytorch_snapshot_fragmentation_decides_only_when_cached_pieces_cover_the_request():
    # A PyTorch snapshot of a process capped with set_per_process_memory_fraction:
    # the driver's free memory ignores the cap, so it cannot show that the
    # memory was there; only cached-but-unused pieces can.
    allocator = {
        "reserved_bytes": 854 * MiB,
        "allocated_bytes": 836 * MiB,
        "inactive_split_bytes": 18 * MiB,
        "inactive_split_blocks": 4,
        "segments": 20,
    }
    document = cuda_document(allocator, requested=256 * MiB)
    document["oom"]["free_bytes"] = 77 * GiB
    document["source"] = {"format": "torch_pickle", "path": "x.pickle"}
    assert "fragmentation" not in kinds(document)
    # As tests/scripts/suggest_make_torch_snapshot.py makes on a GPU: 256 MiB
    # in split pieces, a 600 MiB request under a 1 GiB cap.
    allocator.update(
        reserved_bytes=512 * MiB,
        allocated_bytes=256 * MiB,
        inactive_split_bytes=256 * MiB,
        inactive_split_blocks=16,
    )
    document = cuda_document(allocator, requested=600 * MiB)
    document["oom"]["free_bytes"] = 77 * GiB
    document["source"] = {"format": "torch_pickle", "path": "x.pickle"}
    diagnosis = diagnose(document)[0]
    assert diagnosis["kind"] == "fragmentation"
    assert "may have decided the OOM" in diagnosis["summary"]
    allocator.update(
        reserved_bytes=1100 * MiB,
        allocated_bytes=836 * MiB,
        inactive_split_bytes=264 * MiB,
        inactive_split_blocks=9,
    )
    document = cuda_document(allocator, requested=256 * MiB)
    document["oom"]["free_bytes"] = 77 * GiB
    document["source"] = {"format": "torch_pickle", "path": "x.pickle"}
    diagnosis = find(document, "fragmentation")
    assert "decided the OOM" in diagnosis["summary"]


def test_expandable_segments_already_on_leaves_empty_cache():
    allocator = {
        "reserved_bytes": 15 * GiB,
        "allocated_bytes": 10 * GiB,
        "inactive_split_bytes": 5 * GiB,
        "inactive_split_blocks": 10,
        "expandable_segments": True,
    }
    diagnosis = find(cuda_document(allocator), "fragmentation")
    assert diagnosis["fixes"] == ["empty_cache"]


# ----------------------------------------------------------- other processes


def test_other_processes_holding_the_memory():
    document = cuda_document({"reserved_bytes": 10 * GiB, "allocated_bytes": 10 * GiB})
    document["device"]["other_processes"] = [
        {"pid": 4242, "used_bytes": 6 * GiB},
        {"pid": 7, "used_bytes": None},
    ]
    diagnosis = diagnose(document)[0]
    assert diagnosis["kind"] == "other_processes"
    assert "pid 4242: 6.00 GiB" in diagnosis["evidence"][0]
    assert diagnosis["bytes"] == 6 * GiB


def test_small_other_processes_are_not_diagnosed():
    document = cuda_document(
        {"reserved_bytes": 10 * GiB, "allocated_bytes": 10 * GiB}, requested=1 * GiB
    )
    document["device"]["other_processes"] = [{"pid": 1, "used_bytes": 100 * MiB}]
    assert "other_processes" not in kinds(document)
    document["device"]["other_processes"] = []
    assert "other_processes" not in kinds(document)


# -------------------------------------------------------------- host memory


def test_host_memory_pressure():
    document = oomdoc_document(
        host={"total_bytes": 32 * GiB, "available_bytes": 512 * MiB, "process_rss_bytes": 30 * GiB}
    )
    diagnosis = find(document, "host_memory")
    assert diagnosis is not None and diagnosis["bytes"] == 32 * GiB - 512 * MiB
    killed = oomdoc_document(
        outcome="error", exit_code=137, host={"total_bytes": 32 * GiB, "available_bytes": 512 * MiB}
    )
    assert kinds(killed)[0] == "host_memory"


def test_host_with_room_is_not_diagnosed():
    assert "host_memory" not in kinds(oomdoc_document())
    assert "host_memory" not in kinds(oomdoc_document(host={}))


# ------------------------------------------------------------ the breakdown


@pytest.mark.parametrize(
    "dominant, fixes",
    [
        ("activations", ["checkpointing", "autocast", "smaller_batch"]),
        ("optimizer_state", ["lighter_optimizer"]),
        ("parameters", []),
    ],
)
def test_the_dominant_category_comes_first_with_its_fixes(dominant, fixes):
    breakdown = {
        "parameters": 50 * MiB,
        "gradients": 50 * MiB,
        "optimizer_state": 50 * MiB,
        "activations": 50 * MiB,
        "other": 0,
    }
    breakdown[dominant] = 800 * MiB
    diagnosis = diagnose(oomdoc_document(breakdown=breakdown))[0]
    assert diagnosis["kind"] == dominant
    assert diagnosis["fixes"] == fixes
    assert "largest share" in diagnosis["summary"]


def test_small_categories_are_not_diagnosed():
    breakdown = {
        "parameters": 10 * MiB,
        "gradients": 10 * MiB,
        "optimizer_state": 20 * MiB,
        "activations": 900 * MiB,
        "other": 1,
    }
    assert kinds(oomdoc_document(breakdown=breakdown)) == ["activations"]


def test_bugs_come_before_the_breakdown():
    steps = [step(0, end=400 * MiB)] + [
        step(i, end=400 * MiB, retained_graphs=[TOTAL_LOSS]) for i in range(1, 6)
    ]
    order = kinds(oom_document(allocated=900 * MiB, requested=200 * MiB, steps=steps))
    assert order[0] == "leak" and "activations" in order


# ------------------------------------------------------------ estimated fixes


def test_estimated_fixes_are_labelled_ranked_and_arithmetic():
    document = oom_document(
        allocated=900 * MiB,
        requested=200 * MiB,
        breakdown={
            "parameters": 100 * MiB,
            "gradients": 100 * MiB,
            "optimizer_state": 200 * MiB,
            "activations": 500 * MiB,
            "other": 0,
        },
    )
    fixes, measured = fixes_for(document)
    assert measured is False and all(fix["measured"] is False for fix in fixes)
    by_name = {fix["name"]: fix for fix in fixes}
    needed = 1100 * MiB
    # 8 repeated blocks: (8-1)/(8+1) of activations
    assert by_name["checkpointing"]["saved_bytes"] == int(500 * MiB * 7 / 9)
    assert by_name["smaller_batch"]["saved_bytes"] == 250 * MiB
    assert by_name["autocast"]["saved_bytes"] == int(500 * MiB * 0.4) - 50 * MiB
    assert by_name["lighter_optimizer"]["saved_bytes"] == 100 * MiB
    for fix in fixes:
        assert fix["peak_allocated_bytes"] == needed - fix["saved_bytes"]
        assert fix["fits"] == (fix["peak_allocated_bytes"] <= 1 * GiB)
        assert fix["snippet"]
    fits = [fix["fits"] for fix in fixes]
    assert fits == sorted(fits, reverse=True)  # those that fit first
    assert fixes[0]["name"] == "checkpointing"  # fits, no change to training semantics


def test_pairs_are_estimated_when_no_single_fix_fits():
    document = oom_document(
        allocated=1000 * MiB,
        requested=350 * MiB,
        models=[],
        breakdown={
            "parameters": 100 * MiB,
            "gradients": 100 * MiB,
            "optimizer_state": 200 * MiB,
            "activations": 600 * MiB,
            "other": 0,
        },
    )
    fixes = estimate_fixes(document)
    pair = next(fix for fix in fixes if fix["name"] == "autocast+smaller_batch")
    # Activation fixes compound: 600 MiB * (1 - 0.6 * 0.5), less the weight copies.
    assert pair["saved_bytes"] == int(600 * MiB * (1 - 0.6 * 0.5)) - 50 * MiB
    assert pair["fits"]
    assert not any(fix["fits"] for fix in fixes if "+" not in fix["name"])


def test_measured_fixes_are_shown_as_measured():
    measured = [
        {
            "name": "autocast",
            "peak_allocated_bytes": 700 * MiB,
            "saved_bytes": 400 * MiB,
            "fits": True,
            "step_time_ratio": 0.8,
            "detail": "replayed step 0",
            "snippet": "x",
            "measured": True,
        }
    ]
    document = oom_document(
        allocated=900 * MiB, requested=200 * MiB, fixes=measured, max_batch_size=48
    )
    result = analysis(document)
    assert result["fixes"] == measured and result["fixes_measured"] is True
    assert result["max_batch_size"] == 48
    text = render_text(document)
    assert (
        "measured by replaying" in text
        and "0.80x" in text
        and "estimated" not in text.split("measured by replaying")[1]
    )


def test_estimates_rendered_through_the_same_table():
    document = oom_document(allocated=900 * MiB, requested=200 * MiB)
    text = render_text(document)
    assert "estimated from the breakdown" in text
    assert "checkpointing" in text and "How to apply checkpointing" in text
    markdown = render_markdown(document)
    assert "### Diagnosis" in markdown and "| checkpointing" in markdown


def test_run_that_fit_shows_no_estimated_fixes():
    assert "Fixes" not in render_text(oomdoc_document())


# ------------------------------------------------------- PyTorch snapshots


def test_torch_snapshot_diagnosis():
    document = load_bytes(pickle.dumps(torch_snapshot()), "s.pickle").document
    order = kinds(document)
    assert order[0] == "fragmentation"
    assert "optimizer_state" in order
    names = [fix["name"] for fix in estimate_fixes(document)]
    assert "expandable_segments" in names
    text = render_text(document)
    assert (
        "Allocator events just before the OOM" in text and "/home/me/train.py:42 in forward" in text
    )


def test_a_request_larger_than_the_device_is_said_first_with_its_line():
    """Issue 26, item 6: 390 MiB asked of a 128 MiB device, parameters and
    optimizer state holding the little in use: the first diagnosis says the
    one request cannot fit and where it was made."""
    document = oom_document(allocated=20 * MiB, requested=390 * MiB, capacity=128 * MiB)
    document["breakdown"] = {
        "parameters": 10 * MiB,
        "gradients": 0,
        "optimizer_state": 10 * MiB,
        "activations": 0,
        "other": 0,
    }
    first = diagnose(document)[0]
    assert first["kind"] == "oversized_request"
    assert "390.00 MiB" in first["summary"] and "128.00 MiB" in first["summary"]
    assert "train.py:10 in main" in first["summary"]
    assert "cannot fit" in first["summary"]
    fitting = oom_document(allocated=120 * MiB, requested=16 * MiB, capacity=128 * MiB)
    assert "oversized_request" not in [d["kind"] for d in diagnose(fitting)]


def uncalled_oom(models: list, *, allocated: int, capacity: int, phase: str) -> dict:
    """An OOM with `models` (Oom.uncalled_models) holding `allocated` in `other`."""
    document = oom_document(
        allocated=allocated, requested=500 * MiB, capacity=capacity, phase=phase
    )
    document["oom"]["uncalled_models"] = models
    document["breakdown"] = dict.fromkeys(
        ("parameters", "gradients", "optimizer_state", "activations"), 0
    )
    document["breakdown"]["other"] = allocated
    return document


def test_an_oom_while_the_model_is_moved_to_the_device_says_its_weights_do_not_fit():
    """A 7B model in float32 moved to a 16 GiB card: the OOM comes before any
    step, with 15.5 GiB of its 26 GiB of weights there. Not "a dataset moved
    to the device": the model's weights, and no batch or saver helps."""
    llama = {"class": "LlamaForCausalLM", "bytes": 15 * GiB + GiB // 2, "weights_bytes": 26 * GiB}
    document = uncalled_oom([llama], allocated=llama["bytes"], capacity=16 * GiB, phase="setup")
    document["models"] = []  # no model was called
    found = diagnose(document)
    first = found[0]
    assert first["kind"] == "model_load"
    assert "LlamaForCausalLM" in first["summary"]
    assert "its weights alone, 26.00 GiB, are more than the device's 16.00 GiB" in first["summary"]
    assert "torch_dtype=torch.bfloat16" in first["remedy"]
    other = next(d for d in found if d["kind"] == "unattributed")
    assert "being built or moved to the device" in other["summary"]
    assert "a dataset moved to the device" not in other["summary"].split("; for the rest")[0]


def test_an_ema_copy_named_mid_training_is_no_model_load():
    """The same record once a model was called (an EMA copy): the weights of
    a model kept aside, not a model that does not load."""
    ema = {"class": "AveragedModel", "bytes": 2 * GiB, "weights_bytes": 2 * GiB}
    document = uncalled_oom([ema], allocated=6 * GiB, capacity=8 * GiB, phase="forward")
    assert document["models"], "the builder's run called a model"
    found = diagnose(document)
    assert "model_load" not in [d["kind"] for d in found]
    other = next(d for d in found if d["kind"] == "unattributed")
    assert "AveragedModel(model, device='cpu')" in other["summary"]
    assert any(
        "weights of AveragedModel, a model the run never called" in e for e in other["evidence"]
    )


def test_a_small_model_beside_a_dataset_moved_up_front_is_no_model_load():
    """Before any call, a 1 GiB model and 14 GiB of a dataset moved to the
    16 GiB card: the weights did not fill it; no model_load, and the
    unattributed advice still names the dataset's kind of tensor."""
    small = {"class": "ResNet", "bytes": GiB, "weights_bytes": GiB}
    document = uncalled_oom([small], allocated=15 * GiB, capacity=16 * GiB, phase="setup")
    document["models"] = []
    found = diagnose(document)
    assert "model_load" not in [d["kind"] for d in found]
    other = next(d for d in found if d["kind"] == "unattributed")
    assert "a dataset moved to the device up front" in other["summary"]


def test_copies_of_the_weights_in_other_are_said_with_their_model():
    """A saved state_dict and an EMA's shadow list on the device
    (Oom.weight_copies): the unattributed diagnosis says whose weights they
    are and to keep them on the CPU, not only "a dataset moved up front"."""
    document = uncalled_oom([], allocated=6 * GiB, capacity=8 * GiB, phase="forward")
    del document["oom"]["uncalled_models"]
    document["oom"]["weight_copies"] = [
        {"of": "GPT", "copies": 2, "tensors": 296, "bytes": 3 * GiB}
    ]
    other = next(d for d in diagnose(document) if d["kind"] == "unattributed")
    assert "{k: v.to('cpu') for k, v in model.state_dict().items()}" in other["summary"]
    assert any(
        "3.00 GiB are 296 tensors shaped like GPT's parameters (copies of its weights" in line
        for line in other["evidence"]
    )


# ------------------------------------------------------- fixes already in effect


@pytest.mark.parametrize(
    "framework, checkpointed",
    [
        ({"checkpointed": {"Block": 8}}, True),
        ({"checkpointed": {"Block": 3}}, True),  # an OOM in the first forward cut the count
        ({"checkpointed": {"CheckpointWrapperInner": 8}}, True),  # a wrapper's blocks
        ({"checkpointed": {"Embedding": 1}}, False),  # not the blocks
        ({"checkpointed": {}}, False),
        ({}, False),  # an older snapshot: not known
    ],
)
def test_blocks_the_script_checkpoints_already_are_not_offered_again(framework, checkpointed):
    document = oom_document(
        allocated=900 * MiB,
        requested=200 * MiB,
        framework={"name": "plain", **framework},
        breakdown={"parameters": 50 * MiB, "activations": 800 * MiB, "other": 50 * MiB},
    )
    activations = find(document, "activations")
    assert activations is not None
    estimated = [fix["name"] for fix in estimate_fixes(document)]
    if checkpointed:
        assert "checkpointing" not in activations["fixes"]
        assert "checkpointing" not in estimated
        assert activations["summary"].endswith("(the blocks are already checkpointed)")
        assert any(
            line.endswith("`blocks`: already checkpointed") for line in activations["evidence"]
        )
    else:
        assert "checkpointing" in activations["fixes"]
        assert "checkpointing" in estimated
        assert any(line.endswith("checkpointing candidates") for line in activations["evidence"])


# ------------------------------------------------------------- caught OOMs

FIRST_OOM = {"step": 0, "phase": "forward", "requested_bytes": 64 * MiB}
FIRST_OOM.update(file="/work/train.py", line=24, function="train")


def test_an_oom_the_script_caught_comes_first_when_the_run_then_fit():
    document = oomdoc_document(ooms_seen={"count": 2, **FIRST_OOM})
    diagnosis = diagnose(document)[0]
    assert diagnosis["kind"] == "caught_oom"
    assert diagnosis["summary"].startswith(
        "The script ran out of memory 2 times, caught the error itself and went on"
    )
    assert diagnosis["evidence"][0] == (
        "the first in step 0 during forward, asking for 64.00 MiB, at train.py:24 in train"
    )


def test_retries_before_the_last_oom_are_said_after_what_filled_the_device():
    document = oom_document(allocated=900 * MiB, requested=200 * MiB)
    assert find(document, "caught_oom") is None  # no ooms_seen: an older snapshot
    document["ooms_seen"] = {"count": 1, **FIRST_OOM}
    assert find(document, "caught_oom") is None  # the one OOM ended the run
    document["ooms_seen"] = {"count": 3, **FIRST_OOM}
    diagnosis = find(document, "caught_oom")
    assert diagnosis is not None and kinds(document)[-1] == "caught_oom"
    assert (
        "2 times, caught the error itself, then ran out of memory again and stopped"
        in diagnosis["summary"]
    )
    document.update(outcome="error", oom=None)  # accelerate's finder: "reached zero"
    summary = find(document, "caught_oom")["summary"]
    assert "ran out of memory 3 times, caught the error itself, then failed: " in summary


def test_forwards_an_oom_the_script_caught_cut_short_are_no_evaluation():
    """A batch-size finder's tries that ran out of memory in their forward
    never reached a backward (the H200: accelerate's finder, 7 OOMs caught,
    4 of them in the forward, was told to use torch.no_grad())."""
    steps = [step(0, end=400 * MiB, with_grad=9, backward=5, optimizer_steps=2)]
    steps += [step(i, end=400 * MiB) for i in range(1, 4)]
    document = oomdoc_document(steps=steps)
    assert find(document, "grad_in_eval") is not None  # without the OOMs: a bug
    document["ooms_seen"] = {"count": 7, **FIRST_OOM}
    assert find(document, "grad_in_eval") is None
    assert kinds(document)[0] == "caught_oom"
