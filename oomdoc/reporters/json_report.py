"""The JSON report (`oomdoc suggest --format json`): one object, for tools."""

from __future__ import annotations

import json

from oomdoc.analysis import Analysis
from oomdoc.model import to_dict


class JsonReporter:
    format = "json"
    renders = "snapshot"
    summary = "one object"

    def __init__(self, analysis: Analysis):
        self.analysis = analysis

    @classmethod
    def from_analysis(cls, analysis: Analysis, snapshot_path: str | None = None) -> JsonReporter:
        return cls(analysis)

    def as_dict(self) -> dict:
        analysis = self.analysis
        snapshot = analysis.snapshot
        device = snapshot.device
        result = {
            "snapshot": analysis.path,
            "source_format": analysis.source_format,
            "headline": analysis.headline,
            "outcome": snapshot.outcome,
            "device": {
                "kind": device.kind,
                "name": device.name,
                "capacity_bytes": device.capacity_bytes,
            },
            "needed_bytes": snapshot.needed_bytes,
            "breakdown": dict(snapshot.breakdown.items()),
            "breakdown_at": snapshot.breakdown_at,
            "diagnoses": [diagnosis.as_dict() for diagnosis in analysis.diagnoses],
            "fixes": to_dict(analysis.fixes[: analysis.top]),
            "fixes_measured": analysis.fixes_measured,
            "max_batch_size": snapshot.max_batch_size
            if snapshot.max_batch_size is not None and snapshot.max_batch_size >= 0
            else None,
            "top_allocations": to_dict(snapshot.top_allocations[: analysis.top]),
        }
        if snapshot.modules:
            result["modules"] = to_dict(snapshot.modules[: max(analysis.top, 10)])
        if snapshot.prescription is not None:
            result["prescription"] = to_dict(snapshot.prescription)
        if snapshot.oom is not None:
            result["oom"] = to_dict(snapshot.oom)
        if snapshot.trace_before_oom is not None:
            result["trace_before_oom"] = to_dict(snapshot.trace_before_oom)
        return result

    def render(self) -> str:
        return json.dumps(self.as_dict(), indent=2, allow_nan=False) + "\n"
