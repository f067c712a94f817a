"""`oomdoc run`: run the script once under capture, then (on an OOM) hand the
failure to the replays, write the snapshot and print the report."""

from __future__ import annotations

import sys
from typing import TextIO

from oomdoc.errors import UsageError
from oomdoc.reporters import write_and_report
from oomdoc.runner import (
    RunOptions,
    build_snapshot,
    check_device_choice,
    check_target,
    child_request,
    output_path,
    raise_child_usage_error,
    remove_if_empty,
    replays_failed,
    run_child,
)

__all__ = ["RunOptions", "run_session"]


def run_session(options: RunOptions, stderr: TextIO | None = None) -> int:
    if options.distributed is not None:  # a torchrun job: oomdoc.distributed
        from oomdoc.distributed.session import run_distributed_session

        return run_distributed_session(options, stderr)
    stderr = stderr or sys.stderr
    # Arguments are checked before torch is imported: a usage error is quick.
    check_device_choice(options.device)
    check_target(options)
    path = output_path(options)
    artifact_dir = path.parent / (path.stem + ".files")
    request = child_request(options, artifact_dir=str(artifact_dir))
    pool = None
    if options.replay:
        from oomdoc.replay.orchestrate import early_lanes, warm_pool

        # The replays' children start (and import torch) while the script
        # runs: most runs that get here end in the OOM they are about.
        pool = warm_pool(request, early_lanes(request.device, options.replay_jobs))
    try:
        new_parent = not path.parent.exists()
        artifact_dir.mkdir(parents=True, exist_ok=True)
        result = run_child(request)
        try:
            raise_child_usage_error(result)
        except UsageError:
            remove_if_empty(artifact_dir)
            if new_parent:
                remove_if_empty(path.parent)  # a refused run leaves nothing behind
            raise
        snapshot = build_snapshot(options, result)

        if snapshot.outcome == "oom" and options.replay and result.capture is not None:
            from oomdoc.replay.orchestrate import replay_fixes

            try:
                replay_fixes(snapshot, options, request, stderr=stderr, pool=pool)
            except Exception as exc:
                # A fault of oomdoc's own must not lose the failing run:
                # its snapshot and report are still written.
                snapshot.notes.append(replays_failed(exc, artifact_dir, stderr))
    finally:
        if pool is not None:
            pool.close()

    remove_if_empty(artifact_dir)
    write_and_report(snapshot, path, options.html_path, stderr)
    return result.exit_code
