"""The packages a script imports: recorded by the failing run, imported ahead
by the warm children of its replays.

A replay runs the same script, so it imports the same framework again:
`from transformers import Trainer` alone takes seconds. The failing run
records the heavy third-party packages the script loaded (`imported_packages`
in the snapshot); a warm replay child imports them while it waits for its
work, so the replay pays neither Python's, torch's nor the framework's
import. Only installed packages count (site-packages): the script's own
modules, whose import may do anything, are never imported ahead.

Torch-free at import time (the warm child imports torch itself).
"""

from __future__ import annotations

import importlib
import sys
import time

from oomdoc.warm import ATTRIBUTE_SEPARATOR, install_dirs, is_installed

# A package counts as heavy when the run loaded at least this many of its
# modules (transformers: hundreds; a small helper package: a few).
HEAVY_MODULES = 10
MAX_PACKAGES = 32
# Not the script's choice: in every capture child before the script starts,
# or loaded by torch itself (TorchDynamo, which any optimizer imports, loads
# sympy; a warm child has them all).
ALWAYS_LOADED = frozenset(
    (
        "torch",
        "oomdoc",
        "psutil",
        "numpy",
        "sympy",
        "mpmath",
        "networkx",
        "filelock",
        "fsspec",
        "jinja2",
        "markupsafe",
        "typing_extensions",
        "triton",
        "setuptools",
        "pkg_resources",
    )
)


def imported_packages(loaded_before: set[str] | frozenset[str]) -> list[str]:
    """The heavy installed top-level packages loaded since `loaded_before`
    (sys.modules when the script started), in the order they were first
    imported; empty if sys.modules holds something unreadable (a capture is
    never lost to this)."""
    try:
        return _imported_packages(loaded_before)
    except Exception:
        return []


def _imported_packages(loaded_before: set[str] | frozenset[str]) -> list[str]:
    stdlib: frozenset[str] = getattr(sys, "stdlib_module_names", frozenset())
    dirs = install_dirs()
    counts: dict[str, int] = {}
    for name in list(sys.modules):
        if name in loaded_before:
            continue
        top = name.partition(".")[0]
        counts[top] = counts.get(top, 0) + 1
    packages = []
    for top, count in counts.items():
        if (
            count < HEAVY_MODULES
            or top in stdlib
            or top in ALWAYS_LOADED
            or top.startswith("_")
            or not top.isidentifier()
        ):
            continue
        module = sys.modules.get(top)
        if module is not None and is_installed(_location(module), dirs):
            packages.append(top)
    return packages[:MAX_PACKAGES]


def _location(module) -> str | None:
    """A module's file, or a namespace package's first folder."""
    path = getattr(module, "__file__", None)
    if not path:
        paths = list(getattr(module, "__path__", None) or [])
        path = paths[0] if paths else None
    return path


def _import(name: str) -> None:
    """`import module`, or for `module:name`, `from module import name`
    (an attribute, which a lazy package loads on access, else a submodule)."""
    module_name, _, attribute = name.partition(ATTRIBUTE_SEPARATOR)
    module = importlib.import_module(module_name)
    if attribute:
        try:
            getattr(module, attribute)
        except AttributeError:
            importlib.import_module(f"{module_name}.{attribute}")


class _WouldStartCuda(ImportError):
    pass


def preimport(names: list[str], record: dict) -> None:
    """Import `names` in a warm child that waits for its work; add to
    `record` what was imported and how long it took. A module that fails to
    import, or would start CUDA (a waiting child keeps off the device), is
    left for the script, which raises its own error."""
    from oomdoc.capture.gate import patch_lazy_init

    started = time.time()
    imported = record.setdefault("modules", [])

    def refuse() -> None:
        raise _WouldStartCuda("a warm child does not start CUDA")

    undo = patch_lazy_init(refuse)
    try:
        for name in names:
            if name in sys.modules:
                continue
            try:
                _import(name)
            except (Exception, SystemExit):
                continue
            imported.append(name)
    finally:
        undo()
        record["seconds"] = round(record.get("seconds", 0.0) + time.time() - started, 3)
