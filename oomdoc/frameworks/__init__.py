"""Framework units: each fix in the words of the framework the script uses.

The child detects the framework (oomdoc.capture.frameworks) and records it
in the snapshot as `framework`; `framework_for(snapshot["framework"]["name"])`
gives the unit that writes the fixes' snippets, the prescription block and
the script's own command-line flag for a fix. Adding a framework is one
module with a `Framework` subclass and one line in FRAMEWORKS. Torch-free.
"""

from __future__ import annotations

from oomdoc.frameworks.accelerate import Accelerate
from oomdoc.frameworks.base import Framework
from oomdoc.frameworks.huggingface import HuggingFace
from oomdoc.frameworks.lightning import Lightning
from oomdoc.frameworks.plain import Plain

FRAMEWORKS: list[Framework] = [
    HuggingFace(),
    Lightning(),
    Accelerate(),
    Plain(),
]

_BY_NAME = {framework.name: framework for framework in FRAMEWORKS}


def framework_for(name: str | None) -> Framework:
    """The unit for a snapshot's `framework.name`; plain when unknown or None."""
    return _BY_NAME.get(name or "plain", _BY_NAME["plain"])


def context_from_snapshot(document: dict) -> dict:
    """The part of a unit's context that the snapshot itself holds: the
    framework's entry and import name, the command, the script's options,
    and the autocast device and dtype the replays use."""
    framework = document.get("framework") or {}
    device = document.get("device") or {}
    on_cuda = device.get("kind") == "cuda"
    return {
        "entry": framework.get("entry"),
        "version": framework.get("version"),
        "module": framework.get("module"),
        "command": list(document.get("command") or []),
        "script_options": list(document.get("script_options") or []),
        "script_option_values": dict(document.get("script_option_values") or {}),
        "device_type": "cuda" if on_cuda else "cpu",
        "dtype": "bfloat16" if (not on_cuda or device.get("supports_bf16")) else "float16",
    }


__all__ = ["FRAMEWORKS", "Framework", "context_from_snapshot", "framework_for"]
