"""Diagnosis rules: from a snapshot to an ordered list of findings, and
estimated fixes when no replay measured any.

Each diagnosis is a dict {kind, summary, evidence, bytes, fixes, remedy}:
`evidence` is a list of short sentences, `bytes` the memory it concerns (an
int, 0 when it cannot be put in bytes), `fixes` names from the catalogue in
oomdoc/fixes.py, `remedy` a code change that is not a catalogue fix (for
bugs such as a leak).

Order, most important first: bugs (grad_in_eval, leak), then causes that
decided the OOM on their own (fragmentation, other processes, a host that ran
out of RAM), then what filled the device, largest first.

Kinds: leak, grad_in_eval, fragmentation, other_processes, host_memory,
activations, optimizer_state, parameters, gradients, unattributed (the
breakdown's `other`: tensors made outside the model and optimizer, such as a
dataset moved to the device up front).

A snapshot is untrusted input: every field is read through the helpers below,
so a field of the wrong type is ignored rather than raising.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oomdoc.fixes import COMPATIBLE_PAIRS, FIXES, fix_info
from oomdoc.sizes import format_bytes
from oomdoc.snapshot import CATEGORIES

MiB = 1024**2

# Tiers: lower is shown first; within a tier, more bytes first.
TIER_BUG = 0
TIER_DECISIVE = 1
TIER_BREAKDOWN = 2
TIER_CONTEXT = 3

# A category is diagnosed when it holds at least this share of the memory in
# use (the largest category always is).
CATEGORY_SHARE = 0.2

# Adam-style optimizers keep two tensors per parameter (SGD with momentum one).
_TWO_STATE_OPTIMIZERS = {
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "FusedAdam",
    "DeepSpeedCPUAdam",
}

# Estimation constants, documented in README ("Estimated fixes").
AUTOCAST_ACTIVATION_SAVING = 0.4  # matmul/conv outputs halve; norms, softmax, losses stay fp32
AUTOCAST_WEIGHT_COPY = 0.5  # autocast caches a 16-bit copy of each fp32 weight it uses
SMALLER_BATCH_FACTOR = 0.5  # half the batch, two accumulation steps


def _int(value, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _str(value, default: str = "") -> str:
    return value if isinstance(value, str) else default


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "?"


def _where(location) -> str:
    location = _dict(location)
    if not location:
        return "an unknown place"
    return f"{_str(location.get('file'), '?')}:{_int(location.get('line'))} in {_str(location.get('function'), '?')}"


@dataclass
class Moment:
    """The moment the breakdown describes, and what it would take to fit."""

    breakdown: dict
    total_bytes: int  # sum of the breakdown
    needed_bytes: int  # in use plus the failed request at an OOM; else the peak
    capacity_bytes: int
    is_oom: bool
    label: str  # "at the OOM", "at the peak", ...


def moment_of(document: dict) -> Moment:
    breakdown = {
        category: max(0, _int(_dict(document.get("breakdown")).get(category)))
        for category in CATEGORIES
    }
    total = sum(breakdown.values())
    oom = _dict(document.get("oom"))
    capacity = _int(_dict(document.get("device")).get("capacity_bytes")) or _int(
        oom.get("capacity_bytes")
    )
    is_oom = document.get("outcome") == "oom" and bool(oom)
    if is_oom:
        needed = _int(oom.get("allocated_bytes"), total) + _int(oom.get("requested_bytes"))
    else:
        needed = _int(_dict(document.get("peak")).get("allocated_bytes"), total)
    label = {
        "oom": "at the OOM",
        "peak": "at the peak",
        "end": "at the end",
        "snapshot": "in the snapshot",
    }.get(_str(document.get("breakdown_at")), "at the end")
    return Moment(breakdown, total, needed, capacity, is_oom, label)


def _diagnosis(kind, summary, evidence, num_bytes, *, tier, fixes=(), remedy=None) -> dict:
    return {
        "kind": kind,
        "summary": summary,
        "evidence": [line for line in evidence if line],
        "bytes": int(max(0, num_bytes)),
        "fixes": [name for name in fixes if name in FIXES],
        "remedy": remedy,
        "_tier": tier,
    }


# -------------------------------------------------------------------- steps


def _steps(document: dict) -> list[dict]:
    return [step for step in _list(document.get("steps")) if isinstance(step, dict)]


def _incomplete_step_index(document: dict, steps: list[dict]):
    """The index of the step the run died in (its backward may never have
    come), or None when the run finished."""
    if not steps or document.get("outcome") == "ok":
        return None
    return _int(steps[-1].get("index"), -1)


def _complete_steps(document: dict, steps: list[dict]) -> list[dict]:
    """Steps that ran to their end: in optimizer units those with an
    optimizer step; otherwise every step but the one the run died in."""
    if document.get("step_unit") == "optimizer":
        return [step for step in steps if _int(step.get("optimizer_steps")) > 0]
    incomplete = _incomplete_step_index(document, steps)
    return [
        step for step in steps if incomplete is None or _int(step.get("index"), -1) != incomplete
    ]


def _steady_growth(document: dict, steps: list[dict], capacity: int):
    """(first, last, per_step, count) when allocated memory at the end of a
    step grows steadily across the complete steps; else None.

    The first step is left out: gradients and optimizer state appear there.
    """
    values = [
        _int(step.get("end_allocated_bytes"), -1) for step in _complete_steps(document, steps)[1:]
    ]
    values = [value for value in values if value >= 0]
    if len(values) < 3:
        return None
    deltas = [b - a for a, b in zip(values, values[1:])]
    grew = sum(1 for delta in deltas if delta > 0)
    shrank = sum(1 for delta in deltas if delta < 0)
    net = values[-1] - values[0]
    threshold = max(256 * 1024, capacity // 500)
    if net < threshold or grew < 0.5 * len(deltas) or shrank > 0.25 * len(deltas):
        return None
    return values[0], values[-1], net // len(deltas), len(values)


def _eval_steps(document: dict, steps: list[dict]) -> tuple[list[dict], int]:
    """Steps with forward passes under autograd that no backward used, and how
    many such passes there were in all."""
    incomplete = _incomplete_step_index(document, steps)
    any_backward = any(_int(step.get("backward_calls")) > 0 for step in steps)
    has_optimizer = bool(_list(document.get("optimizers")))
    complete_training = [
        step for step in _complete_steps(document, steps) if _int(step.get("backward_calls")) > 0
    ]
    # Some models are called twice per backward (two views, a GAN's
    # discriminator): the regular surplus of the training steps is not a bug.
    regular_surplus = min(
        (
            max(0, _int(s.get("forward_calls_with_grad")) - _int(s.get("backward_calls")))
            for s in complete_training
        ),
        default=0,
    )
    found, passes = [], 0
    for step in steps:
        with_grad = _int(step.get("forward_calls_with_grad"))
        backward = _int(step.get("backward_calls"))
        eval_mode = _int(step.get("eval_mode_forward_calls_with_grad"))
        surplus = with_grad - backward
        if surplus <= 0:
            continue
        died_here = incomplete is not None and _int(step.get("index"), -1) == incomplete
        if eval_mode > 0:
            # A module in eval mode under autograd without a backward for it.
            unused = min(surplus, eval_mode)
        elif not any_backward and not has_optimizer:
            unused = surplus  # a pure evaluation script
        elif died_here:
            continue  # the training step may simply not have reached its backward
        elif backward == 0 and any_backward:
            unused = surplus
        elif surplus > regular_surplus:
            unused = surplus - regular_surplus
        else:
            continue
        found.append(step)
        passes += unused
    return found, passes


# -------------------------------------------------------------------- rules


def rule_grad_in_eval(document: dict, moment: Moment) -> dict | None:
    steps = _steps(document)
    eval_steps, passes = _eval_steps(document, steps)
    if not eval_steps:
        return None
    indices = [_int(step.get("index"), -1) for step in eval_steps]
    eval_mode = sum(_int(step.get("eval_mode_forward_calls_with_grad")) for step in eval_steps)
    evidence = [
        f"{passes} forward pass(es) ran with autograd on and no backward used them "
        f"(step{'s' if len(indices) > 1 else ''} {_index_list(indices)})",
    ]
    if eval_mode:
        evidence.append(
            f"{eval_mode} of them called a model in eval mode (model.eval()) with gradients enabled"
        )
    if not any(_int(step.get("backward_calls")) > 0 for step in steps):
        evidence.append("the run never called backward")
    index_set = set(indices)
    held = [
        graph
        for step in steps
        for graph in _list(step.get("retained_graphs"))
        if isinstance(graph, dict) and _int(graph.get("from_step"), -1) in index_set
    ]
    if held:
        graph = held[0]
        evidence.append(
            f"`{_str(graph.get('variable'), '?')}` ({_where({'file': graph.get('file'), 'line': graph.get('line'), 'function': graph.get('function')})}) "
            f"keeps the graphs of these passes across steps, so their activations accumulate"
        )
    retained = max((_int(step.get("retained_activation_bytes")) for step in eval_steps), default=0)
    held_bytes = retained
    moment_step = _moment_step(document)
    if moment_step in index_set:
        held_bytes = max(held_bytes, moment.breakdown["activations"])
        evidence.append(
            f"activations were {format_bytes(moment.breakdown['activations'])} {moment.label}, in step {moment_step}, one of these passes"
        )
    summary = (
        "Evaluation without torch.no_grad(): forward passes recorded autograd graphs and kept "
        "their activations for a backward that never came"
    )
    remedy = (
        "model.eval()\n"
        "with torch.no_grad():  # or torch.inference_mode()\n"
        "    for inputs, targets in val_loader:\n"
        "        logits = model(inputs)"
    )
    return _diagnosis("grad_in_eval", summary, evidence, held_bytes, tier=TIER_BUG, remedy=remedy)


def _index_list(indices: list[int], limit: int = 6) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def _moment_step(document: dict):
    if document.get("breakdown_at") == "oom":
        return _dict(document.get("oom")).get("step")
    if document.get("breakdown_at") == "peak":
        return _dict(document.get("peak")).get("step")
    return None


def rule_leak(document: dict, moment: Moment) -> dict | None:
    steps = _steps(document)
    growth = _steady_growth(document, steps, moment.capacity_bytes)
    holders: dict[tuple, dict] = {}
    for step in steps:
        for graph in _list(step.get("retained_graphs")):
            if not isinstance(graph, dict):
                continue
            key = (
                _str(graph.get("variable"), "?"),
                _str(graph.get("file"), "?"),
                _str(graph.get("function"), "?"),
            )
            entry = holders.setdefault(
                key, {"graph": graph, "steps": 0, "from_step": _int(graph.get("from_step"))}
            )
            entry["steps"] += 1
            entry["from_step"] = min(entry["from_step"], _int(graph.get("from_step")))
    if not holders and growth is None:
        return None
    retained = max((_int(step.get("retained_activation_bytes")) for step in steps), default=0)
    evidence = []
    held_bytes = retained
    if growth is not None:
        first, last, per_step, count = growth
        held_bytes = max(held_bytes, last - first)
        evidence.append(
            f"allocated memory at the end of a step grew from {format_bytes(first)} to {format_bytes(last)} "
            f"over {count} steps ({format_bytes(per_step)} per step)"
        )
    if retained:
        evidence.append(
            f"{format_bytes(retained)} made in the forward/backward of earlier steps was still alive at a step's end"
        )
    if holders:
        ranked = sorted(holders.values(), key=lambda entry: (-entry["steps"], entry["from_step"]))
        for entry in ranked[:3]:
            graph = entry["graph"]
            evidence.append(
                f"`{_str(graph.get('variable'), '?')}` in {_str(graph.get('function'), '?')}() "
                f"({_str(graph.get('file'), '?')}:{_int(graph.get('line'))}) still reached the autograd graph of step "
                f"{entry['from_step']} at the end of {entry['steps']} later step(s)"
            )
        top = ranked[0]["graph"]
        variable = _str(top.get("variable"), "?")
        summary = (
            f"Memory leak: `{variable}` keeps the autograd graph of every step since step {ranked[0]['from_step']} alive: "
            f"it holds tensors with history (e.g. `{variable} += loss` without .item())"
        )
        remedy = (
            f"{variable} += loss.item()            # if it sums losses: a Python number keeps no graph\n"
            f"{variable}.append(output.detach())  # if it collects tensors: no graph (.cpu() frees the device)"
        )
    else:
        summary = (
            "Memory leak: allocated memory at the end of each step grows steadily; something keeps "
            "tensors from every step (a list of losses or outputs, a cache)"
        )
        remedy = (
            "losses.append(loss.item())      # numbers, not tensors\n"
            "outputs.append(logits.detach())  # no graph; .cpu() to keep them off the device"
        )
    return _diagnosis("leak", summary, evidence, held_bytes, tier=TIER_BUG, remedy=remedy)


def rule_fragmentation(document: dict, moment: Moment) -> dict | None:
    if _dict(document.get("device")).get("kind") != "cuda":
        return None
    allocator = _dict(document.get("allocator"))
    reserved = _int(allocator.get("reserved_bytes"))
    allocated = _int(allocator.get("allocated_bytes"))
    split_bytes = _int(allocator.get("inactive_split_bytes"))
    split_blocks = _int(allocator.get("inactive_split_blocks"))
    if reserved <= 0:
        return None
    unused = max(0, reserved - allocated)
    oom = _dict(document.get("oom"))
    requested = _int(oom.get("requested_bytes"))
    device_free = _int(oom.get("free_bytes"))
    # The allocator failed although what it had cached but unused, plus what
    # could still be allocated, would have covered the request: no single free
    # piece was large enough. oomdoc's own snapshots know the free memory under
    # the --device-memory cap; PyTorch's snapshots only have the driver's free
    # memory, which ignores a per-process memory fraction, so for them only
    # the cached pieces count.
    from_pytorch = _dict(document.get("source")).get("format", "").startswith("torch")
    usable_free = 0 if from_pytorch else device_free
    decisive = moment.is_oom and requested > 0 and unused > 0 and requested <= unused + usable_free
    large = split_bytes >= 32 * MiB and split_bytes >= 0.1 * reserved
    # The driver had room for the request, so a cap the PyTorch snapshot does
    # not record set the limit: large split pieces may have decided it.
    possibly_decisive = (
        from_pytorch and not decisive and moment.is_oom and large and 0 < requested <= device_free
    )
    if not (decisive or large):
        return None
    evidence = [
        f"{format_bytes(reserved)} reserved by PyTorch's allocator, {format_bytes(allocated)} allocated: "
        f"{format_bytes(unused)} cached but unused",
    ]
    if split_bytes:
        evidence.append(
            f"{format_bytes(split_bytes)} in {split_blocks} inactive split block(s) (free pieces of partly used segments)"
        )
    largest = _int(allocator.get("largest_free_block_bytes"), -1)
    if decisive:
        line = (
            f"the OOM asked for {format_bytes(requested)}; {format_bytes(unused)} cached plus {format_bytes(device_free)} "
            f"free on the device would have covered it"
        )
        if largest >= 0:
            line += f", but the largest free block was {format_bytes(largest)}"
        evidence.append(line)
    expandable = allocator.get("expandable_segments") is True
    if expandable:
        evidence.append("expandable_segments is already on")
    fixes = ["empty_cache"] if expandable else ["expandable_segments", "empty_cache"]
    if possibly_decisive:
        evidence.append(
            f"CUDA reported {format_bytes(device_free)} free on the device at the OOM: a per-process memory cap "
            f"(set_per_process_memory_fraction), which the snapshot does not record, set the limit"
        )
    summary = f"Fragmentation: {format_bytes(split_bytes or unused)} is reserved but split into pieces too small to use"
    if decisive:
        summary += " (this decided the OOM)"
    elif possibly_decisive:
        summary += " (this may have decided the OOM under the process's memory cap)"
    return _diagnosis(
        "fragmentation",
        summary,
        evidence,
        split_bytes or unused,
        tier=TIER_DECISIVE if decisive or possibly_decisive else TIER_BREAKDOWN,
        fixes=fixes,
    )


def rule_other_processes(document: dict, moment: Moment) -> dict | None:
    device = _dict(document.get("device"))
    processes = [p for p in _list(device.get("other_processes")) if isinstance(p, dict)]
    used = [(_int(p.get("pid"), -1), _int(p.get("used_bytes"))) for p in processes]
    total_used = sum(nbytes for _pid, nbytes in used)
    if not processes:
        return None
    total = _int(device.get("total_bytes")) or moment.capacity_bytes
    requested = _int(_dict(document.get("oom")).get("requested_bytes"))
    decisive = moment.is_oom and requested > 0 and total_used >= requested
    if not decisive and total_used < max(256 * MiB, total // 50):
        return None
    shown = ", ".join(
        f"pid {pid}: {format_bytes(nbytes)}"
        for pid, nbytes in sorted(used, key=lambda x: -x[1])[:5]
    )
    evidence = [f"{len(processes)} other process(es) on this GPU: {shown}"]
    if decisive:
        evidence.append(f"they hold more than the {format_bytes(requested)} the OOM asked for")
    if total:
        evidence.append(f"that is {_percent(total_used, total)} of the GPU's {format_bytes(total)}")
    summary = f"Other processes hold {format_bytes(total_used)} of this GPU"
    remedy = "nvidia-smi   # find them; stop them, or run on a free GPU:\nCUDA_VISIBLE_DEVICES=1 python train.py"
    return _diagnosis(
        "other_processes",
        summary,
        evidence,
        total_used,
        tier=TIER_DECISIVE if decisive else TIER_BREAKDOWN,
        remedy=remedy,
    )


def rule_host_memory(document: dict, moment: Moment) -> dict | None:
    host = _dict(document.get("host"))
    total = _int(host.get("total_bytes"))
    available = _int(host.get("available_bytes"), -1)
    if total <= 0 or available < 0:
        return None
    if available >= 0.1 * total and available >= 1024 * MiB:
        return None
    rss = _int(host.get("process_rss_bytes"))
    killed = _int(document.get("exit_code")) in (137, -9) or (
        document.get("outcome") in ("error", "interrupted")
        and _int(document.get("exit_code")) == 137
    )
    evidence = [
        f"{format_bytes(available)} of {format_bytes(total)} host RAM available ({_percent(available, total)})"
    ]
    if rss:
        evidence.append(f"the script's process used {format_bytes(rss)}")
    if killed:
        evidence.append(
            "the script was killed (exit status 137): the kernel's OOM killer ends a process when RAM runs out"
        )
    summary = "Host memory is nearly exhausted" + (" and the script was killed" if killed else "")
    remedy = (
        "DataLoader(..., num_workers=2)        # each worker holds its own copy of the dataset state\n"
        "torch.load(path, map_location='cpu', mmap=True)  # map checkpoints instead of reading them into RAM"
    )
    return _diagnosis(
        "host_memory",
        summary,
        evidence,
        total - available,
        tier=TIER_DECISIVE if killed else TIER_CONTEXT,
        remedy=remedy,
    )


_CATEGORY_KIND = {
    "activations": "activations",
    "optimizer_state": "optimizer_state",
    "parameters": "parameters",
    "gradients": "gradients",
    "other": "unattributed",
}

_CATEGORY_FIXES = {
    "activations": ("checkpointing", "autocast", "smaller_batch"),
    "optimizer_state": ("lighter_optimizer",),
    "parameters": (),
    "gradients": (),
    "other": (),
}

_CATEGORY_ADVICE = {
    "activations": "activation checkpointing of the repeated blocks, autocast to bf16, or a smaller batch with gradient accumulation",
    "optimizer_state": "a lighter optimizer (SGD with momentum, Adafactor, 8-bit AdamW from bitsandbytes), or shard the state with ZeRO/FSDP",
    "parameters": "keep the weights in bf16 (model.to(torch.bfloat16)), shard them with FSDP, or offload them to the CPU",
    "gradients": "shard gradients with FSDP/ZeRO-2, keep them in bf16, and free them with optimizer.zero_grad(set_to_none=True)",
    "other": "tensors made outside the model and optimizer (a dataset moved to the device up front, caches): keep data on the CPU and move one batch at a time",
}


def rules_breakdown(document: dict, moment: Moment) -> list[dict]:
    if moment.total_bytes <= 0:
        return []
    largest = max(CATEGORIES, key=lambda c: moment.breakdown[c])
    found = []
    for category in CATEGORIES:
        nbytes = moment.breakdown[category]
        if nbytes <= 0 or (category != largest and nbytes < CATEGORY_SHARE * moment.total_bytes):
            continue
        evidence = [
            f"{format_bytes(nbytes)} of {format_bytes(moment.total_bytes)} in use {moment.label}"
            + (
                f" ({_percent(nbytes, moment.capacity_bytes)} of the {format_bytes(moment.capacity_bytes)} capacity)"
                if moment.capacity_bytes
                else ""
            )
        ]
        evidence += _category_evidence(document, category)
        name = (
            "Unattributed tensors"
            if category == "other"
            else category.replace("_", " ").capitalize()
        )
        summary = (
            f"{name}: {'the largest' if category == largest else 'a large'} share, "
            f"{_percent(nbytes, moment.total_bytes)} of the memory in use {moment.label}; {_CATEGORY_ADVICE[category]}"
        )
        found.append(
            _diagnosis(
                _CATEGORY_KIND[category],
                summary,
                evidence,
                nbytes,
                tier=TIER_BREAKDOWN,
                fixes=_CATEGORY_FIXES[category],
            )
        )
    return found


def _category_evidence(document: dict, category: str) -> list[str]:
    evidence = []
    relative_to = _str(document.get("cwd")) or None
    sites = [
        s
        for s in _list(document.get("top_allocations"))
        if isinstance(s, dict) and s.get("category") == category
    ]
    for site in sites[:2]:
        from oomdoc.report import format_location, tensor_description

        description = tensor_description(site)
        evidence.append(
            f"{format_bytes(_int(site.get('bytes')))} allocated at {format_location(_dict(site.get('location')) or None, relative_to)}"
            + (f" ({description})" if description else "")
        )
    if category == "activations":
        oom = _dict(document.get("oom"))
        if document.get("outcome") == "oom" and oom.get("phase"):
            evidence.append(f"the OOM came during {oom.get('phase')}")
        for model in _list(document.get("models"))[:2]:
            blocks = _repeated_blocks(model)
            if blocks:
                block = blocks[0]
                evidence.append(
                    f"{_str(_dict(model).get('class'), 'the model')} repeats {block['count']} x {block['class']} in "
                    f"`{block['path']}`: checkpointing candidates"
                )
    elif category == "optimizer_state":
        optimizers = [o for o in _list(document.get("optimizers")) if isinstance(o, str)]
        if optimizers:
            two = [o for o in optimizers if o in _TWO_STATE_OPTIMIZERS]
            line = f"optimizer{'s' if len(optimizers) > 1 else ''}: {', '.join(optimizers)}"
            if two:
                line += " (two state tensors per parameter: exp_avg and exp_avg_sq)"
            evidence.append(line)
    elif category == "parameters":
        for model in _list(document.get("models"))[:3]:
            model = _dict(model)
            if _int(model.get("parameters_bytes")):
                evidence.append(
                    f"{_str(model.get('class'), 'a model')} has {format_bytes(_int(model.get('parameters_bytes')))} of parameters"
                )
    return evidence


def _repeated_blocks(model) -> list[dict]:
    """A model's repeated blocks, the outermost (shortest path) first."""
    blocks = []
    for block in _list(_dict(model).get("repeated_blocks")):
        block = _dict(block)
        count = _int(block.get("count"))
        if count >= 2:
            blocks.append(
                {
                    "path": _str(block.get("path"), "?"),
                    "class": _str(block.get("class"), "?"),
                    "count": count,
                }
            )
    return sorted(blocks, key=lambda b: (b["path"].count("."), -b["count"]))


RULES = (rule_grad_in_eval, rule_leak, rule_fragmentation, rule_other_processes, rule_host_memory)


def diagnose(document: dict) -> list[dict]:
    """All diagnoses for a snapshot, the most important first."""
    moment = moment_of(document)
    found = [d for d in (rule(document, moment) for rule in RULES) if d is not None]
    found += rules_breakdown(document, moment)
    kinds = {d["kind"] for d in found}
    if "grad_in_eval" in kinds and "leak" in kinds:
        # A leak of graphs made by evaluation passes is cured by no_grad.
        eval_indices = {
            _int(step.get("index"), -1) for step in _eval_steps(document, _steps(document))[0]
        }
        leak = next(d for d in found if d["kind"] == "leak")
        from_eval = any(
            _int(graph.get("from_step"), -1) in eval_indices
            for step in _steps(document)
            for graph in _list(step.get("retained_graphs"))
            if isinstance(graph, dict)
        )
        if from_eval:
            leak["_tier"] = TIER_BUG + 0.5
            leak["evidence"].append(
                "the leaked graphs come from the forward passes without torch.no_grad() (see grad_in_eval)"
            )
    found.sort(key=lambda d: (d["_tier"], -d["bytes"]))
    for d in found:
        d.pop("_tier")
    return found


# ------------------------------------------------------------ estimated fixes


@dataclass
class _Effect:
    """A fix's estimated effect: a share of activations saved, plus bytes."""

    activation_share: float = 0.0
    other_bytes: int = 0
    detail: str = ""


def _fix_effects(document: dict, moment: Moment) -> dict[str, _Effect]:
    """Estimates for the fixes that can be estimated from this snapshot."""
    breakdown = moment.breakdown
    activations = breakdown["activations"]
    effects: dict[str, _Effect] = {}
    if activations > 0:
        blocks = [b for model in _list(document.get("models")) for b in _repeated_blocks(model)[:1]]
        if blocks:
            count = max(block["count"] for block in blocks)
            block = next(b for b in blocks if b["count"] == count)
            share = (count - 1) / (count + 1)
            effects["checkpointing"] = _Effect(
                share,
                0,
                (
                    f"with {count} x {block['class']} checkpointed, about each block's input and one block's "
                    "activations are kept: "
                    f"about {share:.0%} of {format_bytes(activations)} of activations saved; "
                    "the forward of each block runs again in backward"
                ),
            )
        activation_dtypes = {
            _str(site.get("dtype"))
            for site in _list(document.get("top_allocations"))
            if isinstance(site, dict)
            and site.get("category") == "activations"
            and site.get("dtype")
        }
        if not activation_dtypes or "float32" in activation_dtypes:
            weight_copy = int(AUTOCAST_WEIGHT_COPY * breakdown["parameters"])
            effects["autocast"] = _Effect(
                AUTOCAST_ACTIVATION_SAVING,
                -weight_copy,
                (
                    f"about {AUTOCAST_ACTIVATION_SAVING:.0%} of {format_bytes(activations)} of activations saved "
                    f"(matmul outputs in 16 bits), less {format_bytes(weight_copy)} for the 16-bit weight copies autocast caches"
                ),
            )
        needed_without = moment.needed_bytes - activations
        detail = (
            f"half the batch and two accumulation steps: about {format_bytes(int(activations * SMALLER_BATCH_FACTOR))} "
            "of activations saved (activations grow linearly with the batch)"
        )
        if moment.capacity_bytes and activations:
            ratio = (moment.capacity_bytes - needed_without) / activations
            if 0 < ratio < 1:
                detail += (
                    f"; a batch up to about {math.floor(ratio * 100)}% of the current one would fit"
                )
            elif ratio <= 0:
                detail += "; even without activations the rest does not fit"
        effects["smaller_batch"] = _Effect(SMALLER_BATCH_FACTOR, 0, detail)
    optimizers = [o for o in _list(document.get("optimizers")) if isinstance(o, str)]
    state = breakdown["optimizer_state"]
    # Only when state was allocated at this moment: an OOM before the first
    # optimizer step is not helped by a lighter optimizer.
    if state > 0 and any(o in _TWO_STATE_OPTIMIZERS for o in optimizers):
        effects["lighter_optimizer"] = _Effect(
            0.0,
            state // 2,
            (
                f"SGD with momentum keeps one state tensor per parameter instead of two: about {format_bytes(state // 2)} saved"
            ),
        )
    if _dict(document.get("device")).get("kind") == "cuda":
        allocator = _dict(document.get("allocator"))
        split_bytes = _int(allocator.get("inactive_split_bytes"))
        if split_bytes > 0 and allocator.get("expandable_segments") is not True:
            effects["expandable_segments"] = _Effect(
                0.0,
                split_bytes,
                (
                    f"segments that grow in place leave no split remainders: up to {format_bytes(split_bytes)} of inactive split blocks recovered"
                ),
            )
    return effects


def estimate_fixes(document: dict) -> list[dict]:
    """Fixes estimated from the breakdown, ranked as measured ones are: those
    that fit first, then the lower cost to training semantics, then to speed,
    then the larger saving. Pairs are added when no single fix fits."""
    steps = _steps(document)
    if (
        steps
        and not any(_int(step.get("backward_calls")) > 0 for step in steps)
        and _eval_steps(document, steps)[0]
    ):
        # An evaluation under autograd: the training fixes of the catalogue
        # do not apply; torch.no_grad() (the grad_in_eval remedy) does.
        return []
    moment = moment_of(document)
    effects = _fix_effects(document, moment)
    activations = moment.breakdown["activations"]

    def entry(name: str, parts: list[str]) -> dict:
        remaining_share = 1.0
        other = 0
        for part in parts:
            remaining_share *= 1.0 - effects[part].activation_share
            other += effects[part].other_bytes
        saved = int(activations * (1.0 - remaining_share)) + other
        peak = moment.needed_bytes - saved
        info = fix_info(name)
        return {
            "name": name,
            "peak_allocated_bytes": int(peak),
            "saved_bytes": int(saved),
            "fits": bool(moment.capacity_bytes and peak <= moment.capacity_bytes),
            "step_time_ratio": None,
            "detail": "; ".join(effects[part].detail for part in parts),
            "snippet": info.snippet if info else "",
            "measured": False,
        }

    fixes = [entry(name, [name]) for name in effects]
    if fixes and not any(fix["fits"] for fix in fixes):
        for pair in sorted(COMPATIBLE_PAIRS, key=sorted):
            if all(part in effects for part in pair):
                parts = [name for name in FIXES if name in pair]  # catalogue order
                fixes.append(entry("+".join(parts), parts))
    return rank_fixes(fixes)


def rank_fixes(fixes: list[dict]) -> list[dict]:
    def key(fix: dict):
        info = fix_info(_str(fix.get("name")))
        return (
            not fix.get("fits"),
            info.semantics_cost if info else 9,
            info.speed_cost if info else 9,
            -_int(fix.get("saved_bytes")),
            _str(fix.get("name")),
        )

    return sorted(fixes, key=key)


def fixes_for(document: dict) -> tuple[list[dict], bool]:
    """The fixes to show: those in the snapshot (measured by replays) when
    there are any, else estimates. Returns (fixes, measured)."""
    recorded = [
        fix
        for fix in _list(document.get("fixes"))
        if isinstance(fix, dict) and isinstance(fix.get("name"), str)
    ]
    if recorded:
        return recorded, any(fix.get("measured") is not False for fix in recorded)
    return estimate_fixes(document), False


def analysis(
    document: dict, top: int = 5, source_format: str = "oomdoc", path: str | None = None
) -> dict:
    """What `oomdoc suggest --format json` prints."""
    from oomdoc.report import headline

    moment = moment_of(document)
    fixes, measured = fixes_for(document)
    result = {
        "snapshot": path,
        "source_format": source_format,
        "headline": headline(document),
        "outcome": document.get("outcome"),
        "device": {
            key: _dict(document.get("device")).get(key)
            for key in ("kind", "name", "capacity_bytes")
        },
        "needed_bytes": moment.needed_bytes,
        "breakdown": moment.breakdown,
        "breakdown_at": document.get("breakdown_at"),
        "diagnoses": diagnose(document),
        "fixes": fixes[:top],
        "fixes_measured": measured,
        "max_batch_size": document.get("max_batch_size")
        if _int(document.get("max_batch_size"), -1) >= 0
        else None,
        "top_allocations": [
            site for site in _list(document.get("top_allocations")) if isinstance(site, dict)
        ][:top],
    }
    if document.get("oom"):
        result["oom"] = document.get("oom")
    if document.get("trace_before_oom") is not None:
        result["trace_before_oom"] = document.get("trace_before_oom")
    return result
