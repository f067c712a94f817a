"""The analysis of one snapshot: what every reporter renders.

Built once per report (`analyse`): the headline, the diagnoses, and the fixes
to show (measured by replays when the snapshot has them, else estimated).
Report renders, diagnosis decides: reporters read this and the snapshot's
fields, and decide nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from oomdoc.diagnosis import BUG_KINDS, Diagnosis, diagnose
from oomdoc.estimates import estimate_fixes
from oomdoc.model import FixResult, Snapshot
from oomdoc.sizes import format_bytes


@dataclass
class Analysis:
    snapshot: Snapshot
    headline: str
    diagnoses: list[Diagnosis]
    # Measured fixes when the snapshot has them, else estimates.
    fixes: list[FixResult]
    fixes_measured: bool
    # Where the snapshot came from: "oomdoc", "torch_pickle", "torch_json".
    source_format: str = "oomdoc"
    # The file read (suggest) or written (run).
    path: Optional[str] = None
    top: int = 5
    notes: list[str] = field(default_factory=list)
    # The script stopped before it put anything on the device (a SyntaxError,
    # an error at import): there is no breakdown to show.
    measured_nothing: bool = False

    @property
    def shown_fixes(self) -> list[FixResult]:
        """The fixes a report shows: measured ones whenever the snapshot has
        them; estimates only for an OOM (on a run that fit they are noise)."""
        if not self.fixes_measured and self.snapshot.outcome != "oom" and not self.snapshot.fixes:
            return []
        return self.fixes

    @property
    def bug_first(self) -> Optional[Diagnosis]:
        """The first diagnosis when it is a bug: the fixes treat the memory it
        wastes as needed, and the report says so above them."""
        if self.diagnoses and self.diagnoses[0].kind in BUG_KINDS:
            return self.diagnoses[0]
        return None


def analyse(
    snapshot: Snapshot, *, top: int = 5, source_format: str = "oomdoc", path: Optional[str] = None
) -> Analysis:
    fixes, measured = fixes_for(snapshot)
    notes = []
    if snapshot.device.kind == "simulated":
        notes.append(
            "on the simulated device every CPU tensor of the script counts against the capacity."
        )
    notes.extend(snapshot.notes)
    return Analysis(
        snapshot=snapshot,
        headline=headline(snapshot),
        diagnoses=diagnose(snapshot),
        fixes=fixes,
        fixes_measured=measured,
        source_format=source_format,
        path=path,
        top=top,
        notes=notes,
        measured_nothing=measured_nothing(snapshot),
    )


def measured_nothing(snapshot: Snapshot) -> bool:
    """A run that ended (failed or stopped) before any step and any byte on the device."""
    peak = snapshot.peak.allocated_bytes if snapshot.peak else None
    return (
        snapshot.outcome in ("error", "interrupted")
        and not snapshot.steps
        and not snapshot.ranks
        and not peak
        and snapshot.breakdown.total == 0
    )


def fixes_for(snapshot: Snapshot) -> tuple[list[FixResult], bool]:
    """The fixes in the snapshot (measured by replays) when there are any,
    else estimates. Returns (fixes, measured)."""
    if snapshot.fixes:
        return list(snapshot.fixes), any(fix.measured is not False for fix in snapshot.fixes)
    return estimate_fixes(snapshot), False


def uncaptured_work(snapshot: Snapshot) -> str:
    """When the script's training ran in processes oomdoc did not capture
    (started with `multiprocessing.Process`, not torch's spawn) and its own
    process trained nothing: what to do instead, else ''."""
    processes = snapshot.uncaptured_processes
    if not processes or snapshot.steps or snapshot.ranks:
        return ""
    count = sum(max(1, entry.count) for entry in processes)
    functions = ", ".join(f"`{entry.function}`" for entry in processes[:3])
    return (
        f"Not captured: the script's work ran in {count} process(es) it started with "
        f"multiprocessing.Process ({functions}), which joined no process group, so oomdoc "
        f"did not capture them; call torch.distributed.init_process_group in them or start "
        f"them with torch.multiprocessing.spawn (captured as ranks), or launch one process per "
        f"device with `oomdoc run --nproc-per-node {count} SCRIPT`"
    )


def headline(snapshot: Snapshot) -> str:
    """One sentence that says what happened."""
    uncaptured = uncaptured_work(snapshot)
    if uncaptured:
        return uncaptured
    capacity = snapshot.device.capacity_bytes
    if snapshot.is_oom:
        oom = snapshot.oom
        assert oom is not None
        where = " ".join(
            part
            for part in (
                f"in step {oom.step}" if oom.step is not None else "",
                f"during {oom.phase}" if oom.phase else "",
            )
            if part
        )
        return (
            f"OOM{' ' + where if where else ''}: tried to allocate {format_bytes(oom.requested_bytes)} "
            f"with {format_bytes(oom.allocated_bytes)} of {format_bytes(capacity)} in use"
        )
    peak = snapshot.peak
    peak_allocated = peak.allocated_bytes if peak else None
    peak_reserved = peak.reserved_bytes if peak else None
    if snapshot.from_pytorch:
        return (
            f"PyTorch memory snapshot without an OOM: {format_bytes(peak_allocated)} allocated, "
            f"{format_bytes(peak_reserved)} reserved"
        )
    peak_text = (
        f"peak {format_bytes(peak_allocated or 0)} allocated"
        f" ({format_bytes(peak_reserved)} reserved)"
        f" of {format_bytes(capacity)}"
    )
    if peak is not None and peak.step is not None:
        peak_text += f" in step {peak.step} during {peak.phase}"
    steps = snapshot.step_count
    if snapshot.outcome == "ok":
        used = peak_reserved if peak_reserved is not None else (peak_allocated or 0)
        return f"The run fit: {peak_text}; headroom {format_bytes(capacity - used)} over {steps} step(s)"
    if snapshot.outcome == "interrupted":
        return f"Interrupted after {steps} step(s): {peak_text}"
    error = snapshot.error
    failure = (error.type if error else None) or f"exit status {snapshot.exit_code}"
    return f"The script failed ({failure}) after {steps} step(s): {peak_text}"
