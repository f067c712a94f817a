"""Typed records from JSON documents, leniently: the machinery behind
oomdoc.model (its docstring says the rules). A field of the wrong type
becomes its default, a list item of the wrong shape is dropped, unknown keys
are kept in the record's `extra`; a field made with `when_set` is written
back only when set or read."""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import field
from typing import Any, Dict, List, TypeVar, Union

Record = TypeVar("Record")


def _json_key(spec: dataclasses.Field) -> str:
    return spec.metadata.get("key", spec.name)


def when_set(default: Any = None, factory: Any = None) -> Any:
    """A field written only when set (see the module docstring)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"when_set": True})
    return field(default=default, metadata={"when_set": True})


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        module = sys.modules[cls.__module__]
        hints = _HINTS[cls] = typing.get_type_hints(cls, vars(module))
    return hints


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MISSING = object()


def _coerce(kind: Any, value: Any) -> Any:
    """`value` as `kind`, or _MISSING when it is not one."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if origin is Union:
        options = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if value is None:
            return None
        for option in options:
            coerced = _coerce(option, value)
            if coerced is not _MISSING:
                return coerced
        return _MISSING
    if origin in (list, List):
        if not isinstance(value, list):
            return _MISSING
        (item_kind,) = typing.get_args(kind) or (Any,)
        items = (_coerce(item_kind, item) for item in value)
        return [item for item in items if item is not _MISSING]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            return _MISSING
        _key_kind, value_kind = typing.get_args(kind) or (str, Any)
        pairs = ((str(k), _coerce(value_kind, v)) for k, v in value.items())
        return {k: v for k, v in pairs if v is not _MISSING}
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return parse(kind, value) if isinstance(value, dict) else _MISSING
    if kind is int:
        return value if _is_int(value) else _MISSING
    if kind is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if number and math.isfinite(value) else _MISSING
    if kind is bool:
        return value if isinstance(value, bool) else _MISSING
    if kind is str:
        return value if isinstance(value, str) else _MISSING
    return value if isinstance(value, kind) else _MISSING


def parse(cls: type[Record], data: dict) -> Record:
    """A record from a dict, leniently: see the module docstring."""
    hints = _hints(cls)
    values: dict[str, Any] = {}
    known = set()
    for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
        if spec.name == "extra":
            continue
        key = _json_key(spec)
        known.add(key)
        if key not in data:
            continue
        coerced = _coerce(hints[spec.name], data[key])
        if coerced is not _MISSING:
            values[spec.name] = coerced
    record = cls(**values)
    if hasattr(record, "extra"):
        record.extra = {k: v for k, v in data.items() if k not in known}
    # Written back, a field the input did not have stays absent while it
    # keeps its default: a document read and written again is unchanged.
    record.__dict__["_absent"] = known - set(data)
    record.__dict__["_present"] = known & set(data)
    return record


def was_absent(record: Any, key: str) -> bool:
    """The document `record` was parsed from had no `key` (a field added
    since it was written)."""
    return key in record.__dict__.get("_absent", ())


def _default_of(spec: dataclasses.Field) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return _MISSING


def to_dict(record: Any) -> Any:
    """A record (or a list or dict of them) back to JSON-ready values."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        out: dict[str, Any] = {}
        absent = record.__dict__.get("_absent", ())
        present = record.__dict__.get("_present", ())
        for spec in dataclasses.fields(record):
            if spec.name == "extra":
                continue
            key, value = _json_key(spec), getattr(record, spec.name)
            unset = value == _default_of(spec)
            if unset and (key in absent or (spec.metadata.get("when_set") and key not in present)):
                continue
            out[key] = to_dict(value)
        out.update(to_dict(getattr(record, "extra", None) or {}))
        return out
    if isinstance(record, list):
        return [to_dict(item) for item in record]
    if isinstance(record, dict):
        return {key: to_dict(value) for key, value in record.items()}
    return record
