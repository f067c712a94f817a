"""The files a replay of the user's script writes.

A replay runs the script again (oomdoc.replay), so whatever the script writes
as it trains, a replay writes too, where the user's own run, stopped by its
OOM, may not have got to: pytorch/examples' DCGAN saves `netG_epoch_0.pth`
and its sample images into `--outf` at each epoch's end, and each replay of
its batch of 1000 out of 1000 fake images reaches one. The report names
them (the README says to guard such writes with `OOMDOC_REPLAY`).

Seen through Python's audit hook for `open` (builtins.open, io.open,
os.open: PIL, numpy and pathlib all open through them), in write, append,
create or update mode, and at torch.save's zip writer, which opens an
ASCII-named file in native code (`_open_zipfile_writer_file`; unseen by the
hook, pytorch/examples' DCGAN's `netG_epoch_0.pth` and minGPT's `model.pt`
went unnamed); not files other native code opens itself (safetensors). Nothing the script does changes: the
hook only records, never raises, and calls nothing that takes a lock. oomdoc's own files, the bytecode
cache, the temporary folder outside the script's working directory and
the caches under the home folder are left out.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

# At most this many paths are kept (the count goes on).
KEPT = 50
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


class WrittenFiles:
    """The paths a replay opened to write, in the order first opened."""

    def __init__(self, left_out: list[str]) -> None:
        self.paths: list[str] = []
        self.count = 0
        self._seen: set[str] = set()
        self._cwd = os.path.join(os.getcwd(), "")
        self._left_out = tuple(os.path.join(os.path.abspath(p), "") for p in left_out if p)
        # Worked out now, never inside the hook: the first tempfile.gettempdir()
        # opens a file to test the folder while it holds a lock, and the hook
        # asking for it there waited on that lock for good (a replay hung).
        home = os.path.expanduser("~")
        scratch = [tempfile.gettempdir(), "/dev", "/proc", "/sys"]
        scratch += [os.path.join(home, name) for name in (".cache", ".triton", ".nv", ".config")]
        self._scratch = tuple(os.path.join(place, "") for place in scratch)
        self._inside = False

    def fields(self) -> dict[str, Any]:
        return {"paths": list(self.paths), "count": self.count}

    def hook(self, event: str, args: tuple) -> None:
        if event != "open" or self._inside:
            return
        self._inside = True  # what it calls may open files: not seen again
        try:
            self._opened(*args[:3])
        except Exception:  # an audit hook must never change what the script sees
            pass
        finally:
            self._inside = False

    def _opened(self, path: Any, mode: Any, flags: Any) -> None:
        if isinstance(mode, str):
            writes = any(letter in mode for letter in "wax+")
        else:
            writes = isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
        if not writes or isinstance(path, int):
            return
        full = os.path.abspath(os.fsdecode(path))  # from where the script is now
        if full in self._seen or not self.kept(full):
            return
        self._seen.add(full)
        self.count += 1
        if len(self.paths) < KEPT:
            self.paths.append(full)

    def kept(self, full: str) -> bool:
        """Whether a path is the user's, not oomdoc's or a scratch or cache
        file (the script's working directory: where it started)."""
        if "__pycache__" in full.split(os.sep) or full.startswith(self._left_out):
            return False
        return full.startswith(self._cwd) or not full.startswith(self._scratch)


_WATCHING: list[WrittenFiles] = []  # this process's, once watched


def watch(left_out: list[str | None]) -> None:
    """In a replay (OOMDOC_REPLAY=1), record the files it writes from now
    on, except under `left_out` (oomdoc's own folders). Once per process:
    an audit hook cannot be removed."""
    if os.environ.get("OOMDOC_REPLAY") != "1" or _WATCHING:
        return
    written = WrittenFiles([place for place in left_out if place])
    _WATCHING.append(written)
    sys.addaudithook(written.hook)
    _watch_torch_save(written)


def _watch_torch_save(written: WrittenFiles) -> None:
    """torch.save's file writer opens its file in native code: its path is
    recorded as the hook records an open, and it goes on as it would."""
    serialization = sys.modules.get("torch.serialization")
    writer = getattr(serialization, "_open_zipfile_writer_file", None)
    original = getattr(writer, "__init__", None)
    if writer is None or original is None:
        return

    def __init__(self: Any, name: Any, *args: Any, **kwargs: Any) -> None:
        written.hook("open", (name, "wb", 0))
        original(self, name, *args, **kwargs)

    writer.__init__ = __init__


def fields() -> dict[str, Any] | None:
    """The capture's `files_written`: None where nothing was watched."""
    return _WATCHING[0].fields() if _WATCHING else None
