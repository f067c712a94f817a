"""Fixes estimated from the breakdown, for snapshots no replay measured
(`oomdoc suggest` on a PyTorch snapshot, or `oomdoc run --no-replay`).

Each fix estimates itself (Fix.estimate); here they are combined into fix
results ranked as measured ones are, with pairs when no single fix fits.
An estimate is a rule of thumb, labelled so.
"""

from __future__ import annotations

import itertools

from oomdoc.diagnosis.steps import is_evaluation_only
from oomdoc.fixes import FIXES, Combination, Effect, Fix, compatible
from oomdoc.fixes.ranking import rank_fixes
from oomdoc.model import FixResult, Snapshot, parse


def estimate_fixes(snapshot: Snapshot) -> list[FixResult]:
    """Estimated fixes, ranked: those that fit first, then the lower cost to
    training semantics, then to speed, then the larger saving."""
    if is_evaluation_only(snapshot):
        # An evaluation under autograd: the training fixes of the catalogue
        # do not apply; torch.no_grad() (the grad_in_eval remedy) does.
        return []
    effects: dict[str, tuple[Fix, Effect]] = {}
    for fix in FIXES:
        if fix.in_effect(snapshot) is not None:
            continue  # (the run already does it: it would change nothing)
        effect = fix.estimate(snapshot)
        if effect is not None:
            effects[fix.name] = (fix, effect)
    results = [_result(snapshot, fix, [effect]) for fix, effect in effects.values()]
    if results and not any(result.fits for result in results):
        # Catalogue order names the pair (`checkpointing+autocast`).
        for (first, first_effect), (second, second_effect) in itertools.combinations(
            effects.values(), 2
        ):
            if compatible(first, second):
                results.append(
                    _result(snapshot, Combination(first, second), [first_effect, second_effect])
                )
    return rank_fixes(results)


def _result(snapshot: Snapshot, fix: Fix, effects: list[Effect]) -> FixResult:
    """Activation savings compound; byte savings add up."""
    remaining_share = 1.0
    other = 0
    for effect in effects:
        remaining_share *= 1.0 - effect.activation_share
        other += effect.other_bytes
    saved = int(snapshot.breakdown.bytes_of("activations") * (1.0 - remaining_share)) + other
    peak = snapshot.needed_bytes - saved
    capacity = snapshot.capacity_bytes
    # Parsed from the fields an estimate has, so that it is written (JSON)
    # without the measured-only fields (outcome, step_s, ...).
    return parse(
        FixResult,
        {
            "name": fix.name,
            "peak_allocated_bytes": int(peak),
            "saved_bytes": int(saved),
            "fits": bool(capacity and peak <= capacity),
            "step_time_ratio": None,
            "detail": "; ".join(effect.detail for effect in effects),
            "snippet": fix.snippet({}),
            "measured": False,
        },
    )
