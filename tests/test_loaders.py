"""Loading oomdoc snapshots and PyTorch's own memory snapshots, and refusing
everything else with a SnapshotError."""

from __future__ import annotations

import io
import json
import pickle
import pickletools
from pathlib import Path

import pytest
from suggest_builders import USER_FORWARD, USER_OPTIMIZER, MiB, oomdoc_document, torch_snapshot

from oomdoc import loaders
from oomdoc.loaders import foreign_user_frame, infer_category, load_bytes, load_snapshot
from oomdoc.snapshot import MAX_SNAPSHOT_BYTES, SnapshotError

H100_PICKLE = Path(__file__).parent / "data" / "h100_oom_snapshot.pickle"


def write(tmp_path, name, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------ oomdoc


def test_oomdoc_snapshot_loads_as_written(tmp_path):
    document = oomdoc_document()
    loaded = load_snapshot(write(tmp_path, "s.json", json.dumps(document).encode()))
    assert loaded.source_format == "oomdoc"
    assert loaded.document == document


def test_unknown_schema_version_is_named(tmp_path):
    document = oomdoc_document(schema_version=99)
    with pytest.raises(SnapshotError, match="unknown schema_version 99"):
        load_snapshot(write(tmp_path, "s.json", json.dumps(document).encode()))


def test_json_that_is_neither_snapshot_is_refused():
    with pytest.raises(SnapshotError, match="neither an oomdoc snapshot"):
        load_bytes(b'{"hello": 1}', "x.json")


def test_nan_and_giant_integers_are_refused():
    with pytest.raises(SnapshotError, match="not valid JSON"):
        load_bytes(b'{"schema_version": NaN}', "x.json")
    with pytest.raises(SnapshotError, match="not valid JSON"):
        load_bytes(b'{"schema_version": ' + b"9" * 5000 + b"}", "x.json")


# --------------------------------------------------------- PyTorch snapshot


@pytest.mark.parametrize("protocol", [0, 2, 4, pickle.HIGHEST_PROTOCOL])
def test_torch_pickle_is_converted(protocol):
    loaded = load_bytes(pickle.dumps(torch_snapshot(), protocol=protocol), "snap.pickle")
    assert loaded.source_format == "torch_pickle"
    document = loaded.document
    allocator = document["allocator"]
    assert allocator["reserved_bytes"] == 1964 * MiB
    assert allocator["allocated_bytes"] == 1564 * MiB
    assert allocator["inactive_split_bytes"] == 400 * MiB
    assert allocator["inactive_split_blocks"] == 2
    assert allocator["largest_free_block_bytes"] == 250 * MiB
    assert document["outcome"] == "oom"
    oom = document["oom"]
    assert oom["requested_bytes"] == 300 * MiB
    assert oom["free_bytes"] == 100 * MiB
    assert oom["phase"] == "forward"
    assert oom["location"] == {"file": "/home/me/train.py", "line": 42, "function": "forward"}
    assert document["device"]["capacity_bytes"] == 2064 * MiB
    assert document["breakdown"] == {
        "parameters": 400 * MiB,
        "gradients": 0,
        "optimizer_state": 800 * MiB,
        "activations": 300 * MiB,
        "communication": 0,
        "other": 64 * MiB,
    }
    top = document["top_allocations"]
    assert [site["bytes"] for site in top] == sorted((site["bytes"] for site in top), reverse=True)
    assert top[0]["category"] == "optimizer_state" and top[0]["location"]["line"] == 95
    assert top[0]["frames"][0]["name"] == "_init_group"
    forward_site = next(site for site in top if site["category"] == "activations")
    assert forward_site["count"] == 2 and forward_site["bytes"] == 300 * MiB
    # The events just before the OOM, oldest first, with where they came from.
    events = document["trace_before_oom"]
    assert [event["action"] for event in events] == [
        "segment_alloc",
        "alloc",
        "alloc",
        "free_requested",
        "free_completed",
    ]
    assert events[1]["bytes"] == 200 * MiB and events[1]["location"]["file"] == "/home/me/train.py"


def test_torch_snapshot_saved_as_json_is_converted():
    raw = json.dumps(torch_snapshot()).encode()  # tuples become lists
    loaded = load_bytes(raw, "snap.json")
    assert loaded.source_format == "torch_json"
    assert loaded.document["allocator"]["inactive_split_bytes"] == 400 * MiB


def test_torch_snapshot_without_trace_or_oom():
    data = torch_snapshot(with_oom=False, fragmented=False)
    data["device_traces"] = []
    document = load_bytes(pickle.dumps(data), "s.pickle").document
    assert document["outcome"] == "ok" and document["oom"] is None
    assert document["trace_before_oom"] == []
    assert document["allocator"]["inactive_split_bytes"] == 0
    assert any("no allocation trace" in note for note in document["notes"])


def test_device_with_the_oom_is_chosen():
    data = torch_snapshot()
    data["segments"].append({"device": 1, "total_size": 50 * 1024 * MiB, "blocks": []})
    data["device_traces"] = [data["device_traces"][0], []]
    assert load_bytes(pickle.dumps(data), "s").document["device"]["index"] == 0
    data["device_traces"] = [[], data["device_traces"][0]]
    assert load_bytes(pickle.dumps(data), "s").document["device"]["index"] == 1


def test_categories_from_frames():
    assert infer_category(USER_OPTIMIZER) == "optimizer_state"
    assert infer_category(USER_FORWARD) == "activations"
    assert infer_category([]) == "other"
    assert (
        infer_category(
            [{"filename": "/x/site-packages/torch/_tensor.py", "line": 1, "name": "backward"}]
        )
        == "gradients"
    )
    assert (
        infer_category(
            [{"filename": "??", "line": 0, "name": "torch::autograd::Engine::evaluate_function"}]
        )
        == "gradients"
    )


def test_user_frame_is_found_by_path_shape():
    frames = [
        {"filename": "<frozen runpy>", "line": 1, "name": "x"},
        {
            "filename": "/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py",
            "line": 2,
            "name": "y",
        },
        {"filename": "/home/a/model.py", "line": 3, "name": "forward"},
    ]
    assert foreign_user_frame(frames) == {
        "file": "/home/a/model.py",
        "line": 3,
        "function": "forward",
    }
    assert foreign_user_frame(frames[:2])["line"] == 2  # falls back to the innermost Python frame
    assert foreign_user_frame([]) is None


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.__setitem__("segments", "nope"), "segments is a str"),
        (lambda d: d["segments"][0].__setitem__("total_size", "big"), "total_size is a str"),
        (
            lambda d: d["segments"][2]["blocks"][0].__setitem__("frames", [7]),
            "frames\\[0\\] is a int",
        ),
        (lambda d: d["device_traces"][0].append("x"), "is a str, not a dict"),
        (lambda d: d["segments"][0].__setitem__("total_size", 2**70), "out of range"),
    ],
)
def test_torch_snapshot_of_the_wrong_shape_is_named(mutate, message):
    data = torch_snapshot()
    mutate(data)
    with pytest.raises(SnapshotError, match=message):
        load_bytes(pickle.dumps(data), "s.pickle")


def test_real_h100_pickle_is_read():
    loaded = load_snapshot(H100_PICKLE)
    document = loaded.document
    assert loaded.source_format == "torch_pickle"
    allocator = document["allocator"]
    assert 0 < allocator["allocated_bytes"] <= allocator["reserved_bytes"]
    # The script OOMs in its first AdamW step on a card capped to 1 GiB with
    # set_per_process_memory_fraction, which the snapshot does not record: the
    # capacity it can show is the driver's free memory plus what was reserved.
    assert document["outcome"] == "oom"
    assert document["oom"]["requested_bytes"] == 256 * MiB
    assert allocator["reserved_bytes"] < 1024 * MiB
    assert document["device"]["capacity_bytes"] >= allocator["reserved_bytes"]
    assert document["top_allocations"] and document["top_allocations"][0]["bytes"] > 0
    assert document["trace_before_oom"]
    assert any(
        site["location"] and site["location"]["file"].endswith("make_h100_snapshot.py")
        for site in document["top_allocations"]
    )
    assert document["breakdown"]["optimizer_state"] > 0 or document["breakdown"]["parameters"] > 0


# ------------------------------------------------------------------ refused


class CreatesFile:
    """Unpickling this would create a file: proof that something ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_hostile_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    raw = pickle.dumps({"segments": [CreatesFile(str(marker))]})
    # The pickle really would create the file if loaded the ordinary way.
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(CreatesFile(str(probe))))
    assert probe.exists()

    with pytest.raises(
        SnapshotError, match=r"refused: the pickle asks for pathlib.*nothing in it was run"
    ):
        load_snapshot(write(tmp_path, "evil.pickle", raw))
    assert not marker.exists()


@pytest.mark.parametrize(
    "raw",
    [
        # protocol 0 GLOBAL + REDUCE: os.system('touch ...')
        b"cos\nsystem\n(S'echo hostile'\ntR.",
        # protocol 0 INST opcode
        b"(S'echo hostile'\nios\nsystem\n.",
        # protocol 4 STACK_GLOBAL builtins.eval
        pickle.dumps(eval, protocol=4),
        # a persistent id
        b"\x80\x02P0\n.",
        # an extension code (copyreg's registry) is a global lookup too
        b"\x80\x02\x82\x01.",
    ],
)
def test_every_way_to_reach_code_is_refused(raw, tmp_path):
    with pytest.raises(SnapshotError, match="refused|corrupt"):
        load_bytes(raw, "evil")


def test_plain_data_walk():
    # Defence in depth after unpickling: only containers and scalars pass.
    loaders._check_plain({"a": [1, 2.0, (None, True)], "b": {b"x", frozenset()}}, "x")
    with pytest.raises(SnapshotError, match="not plain data"):
        loaders._check_plain({"a": [object()]}, "x")
    cyclic = []
    cyclic.append(cyclic)
    loaders._check_plain(cyclic, "x")  # a cycle terminates


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"", "empty file"),
        (b"hello world", "neither JSON nor a pickle"),
        (b"\x00\x01\x02garbage", "neither JSON nor a pickle"),
        (b'{"schema_version": 1, "oomdoc_version"', "not valid JSON"),
        (b"\xff\xfe{}", "neither JSON nor a pickle"),
    ],
)
def test_bad_bytes_are_named(raw, message):
    with pytest.raises(SnapshotError, match=message):
        load_bytes(raw, "f")


def test_shared_references_cannot_blow_up_the_walk():
    """A pickle shares one list among many parents for a few bytes each; the
    converter must not walk segments x blocks (or traces x entries) in full."""
    blocks = [
        {"size": 512, "state": "active_allocated", "frames": [USER_FORWARD[0]] * 10_000}
    ] * 5_000
    data = {
        "segments": [{"device": 0, "total_size": 512, "blocks": blocks}] * 1_000,
        "device_traces": [[{"action": "alloc", "size": 1}] * 10_000] * 10_000,
    }
    raw = pickle.dumps(data, protocol=4)
    assert len(raw) < 1024**2
    with pytest.raises(SnapshotError, match="more than .* blocks"):
        load_bytes(raw, "bomb")
    data["segments"] = data["segments"][:1]
    document = load_bytes(pickle.dumps(data, protocol=4), "shared").document
    assert document["allocator"]["allocated_bytes"] == 512 * 5_000


def test_truncated_pickle_is_named():
    raw = pickle.dumps(torch_snapshot())
    with pytest.raises(SnapshotError, match="truncated or corrupt pickle"):
        load_bytes(raw[: len(raw) // 2], "f")


def test_missing_directory_and_huge_files(tmp_path):
    with pytest.raises(SnapshotError, match="no such file"):
        load_snapshot(tmp_path / "absent.json")
    with pytest.raises(SnapshotError, match="is a directory"):
        load_snapshot(tmp_path)
    huge = tmp_path / "huge.pickle"
    with open(huge, "wb") as handle:
        handle.truncate(MAX_SNAPSHOT_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(SnapshotError, match="larger than"):
        load_snapshot(huge)


def test_pickle_disassembles_to_plain_opcodes_only():
    """The builders' pickle really is what PyTorch writes: plain containers
    only, no GLOBAL opcode (so the restricted unpickler is no obstacle)."""
    out = io.StringIO()
    pickletools.dis(pickle.dumps(torch_snapshot()), out=out)
    assert "GLOBAL" not in out.getvalue()
