"""The user's files, as the user's run left them, whatever the replays write.

A replay runs the user's script again (oomdoc.replay), and the script does
what it does when it runs: it appends to its log, saves and rotates its
checkpoints, makes a new `lightning_logs/version_N`. The user's run was the
failing one; the replays are oomdoc's, and nothing they change may stay: a
checkpoint the user resumes from, overwritten with a few steps' weights, is
lost work.

So in a replay, just before the script first changes one of its files
(writes, truncates, renames, removes it, or makes a folder: seen through
Python's audit hook, oomdoc.capture.replay_writes), `FileKeeper.keep` notes
what is there: a copy of a file, a link's target, an existing folder, or
that nothing was. The notes go into one folder shared by the replays of a
diagnosis, the first replay to touch a path writing its note under a lock.
Once every replay has ended, the parent puts each path back as it was and
removes what the replays created (`put_back`).

Torch-free: the child keeps, the parent puts back. POSIX (flock), as the
device lock is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

LOCK_NAME = ".lock"
# What a note says was at the path before the first replay changed it.
FILE, LINK, FOLDER, NOTHING = "file", "link", "folder", "nothing"


def _key(path: str) -> str:
    return hashlib.sha256(os.fsencode(path)).hexdigest()[:40]


@contextmanager
def _locked(folder: str) -> Iterator[None]:
    """Every process of the diagnosis, one at a time (the kernel's flock: a
    replay killed while holding it never blocks the others)."""
    descriptor = os.open(os.path.join(folder, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


class FileKeeper:
    """A replay's side: the note of each path before it first changes it."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._kept: set[str] = set()

    def keep(self, path: str) -> None:
        """Note what is at absolute `path` (once per diagnosis: the first
        note is what the user's run left). Raises OSError when no copy can
        be made, so that the replay's change fails rather than lose the
        user's file."""
        if path in self._kept:
            return
        key = _key(path)
        note_path = os.path.join(self.folder, key + ".json")
        os.makedirs(self.folder, exist_ok=True)
        with _locked(self.folder):
            if not os.path.exists(note_path):
                note = _note_of(path, os.path.join(self.folder, key + ".data"))
                temporary = note_path + ".tmp"
                with open(temporary, "w") as out:
                    json.dump(note, out)
                os.replace(temporary, note_path)
        self._kept.add(path)

    def keep_tree(self, path: str, moved_to: str | None = None) -> None:
        """Before a folder is removed with everything in it (shutil.rmtree),
        or renamed to `moved_to` (what arrives there is noted as not there
        before, so that it goes once the folder is back)."""
        self.keep(path)
        if moved_to:
            self.keep(moved_to)
        for root, folders, files in os.walk(path):
            for name in folders + files:
                self.keep(os.path.join(root, name))
                if moved_to:
                    relative = os.path.relpath(os.path.join(root, name), path)
                    self.keep(os.path.join(moved_to, relative))


def _note_of(path: str, copy_path: str) -> dict:
    if os.path.islink(path):
        return {"path": path, "was": LINK, "target": os.readlink(path)}
    if os.path.isfile(path):
        shutil.copy2(path, copy_path)
        return {"path": path, "was": FILE, "copy": copy_path}
    if os.path.isdir(path):
        return {"path": path, "was": FOLDER}
    return {"path": path, "was": NOTHING}


@dataclass
class PutBack:
    """What `put_back` did: paths as they were (restored), paths the replays
    created (removed), and those it could not mend, with why."""

    restored: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return len(self.restored) + len(self.removed) + len(self.failed)


def put_back(folder: str, rescue_dir: str | None = None) -> PutBack:
    """Every path the replays changed, as it was before the first of them
    (call once no replay runs any more). A file that cannot be put back
    keeps its copy, moved to `rescue_dir` (the run's artifact folder: the
    notes' folder is temporary), and the failure names it."""
    done = PutBack()
    notes = _notes(folder)
    # Files and links first; then the folders the replays made, deepest
    # first, once the files in them are gone; folders that were there come
    # back with the files put into them.
    for note in notes:
        if note["was"] in (FILE, LINK, NOTHING):
            _mend(note, done, rescue_dir)
    made = [note["path"] for note in notes if note["was"] == NOTHING]
    for path in sorted(made, key=lambda path: path.count(os.sep), reverse=True):
        if os.path.isdir(path) and not os.path.islink(path):
            try:
                os.rmdir(path)
                done.removed.append(path)
            except OSError:
                done.failed.append((path, "a folder the replays made, still holding files"))
    for note in notes:
        if note["was"] == FOLDER and not os.path.isdir(note["path"]):
            try:
                os.makedirs(note["path"], exist_ok=True)
                done.restored.append(note["path"])
            except OSError as exc:
                done.failed.append((note["path"], str(exc)))
    return done


def _notes(folder: str) -> list[dict]:
    notes = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as note:
                notes.append(json.load(note))
        except (OSError, ValueError):
            continue  # a replay killed while writing it: its .tmp never became a note
    return notes


def _mend(note: dict, done: PutBack, rescue_dir: str | None) -> None:
    path, was = note["path"], note["was"]
    try:
        if was == NOTHING:
            if os.path.lexists(path) and not (os.path.isdir(path) and not os.path.islink(path)):
                os.remove(path)
                done.removed.append(path)
            return
        if os.path.isdir(path) and not os.path.islink(path):
            raise IsADirectoryError("a replay made a folder where it was")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if was == LINK:
            if os.path.lexists(path):
                if os.path.islink(path) and os.readlink(path) == note["target"]:
                    return
                os.remove(path)
            os.symlink(note["target"], path)
        else:
            if _same_file(note["copy"], path):
                os.remove(note["copy"])
                return
            _move(note["copy"], path)
        done.restored.append(path)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        copy = note.get("copy")
        if copy and os.path.exists(copy) and rescue_dir:
            try:
                os.makedirs(rescue_dir, exist_ok=True)
                # Named by its path's key too: two files of one name never meet.
                name = f"kept-{_key(path)[:8]}-{os.path.basename(path)}"
                kept = os.path.join(rescue_dir, name)
                shutil.move(copy, kept)
                reason += f"; its copy is at {kept}"
            except OSError:
                pass
        done.failed.append((path, reason))


def _same_file(copy: str, path: str) -> bool:
    """Whether `path` holds what its copy does (nothing to put back)."""
    try:
        if os.path.islink(path) or os.path.getsize(copy) != os.path.getsize(path):
            return False
        with open(copy, "rb") as a, open(path, "rb") as b:
            while True:
                left, right = a.read(1 << 20), b.read(1 << 20)
                if left != right:
                    return False
                if not left:
                    return True
    except OSError:
        return False


def _move(copy: str, path: str) -> None:
    try:
        if os.path.lexists(path):
            os.remove(path)  # a link a replay left there is not followed
        os.replace(copy, path)  # the same file system: the copy itself
    except OSError:
        shutil.copy2(copy, path)
        os.remove(copy)
