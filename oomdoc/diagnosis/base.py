"""What a diagnosis is, and the tiers that order them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

MiB = 1024**2

# Tiers: lower is shown first; within a tier, more bytes first.
TIER_BUG = 0.0
TIER_DECISIVE = 1.0
TIER_BREAKDOWN = 2.0
TIER_CONTEXT = 3.0

# Diagnoses that are bugs in the script: fixes treat what they waste as needed.
BUG_KINDS = ("grad_in_eval", "leak")


@dataclass
class Diagnosis:
    """One finding: `evidence` is short sentences, `bytes` the memory it
    concerns (0 when it cannot be put in bytes), `fixes` catalogue fix names,
    `remedy` a code change that is not a catalogue fix (a bug's cure)."""

    kind: str
    summary: str
    evidence: List[str] = field(default_factory=list)
    bytes: int = 0
    fixes: List[str] = field(default_factory=list)
    remedy: Optional[str] = None
    tier: float = field(default=TIER_BREAKDOWN, metadata={"internal": True})

    def __post_init__(self) -> None:
        self.evidence = [line for line in self.evidence if line]
        self.bytes = int(max(0, self.bytes))

    def as_dict(self) -> dict:
        """The JSON form (`oomdoc suggest --format json`)."""
        return {
            "kind": self.kind,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "bytes": self.bytes,
            "fixes": list(self.fixes),
            "remedy": self.remedy,
        }
