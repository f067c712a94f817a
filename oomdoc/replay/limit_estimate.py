"""Where a batch search starts: the largest batch estimated from a run that
ran out of memory in its first step (the failing run, or a saver's replay at
the user's batch), before any replay has fit.

A replay near the limit measures the most (oomdoc.replay.batch), so the
first probe goes where the failing run puts it: the activations its first
forward had made by the OOM, scaled by how far that forward got (the OOM's
module among the model's repeated blocks), with the backward on top, against
the capacity less what stays alive across the step (parameters, gradients,
optimizer state).
"""

from __future__ import annotations

from oomdoc.capture import WRAPPER_ATTRIBUTES
from oomdoc.fixes.optimizer import optimizer_state_estimate
from oomdoc.model import RepeatedBlock, Snapshot


def first_probe(original_batch_size: int, step0_completed: bool) -> int:
    """Without an estimate: half the failing batch (a batch that OOMs is
    usually not many times too large); a quarter when even the failing run's
    first forward pass was far over the capacity."""
    return max(1, original_batch_size // (2 if step0_completed else 4))


def probe_divisor(snapshot: Snapshot) -> int:
    """2 (probe at half the failing batch) unless the failing run's first
    forward pass alone needed more than twice what the device had left: 4."""
    oom = snapshot.oom
    capacity = snapshot.device.capacity_bytes
    start = snapshot.steps[0].start_allocated_bytes if snapshot.steps else None
    if (
        oom is not None
        and oom.step == 0
        and oom.phase == "forward"
        and start is not None
        and capacity
    ):
        # The forward was cut short: by then it already needed this much.
        if oom.needed_bytes - start > 2 * (capacity - start):
            return 4
    return 2


def first_probe_for(snapshot: Snapshot, original_batch_size: int) -> int:
    """The first batch to replay: the failing run's own estimate of the
    largest batch that fits (estimated_max_batch), else a fixed fraction."""
    estimate = estimated_max_batch(snapshot, original_batch_size)
    if estimate is not None:
        return max(1, min(estimate, original_batch_size - 1))
    return max(1, original_batch_size // probe_divisor(snapshot))


# The backward's peak over the forward's activations, per sample: the
# gradients flowing back and the loss's copies of the logits come on top
# (1.0 to 1.4 on the H100 runs of benchmarks/batch_search.py --offline).
BACKWARD_OVER_FORWARD = 1.1
# A tensor asked for in the first forward past the model's repeated blocks
# has more of its size to come that the forward never reached. Asked for in a
# module outside the blocks (the head's logits): the loss's copy of it
# (log-softmax; in fp32 under autocast) and the backward's gradient. On the
# H200 (16 GiB) the Lightning encoder's checkpointing replay at batch 256 ran
# out of memory asking for its 15.6 GiB of logits; estimated without them,
# its search replayed 128 and 64 before 32 fit (autocast with it: the same),
# each a replay on the diagnosis's critical chain. Asked for outside every
# module (the loss, after the model returned): its gradient. The reference
# GPT (H200, batch 32) ran out of memory so, asking for its logits' fp32
# copy: estimated 23 without it, where 20 was the limit (23 replayed first).
REQUEST_COPIES_PAST_BLOCKS = 2
REQUEST_COPIES_IN_THE_LOSS = 1


def estimated_max_batch(
    snapshot: Snapshot, original_batch_size: int, to_come: bool = True
) -> int | None:
    """The largest batch that fits, guessed from the failing run alone, for
    the first replay: near the limit, that replay measures the most (one that
    fits gives every phase's peak; one that runs out of memory in a later
    step gives the first step's peaks and the fragmentation at the limit).

    Per sample: the activations the failing run's first forward had made by
    the OOM, scaled by how far the forward got (the OOM's module among the
    model's repeated blocks), with the tensors of the request's size still
    to come past the blocks (copies_to_come; not with `to_come` false: an
    estimate that errs large), times BACKWARD_OVER_FORWARD (and at least
    what an OOM after the forward had needed by then). Fixed: what was
    alive when the step began, plus gradients and optimizer state (estimated
    from the optimizer's class when the OOM came before its first step).
    None when the failing run did not measure enough (no step start, an OOM
    outside the first step's forward and no completed forward)."""
    oom = snapshot.oom
    capacity = snapshot.device.capacity_bytes or (oom.capacity_bytes if oom else 0)
    need = failing_batch_need(snapshot, to_come)
    if need is None or original_batch_size <= 0 or not capacity:
        return None
    fixed, batch_bytes = need
    if fixed >= capacity:
        return 0
    per_sample = batch_bytes / original_batch_size
    return int((capacity - fixed) // per_sample)


def failing_batch_need(snapshot: Snapshot, to_come: bool = True) -> tuple[int, float] | None:
    """(fixed, per batch): what the failing run's training step needs, as
    estimated_max_batch reckons it: the bytes alive whatever the batch
    (what was alive when the step began, gradients, optimizer state), and
    those the failing batch adds. None as estimated_max_batch."""
    oom = snapshot.oom
    first = next((step for step in snapshot.steps if step.index <= 0), None)
    if oom is None or first is None or first.start_allocated_bytes is None:
        return None
    start = first.start_allocated_bytes
    forward_peak = first.phase_peaks.get("forward")
    if (oom.step or 0) == 0 and oom.phase == "forward":
        made = oom.needed_bytes - start
        activations = made / forward_progress(snapshot, made) if made > 0 else 0
        if made > 0 and to_come:
            activations += copies_to_come(snapshot) * oom.requested_bytes
    elif forward_peak is not None and first.forward_calls <= 1:
        activations = forward_peak - start  # the whole first forward completed
    else:
        return None
    if activations <= 0:
        return None
    batch_bytes = BACKWARD_OVER_FORWARD * activations
    if (oom.step or 0) == 0 and oom.phase != "forward":
        # After the forward, in its first step: what it needed by then is a floor.
        batch_bytes = max(batch_bytes, oom.needed_bytes - start)
    parameters = snapshot.breakdown.bytes_of("parameters") or sum(
        model.parameters_bytes for model in snapshot.models
    )
    gradients = max(snapshot.breakdown.bytes_of("gradients"), parameters)
    return start + gradients + optimizer_state_estimate(snapshot), batch_bytes


def copies_to_come(snapshot: Snapshot) -> int:
    """How many more tensors the size of the one the first forward's OOM
    asked for come before the backward's peak, in a model with repeated
    blocks: none inside the blocks (their extrapolation counts them), the
    loss's copy and the gradient in a module outside them (a head, a loss
    module), the gradient outside every module (the loss, after the model
    returned: forward_progress counts the forward as complete there too)."""
    module = snapshot.oom.module if snapshot.oom else None
    groups = _block_groups(snapshot)
    if not groups:
        return 0
    if not isinstance(module, str):
        return REQUEST_COPIES_IN_THE_LOSS
    if any(_index_in(block, module) is not None for block in groups):
        return 0
    return REQUEST_COPIES_PAST_BLOCKS


def _block_groups(snapshot: Snapshot) -> list[RepeatedBlock]:
    """The models' runs of repeated blocks (two or more)."""
    return [
        block for model in snapshot.models for block in model.repeated_blocks if block.count >= 2
    ]


def _index_in(block: RepeatedBlock, module: str) -> int | None:
    """Which of `block`'s repeated blocks `module` is in (None: not in one)."""
    path = _as_named(block.path, module)
    prefix = "" if path == "(root)" else path + "."
    rest = module[len(prefix) :] if module.startswith(prefix) else None
    index = rest.split(".", 1)[0] if rest else ""
    return int(index) if index.isdigit() else None


def forward_progress(snapshot: Snapshot, made_bytes: float) -> float:
    """How much of the first forward's activations the failing run had made
    when it ran out of memory (0 < progress <= 1), from the module that asked
    for the memory: inside a run of repeated blocks (a transformer's layers),
    the blocks before it plus half its own; outside any module, after the
    model returned (the loss): all of it. Blocks are assumed alike, which
    overstates the later blocks of a CNN (whose feature maps shrink): the
    first replay then fits, below the limit. 1 when unknown."""
    module = snapshot.oom.module if snapshot.oom else None
    if not isinstance(module, str):
        return 1.0
    groups = _block_groups(snapshot)
    total = sum(block.count for block in groups)
    offset = 0
    for block in groups:
        index = _index_in(block, module)
        if index is not None:
            path = _as_named(block.path, module)
            done = offset + min(index, block.count - 1) + 0.5
            # The blocks' own activations (the module table, when there is
            # one, plus the failed request) extrapolate to all blocks; the
            # rest (embeddings, a CNN's stem) was made once.
            in_blocks = made_bytes
            for entry in snapshot.modules:
                if entry.path == path:
                    request = snapshot.oom.requested_bytes if snapshot.oom else 0
                    in_blocks = min(made_bytes, entry.bytes.bytes_of("activations") + request)
            whole = made_bytes - in_blocks + in_blocks * total / done
            return max(1e-3, min(1.0, made_bytes / whole)) if whole > 0 else 1.0
        offset += block.count
    return 1.0


def _as_named(block_path: str, module_path: str) -> str:
    """`block_path` as the module paths name it: without the wrappers'
    attributes in front when `module_path` does not have them (a model's
    repeated blocks are found on the object the script called, `module.h`;
    module paths are named without the wrapper, `h.3.attn`)."""
    path = block_path
    while not module_path.startswith(path + ".") and "." in path:
        head, rest = path.split(".", 1)
        if head not in WRAPPER_ATTRIBUTES:
            break
        path = rest
    return path if module_path.startswith(path + ".") else block_path
