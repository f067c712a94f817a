"""Byte sizes: parsed from user input at the edge, humanised only for display.

Everything inside oomdoc is plain integer bytes.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse `512MiB`, `16GiB`, `1.5GB` or plain bytes into an int of bytes.

    Decimal units (kB, MB, GB) are powers of 1000 and binary units (KiB, MiB,
    GiB) powers of 1024, as `nvidia-smi` and PyTorch use them.
    Raises ValueError with a message fit for the user.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(
            f"invalid size {text!r}: expected a number with an optional unit, e.g. 512MiB, 16GiB, 1.5GB"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"invalid size {text!r}: unknown unit {unit!r} (use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB)"
        )
    if factor == 1 and "." in number and float(number) != int(float(number)):
        raise ValueError(
            f"invalid size {text!r}: a fraction of a byte (give a unit, e.g. {number}GiB)"
        )
    value = float(number) * factor
    if value < 1:
        raise ValueError(f"invalid size {text!r}: must be at least one byte")
    return int(round(value))


def format_bytes(num_bytes: int | float | None) -> str:
    """Humanise a byte count the way PyTorch's OOM messages do (binary units)."""
    if num_bytes is None:
        return "?"
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "bytes":
                return f"{sign}{int(value)} bytes"
            return f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_tolerance(text: str) -> tuple[float, int]:
    """Parse a tolerance: `5%` gives (0.05, 0), `256MiB` gives (0.0, bytes)."""
    stripped = str(text).strip()
    if stripped.endswith("%"):
        try:
            fraction = float(stripped[:-1]) / 100.0
        except ValueError:
            raise ValueError(f"invalid tolerance {text!r}: expected e.g. 5% or 256MiB") from None
        if not math.isfinite(fraction):
            raise ValueError(f"invalid tolerance {text!r}: must be a finite percentage")
        if fraction < 0:
            raise ValueError(f"invalid tolerance {text!r}: must not be negative")
        return fraction, 0
    if re.fullmatch(r"[\d.]+", stripped):
        raise ValueError(
            f"invalid tolerance {text!r}: say the unit, {stripped}% or {stripped}MiB (a bare number would be bytes)"
        )
    try:
        return 0.0, parse_size(stripped)
    except ValueError:
        raise ValueError(f"invalid tolerance {text!r}: expected e.g. 5% or 256MiB") from None
