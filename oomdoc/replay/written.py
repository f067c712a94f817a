"""What the replays wrote, put back as the user's run left it, and said.

Each replay runs the script again and gets where the user's run, stopped by
its OOM, may not have: pytorch/examples' DCGAN saves its generator at each
epoch's end, which each replay of its one-batch epoch reaches; Lightning
makes a new `lightning_logs/version_N` in each. The replays note each of the
user's paths before changing it (oomdoc.capture.replay_writes,
oomdoc.kept_files); once they have all ended, `put_back_written` puts every
path back and says what the replays wrote and what was mended.
"""

from __future__ import annotations

import os
from typing import Optional

from oomdoc.formatting import relative_path
from oomdoc.kept_files import PutBack, put_back
from oomdoc.model import Snapshot
from oomdoc.replay.replayer import Replayer

# The files a note names (the rest are counted).
FILES_NAMED = 5


def put_back_written(
    snapshot: Snapshot, replayer: Replayer, rescue_dir: Optional[str]
) -> Optional[str]:
    """Put back what the replays changed (call once none runs); the note
    that says so, or None where they wrote nothing of the user's."""
    try:
        mended = put_back(replayer.kept_files, rescue_dir)
    except Exception as exc:  # the failing run's snapshot is written whatever happens here
        return (
            "oomdoc could not put back the files the replays changed "
            f"({type(exc).__name__}: {exc}): check what your script writes."
        )
    return written_note(snapshot, replayer, mended)


def _count(paths: list[str], noun: str) -> str:
    return f"{len(paths)} {noun}{'' if len(paths) == 1 else 's'}"


def written_note(snapshot: Snapshot, replayer: Replayer, mended: PutBack) -> Optional[str]:
    """The files the replays wrote (the first FILES_NAMED, the rest
    counted), and what was put back."""
    cwd = snapshot.cwd or os.getcwd()
    paths: dict[str, None] = {}
    more = False
    for replay in replayer.replays:
        written = replay.capture.files_written if replay.capture is not None else None
        if written is not None:
            paths.update(dict.fromkeys(written.paths))
            more = more or written.count > len(written.paths)
    if not paths and not mended.changed:
        return None
    shown = [relative_path(path, cwd) for path in paths]
    named = ", ".join(shown[:FILES_NAMED])
    rest = len(shown) - FILES_NAMED
    if rest > 0:
        named += f" and {'at least ' if more else ''}{rest} more"
    elif more:
        named += " and more"
    text = (
        f"The replays wrote {'these files' if len(shown) != 1 else 'this file'}, as the "
        f"script does when it runs: {named or 'none named'}."
    )
    done = [f"{_count(mended.restored, 'path')} restored"] if mended.restored else []
    if mended.removed:
        done.append(f"{_count(mended.removed, 'path')} the replays created removed")
    if done:
        text += f" oomdoc put them back as your run left them: {', '.join(done)}."
    if mended.failed:
        failed = "; ".join(
            f"{relative_path(path, cwd)}: {why}" for path, why in mended.failed[:FILES_NAMED]
        )
        more_failed = len(mended.failed) - FILES_NAMED
        text += f" Not put back: {failed}" + (
            f"; and {more_failed} more." if more_failed > 0 else "."
        )
    return text + (
        " What native code writes itself (safetensors) is not seen: skip writes when "
        "OOMDOC_REPLAY=1 is set, as in every replay."
    )
