"""The simulated device's ledger in C++, compiled once per torch build.

Seen from a TorchDispatchMode, every op costs a Python call and a second
entry into the op through its Python binding: on a model of small ops that
alone doubles a step. `counter.cpp` does the check that every op needs (is
each tensor's storage already counted, at its size?) in C++ at the same
dispatch key, and keeps the ledger of live storages there too: new ones are
registered, their frees seen through a wrapper on their DataPtr, and Python
reads a log of the changes at phase boundaries (see the file's header).
Compiled with the machine's C++ compiler against the torch that
runs, into a cache shared by every later run (`python -m
oomdoc.capture.native` builds it ahead, as CI does); without a compiler, or
if the build fails, the device keeps the dispatch mode alone, which counts
the same bytes more slowly.

    OOMDOC_NATIVE=0        never build or load it
    OOMDOC_NATIVE_DIR=DIR  the cache (default ~/.cache/oomdoc/native)
    CXX=...                the compiler (default c++)
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("counter.cpp")
MODULE_NAME = "_oomdoc_counter"
DISABLE_ENV = "OOMDOC_NATIVE"
DIR_ENV = "OOMDOC_NATIVE_DIR"
BUILD_TIMEOUT_S = 600

_loaded: dict[str, ModuleType | None] = {}


class BuildError(Exception):
    """The compiler failed; its message says why."""


def cache_dir() -> Path:
    configured = os.environ.get(DIR_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "oomdoc" / "native"


def build_key() -> str:
    """What the library depends on: the source, this torch and this Python."""
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, os.path.dirname(torch.__file__), sys.version, sys.platform):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_dir() / build_key() / f"{MODULE_NAME}{suffix}"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++")


def compile_command(output: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libraries = cpp_extension.library_paths()
    return [
        compiler() or "c++",
        "-O2",
        "-shared",
        "-fPIC",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *[f"-I{path}" for path in includes],
        str(SOURCE),
        "-o",
        str(output),
        *[f"-L{path}" for path in libraries],
        *[f"-Wl,-rpath,{path}" for path in libraries],
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
    ]


def build(announce: bool = True) -> Path:
    """Compile the library into the cache unless it is there; its path.
    Several processes at once: one compiles, the others wait for it."""
    target = library_path()
    if target.exists():
        return target
    if compiler() is None:
        raise BuildError("no C++ compiler (set CXX)")
    failed = target.parent / "failed"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        if failed.exists():  # not again at every run: remove the file to retry
            raise BuildError(f"{failed.read_text().strip()} (an earlier build, {failed})")
        for stale in target.parent.glob("tmp*.so"):  # of a build killed midway
            stale.unlink(missing_ok=True)
        if announce:
            print(
                "oomdoc: compiling the simulated device's op check "
                "(once per torch install, about 30 s)",
                file=sys.stderr,
                flush=True,
            )
        handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        try:
            done = subprocess.run(
                compile_command(Path(temporary)),
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
                failed.write_text(f"the compiler failed: {last}\n")
                raise BuildError(f"the compiler failed: {last}")
            os.chmod(temporary, 0o755)
            os.replace(temporary, target)
        except subprocess.TimeoutExpired as error:
            raise BuildError(f"the compiler ran past {BUILD_TIMEOUT_S} s") from error
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return target


def load(build_if_missing: bool = True) -> ModuleType | None:
    """The compiled module, or None where it cannot be had (the reason is
    in `unavailable_reason`)."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    try:
        if os.environ.get(DISABLE_ENV, "1") == "0":
            raise BuildError(f"{DISABLE_ENV}=0")
        path = build() if build_if_missing else library_path()
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if spec is None or spec.loader is None:
            raise BuildError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as error:  # whatever it was, the dispatch mode still counts
        _reason[0] = str(error) or type(error).__name__
        module = None
    _loaded["module"] = module
    return module


_reason = [""]


def unavailable_reason() -> str:
    return _reason[0]


def main() -> int:
    """`python -m oomdoc.capture.native`: build now (CI does, before the tests)."""
    try:
        path = build(announce=False)
    except BuildError as error:
        print(f"oomdoc: the native op check was not built: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
