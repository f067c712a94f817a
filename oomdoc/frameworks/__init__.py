"""Framework units: each fix in the words of the framework the script uses.

The child detects the framework (oomdoc.capture.frameworks) and records it
in the snapshot as `framework`; `framework_for(snapshot["framework"]["name"])`
gives the unit that writes the fixes' snippets, the prescription block and
the script's own command-line flag for a fix. Adding a framework is one
module with a `Framework` subclass and one line in FRAMEWORKS. Torch-free.
"""

from __future__ import annotations

from oomdoc.frameworks.accelerate import Accelerate
from oomdoc.frameworks.base import Framework, FrameworkContext
from oomdoc.frameworks.huggingface import HuggingFace
from oomdoc.frameworks.lightning import Lightning
from oomdoc.frameworks.plain import Plain
from oomdoc.model import Snapshot

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


def context_from_snapshot(snapshot: Snapshot) -> FrameworkContext:
    """The part of a unit's context that the snapshot itself holds: the
    framework's entry and import name, the command, the script's options,
    how it updates its parameters (`update`: `optimizer`, `manual` or None),
    and the autocast device and dtype the replays use."""
    framework = snapshot.framework
    device = snapshot.device
    return FrameworkContext(
        entry=framework.entry if framework else None,
        version=framework.version if framework else None,
        module=framework.module if framework else None,
        command=list(snapshot.command),
        script_options=list(snapshot.script_options),
        script_option_values=dict(snapshot.script_option_values),
        script_option_aliases=dict(snapshot.script_option_aliases),
        script_option_defaults=dict(snapshot.script_option_defaults),
        script_option_syntax=snapshot.script_option_syntax,
        update=snapshot.parameter_update,
        device_type="cuda" if device.on_cuda else "cpu",
        dtype="bfloat16" if (not device.on_cuda or device.supports_bf16) else "float16",
    )


def framework_of(snapshot: Snapshot) -> Framework:
    """The unit for the framework the snapshot's run went through."""
    return framework_for(snapshot.framework.name if snapshot.framework else None)


def preimports(snapshot: Snapshot) -> list[str]:
    """What a replay's warm child imports while it waits: the packages the
    failing run's script imported, then what its framework loads lazily."""
    return list(dict.fromkeys([*snapshot.imported_packages, *framework_of(snapshot).preimports]))


__all__ = [
    "FRAMEWORKS",
    "Framework",
    "context_from_snapshot",
    "framework_for",
    "framework_of",
    "preimports",
]
