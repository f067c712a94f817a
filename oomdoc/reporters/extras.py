"""Typed records of the snapshot fields the reporters show that
oomdoc.model keeps in a record's `extra` (written by the replays and the
distributed capture, not declared there): parsed with the model's lenient
`parse`, so the reporters read fields, never key paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from oomdoc.model import Prescription, Site, Snapshot, parse


@dataclass
class FlagsReplay:
    """The prescription replayed with the script's own flags
    (`prescription.verified_by_flags`)."""

    args: Optional[List[str]] = None
    outcome: Optional[str] = None
    peak_allocated_bytes: Optional[int] = None
    note: Optional[str] = None
    # False: the replay ended before an optimizer step and two more micro-batches.
    accumulation_covered: Optional[bool] = None


@dataclass
class PrescriptionExtras:
    verified_by_flags: Optional[FlagsReplay] = None
    # The batch size the throughput was measured at, when not the prescribed one.
    throughput_batch_size: Optional[int] = None


@dataclass
class Frame:
    """A frame of a site's stack, in oomdoc's keys or PyTorch's."""

    file: Optional[str] = None
    filename: Optional[str] = None
    line: Optional[int] = None
    function: Optional[str] = None
    name: Optional[str] = None


@dataclass
class SiteExtras:
    stack: List[Frame] = field(default_factory=list)
    frames: List[Frame] = field(default_factory=list)


@dataclass
class JobExtras:
    # The first rank that failed (any failure, not only an OOM).
    first_failing_rank: Optional[int] = None


def prescription_extras(prescription: Prescription) -> PrescriptionExtras:
    flags = prescription.verified_by_flags
    return PrescriptionExtras(
        verified_by_flags=parse(FlagsReplay, flags) if isinstance(flags, dict) else None,
        throughput_batch_size=prescription.throughput_batch_size,
    )


def site_extras(site: Site) -> SiteExtras:
    return parse(SiteExtras, site.extra)


def job_extras(snapshot: Snapshot) -> JobExtras:
    return parse(JobExtras, snapshot.extra)
