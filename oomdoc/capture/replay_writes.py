"""The files a replay of the user's script writes.

A replay runs the script again (oomdoc.replay), so whatever the script writes
as it trains, a replay writes too, where the user's own run, stopped by its
OOM, may not have got to: pytorch/examples' DCGAN saves `netG_epoch_0.pth`
and its sample images into `--outf` at each epoch's end, and each replay of
its batch of 1000 out of 1000 fake images reaches one. The report names
them, and puts them back (below).

Seen through Python's audit hook for `open` (builtins.open, io.open,
os.open: PIL, numpy and pathlib all open through them), in write, append,
create or update mode, and at torch.save's zip writer, which opens an
ASCII-named file in native code (`_open_zipfile_writer_file`; unseen by the
hook, pytorch/examples' DCGAN's `netG_epoch_0.pth` and minGPT's `model.pt`
went unnamed); not files other native code opens itself (safetensors). Nothing the script does
changes: the hook calls nothing that takes a Python lock (the keeper's flock is the kernel's) and
raises only as said below. oomdoc's own files, the bytecode cache, the temporary folder outside the
script's working directory and the caches under the home folder are left out, unless the script's
arguments name a place there.

With a keeper (oomdoc.kept_files, the replays' `kept_files` folder), each of
the user's paths is noted before the replay first changes it, so that the
parent puts it back once the replays end: opened to write, truncated,
renamed (both names), removed, a folder made or removed, a link made. That
is the one thing the hook may refuse: when no copy of a file can be made,
the replay's change fails rather than lose the user's file.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from typing import Any, Sequence

from oomdoc.child_config import ChildConfig
from oomdoc.kept_files import FileKeeper

# At most this many paths are kept (the count goes on).
KEPT = 50
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# Audit events that change a path besides `open`: for each, where its
# paths are among the arguments, each with where its `dir_fd` is (a path
# relative to a folder's descriptor is not one from here: shutil.rmtree
# removes what it holds that way, and is kept whole at its own event).
# os.replace raises os.rename; shutil.move renames, or copies and removes.
_CHANGES: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)),
    "os.truncate": ((0, None),),
    "os.symlink": ((1, 2),),
    "os.link": ((1, 3),),
    "shutil.rmtree": ((0, 1),),
}


class KeepRefused(PermissionError):
    """A replay's change of a user's file, refused: no copy could be kept."""


class WrittenFiles:
    """The paths a replay opened to write, in the order first opened."""

    def __init__(
        self, left_out: list[str], keeper: FileKeeper | None = None, named: Sequence[str] = ()
    ) -> None:
        self.keeper = keeper
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
        # Scratch places the user named on the script's command line (the
        # Hugging Face examples' `--output_dir /tmp/test-clm`): theirs.
        self._named = tuple(
            os.path.join(path, "")
            for path in (os.path.abspath(place) for place in named_paths(named))
            if path.startswith(self._scratch) and os.path.join(path, "") not in self._scratch
        )
        # Per thread: what the hook itself opens is not seen again, while
        # another thread's open still is.
        self._local = threading.local()

    def fields(self) -> dict[str, Any]:
        return {"paths": list(self.paths), "count": self.count}

    def hook(self, event: str, args: tuple) -> None:
        if (event != "open" and event not in _CHANGES) or getattr(self._local, "inside", False):
            return
        self._local.inside = True  # what it calls may open files: not seen again
        try:
            if event == "open":
                self._opened(*args[:3])
            else:
                for path, whole, moved_to in _paths_changed(event, args):
                    self._changed(path, whole, moved_to)
        except KeepRefused:
            raise  # no copy of the user's file could be made: the change must not happen
        except Exception:  # otherwise an audit hook must never change what the script sees
            pass
        finally:
            self._local.inside = False

    def _opened(self, path: Any, mode: Any, flags: Any) -> None:
        if isinstance(mode, str):
            writes = any(letter in mode for letter in "wax+")
        else:
            writes = isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
        if writes:
            self._changed(path)

    def _changed(self, path: Any, whole: bool = False, moved_to: Any = None) -> None:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return  # a file descriptor
        full = os.path.abspath(os.fsdecode(path))  # from where the script is now
        if not self.kept(full):
            return
        if self.keeper is not None:
            try:
                if whole:
                    self.keeper.keep_tree(full, moved_to and os.path.abspath(os.fsdecode(moved_to)))
                else:
                    self.keeper.keep(full)
            except OSError as exc:
                raise KeepRefused(
                    f"oomdoc: no copy of {full} could be kept before this replay changed it "
                    f"({exc.strerror or exc}), so the replay may not change it"
                ) from None
        if full in self._seen:
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
        if full.startswith(self._cwd) or os.path.join(full, "").startswith(self._named):
            return True
        return not full.startswith(self._scratch)


def _paths_changed(event: str, args: tuple) -> list[tuple[Any, bool, Any]]:
    """The paths an audit event in _CHANGES changes, from here, each with
    whether all it holds changes with it (a folder removed whole, or
    renamed: each of its files is kept, one by one) and where it goes (a
    folder renamed: what arrives there is removed)."""
    paths = []
    for index, folder in _CHANGES[event]:
        descriptor = args[folder] if folder is not None and folder < len(args) else None
        if index >= len(args) or (isinstance(descriptor, int) and descriptor >= 0):
            continue  # relative to a folder's descriptor (-1: none given)
        path = args[index]
        if event == "os.mkdir" and os.path.isdir(path):
            continue  # os.makedirs(exist_ok=True): nothing changes
        moved = event == "os.rename" and index == 0 and os.path.isdir(path)
        moved = moved and not os.path.islink(path)
        paths.append((path, moved or event == "shutil.rmtree", args[1] if moved else None))
    return paths


_WATCHING: list[WrittenFiles] = []  # this process's, once watched


def named_paths(args: Sequence[str]) -> list[str]:
    """The absolute paths among a script's arguments (`--key=value` too)."""
    values = [arg.split("=", 1)[1] if "=" in arg else arg for arg in args]
    return [value for value in values if os.path.isabs(value)]


def watch(
    left_out: list[str | None], kept_files: str | None = None, named: Sequence[str] = ()
) -> None:
    """In a replay (OOMDOC_REPLAY=1), record the files it writes from now
    on, except under `left_out` (oomdoc's own folders), and with `kept_files`
    note each before it changes (oomdoc.kept_files). Once per process: an
    audit hook cannot be removed."""
    if os.environ.get("OOMDOC_REPLAY") != "1" or _WATCHING:
        return
    keeper = FileKeeper(kept_files) if kept_files else None
    written = WrittenFiles([place for place in [*left_out, kept_files] if place], keeper, named)
    _WATCHING.append(written)
    sys.addaudithook(written.hook)
    _watch_torch_save(written)


def watch_run(config: ChildConfig) -> None:
    """`watch` for a child's run: oomdoc's own folders are its capture's and
    its artifacts'; the script's arguments may name its own places."""
    folders = [os.path.dirname(config.result_path), config.artifact_dir]
    watch(folders, config.kept_files, config.args)


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
