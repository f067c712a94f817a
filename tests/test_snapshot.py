"""The snapshot data model: validation, atomic writes, default paths."""

import copy
import json
import os

import pytest

from oomdoc.snapshot import (
    SCHEMA_VERSION,
    SnapshotError,
    default_snapshot_path,
    read_snapshot,
    validate,
    write_atomic,
    write_snapshot,
)

VALID = {
    "schema_version": SCHEMA_VERSION,
    "oomdoc_version": "0.1.0",
    "created_at": "2026-11-22T00:00:00Z",
    "command": ["train.py", "--batch-size", "8"],
    "torch_version": "2.13.0",
    "device": {"kind": "simulated", "name": "sim", "capacity_bytes": 1024},
    "outcome": "oom",
    "exit_code": 1,
    "oom": {
        "step": 0,
        "phase": "forward",
        "requested_bytes": 10,
        "allocated_bytes": 1000,
        "reserved_bytes": 1000,
        "message": "Tried to allocate",
        "location": {"file": "train.py", "line": 3, "function": "main"},
    },
    "breakdown": {
        "parameters": 1,
        "gradients": 2,
        "optimizer_state": 3,
        "activations": 4,
        "other": 5,
    },
    "steps": [
        {
            "index": 0,
            "peak_allocated_bytes": 5,
            "peak_reserved_bytes": 5,
            "peak_phase": "forward",
            "end_allocated_bytes": 4,
        }
    ],
    "top_allocations": [
        {"bytes": 4, "category": "activations", "location": None, "shape": [2], "dtype": "float32"}
    ],
    "fixes": [],
    "max_batch_size": None,
}


def test_valid_document_passes():
    validate(copy.deepcopy(VALID))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version=99), "unknown schema_version 99"),
        (lambda d: d.pop("schema_version"), "no schema_version"),
        (lambda d: d.update(outcome="exploded"), "outcome must be"),
        (lambda d: d["device"].update(kind="tpu"), "device.kind"),
        (lambda d: d["breakdown"].pop("activations"), "breakdown.activations"),
        (lambda d: d["steps"][0].update(peak_phase="lunch"), "steps[0].peak_phase"),
        (lambda d: d["oom"].update(requested_bytes="10"), "oom.requested_bytes"),
        (lambda d: d.update(oom=None), "oom must be an object"),
        (lambda d: d["top_allocations"][0].update(category="misc"), "top_allocations[0].category"),
        (lambda d: d.update(command="train.py"), "command must be a list"),
        (lambda d: d["breakdown"].update(other=True), "breakdown.other must be an integer"),
    ],
)
def test_invalid_documents_name_the_problem(mutate, message):
    document = copy.deepcopy(VALID)
    mutate(document)
    with pytest.raises(SnapshotError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(document)


def test_write_snapshot_never_overwrites(tmp_path):
    path = tmp_path / "s.json"
    write_snapshot(copy.deepcopy(VALID), path)
    assert read_snapshot(path) == VALID
    with pytest.raises(FileExistsError):
        write_snapshot(copy.deepcopy(VALID), path)
    assert read_snapshot(path) == VALID
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary files left


def test_write_atomic_overwrite_replaces_whole_file(tmp_path):
    path = tmp_path / "b.json"
    write_atomic(path, "old")
    write_atomic(path, "new", overwrite=True)
    assert path.read_text() == "new"


def test_invalid_document_is_not_written(tmp_path):
    document = copy.deepcopy(VALID)
    document["outcome"] = "?"
    with pytest.raises(SnapshotError):
        write_snapshot(document, tmp_path / "x.json")
    assert not os.listdir(tmp_path)


def test_read_snapshot_errors(tmp_path):
    with pytest.raises(SnapshotError, match="no such file"):
        read_snapshot(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SnapshotError, match="not valid JSON"):
        read_snapshot(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    with pytest.raises(SnapshotError, match="not an oomdoc snapshot"):
        read_snapshot(tmp_path / "list.json")


def test_default_snapshot_path_skips_existing(tmp_path):
    first = default_snapshot_path("dir/My Train.py", tmp_path)
    assert (
        first.parent == tmp_path and first.name.startswith("My_Train-") and first.suffix == ".json"
    )
    first.write_text("x")
    second = default_snapshot_path("dir/My Train.py", tmp_path)
    assert second != first and not second.exists()


def test_fields_that_lived_in_extra_are_typed_and_round_trip():
    """Issue 27: the keys the child, the replays and the distributed launch
    write in some runs only are typed fields, read by name; a document read
    and written again is unchanged, and keys oomdoc does not know still go
    to `extra`."""
    from oomdoc.model import FixResult, Prescription, ReplaySummary, Snapshot

    document = copy.deepcopy(VALID)
    document["device"].update(kind="cuda", index=1, nvml_free_bytes=512, driver_version="550")
    document["oom"]["module"] = "transformer.h.*.mlp"
    document["fix_applied"] = {"smaller_batch": {"patched": True}}
    document["parallel"] = {"ddp": [{"class": "GPT"}]}
    document["script_option_values"] = {"--optim": ["adamw", "adafactor"], "--lr": []}
    document["steps"] = [{"index": 0, "device_shared": True}]
    document["fixes"] = [
        {"name": "smaller_batch", "max_batch_size": 5, "micro_batch_size": 4, "how": "--bs 4"}
    ]
    document["replay"] = {"unused_runs": [{"label": "x"}], "saver_batch_search": {"fixes": "a+b"}}
    document["prescription"] = {"throughput_batch_size": 6, "verified_by_flags": {"args": []}}
    document["a_key_from_the_future"] = {"kept": True}
    snapshot = Snapshot.from_dict(document)
    assert snapshot.device.index == 1 and snapshot.device.nvml_free_bytes == 512
    assert snapshot.oom is not None and snapshot.oom.module == "transformer.h.*.mlp"
    assert snapshot.fix_applied == {"smaller_batch": {"patched": True}}
    assert snapshot.parallel is not None and snapshot.parallel.ddp[0].class_name == "GPT"
    assert snapshot.script_option_values["--optim"] == ["adamw", "adafactor"]
    assert snapshot.steps[0].device_shared is True
    assert snapshot.fixes[0].max_batch_size == 5 and snapshot.fixes[0].how == "--bs 4"
    assert snapshot.replay is not None and snapshot.replay.unused_runs == [{"label": "x"}]
    assert snapshot.replay.saver_batch_search is not None
    assert snapshot.replay.saver_batch_search.fixes == "a+b"
    assert snapshot.prescription is not None
    assert snapshot.prescription.throughput_batch_size == 6
    flags = snapshot.prescription.verified_by_flags
    assert flags is not None and flags.args == []
    assert snapshot.extra == {"a_key_from_the_future": {"kept": True}}
    assert snapshot.to_dict() == document
    # Made by code: such a field is written only once it is set.
    written = Snapshot.from_dict(copy.deepcopy(VALID))
    written.write_every_field()
    keys = set(written.to_dict())
    assert {"fix_applied", "parallel", "script_option_values"}.isdisjoint(keys)
    assert "steps" in keys  # a field that is always written still is
    from oomdoc.model import to_dict

    assert set(to_dict(FixResult(name="autocast"))).isdisjoint({"how", "delays_oom_by_steps"})
    result = FixResult(name="autocast", delays_oom_by_steps=3)
    assert to_dict(result)["delays_oom_by_steps"] == 3
    assert "unused_runs" not in to_dict(ReplaySummary())
    assert "verified_by_flags" not in to_dict(Prescription())


def test_every_field_written_only_when_set_is_documented():
    """The promoted fields (issue 27: three of them were in no document)
    are each described in docs/snapshot.md."""
    import dataclasses
    import pathlib

    from oomdoc import model

    docs = (pathlib.Path(__file__).parent.parent / "docs" / "snapshot.md").read_text()
    records = [
        value
        for value in vars(model).values()
        if isinstance(value, type) and dataclasses.is_dataclass(value)
    ]
    promoted = [
        f"{record.__name__}.{spec.name}"
        for record in records
        for spec in dataclasses.fields(record)
        if spec.metadata.get("when_set")
    ]
    assert len(promoted) >= 15
    missing = [name for name in promoted if f"{name.split('.')[1]}`" not in docs]
    assert missing == []


def test_a_snapshot_without_the_communication_category_loads_and_renders():
    """`communication` came after the first snapshots of schema 1: a document
    without it validates, reads as 0 and is written back without it, and
    its tables read as before; one with it shows it in the breakdown, the
    module and rank tables, Markdown and HTML."""
    from oomdoc.analysis import analyse
    from oomdoc.model import Snapshot
    from oomdoc.reporters import render

    old = copy.deepcopy(VALID)
    old["category_peaks"] = dict(old["breakdown"])
    validate(old)
    snapshot = Snapshot.from_dict(copy.deepcopy(old))
    assert snapshot.breakdown.communication == 0 and snapshot.category_peaks.communication == 0
    assert Snapshot.from_dict(copy.deepcopy(old)).to_dict() == old
    for output_format in ("table", "markdown", "html"):
        assert "communication" not in render(output_format, analyse(snapshot))

    new = copy.deepcopy(old)
    new["breakdown"]["communication"] = 600
    new["modules"] = [{"path": "(root)", "class": "Net", "bytes": {"communication": 600}}]
    new["ranks"] = [{"rank": r, "breakdown": new["breakdown"]} for r in (0, 1)]
    new["world_size"] = 2
    validate(new)
    analysis = analyse(Snapshot.from_dict(new))
    text = render("table", analysis)
    assert "communication" in text.split("Top 1 modules")[1].splitlines()[1]  # a module column
    assert any(line.split()[:2] == ["communication", "600"] for line in text.splitlines())
    ranks = text.split("Ranks (2 of a world of 2")[1].splitlines()[1]
    assert "communication" in ranks.split()
    assert "| communication   | 600 bytes |" in render("markdown", analysis)
    page = render("html", analysis)
    assert 'data-category="communication"' in page and "#059669" in page
    kinds = [d.kind for d in analysis.diagnoses]
    assert "communication" in kinds  # the largest category: its advice, not gradients'
    advice = next(d for d in analysis.diagnoses if d.kind == "communication").summary
    assert "gradient_as_bucket_view=True" in advice and "fully_shard" in advice
