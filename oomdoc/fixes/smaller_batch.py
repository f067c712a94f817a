"""smaller_batch: the largest batch that fits, with gradient accumulation to
keep the effective batch. Measured by the batch search (oomdoc.replay.batch).

The prescription's replay also runs the accumulation itself
(`accumulation_steps` in the payload): under accumulation the forward of a
micro-batch runs while the earlier micro-batches' gradients are alive, so a
micro-batch's peak without it can be lower than the configuration's."""

from __future__ import annotations

import math
from typing import Any, Optional

from oomdoc.fixes.base import Effect, Fix, SnippetContext
from oomdoc.model import Snapshot
from oomdoc.script_flags import spelled
from oomdoc.sizes import format_bytes

FACTOR = 0.5  # half the batch, two accumulation steps


class SmallerBatch(Fix):
    name = "smaller_batch"
    title = "A smaller batch, with gradient accumulation to keep the effective batch"
    semantics_cost, speed_cost = 2, 1
    addresses = ("activations",)
    combines_with = ("autocast", "checkpointing")
    searches_batch = True
    changes_batch = True
    replay_priority = 0

    def snippet(self, context: SnippetContext) -> str:
        if context.get("micro_batch"):
            micro, steps = context["micro_batch"], context["accumulation_steps"]
            how = spelled(
                context.get("how") or "batch_size", micro, context.get("script_option_syntax")
            )
            head = (
                f"# {how}: {steps} micro-batches of {micro} keep the effective batch at {micro * steps}\n"
                f"accumulation_steps = {steps}\n"
            )
        else:
            head = "accumulation_steps = 2  # effective batch = batch_size * accumulation_steps\n"
        return (
            head + "for i, (x, y) in enumerate(loader):\n"
            "    loss = loss_fn(model(x), y) / accumulation_steps\n"
            "    loss.backward()\n"
            "    if (i + 1) % accumulation_steps == 0:\n"
            + "\n".join(update_lines(context, "        "))
        )

    def estimate(self, snapshot: Snapshot) -> Optional[Effect]:
        activations = snapshot.breakdown.bytes_of("activations")
        if activations <= 0:
            return None
        detail = (
            f"half the batch and two accumulation steps: about {format_bytes(int(activations * FACTOR))} "
            "of activations saved (activations grow linearly with the batch)"
        )
        capacity = snapshot.capacity_bytes
        if capacity:
            ratio = (capacity - (snapshot.needed_bytes - activations)) / activations
            if 0 < ratio < 1:
                detail += (
                    f"; a batch up to about {math.floor(ratio * 100)}% of the current one would fit"
                )
            elif ratio <= 0:
                detail += "; even without activations the rest does not fit"
        return Effect(FACTOR, 0, detail)

    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        """On the command line the parent has already rewritten the batch flag;
        otherwise the DataLoader that carries the failing batch size gets the
        new one (the first DataLoader with a batch size above 1, when the
        parent does not know the original size yet and asks for a fraction)."""
        record["mode"] = payload.get("batch_mode", "dataloader")
        record["batch_size"] = payload.get("batch_size")
        steps = int(payload.get("accumulation_steps") or 1)
        if steps > 1:
            accumulate(steps, record)
        if record["mode"] != "dataloader":
            return
        from oomdoc.dataloader_args import on_dataloader_init

        record["original_batch_size"] = payload.get("original_batch_size")
        record["patched"] = 0
        divisor = payload.get("batch_divisor")

        def smaller(arguments: dict) -> None:
            current = arguments.get("batch_size", 1)
            if not batch_size_to_change(arguments):
                return
            if record["original_batch_size"] is None:
                record["original_batch_size"] = current
                if record["batch_size"] is None and divisor:
                    record["batch_size"] = max(1, current // int(divisor))
            if current == record["original_batch_size"] and record["batch_size"]:
                arguments["batch_size"] = int(record["batch_size"])
                record["patched"] += 1

        on_dataloader_init(smaller)


def update_lines(context: SnippetContext, indent: str, scaled: bool = False) -> list[str]:
    """The update every `accumulation_steps` micro-batches: the optimizer's
    step, or for a script without one (context `update` `manual`) its own
    update by hand and `model.zero_grad()`."""
    if context.get("update") == "manual":
        lines = [
            "# your own update, as before (the script has no optimizer), e.g.",
            "for p in model.parameters():",
            "    p.data.add_(p.grad, alpha=-lr)",
            "model.zero_grad()",
        ]
    elif scaled:
        lines = [
            "scaler.step(optimizer)",
            "scaler.update()",
            "optimizer.zero_grad(set_to_none=True)",
        ]
    else:
        lines = ["optimizer.step()", "optimizer.zero_grad(set_to_none=True)"]
    return [indent + line for line in lines]


def batch_size_to_change(arguments: dict) -> bool:
    """Whether a DataLoader made with these arguments carries a batch size the
    smaller-batch fix can change (above 1, without a batch_sampler)."""
    current = arguments.get("batch_size", 1)
    return isinstance(current, int) and current > 1 and arguments.get("batch_sampler") is None


def watch_dataloaders(tracker: Any) -> None:
    """Note in the tracker's `dataloader_batch_sizes` the batch size of every
    DataLoader the script makes that the smaller-batch fix could change: a
    run that made none needs no replay to learn that a smaller batch cannot
    be tried; and in its `dataloader_workers` every DataLoader's num_workers
    (the cores its replays take: oomdoc.replay.lanes.default_jobs)."""
    from oomdoc.dataloader_args import on_dataloader_init

    batch_sizes: list = []
    workers: list = []
    tracker.dataloader_batch_sizes, tracker.dataloader_workers = batch_sizes, workers

    def note(arguments: dict) -> None:
        if batch_size_to_change(arguments):
            batch_sizes.append(int(arguments["batch_size"]))
        count = arguments.get("num_workers", 0)
        if isinstance(count, int) and not isinstance(count, bool):
            workers.append(max(0, count))

    on_dataloader_init(note)


def accumulate(steps: int, record: dict) -> None:
    """Gradient accumulation whatever the script's loop: only every
    `steps`-th call of an optimizer's step updates the parameters (the others
    run their closure, as Lightning's `optimizer.step(closure)` needs, and
    return), and `zero_grad` (the optimizer's or a module's) clears the
    gradients only when no step has been held back since the last update, so
    the micro-batches in between add up their gradients, as with the
    framework's own accumulation. Counted per call and per optimizer, so
    that a script that accumulates itself accumulates `steps` times more,
    and one whose optimizers step in turn (a GAN's discriminator and
    generator) has each update every `steps`-th of its own calls: counted
    together, the generator's step made every update and the discriminator
    never stepped."""
    import weakref

    import torch

    record.update(accumulation_steps=steps, optimizer_steps=0, held_back_steps=0)
    held_back: dict[int, int] = {}  # each optimizer's step calls since its last update
    stepped: dict[int, Any] = {}  # weak references to them, by id
    depth = [0]  # a step inside a step (a wrapper optimizer's): decided once
    optimizer_class = torch.optim.Optimizer
    original_init = optimizer_class.__init__

    def wrap_step(original: Any) -> Any:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            closure = kwargs.get("closure", args[0] if args else None)
            stepped.setdefault(id(self), weakref.ref(self))
            if depth[0] == 0 and held_back.get(id(self), 0) + 1 < steps:
                # The closure runs first: its zero_grad (Lightning's, before
                # its backward) clears the gradients when a cycle begins.
                result = None
                if closure is not None:
                    with torch.enable_grad():
                        result = closure()
                held_back[id(self)] = held_back.get(id(self), 0) + 1
                record["held_back_steps"] += 1
                return result
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    held_back[id(self)] = 0
                    record["optimizer_steps"] += 1

        step.__wrapped__ = original  # type: ignore[attr-defined]
        # torch wraps a class's step with its hooks once, unless marked hooked:
        # its hooks (the tracker's) must run only for the steps that update.
        step.hooked = True  # type: ignore[attr-defined]
        step.oomdoc_accumulation = True  # type: ignore[attr-defined]
        return step

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        cls = type(self)
        if not getattr(cls.step, "oomdoc_accumulation", False):
            cls.step = wrap_step(cls.step)

    def holds(owner: Any) -> bool:
        """Whether `owner` (an optimizer, or a module: the optimizers of its
        parameters) has step calls held back since its last update."""
        if isinstance(owner, optimizer_class):
            return bool(held_back.get(id(owner)))
        waiting = [
            optimizer
            for key, count in held_back.items()
            if count and (optimizer := stepped[key]()) is not None
        ]
        if not waiting:
            return False
        mine = {id(parameter) for parameter in owner.parameters()}
        return any(
            id(parameter) in mine
            for optimizer in waiting
            for group in optimizer.param_groups
            for parameter in group["params"]
        )

    def held(original: Any) -> Any:
        def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
            if holds(self):
                return None  # the gradients of this accumulation cycle stay
            return original(self, *args, **kwargs)

        zero_grad.__wrapped__ = original  # type: ignore[attr-defined]
        return zero_grad

    init.__wrapped__ = original_init  # type: ignore[attr-defined]
    optimizer_class.__init__ = init  # type: ignore[method-assign]
    optimizer_class.zero_grad = held(optimizer_class.zero_grad)  # type: ignore[method-assign]
    torch.nn.Module.zero_grad = held(torch.nn.Module.zero_grad)  # type: ignore[method-assign]
