"""Snapshot builders for the suggest/diagnose/loader tests.

`oomdoc_document` makes a valid oomdoc snapshot (the fields `validate()` and
the rules read); `torch_snapshot` makes a dict shaped like the one
`torch.cuda.memory._snapshot()` returns (segments of blocks with frames,
per-device trace entries), as documented in torch/cuda/memory.py.
"""

from __future__ import annotations

import copy

MiB = 1024**2
GiB = 1024**3


def step(
    index,
    *,
    end,
    peak=None,
    with_grad=1,
    backward=1,
    optimizer_steps=1,
    eval_mode=0,
    retained_graphs=(),
    retained_activation_bytes=0,
    peak_phase="backward",
) -> dict:
    return {
        "index": index,
        "peak_allocated_bytes": peak if peak is not None else end + 10 * MiB,
        "peak_reserved_bytes": peak if peak is not None else end + 10 * MiB,
        "peak_phase": peak_phase,
        "end_allocated_bytes": end,
        "phase_peaks": {},
        "forward_calls": with_grad + 1,
        "forward_calls_with_grad": with_grad,
        "eval_mode_forward_calls_with_grad": eval_mode,
        "backward_calls": backward,
        "optimizer_steps": optimizer_steps,
        "duration_s": 0.1,
        "retained_graphs": list(retained_graphs),
        "retained_activation_bytes": retained_activation_bytes,
    }


def training_steps(count, end=100 * MiB, growth=0) -> list[dict]:
    return [step(i, end=end + i * growth) for i in range(count)]


def oomdoc_document(**overrides) -> dict:
    """A healthy simulated-device run that fit; override what a test needs."""
    document = {
        "schema_version": 1,
        "oomdoc_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00Z",
        "command": ["train.py"],
        "cwd": "/work",
        "torch_version": "2.13.0",
        "device": {
            "kind": "simulated",
            "name": "simulated",
            "capacity_bytes": 1 * GiB,
            "total_bytes": 1 * GiB,
        },
        "host": {
            "total_bytes": 64 * GiB,
            "available_bytes": 40 * GiB,
            "process_rss_bytes": 2 * GiB,
        },
        "outcome": "ok",
        "exit_code": 0,
        "error": None,
        "step_unit": "optimizer",
        "oom": None,
        "breakdown": {
            "parameters": 100 * MiB,
            "gradients": 100 * MiB,
            "optimizer_state": 200 * MiB,
            "activations": 300 * MiB,
            "other": 1 * MiB,
        },
        "breakdown_at": "peak",
        "peak": {
            "allocated_bytes": 701 * MiB,
            "reserved_bytes": 701 * MiB,
            "step": 1,
            "phase": "backward",
        },
        "steps": training_steps(6, end=400 * MiB),
        "top_allocations": [],
        "allocator": {},
        "optimizers": ["AdamW"],
        "models": [
            {
                "class": "GPT",
                "parameters_bytes": 100 * MiB,
                "repeated_blocks": [{"path": "blocks", "class": "Block", "count": 8}],
            }
        ],
        "artifacts": {},
        "fixes": [],
        "max_batch_size": None,
    }
    for key, value in overrides.items():
        document[key] = copy.deepcopy(value)
    return document


def oom_document(
    *, allocated, requested, capacity=1 * GiB, phase="backward", step_index=0, **overrides
) -> dict:
    oom = {
        "step": step_index,
        "phase": phase,
        "requested_bytes": requested,
        "allocated_bytes": allocated,
        "reserved_bytes": allocated,
        "free_bytes": max(0, capacity - allocated),
        "capacity_bytes": capacity,
        "message": "out of memory",
        "location": {"file": "/work/train.py", "line": 10, "function": "main"},
    }
    defaults = dict(
        outcome="oom",
        exit_code=1,
        oom=oom,
        breakdown_at="oom",
        device={
            "kind": "simulated",
            "name": "simulated",
            "capacity_bytes": capacity,
            "total_bytes": capacity,
        },
    )
    defaults.update(overrides)
    return oomdoc_document(**defaults)


# ------------------------------------------------------------------ PyTorch


def frame(filename, line, name) -> dict:
    return {"filename": filename, "line": line, "name": name}


USER_FORWARD = [
    frame("/usr/lib/python3.10/site-packages/torch/nn/modules/linear.py", 125, "forward"),
    frame("/usr/lib/python3.10/site-packages/torch/nn/modules/module.py", 1747, "_call_impl"),
    frame("/home/me/train.py", 42, "forward"),
    frame("/home/me/train.py", 88, "main"),
]
USER_OPTIMIZER = [
    frame("/usr/lib/python3.10/site-packages/torch/optim/adamw.py", 120, "_init_group"),
    frame("/usr/lib/python3.10/site-packages/torch/optim/optimizer.py", 480, "wrapper"),
    frame("/home/me/train.py", 95, "main"),
]
USER_PARAMETERS = [
    frame("/usr/lib/python3.10/site-packages/torch/nn/modules/module.py", 1340, "_apply"),
    frame("/usr/lib/python3.10/site-packages/torch/nn/modules/module.py", 1350, "cuda"),
    frame("/home/me/train.py", 70, "main"),
]


def block(address, size, state="active_allocated", frames=(), requested=None) -> dict:
    return {
        "address": address,
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "frames": list(frames),
    }


def segment(address, blocks, device=0) -> dict:
    total = sum(b["size"] for b in blocks)
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "allocated_size": active,
        "active_size": active,
        "requested_size": active,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def torch_snapshot(*, with_oom=True, fragmented=True) -> dict:
    """A device with parameters, optimizer state, activations, a gradient made
    by the autograd engine (no Python stack), free split remainders, and a
    trace that ends in an OOM of 300 MiB."""
    base = 0x7F0000000000
    segments = [
        segment(base, [block(base, 400 * MiB, frames=USER_PARAMETERS)]),
        segment(base + GiB, [block(base + GiB, 800 * MiB, frames=USER_OPTIMIZER)]),
        segment(
            base + 2 * GiB,
            [
                block(base + 2 * GiB, 200 * MiB, frames=USER_FORWARD),
                block(base + 2 * GiB + 200 * MiB, 250 * MiB if fragmented else 0, state="inactive"),
                block(base + 2 * GiB + 450 * MiB, 100 * MiB, frames=USER_FORWARD),
                block(base + 2 * GiB + 550 * MiB, 150 * MiB if fragmented else 0, state="inactive"),
                block(base + 2 * GiB + 700 * MiB, 64 * MiB, frames=[]),
            ],
        ),
    ]
    for seg in segments:
        seg["blocks"] = [b for b in seg["blocks"] if b["size"]]
    trace = [
        {
            "action": "segment_alloc",
            "addr": base + 2 * GiB,
            "size": 764 * MiB,
            "stream": 0,
            "frames": USER_FORWARD,
        },
        {
            "action": "alloc",
            "addr": base + 2 * GiB,
            "size": 200 * MiB,
            "stream": 0,
            "frames": USER_FORWARD,
        },
        {
            "action": "alloc",
            "addr": base + 2 * GiB + 450 * MiB,
            "size": 100 * MiB,
            "stream": 0,
            "frames": USER_FORWARD,
        },
        {
            "action": "free_requested",
            "addr": base + 2 * GiB + 200 * MiB,
            "size": 250 * MiB,
            "stream": 0,
            "frames": USER_FORWARD,
        },
        {
            "action": "free_completed",
            "addr": base + 2 * GiB + 200 * MiB,
            "size": 250 * MiB,
            "stream": 0,
            "frames": USER_FORWARD,
        },
    ]
    if with_oom:
        trace.append(
            {
                "action": "oom",
                "size": 300 * MiB,
                "stream": 0,
                "device_free": 100 * MiB,
                "frames": USER_FORWARD,
            }
        )
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False},
    }
