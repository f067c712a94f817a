"""Finding the user's own code in a Python stack.

An OOM is raised deep inside torch; what a user wants to see is the line of
*their* code that asked for the memory. A frame is "library" when its file
lives in the standard library, in site-packages, inside torch or inside
oomdoc itself; everything else is the user's.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from functools import lru_cache
from typing import Iterator

import torch

import oomdoc

_LIBRARY_DIRS: tuple[str, ...] = tuple(
    sorted(
        {
            os.path.realpath(path)
            for path in (
                sysconfig.get_paths().get("stdlib"),
                sysconfig.get_paths().get("platstdlib"),
                sysconfig.get_paths().get("purelib"),
                sysconfig.get_paths().get("platlib"),
                os.path.dirname(torch.__file__),
                os.path.dirname(oomdoc.__file__),
            )
            if path
        }
    )
)


def exception_chain(failure: BaseException | None, limit: int) -> Iterator[BaseException]:
    """`failure`, then what it was raised from or while handling, and so on
    (`__cause__`, else `__context__`), each once, at most `limit` of them."""
    seen: set[int] = set()
    while failure is not None and id(failure) not in seen and len(seen) < limit:
        seen.add(id(failure))
        yield failure
        failure = failure.__cause__ or failure.__context__


@lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """True when `filename` belongs to the user's code rather than a library."""
    if not filename or filename.startswith("<"):
        return False
    real = os.path.realpath(filename)
    for library_dir in _LIBRARY_DIRS:
        if real == library_dir or real.startswith(library_dir + os.sep):
            return False
    return True


def location_dict(filename: str, line: int, function: str) -> dict:
    return {"file": filename, "line": int(line), "function": function}


def innermost_user_frame(frame=None):
    """The innermost frame of user code on the current stack, or None."""
    frame = frame if frame is not None else sys._getframe(1)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def user_frames(limit: int, frame=None) -> list:
    """Up to `limit` user frames, innermost first."""
    frame = frame if frame is not None else sys._getframe(1)
    found: list = []
    while frame is not None and len(found) < limit:
        if is_user_file(frame.f_code.co_filename):
            found.append(frame)
        frame = frame.f_back
    return found


def current_user_location(frame=None) -> dict | None:
    """The innermost user frame as a snapshot `location`, or None."""
    user = innermost_user_frame(frame if frame is not None else sys._getframe(1))
    if user is None:
        return None
    return location_dict(user.f_code.co_filename, user.f_lineno, user.f_code.co_name)


def pick_user_location(frames: list[dict]) -> dict | None:
    """From a list of {filename, line, name} dicts (innermost first, as
    `torch.cuda.memory._snapshot()` gives them), the innermost user frame;
    falls back to the innermost non-torch, non-oomdoc frame."""
    fallback = None
    for frame in frames or []:
        filename = frame.get("filename", "")
        if is_user_file(filename):
            return location_dict(filename, frame.get("line", 0), frame.get("name", "?"))
        if fallback is None and filename and not filename.startswith("<"):
            real = os.path.realpath(filename)
            if not (
                real.startswith(os.path.dirname(torch.__file__))
                or real.startswith(os.path.dirname(oomdoc.__file__))
            ):
                fallback = location_dict(filename, frame.get("line", 0), frame.get("name", "?"))
    return fallback
