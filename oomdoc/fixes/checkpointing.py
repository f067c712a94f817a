"""checkpointing: activation checkpointing of the repeated blocks."""

from __future__ import annotations

import weakref
from typing import Any, Optional

from oomdoc.fixes.base import Effect, Fix, FixRequest, SnippetContext
from oomdoc.model import Snapshot
from oomdoc.sizes import format_bytes

_CHECKPOINTED = "_oomdoc_checkpointed"


def checkpointed_blocks(snapshot: Snapshot) -> Optional[str]:
    """`2 x GPT2Block`: what the script's first training call already ran
    under torch.utils.checkpoint, where that covers the repeated blocks
    (checkpointing them again nests a checkpoint in each and saves nothing):
    their class was checkpointed (an OOM in that call's forward cuts the
    count short), or as many regions as the outermost run of them has
    blocks (a wrapper module's blocks: `checkpoint_wrapper`); else None."""
    framework = snapshot.framework
    checkpointed = (framework.checkpointed if framework is not None else None) or {}
    blocks = snapshot.repeated_blocks
    if not checkpointed or not blocks:
        return None
    same_class = any(block.class_name in checkpointed for block in blocks)
    if not same_class and sum(checkpointed.values()) < max(block.count for block in blocks):
        return None
    return ", ".join(f"{count} x {name}" for name, count in checkpointed.items())


class Checkpointing(Fix):
    name = "checkpointing"
    title = "Activation checkpointing of the repeated blocks"
    semantics_cost, speed_cost = 0, 1
    addresses = ("activations",)
    combines_with = (
        "autocast",
        "lighter_optimizer",
        "expandable_segments",
        "empty_cache",
        "smaller_batch",
    )
    prescribable = True
    replay_priority = 2
    helps_in_evaluation = False

    def skip_reason(self, snapshot: Snapshot, explicit: bool) -> Optional[str]:
        if not snapshot.models:
            return "no model ran a forward pass before the OOM"
        if not self.helps_in_evaluation and snapshot.oom is not None and snapshot.oom.in_evaluation:
            return "the OOM is in evaluation, where no autograd graph is kept: checkpointing saves nothing there"
        if not any(model.repeated_blocks for model in snapshot.models):
            return "the model has no repeated blocks (same-class children of an nn.ModuleList or nn.Sequential)"
        return super().skip_reason(snapshot, explicit)

    def in_effect(self, snapshot: Snapshot) -> Optional[str]:
        checkpointed = checkpointed_blocks(snapshot)
        if checkpointed is None:
            return None
        return f"the script already checkpoints its blocks ({checkpointed} under torch.utils.checkpoint)"

    def not_applied(self, applied: dict) -> Optional[str]:
        if not self.record_in(applied).get("wrapped"):
            return "no repeated blocks were found to wrap"
        return None

    def describe(self, applied: dict, request: FixRequest) -> str:
        wrapped = self.record_in(applied).get("wrapped") or []
        if wrapped:
            first = wrapped[0]
            request.context.update(
                SnippetContext(
                    blocks_path=first["path"],
                    blocks_class=first["class"],
                    blocks_count=first["count"],
                    # Every run of blocks it wrapped (a ResNet's four stages), in order.
                    blocks_groups=[
                        {
                            "path": w["path"],
                            "class": w["class"],
                            "count": w["count"],
                            "segments": bool(w.get("segments")),
                            "model": w.get("model"),
                        }
                        for w in wrapped
                    ],
                )
            )
        return "checkpointed " + ", ".join(
            f"{w['count']} x {w['class']} in {w['path']}" for w in wrapped
        )

    def snippet(self, context: SnippetContext) -> str:
        """`context`: blocks_path, blocks_class, blocks_count; `owner`, the
        expression the path starts from (default `model`)."""
        owner = context.get("owner", "model")
        return "\n".join(["from torch.utils.checkpoint import checkpoint", *loops(context, owner)])

    def estimate(self, snapshot: Snapshot) -> Optional[Effect]:
        activations = snapshot.breakdown.bytes_of("activations")
        blocks = snapshot.repeated_blocks
        if activations <= 0 or not blocks:
            return None
        block = max(blocks, key=lambda b: b.count)
        count = block.count
        share = (count - 1) / (count + 1)
        return Effect(
            share,
            0,
            f"with {count} x {block.class_name} checkpointed, about each block's input and one block's "
            "activations are kept: "
            f"about {share:.0%} of {format_bytes(activations)} of activations saved; "
            "the forward of each block runs again in backward",
        )

    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        """Wrap each repeated block's forward in checkpoint(); leaf blocks of
        an nn.Sequential (a Linear, ...) are checkpointed in segments with the
        modules that follow them. Applied at each new model's first call."""
        import torch
        import torch.nn as nn
        from torch.utils.checkpoint import checkpoint

        record.update(wrapped=[], models=0)
        roots: weakref.WeakSet = weakref.WeakSet()
        segmented: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        def checkpointed_forward(forward: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                if torch.is_grad_enabled():
                    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
                return forward(*args, **kwargs)

            return run

        original_forward = nn.Sequential.forward

        def sequential_forward(self: Any, input: Any) -> Any:
            # Patched on the class so that it also takes effect for a call
            # that has already started its hooks.
            segments = segmented.get(self)
            if segments is None or not torch.is_grad_enabled():
                return original_forward(self, input)
            for is_checkpointed, modules in segments:

                def run(x: Any, modules: Any = modules) -> Any:
                    for module in modules:
                        x = module(x)
                    return x

                input = (
                    checkpoint(run, input, use_reentrant=False) if is_checkpointed else run(input)
                )
            return input

        nn.Sequential.forward = sequential_forward  # type: ignore[method-assign]

        def wrap(module: Any) -> None:
            if module in roots:
                return
            roots.add(module)
            record["models"] += 1
            for path, container, class_name, blocks, composite in tracker.checkpoint_targets(
                module
            ):
                if composite:
                    for block in blocks:
                        if not getattr(block, _CHECKPOINTED, False):
                            block.forward = checkpointed_forward(block.forward)
                            setattr(block, _CHECKPOINTED, True)
                else:
                    segments: list = []
                    current: Any = None
                    for child in container.children():
                        if isinstance(child, type(blocks[0])) or current is None:
                            current = (isinstance(child, type(blocks[0])), [])
                            segments.append(current)
                        current[1].append(child)
                    segmented[container] = segments
                record["wrapped"].append(
                    {
                        "path": path or "(root)",
                        "class": class_name,
                        "count": len(blocks),
                        "segments": not composite,
                        "model": type(module).__name__,
                    }
                )

        tracker.forward_start_callbacks.append(wrap)


# What a replay ran for the same-class layers of a mixed nn.Sequential (a
# DCGAN's Conv2d, BatchNorm2d, LeakyReLU, ...): one checkpointed segment
# from each such layer to the next; a loop over the layers one by one would
# checkpoint each alone, which is not what was measured.
SEGMENTS_HELPER = """\
def checkpointed_segments(layers, x, block_class):
    \"\"\"`layers` (an nn.Sequential) run as segments that each start at a
    `block_class` layer, those checkpointed (as oomdoc's replay ran them).\"\"\"
    segment = []
    for layer in [*layers, None]:
        if segment and (layer is None or type(layer).__name__ == block_class):
            run = torch.nn.Sequential(*segment)
            starts = type(segment[0]).__name__ == block_class
            x = checkpoint(run, x, use_reentrant=False) if starts else run(x)
            segment = []
        if layer is not None:
            segment.append(layer)
    return x
"""


def loops(context: SnippetContext, owner: str) -> list[str]:
    """One checkpointed loop per run of blocks the replay wrapped, in order
    (a ResNet's four stages), over `owner.path`; the blocks' class and count
    as a comment. Layers of a mixed nn.Sequential run in segments
    (SEGMENTS_HELPER); where several models were wrapped (a GAN's two),
    each part says whose forward it goes in."""
    groups = context.get("blocks_groups") or [
        {
            "path": context.get("blocks_path"),
            "class": context.get("blocks_class", "block"),
            "count": context.get("blocks_count", "?"),
        }
    ]
    models = list(dict.fromkeys(group["model"] for group in groups if group.get("model")))
    lines = [*SEGMENTS_HELPER.splitlines(), ""] if any(g.get("segments") for g in groups) else []
    for group in groups:
        path = group.get("path")
        if len(models) > 1 and group.get("model"):
            lines.append(f"# in {group['model']}.forward:")
        comment = f"  # {group.get('class')} x {group.get('count')}" if path else ""
        path = path or "blocks"
        # The root itself is the container (a top-level nn.Sequential).
        blocks = owner if path == "(root)" else f"{owner}.{path}"
        if group.get("segments"):
            lines.append(
                f"x = checkpointed_segments({blocks}, x, {group.get('class')!r})"
                f"  # instead of {blocks}(x): {group.get('count')} segments"
            )
            continue
        lines.append(f"for block in {blocks}:{comment}")
        lines.append("    x = checkpoint(block, x, use_reentrant=False)")
    return lines
