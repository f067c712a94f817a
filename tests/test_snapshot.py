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
