"""The records of `oomdoc check`: its options, the baseline document (parsed
once, at the boundary, into `Baseline`), each compared quantity and the
check's result.

Its own module so that `oomdoc.check` (which runs the check and renders it)
and the check reporters (which read these records) both import it, and
neither imports the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

from oomdoc.analysis import headline
from oomdoc.categories import REQUIRED
from oomdoc.model import CATEGORIES, Breakdown, Certificate, Location, Site, Snapshot, parse
from oomdoc.sizes import format_bytes
from oomdoc.snapshot import SnapshotError, dumps, read_json_file

if TYPE_CHECKING:
    from oomdoc.runner import RunOptions

BASELINE_FORMAT = "oomdoc-baseline"
BASELINE_VERSION = 1


@dataclass
class CheckOptions:
    run: RunOptions  # target, args, device, capacity and max_steps (the --steps)
    baseline_path: str
    tolerance_fraction: float = 0.05
    tolerance_bytes: int = 0
    tolerance_text: str = "5%"
    update_baseline: bool = False
    junit_path: str | None = None
    html_path: str | None = None
    # --whole-run: the run's worst case (oomdoc.capture.whole_run), gated
    # on its certificate having no gap.
    whole_run: bool = False


# ------------------------------------------------------------------ baseline


@dataclass
class BaselineDevice:
    kind: Optional[str] = None
    name: Optional[str] = None
    capacity_bytes: Optional[int] = None


@dataclass
class BaselinePeak:
    allocated_bytes: int = 0
    # None: a baseline written without it (compared as "not in baseline").
    reserved_bytes: Optional[int] = None


def site_key(site: Site) -> tuple:
    """Category and line of code: shapes are not part of it, a larger batch
    changes the shape at the same line."""
    location = site.location
    if location is None:
        return (site.category, "", 0, "")
    return (site.category, location.file, location.line, location.function)


@dataclass
class Baseline:
    """What a baseline file records of a run (and what a check measures, in
    the same form): the peaks, each category's maximum, the largest sites,
    and how it was measured."""

    device: BaselineDevice = field(default_factory=BaselineDevice)
    peak: BaselinePeak = field(default_factory=BaselinePeak)
    categories: Breakdown = field(default_factory=Breakdown)
    # Locations relative to the working directory: checkouts elsewhere match.
    top_allocations: List[Site] = field(default_factory=list)
    command: List[str] = field(default_factory=list)
    steps: Optional[int] = None
    steps_run: Optional[int] = None
    torch_version: Optional[str] = None
    oomdoc_version: Optional[str] = None

    @classmethod
    def from_document(cls, document: dict) -> Baseline:
        """Leniently, as oomdoc.model reads a snapshot: `read_baseline`
        checks the fields a comparison needs first."""
        return parse(cls, document)

    def to_document(self) -> dict:
        device = self.device
        return {
            "format": BASELINE_FORMAT,
            "version": BASELINE_VERSION,
            "oomdoc_version": self.oomdoc_version,
            "torch_version": self.torch_version,
            "device": {
                "kind": device.kind,
                "name": device.name,
                "capacity_bytes": device.capacity_bytes,
            },
            "command": list(self.command),
            "steps": self.steps,
            "steps_run": self.steps_run,
            "peak": {
                "allocated_bytes": self.peak.allocated_bytes,
                "reserved_bytes": self.peak.reserved_bytes,
            },
            "categories": dict(self.categories.items()),
            "top_allocations": [
                {
                    "bytes": site.bytes,
                    "count": site.count,
                    "category": site.category,
                    "location": None
                    if site.location is None
                    else {
                        "file": site.location.file,
                        "line": site.location.line,
                        "function": site.location.function,
                    },
                    "shape": site.shape,
                    "dtype": site.dtype,
                }
                for site in self.top_allocations
            ],
        }

    def text(self) -> str:
        """Sorted keys, one value per line, no timestamps: a baseline diffs cleanly."""
        return dumps(self.to_document(), sort_keys=True)


def read_baseline(path: str | os.PathLike) -> Baseline:
    """The baseline file at `path`; a SnapshotError (one line) when it is not one."""
    document = read_json_file(path)

    def expect(condition: bool, message: str) -> None:
        if not condition:
            raise SnapshotError(f"{path}: {message}")

    expect(
        isinstance(document, dict) and document.get("format") == BASELINE_FORMAT,
        "not an oomdoc baseline (write one with oomdoc check --update-baseline)",
    )
    expect(
        document.get("version") == BASELINE_VERSION,
        f"unknown baseline version {document.get('version')!r} (this oomdoc reads version {BASELINE_VERSION}; refresh it with --update-baseline)",
    )
    peak = document.get("peak")
    expect(
        isinstance(peak, dict) and _is_byte_count(peak.get("allocated_bytes")),
        "peak.allocated_bytes must be an integer",
    )
    categories = document.get("categories")
    expect(isinstance(categories, dict), "categories must be an object")
    for category in CATEGORIES:  # one added since the baseline was written may be absent
        expect(
            _is_byte_count(categories.get(category, 0 if category not in REQUIRED else None)),
            f"categories.{category} must be an integer",
        )
    expect(isinstance(document.get("device"), dict), "device must be an object")
    sites = document.get("top_allocations", [])
    expect(
        isinstance(sites, list)
        and all(isinstance(s, dict) and _is_byte_count(s.get("bytes")) for s in sites),
        "top_allocations must be a list of objects with integer bytes",
    )
    return Baseline.from_document(document)


def _is_byte_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------ results


@dataclass
class Comparison:
    """One compared quantity."""

    name: str
    baseline: int | None  # None: the baseline does not have it
    current: int
    allowed_growth: int

    @property
    def change(self) -> int:
        return self.current - (self.baseline or 0)

    @property
    def grew(self) -> bool:
        """Beyond the tolerance: a regression."""
        return self.baseline is not None and self.change > self.allowed_growth

    @property
    def shrank(self) -> bool:
        """Smaller by more than the tolerance: the baseline could be tightened."""
        return self.baseline is not None and -self.change > self.allowed_growth

    def change_text(self) -> str:
        if self.baseline is None:
            return "(not in baseline)"
        change = self.change
        sign = "+" if change > 0 else ""
        text = f"{sign}{format_bytes(change)}" if change else "0 bytes"
        if self.baseline:
            text += f" ({sign}{100.0 * change / self.baseline:.1f}%)"
        return text

    def status(self) -> str:
        if self.baseline is None:
            return "new"
        return "GREW" if self.grew else ("shrank" if self.shrank else "ok")

    def failure_message(self, tolerance_text: str) -> str:
        return (
            f"{self.name} grew by {self.change_text()}: from {format_bytes(self.baseline)} to "
            f"{format_bytes(self.current)}, more than the {tolerance_text} tolerance allows "
            f"(+{format_bytes(self.allowed_growth)})"
        )


@dataclass
class SiteChange:
    """An allocation site whose bytes at the peak differ from the baseline's."""

    category: str
    location: Optional[Location]
    baseline: int = 0
    current: int = 0

    @property
    def change(self) -> int:
        return self.current - self.baseline

    @property
    def key(self) -> tuple:
        return site_key(Site(category=self.category, location=self.location))


@dataclass
class CheckResult:
    """A check's outcome: what the check reporters render."""

    snapshot: Snapshot  # the run's snapshot
    current: Baseline  # the run, as a baseline records it
    baseline: Baseline | None
    comparisons: list[Comparison]
    site_changes: list[SiteChange]
    notes: list[str]
    wall_s: float
    options: Optional[CheckOptions] = field(default=None)
    # --whole-run: what the run covered (oomdoc.replay.certificate).
    certificate: Optional[Certificate] = field(default=None)

    @property
    def measured(self) -> bool:
        return self.snapshot.outcome in ("ok", "oom")

    @property
    def oom(self) -> bool:
        return self.snapshot.outcome == "oom"

    @property
    def headline(self) -> str:
        return headline(self.snapshot)

    @property
    def regressions(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.grew]

    @property
    def uncovered(self) -> bool:
        """--whole-run asked, and the run's worst case is not all covered."""
        return self.certificate is not None and not self.certificate.certified

    @property
    def failed(self) -> bool:
        return not self.measured or self.oom or bool(self.regressions) or self.uncovered
