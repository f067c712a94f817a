"""The memory categories: the one table every room reads.

Every byte on the device is in exactly one category. The capture names them
(oomdoc.capture.modules.category_of), the snapshot validates them, the
reports, the breakdown diagnosis and `oomdoc check` list them from here:
adding a category is a row of `TABLE`, a field of `oomdoc.model.Breakdown`
(tests/test_registries.py checks that they agree) and the capture's rule.

`communication` holds the buffers made for collectives, told by where they
were made (a phase of the simulated device, the allocation stack on CUDA and
in PyTorch's snapshots; `COMMUNICATION_BUILDERS` below):

- covered: DistributedDataParallel's gradient buckets (the reducer builds
  them in `_ddp_init_helper` and rebuilds them in `_pre_forward` after the
  first backward) and FSDP2's (`fully_shard`) all-gather output and
  reduce-scatter input buffers (`foreach_all_gather`, `foreach_reduce`);
- not covered: FSDP1's (`FullyShardedDataParallel`) flat-parameter buffers,
  DeepSpeed's, the gathered (unsharded) parameters of FSDP (parameters),
  the sharded gradient FSDP2's reduce-scatter writes (a gradient, by
  identity: a known category wins), temporaries of a collective the script
  calls itself, and NCCL's own buffers, which are outside PyTorch's
  allocator altogether (the `outside_allocator` diagnosis).

Categories added after the first snapshots (`always_shown=False`) are absent
from older snapshots and baselines, which read them as 0; text tables show
them only where they hold bytes, so runs without them read as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Category:
    name: str
    # The breakdown diagnosis: its kind, its summary's name, its advice.
    kind: str
    title: str
    advice: str
    color: str  # the HTML report's
    # Its column in the module table (order, header); None: not a column.
    module_column: Optional[int] = None
    module_header: str = ""
    # False: absent from older snapshots and baselines (read as 0) and shown
    # in text tables only where it holds bytes.
    always_shown: bool = True


TABLE: tuple[Category, ...] = (
    Category(
        "parameters",
        kind="parameters",
        title="Parameters",
        advice="keep the weights in bf16 (model.to(torch.bfloat16)), shard them with FSDP, or offload them to the CPU",
        color="#3b82f6",
        module_column=1,
        module_header="parameters",
    ),
    Category(
        "gradients",
        kind="gradients",
        title="Gradients",
        advice="shard gradients with FSDP/ZeRO-2, keep them in bf16, and free them with optimizer.zero_grad(set_to_none=True)",
        color="#14b8a6",
        module_column=2,
        module_header="gradients",
    ),
    Category(
        "optimizer_state",
        kind="optimizer_state",
        title="Optimizer state",
        advice="a lighter optimizer (SGD with momentum, Adafactor, 8-bit AdamW from bitsandbytes), or shard the state with ZeRO/FSDP",
        color="#f59e0b",
        module_column=3,
        module_header="optimizer",
    ),
    Category(
        "activations",
        kind="activations",
        title="Activations",
        advice="activation checkpointing of the repeated blocks, autocast to bf16, or a smaller batch with gradient accumulation",
        color="#8b5cf6",
        module_column=0,
        module_header="activations",
    ),
    Category(
        "communication",
        kind="communication",
        title="Communication buffers",
        advice=(
            "DDP: gradient_as_bucket_view=True (the gradients become views of the buckets: "
            "one copy, not two; bucket_cap_mb sets each bucket's size, not their total); "
            "FSDP2: each all-gather and reduce-scatter buffer is one fully_shard unit's size: "
            "shard smaller units, prefetch fewer of them, reduce in bf16 "
            "(MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))"
        ),
        color="#059669",
        module_column=4,
        module_header="communication",
        always_shown=False,
    ),
    Category(
        "other",
        kind="unattributed",
        title="Unattributed tensors",
        advice="tensors made outside the model and optimizer (a dataset moved to the device up front, caches): keep data on the CPU and move one batch at a time",
        color="#94a3b8",
    ),
)

CATEGORIES: tuple[str, ...] = tuple(category.name for category in TABLE)
BY_NAME = {category.name: category for category in TABLE}
# Required in every snapshot and baseline (the others may be absent: 0).
REQUIRED: tuple[str, ...] = tuple(c.name for c in TABLE if c.always_shown)
COMMUNICATION = "communication"


def shown(*values_by_category) -> list[str]:
    """The categories a table shows: every one always shown, and the others
    where any of `values_by_category` (mappings of category to bytes, or
    None) holds bytes in them."""
    return [
        c.name
        for c in TABLE
        if c.always_shown
        or any(values and (values.get(c.name) or 0) > 0 for values in values_by_category)
    ]


def module_columns(names: list[str]) -> list[Category]:
    """The module table's category columns among `names`, in its order."""
    columns = [BY_NAME[name] for name in names if BY_NAME[name].module_column is not None]
    return sorted(columns, key=lambda c: c.module_column or 0)


# Where buffers for collectives are made: (the end of a file's path, its
# functions). A block whose allocation stack passes through one of them is
# `communication` (the module docstring says what is and is not covered).
COMMUNICATION_BUILDERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch/nn/parallel/distributed.py", ("_ddp_init_helper", "_pre_forward")),
    # torch >= 2.6: distributed/fsdp/_fully_shard/; 2.4-2.5: distributed/_composable/fsdp/
    ("/_fsdp_collectives.py", ("foreach_all_gather", "foreach_reduce")),
)


def is_communication_frame(filename: str, function: Optional[str]) -> bool:
    """A frame of code that makes buffers for collectives."""
    filename = filename.replace("\\", "/")
    return any(
        function in functions and filename.endswith(path)
        for path, functions in COMMUNICATION_BUILDERS
    )
