"""What a fix is: one object that knows when it is worth a replay, how the
child applies it, how to describe what the replay did, its snippet, its
estimate from a breakdown, and what it combines with.

The parent never imports torch: a fix's `apply` (run in the capture child,
before the user's script starts) imports torch inside the method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, TypedDict

from oomdoc.model import Breakdown, FixResult, Snapshot


class SnippetContext(TypedDict, total=False):
    """What a fix's snippet is made concrete with; every key is optional (a
    snippet without one writes a placeholder). Replays learn most of it
    (FixRequest.context, Fix.describe); the framework units add the
    snapshot's part (oomdoc.frameworks.base.FrameworkContext)."""

    # smaller_batch: the batch that fits, the steps that keep the effective
    # batch, and the batch-size flag (`--batch-size`, or `batch_size` for a
    # DataLoader)
    micro_batch: int
    accumulation_steps: int
    how: str
    # autocast: `cuda`/`cpu`, `bfloat16`/`float16`
    device_type: str
    dtype: str
    # checkpointing: the (first) repeated blocks, relative to the model
    # called; every run of blocks wrapped, in order (`path`, `class`,
    # `count`); the name the model goes by in the snippet
    blocks_path: str
    blocks_class: str
    blocks_count: int
    blocks_groups: list[dict[str, Any]]
    owner: str
    # lighter_optimizer: the optimizer measured (`Adafactor`), and what its
    # snippet passes it
    optimizer: Optional[str]
    parameters: str
    # How the script updates its parameters: `optimizer`, `manual` or None
    update: Optional[str]
    # The snapshot's `script_option_syntax`: how to spell an option
    script_option_syntax: Optional[str]


@dataclass
class FixRequest:
    """One replay of a fix: what the child is sent (`payload`, with the fix's
    `name`), the replay's extra environment, and what the snippet needs."""

    payload: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    context: SnippetContext = field(default_factory=lambda: SnippetContext())


@dataclass
class Effect:
    """A fix's estimated effect: a share of activations saved, plus bytes."""

    activation_share: float = 0.0
    other_bytes: int = 0
    detail: str = ""


class Fix:
    """A fix in the catalogue. Subclasses set the class attributes and
    override what applies to them."""

    name: str = "?"
    title: str = "?"
    # Lower is cheaper. Ranking puts fixes that fit first, then the smaller
    # cost to training semantics, then to speed, then the larger saving.
    semantics_cost: int = 0  # 0: none, 1: numerics change, 2: optimisation changes
    speed_cost: int = 0  # 0: none expected, 1: some recompute or overhead
    # It can make a step faster, not only smaller (bf16 autocast on tensor
    # cores): the prescription's search combines it with the other savers
    # whatever it did alone. A fix with speed_cost 1 only adds work.
    speeds_up: bool = False
    # Breakdown categories it shrinks: the category's diagnosis lists it.
    addresses: tuple[str, ...] = ()
    # Fixes it can be measured together with, as `a+b`.
    combines_with: tuple[str, ...] = ()
    cuda_only: bool = False
    # Measured by the largest-batch search rather than by one replay.
    searches_batch: bool = False
    # Sets the batch size (and gradient accumulation) its payload gives, alone
    # or `also` with other fixes: every replay at another batch goes through
    # it (oomdoc.fixes.batch_fix), so that no room names it.
    changes_batch: bool = False
    # Replays try fixes in this order (lowest first).
    replay_priority: int = 9
    # Takes effect through the environment its request sets, with no code
    # change (an allocator setting): the script's own flags run with it set.
    by_environment: bool = False
    # Only lays the allocator's cache out differently: it gives back at most
    # what was reserved but unallocated (oomdoc.replay.plan.beyond_the_cache).
    rearranges_cache: bool = False
    # Saves memory at any batch size, so the prescription may combine it with
    # other such fixes and a batch size (allocator settings are not).
    prescribable: bool = False

    @property
    def parts(self) -> list[Fix]:
        return [self]

    # ------------------------------------------------------------ parent
    # Whether it can lower memory in an evaluation pass (no autograd graph
    # there): checkpointing cannot.
    helps_in_evaluation = True

    def applies_to(self, snapshot: Snapshot) -> bool:
        """Whether the fix means anything for this kind of run (a sharding fix
        for a single process does not): when not, it is left out silently."""
        return True

    def skip_reason(self, snapshot: Snapshot, explicit: bool) -> Optional[str]:
        """Why a replay of this fix is not worth it for this run (None: replay
        it). `explicit`: the user asked for it with --fixes."""
        if self.cuda_only and not snapshot.device.on_cuda:
            return "CUDA only: the simulated device has no caching allocator"
        return self.in_effect(snapshot)

    def in_effect(self, snapshot: Snapshot) -> Optional[str]:
        """How the run already does what this fix does (None: it does not):
        such a fix is neither replayed (skip_reason) nor offered by the
        diagnosis, since it would change nothing."""
        return None

    def request(self, snapshot: Snapshot) -> FixRequest:
        """What a replay of this fix sends to the child."""
        return FixRequest(payload={"name": self.name})

    def record_in(self, applied: dict) -> dict:
        """What the child recorded for this fix (see `apply`), from the
        replay's `fix_applied`: {fix name: record}."""
        record = applied.get(self.name)
        return record if isinstance(record, dict) else {}

    def not_applied(self, applied: dict) -> Optional[str]:
        """Why the fix changed nothing in the replay, from what the child
        recorded (None: it was applied)."""
        return None

    def describe(self, applied: dict, request: FixRequest) -> str:
        """What the replay did, for the fix's detail; may add to
        `request.context` what the snippet needs."""
        return ""

    def snippet(self, context: SnippetContext) -> str:
        """How to apply the fix by hand, made concrete with `context`."""
        raise NotImplementedError

    def annotate(self, result: FixResult, static: Breakdown, snapshot: Snapshot) -> None:
        """Add to a measured result what only this fix knows, given the run's
        largest parameters, gradients and optimizer state (`static`)."""

    def estimate(self, snapshot: Snapshot) -> Optional[Effect]:
        """What the fix would save, estimated from the breakdown (None: it
        cannot be estimated for this snapshot)."""
        return None

    # ------------------------------------------------------------- child
    def apply(self, payload: dict, record: dict, tracker: Any) -> None:
        """Patch the libraries in the capture child before the script starts;
        record in `record` what was done (read back by `not_applied`)."""


class Combination(Fix):
    """Compatible fixes measured together (`a+b`, `a+b+c`)."""

    def __init__(self, *fixes: Fix):
        self.fixes = list(fixes)
        self.name = "+".join(fix.name for fix in fixes)
        self.title = " + ".join(fix.title for fix in fixes)
        self.semantics_cost = max(fix.semantics_cost for fix in fixes)
        self.speed_cost = max(fix.speed_cost for fix in fixes)
        self.speeds_up = any(fix.speeds_up for fix in fixes)
        self.addresses = tuple(sorted({c for fix in fixes for c in fix.addresses}))
        self.cuda_only = any(fix.cuda_only for fix in fixes)
        self.prescribable = all(fix.prescribable for fix in fixes)

    @property
    def parts(self) -> list[Fix]:
        return list(self.fixes)

    def request(self, snapshot: Snapshot) -> FixRequest:
        merged = FixRequest(payload={"name": self.name})
        for part in self.parts:
            request = part.request(snapshot)
            merged.payload.update({k: v for k, v in request.payload.items() if k != "name"})
            merged.env.update(request.env)
            merged.context.update(request.context)
        return merged

    def not_applied(self, applied: dict) -> Optional[str]:
        for part in self.parts:
            reason = part.not_applied(applied)
            if reason:
                return reason
        return None

    def describe(self, applied: dict, request: FixRequest) -> str:
        details = [part.describe(applied, request) for part in self.parts]
        return "; ".join(detail for detail in details if detail)

    def snippet(self, context: SnippetContext) -> str:
        return "\n\n".join(f"# {part.name}\n{part.snippet(context)}" for part in self.parts)
