"""Datasets' sample sizes read once per diagnosis, shared by its replays.

Every replay orders its DataLoaders longest first (oomdoc.capture.whole_run),
reading each sample's size within a time budget. A dataset whose samples are
costly to make (images drawn or decoded, then transformed) spends the whole
budget in every replay: on the H200 each replay of the ImageNet-style
trainer waited 5 s for its first batch, 18 replays in one diagnosis. The
replays run the same script on the same data, so the first to read a
dataset writes what it read into the diagnosis's folder and the others take
it from there; every replay then orders the data the same way, too.

A dataset is known by its class, its length, its place among the datasets
of that class and length the replay read, and its first sample's size.
Child side, torch-free.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from typing import Any, Callable, Optional, Protocol


class Sizes(Protocol):
    """What is shared of a dataset's sizes (whole_run.DatasetSizes)."""

    samples: int
    sizes: list[int]
    error: Optional[str]
    seconds: float


class SharedSizes:
    """The sizes files in `folder` (one per dataset, with a lock beside it)."""

    def __init__(self, folder: str):
        self.folder = folder
        self._seen: dict[str, int] = {}

    def key(self, dataset: Any, first_size: Callable[[], int]) -> str:
        kind = f"{type(dataset).__module__}.{type(dataset).__qualname__}:{len(dataset)}"
        place = self._seen.get(kind, 0)
        self._seen[kind] = place + 1
        try:
            first = first_size()
        except Exception:  # the read itself says why (DatasetSizes.error)
            first = -1
        return hashlib.sha1(f"{kind}:{place}:{first}".encode()).hexdigest()[:16]

    def get(self, key: str, read: Callable[[], Sizes], load: Callable[[dict], Sizes]) -> Sizes:
        """The sizes under `key`: those an earlier replay wrote (`load`), else
        `read` now and written for the others. Replays that want the same
        dataset at once wait for the first to read it (no longer than it
        takes them to read it themselves)."""
        path = os.path.join(self.folder, f"dataset-sizes-{key}.json")
        try:
            lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return read()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = _load(path)
            if found is not None:
                try:
                    return load(found)
                except (KeyError, TypeError, ValueError):
                    pass  # another version's file: read again
            sizes = read()
            _store(path, sizes)
            return sizes
        finally:
            os.close(lock)  # and with it the lock


def _load(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _store(path: str, sizes: Sizes) -> None:
    record = {
        "samples": sizes.samples,
        "sizes": sizes.sizes,
        "error": sizes.error,
        "seconds": sizes.seconds,
    }
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.replace(temporary, path)
    except OSError:  # a full disk: the others read for themselves
        try:
            os.unlink(temporary)
        except OSError:
            pass
