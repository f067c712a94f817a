"""Warm children: capture children started before their work is known, so
that a replay's start-up (Python, torch, the script's own imports) happens
while the run or the replay before it still runs.

Parent side and torch-free. What a warm child imports ahead comes from the
failing run (its `imported_packages`, its framework's lazy modules) and,
before that run has even ended, from the script's own top-level import
statements, read with `ast` and never executed (`script_preimports`).
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Protocol

from oomdoc.capture import CONFIG_FD_ENV, STARTED_ENV, preimport_request
from oomdoc.forking import ForkedProcess, ForkServer, forks_allowed

# A preimport `module:name` means `from module import name`: the name may be
# a submodule, or an attribute a lazy package (transformers) loads on access.
ATTRIBUTE_SEPARATOR = ":"


class WarmRequest(Protocol):
    """What a warm child must match in a run it is handed (a ChildRequest)."""

    device: str
    extra_env: dict[str, str]
    output_path: str | None


def install_dirs() -> tuple[str, ...]:
    """Where installed packages live (site-packages), each ending in a
    separator: a script's own modules, whose import may do anything, are
    never imported ahead."""
    dirs = set()
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(path)
    return tuple(os.path.realpath(path) + os.sep for path in dirs if path)


def is_installed(path: str | None, dirs: tuple[str, ...]) -> bool:
    """Whether the file or folder `path` is part of an installed package."""
    if not path:
        return False
    real = os.path.realpath(path)
    return real.startswith(dirs) or f"{os.sep}site-packages{os.sep}" in real


def _imports_of(statements: list[ast.stmt]) -> list[tuple[str, str | None]] | None:
    """(module, name or None) of `statements` when they are all import
    statements, else None."""
    found: list[tuple[str, str | None]] = []
    for node in statements:
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module, None))
            found.extend((node.module, alias.name) for alias in node.names if alias.name != "*")
        elif not isinstance(node, ast.ImportFrom):  # a relative import is skipped, not an end
            return None
    return found


def _top_level_imports(tree: ast.Module) -> list[tuple[str, str | None]]:
    """(module, name or None) of the import statements the script runs first:
    those at the top of its module body, and of the `try` blocks there that
    hold only imports (`try: import apex`), up to its first other statement.
    A statement before an import may change what importing does
    (`os.environ["HF_HOME"] = ...`, `sys.path.insert`), so nothing after it
    is read; nor imports inside functions, classes or `if` blocks (`if
    __name__ == "__main__":`), nor relative ones (`from . import x`: the
    script's own package)."""
    found: list[tuple[str, str | None]] = []
    for index, node in enumerate(tree.body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        imports = _imports_of(node.body if isinstance(node, ast.Try) else [node])
        if imports is None:
            break
        found.extend(imports)
    return found


def script_preimports(script: str) -> list[str]:
    """What a warm child may import ahead for `script` (a file, read, never
    run): the modules its top-level import statements name, and the names it
    takes from them (`module:name`, which also loads what a lazy package such
    as transformers loads on first access: its model's module). Only modules
    of installed packages: not the standard library's (cheap, and loaded
    already), nor anything the script's own folder or the current folder
    holds (the child's import path starts there). Empty when the script
    cannot be read or parsed (the script then reports that itself)."""
    try:
        with open(script, "rb") as handle:
            tree = ast.parse(handle.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    stdlib: frozenset[str] = getattr(sys, "stdlib_module_names", frozenset())
    local = {os.path.dirname(os.path.abspath(script)), os.getcwd()}
    search = [path for path in sys.path if path and os.path.abspath(path) not in local]
    dirs = install_dirs()
    verdicts: dict[str, bool] = {}

    def installed(top: str) -> bool:
        if top not in verdicts:
            verdicts[top] = False
            if top not in stdlib and top != "__future__" and not _in_folders(top, local):
                try:
                    spec = importlib.machinery.PathFinder.find_spec(top, search)
                except (ImportError, ValueError):
                    spec = None
                locations = list(getattr(spec, "submodule_search_locations", None) or [])
                origin = getattr(spec, "origin", None) or (locations[0] if locations else None)
                verdicts[top] = spec is not None and is_installed(origin, dirs)
        return verdicts[top]

    names = []
    for module, name in _top_level_imports(tree):
        if installed(module.partition(".")[0]):
            names.append(module if name is None else f"{module}{ATTRIBUTE_SEPARATOR}{name}")
    return list(dict.fromkeys(names))


def _in_folders(top: str, folders: set[str]) -> bool:
    """Whether one of `folders` holds a module or package named `top`."""
    for folder in folders:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        if top in entries or any(entry.partition(".")[0] == top for entry in entries):
            return True
    return False


def child_env(device: str, extra_env: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    if device == "cpu":
        # On the simulated device the script must not find a GPU to use.
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra_env)
    # Where oomdoc itself was imported from must stay importable in the
    # child even though sys.path[0] becomes the script's directory.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if package_root not in site.getsitepackages():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )
    cache = bytecode_cache_env(env)
    if cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.update(cache)
    return env


def bytecode_cache_env(
    env: dict[str, str], origin: str | None = None, cache_root: str | None = None
) -> dict[str, str]:
    """What a child needs so that it does not recompile torch from source.

    A child that may not write bytecode (PYTHONDONTWRITEBYTECODE, or a
    read-only site-packages) and finds no .pyc files compiles every module it
    imports, about 1,800 for torch: seconds per child, paid again by every
    replay (measured on the H100 machine: 5.7 s of each child's start). Such
    children share bytecode in oomdoc's own cache instead (PYTHONPYCACHEPREFIX),
    so nothing is written beside torch's or the script's sources (and the
    child's PYTHONDONTWRITEBYTECODE is dropped). Empty when torch's bytecode
    is there to read or the user chose a prefix.
    """
    if env.get("PYTHONPYCACHEPREFIX"):
        return {}
    import importlib.util

    if origin is None:  # torch's __init__.py, found without importing torch
        try:
            origin = getattr(importlib.util.find_spec("torch"), "origin", None)
        except (ImportError, ValueError):
            return {}
    if not origin or not origin.endswith(".py"):
        return {}
    compiled = importlib.util.cache_from_source(origin)
    if os.path.exists(compiled):
        return {}
    cache_dir = os.path.dirname(compiled)
    writable = os.access(
        cache_dir if os.path.isdir(cache_dir) else os.path.dirname(origin), os.W_OK
    )
    if writable and not env.get("PYTHONDONTWRITEBYTECODE"):
        return {}  # the first child writes torch's bytecode where Python looks for it
    root = cache_root or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "oomdoc", "pycache"
    )
    try:
        os.makedirs(root, exist_ok=True)
    except OSError:
        return {}
    return {"PYTHONPYCACHEPREFIX": root}


def start_child(env: dict[str, str], **popen) -> subprocess.Popen:
    """Start a capture child, stamped with when it started (its start-up is
    timed from this, see STARTED_ENV)."""
    env[STARTED_ENV] = repr(time.time())
    return subprocess.Popen([sys.executable, "-m", "oomdoc.capture.child"], env=env, **popen)


# Variables a warm child takes when it is handed its work rather than when it
# starts: torch reads the CUDA allocator's settings once, at import (2.9 and
# later) or when CUDA starts, and the child sets them again itself before the
# script's first device work (oomdoc.capture.child.apply_late_env). So the
# replays with expandable segments start warm too, where before each waited
# for a child of its own (on the H100: 8 to 13 s to its first step against 3).
LATE_ENV = frozenset({"PYTORCH_CUDA_ALLOC_CONF"})


def _env_key(device: str, extra_env: dict[str, str]) -> tuple:
    return device, tuple(sorted((k, v) for k, v in extra_env.items() if k not in LATE_ENV))


class WarmChild:
    """A capture child started before its work is known.

    It starts Python and imports torch and oomdoc (seconds that a fresh child
    pays before it does anything), or is forked from a fork server that did
    (`server`, oomdoc.forking), then blocks on a pipe until the parent
    sends its configuration. While it waits the parent may send it modules to
    import too (`preimport`: the framework the failing run used). It touches
    no device while it waits, so the child that is running keeps the device,
    and its measurements, to itself. Only children whose output goes to a log
    are warm: their environment and output are fixed when they start.
    """

    def __init__(
        self,
        device: str,
        extra_env: dict[str, str],
        log_dir: str,
        preimports: list[str] | None = None,
        server: ForkServer | None = None,
    ):
        self.key = _env_key(device, extra_env)
        descriptor, self.log_path = tempfile.mkstemp(prefix="warm-", suffix=".log", dir=log_dir)
        read_fd, self._write_fd = os.pipe()
        env = child_env(device, extra_env)
        # The late variables it started with: a run it is handed must ask for
        # the same (it cannot take them back), or set them afresh (late_env_for).
        self.own_late = {name: env[name] for name in LATE_ENV if name in env}
        env[CONFIG_FD_ENV] = str(read_fd)

        def start() -> subprocess.Popen:
            return start_child(
                env,
                stdout=descriptor,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(read_fd,),
            )

        self.process: subprocess.Popen | ForkedProcess
        if server is not None:  # forked (it closes both descriptors once it exists)
            self.process = server.fork(descriptor, read_fd, start)
        else:
            try:
                self.process = start()
            finally:
                os.close(read_fd)
                os.close(descriptor)
        if preimports:
            self.preimport(preimports)

    def _send(self, line: str) -> bool:
        """One line to the child (it reads them in order); False when it is gone."""
        try:
            os.write(self._write_fd, (line + "\n").encode("utf-8"))
            return True
        except OSError:  # it died: take() sees that and starts another
            return False

    def preimport(self, modules: list[str]) -> None:
        """Have the child import `modules` while it waits (errors ignored there)."""
        self._send(preimport_request(modules))

    def usable_for(self, request: WarmRequest) -> bool:
        return (
            request.output_path is not None
            and self.key == _env_key(request.device, request.extra_env)
            and all(
                request.extra_env.get(name, value) == value for name, value in self.own_late.items()
            )
            and not self.gone
        )

    @property
    def gone(self) -> bool:
        """Ended, or a fork whose server died (its end could not be told)."""
        return self.process.poll() is not None or (
            isinstance(self.process, ForkedProcess) and self.process.lost
        )

    def late_env_for(self, request: WarmRequest) -> dict[str, str]:
        """The late variables `request` sets that this child did not start
        with: it applies them before the script runs."""
        return {
            name: value
            for name, value in request.extra_env.items()
            if name in LATE_ENV and name not in self.own_late
        }

    def hand(self, config_path: str, output_path: str) -> subprocess.Popen | ForkedProcess:
        """Give the child its work; its output so far moves to `output_path`."""
        os.replace(self.log_path, output_path)
        self._send(config_path)
        os.close(self._write_fd)
        return self.process

    def discard(self) -> None:
        """End an unused child at once: it holds no work and nothing to save,
        and waiting for it to finish importing torch would only delay the end
        of the run."""
        try:
            os.close(self._write_fd)
        except OSError:
            pass
        if self.process.poll() is None:
            self.process.kill()
        if not isinstance(self.process, ForkedProcess) or self.process.started:
            self.process.wait()
        # else a fork not made yet: made, it finds its pipe closed and ends
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


# Warm children kept beyond one per lane once replays run: a child's start-up
# (Python, torch, the script's framework: 5 s and more) outlasts a short
# replay, so a child started only when the one before it is taken is not
# ready for the next replay (benchmarks/replay_startup.py: the Trainer
# replays' median start-up 2.4 s with none ahead, under 1 s with one). With
# several lanes, one spare per lane: on the H100 the HF Trainer's three
# replays of its prescription start together, and with one spare two of them
# waited 2.3 to 2.8 s for a child.
SPARES_AHEAD = 1


def host_cpus() -> int:
    """The cores this process may run on (its affinity, else the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spares_for(lanes: int, cpus: int | None = None) -> int:
    """Spare warm children beyond one per lane: one per lane where the host
    has more than two cores per lane (a running replay and the child warming
    up for its lane's next each take one); none on fewer. There a spare only
    takes the CPU from the replays it would serve, and the last ones are
    never used: on this 2-core machine one spare left the Trainer's 7 replays
    at 22.2 s against 22.7 s without, and each diagnosis's unused spare
    (Python, torch and the framework imported, 3 to 8 s of a core) is a
    diagnosis's worth of the test suite's time."""
    if cpus is None:
        cpus = host_cpus()
    return max(SPARES_AHEAD, lanes) if cpus > 2 * lanes else 0


class WarmPool:
    """Keeps `size` warm children ready for the next runs with this device and
    environment: while replays run, the next ones' start-up happens. One per
    replay that may run at once (oomdoc run --replay-jobs), and spares_for()
    more once replays take them. While the failing run runs, one child, or
    with lanes (oomdoc.replay.replayer.early_lanes) one per lane and the
    spares (oomdoc.replay.replayer.warm_pool) on a host with the cores for them: a run that does
    not end in an OOM needs none, and they would slow a run on few cores.
    Thread-safe: the replays of one run take children from several threads."""

    def __init__(
        self,
        device: str,
        extra_env: dict[str, str],
        size: int = 1,
        preimports: list[str] | None = None,
    ):
        self.device, self.extra_env = device, dict(extra_env)
        self.size = max(1, size)
        # Spares beyond one per lane, once replays take them (`take`).
        self.ahead = 0
        # Replay logs live here too (a warm child's output moves to its log).
        self.log_dir = tempfile.mkdtemp(prefix="oomdoc-replays-")
        self.spares: list[WarmChild] = []
        # Modules every warm child imports while it waits (`preimport`).
        self.preimports: list[str] = list(dict.fromkeys(preimports or []))
        self._lock = threading.Lock()
        self._closed = False
        # The children are forks of one server (oomdoc.forking), started
        # with the first child.
        self._server: ForkServer | None = None
        self._forks = forks_allowed(device)

    def _fork_server(self) -> ForkServer | None:
        """Under the lock: the running fork server, started if need be; None
        where children start on their own (or the server died)."""
        if not self._forks:
            return None
        if self._server is None:
            log_path = os.path.join(self.log_dir, "fork-server.log")
            try:
                self._server = ForkServer(
                    child_env(self.device, self.extra_env), log_path, start_child
                )
            except OSError:
                self._forks = False
                return None
            if self.preimports:
                self._server.preimport(self.preimports)
        if not self._server.alive:
            self._forks = False  # it died: children start on their own from now
            return None
        return self._server

    def _fill(self) -> None:
        """Under the lock: replace dead spares, start new ones up to `size`
        (and those ahead)."""
        if self._closed:
            return
        for spare in [spare for spare in self.spares if spare.gone]:
            spare.discard()
            self.spares.remove(spare)
        while len(self.spares) < self.size + self.ahead:
            self.spares.append(
                WarmChild(
                    self.device, self.extra_env, self.log_dir, self.preimports, self._fork_server()
                )
            )

    def fill(self) -> None:
        with self._lock:
            self._fill()

    def configure(self, size: int | None = None, preimports: list[str] | None = None) -> None:
        """Change how many children wait, and what they import while they wait
        (sent to those already waiting too)."""
        with self._lock:
            new = [name for name in preimports or [] if name not in self.preimports]
            if new:
                self.preimports.extend(new)
                if self._server is not None:
                    self._server.preimport(new)
                for spare in self.spares:
                    spare.preimport(new)
            if size is not None:
                self.size = max(1, size)
                while len(self.spares) > self.size + self.ahead:
                    self.spares.pop().discard()
            self._fill()

    def take(self, request: WarmRequest) -> WarmChild | None:
        """A spare that suits `request` (and a new spare starts), else None."""
        with self._lock:
            if self._closed:
                return None
            live = [spare for spare in self.spares if not spare.gone]
            if len(live) < len(self.spares):
                self._fill()  # some died (e.g. Ctrl-C reached them): start others
            spare = next((spare for spare in live if spare.usable_for(request)), None)
            if spare is None:
                return None
            self.spares.remove(spare)
            self.ahead = spares_for(self.size)
            self._fill()
            return spare

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spares, self.spares = self.spares, []
        for spare in spares:
            spare.discard()
        if self._server is not None:
            self._server.close()
        remove_folder(self.log_dir)


def remove_folder(path: str, attempts: int = 10, pause_s: float = 0.05) -> None:
    """Remove `path` and what is in it, again while it is still there: a
    replay ended just before may still write and then remove a file of its
    own in it (its dataset sizes' temporary file, its log), and the removal
    that met that file left the folder behind (the test suite left an empty
    oomdoc-replays-* folder in the temporary folder every few runs)."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(pause_s)
