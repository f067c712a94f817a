"""Fuzzing the loaders and the rules: any bytes give a document or a
SnapshotError, never another exception; any loaded document can be diagnosed
and rendered."""

from __future__ import annotations

import json
import os
import pickle

from adapters import analysis, render_markdown, render_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from suggest_builders import MiB, oom_document, oomdoc_document, torch_snapshot

from oomdoc.loaders import load_bytes
from oomdoc.snapshot import SnapshotError

# OOMDOC_FUZZ_EXAMPLES=3000 for a longer hunt; CI keeps the default small.
FUZZ = settings(
    max_examples=int(os.environ.get("OOMDOC_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

VALID_PICKLE = pickle.dumps(torch_snapshot(), protocol=4)
VALID_JSON = json.dumps(oom_document(allocated=900 * MiB, requested=200 * MiB)).encode()
VALID_TORCH_JSON = json.dumps(torch_snapshot()).encode()


def load_or_refuse(raw: bytes):
    """The property: a LoadedSnapshot, or SnapshotError with a one-line message."""
    try:
        loaded = load_bytes(raw, "fuzz")
    except SnapshotError as exc:
        assert "\n" not in str(exc)
        return None
    # Whatever loads can be diagnosed, rendered and printed as JSON.
    json.dumps(analysis(loaded.document), allow_nan=False)
    render_text(loaded.document)
    render_markdown(loaded.document)
    return loaded


@FUZZ
@given(st.binary(max_size=2048))
def test_any_bytes(raw):
    load_or_refuse(raw)


@FUZZ
@given(
    st.sampled_from([b"\x80\x02", b"\x80\x04\x95", b"\x80\x05", b"{", b"(dp0\n"]),
    st.binary(max_size=512),
)
def test_pickle_and_json_headers_with_noise(head, tail):
    load_or_refuse(head + tail)


@FUZZ
@given(st.sampled_from([VALID_PICKLE, VALID_JSON, VALID_TORCH_JSON]), st.data())
def test_mutated_valid_files(base, data):
    raw = bytearray(base)
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(raw) - 1))
        raw[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    load_or_refuse(bytes(raw[:cut]))


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=12), children, max_size=4)
        | st.tuples(children, children)
    ),
    max_leaves=30,
)


@FUZZ
@given(plain)
def test_any_plain_pickle(value):
    load_or_refuse(pickle.dumps(value))


def _snapshot_keys():
    return st.sampled_from(
        [
            "segments",
            "device_traces",
            "blocks",
            "size",
            "state",
            "frames",
            "total_size",
            "device",
            "action",
            "addr",
            "device_free",
            "requested_size",
            "address",
            "filename",
            "line",
            "name",
            "allocator_settings",
            "expandable_segments",
        ]
    )


torch_shaped = st.recursive(
    st.none()
    | st.integers(-5, 2**40)
    | st.sampled_from(["active_allocated", "inactive", "oom", "alloc", "x.py"])
    | st.booleans(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(_snapshot_keys(), children, max_size=6)
    ),
    max_leaves=40,
)


@FUZZ
@given(torch_shaped)
def test_torch_shaped_nonsense(value):
    if isinstance(value, dict):
        value.setdefault("segments", [])
    load_or_refuse(pickle.dumps(value))


json_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3)
    ),
    max_leaves=12,
)

OPTIONAL_FIELDS = [
    "host",
    "allocator",
    "optimizers",
    "models",
    "peak",
    "step_unit",
    "max_batch_size",
    "cwd",
    "breakdown_at",
    "notes",
    "artifacts",
]
STEP_FIELDS = [
    "forward_calls_with_grad",
    "backward_calls",
    "eval_mode_forward_calls_with_grad",
    "retained_graphs",
    "retained_activation_bytes",
    "optimizer_steps",
    "phase_peaks",
]


@FUZZ
@given(
    st.sampled_from(OPTIONAL_FIELDS),
    json_value,
    st.sampled_from(STEP_FIELDS),
    json_value,
    st.booleans(),
)
def test_valid_snapshot_with_odd_optional_fields(field, value, step_field, step_value, oom):
    """validate() checks what later commands rely on; the rules must survive
    anything in the fields it leaves alone."""
    document = oom_document(allocated=900 * MiB, requested=200 * MiB) if oom else oomdoc_document()
    document[field] = value
    document["steps"][2][step_field] = step_value
    document["device"]["other_processes"] = value
    load_or_refuse(json.dumps(document).encode())
