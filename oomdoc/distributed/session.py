"""`oomdoc run --nproc-per-node N`: one job through torch.distributed.run,
every rank under capture, one snapshot for the job (see merge.py), replays
through the same launcher with the same world size."""

from __future__ import annotations

import sys
from typing import TextIO

from oomdoc.distributed import DistOptions, check_dist_options
from oomdoc.distributed.launch import run_distributed_child, run_job
from oomdoc.distributed.merge import merge_rank_captures, missing_entry
from oomdoc.distributed.warm_jobs import WarmJobs
from oomdoc.errors import UsageError
from oomdoc.frameworks import preimports
from oomdoc.model import RankEntry, parse
from oomdoc.replay.replayer import REPLAY_ENV
from oomdoc.reporters import write_and_report
from oomdoc.runner import (
    ChildResult,
    RunOptions,
    WarmPool,
    build_snapshot,
    check_device_choice,
    check_target,
    child_request,
    output_path,
    remove_if_empty,
    replays_failed,
)
from oomdoc.warm import script_preimports


def run_distributed_session(options: RunOptions, stderr: TextIO | None = None) -> int:
    """run_session's counterpart for a distributed job (`options.distributed`)."""
    stderr = stderr or sys.stderr
    dist: DistOptions = options.distributed
    check_device_choice(options.device)
    check_dist_options(dist)
    check_target(options)
    path = output_path(options)
    artifact_dir = path.parent / (path.stem + ".files")
    request = child_request(options, artifact_dir=str(artifact_dir))
    new_parent = not path.parent.exists()
    artifact_dir.mkdir(parents=True, exist_ok=True)
    # The replays' first job starts importing while the failing run runs,
    # with the imports read from the script's file (never run).
    jobs = None
    if options.replay:
        imports = [] if request.is_module else script_preimports(request.target)
        jobs = WarmJobs(dist, request.device, REPLAY_ENV, imports)
        jobs.fill()
    try:
        return _run_and_replay(options, dist, request, path, artifact_dir, new_parent, jobs, stderr)
    finally:
        if jobs is not None:
            jobs.close()


def _run_and_replay(options, dist, request, path, artifact_dir, new_parent, jobs, stderr) -> int:
    result = run_job(request, dist)
    refused = next((c["usage_error"] for c in result.captures if c.get("usage_error")), None)
    if refused:
        _remove_empty_tree(artifact_dir)
        if new_parent:
            remove_if_empty(path.parent)
        raise UsageError(refused)

    capture = None
    if result.captures:
        capture = merge_rank_captures(
            result.captures, missing=result.missing, launch=dist.as_dict()
        )
    snapshot = build_snapshot(
        options, ChildResult(exit_code=result.exit_code, capture=capture, wall_s=result.wall_s)
    )
    if capture is None:
        snapshot.ranks = [parse(RankEntry, missing_entry(item)) for item in result.missing]
        snapshot.world_size = len(result.missing) * _nodes(dist)
        snapshot.notes.append(
            "No rank wrote its capture: the launcher failed (see its output above) or every rank was killed."
        )
    snapshot.notes.extend(result.notes)
    if snapshot.options is not None:
        snapshot.options.distributed = dist.as_dict()

    if snapshot.outcome == "oom" and options.replay and capture is not None:
        from oomdoc.replay.orchestrate import replay_fixes

        # Never filled: a job's ranks are started by the launcher, in jobs
        # started ahead (warm_jobs), not by the pool.
        pool = WarmPool(request.device, REPLAY_ENV)
        assert jobs is not None  # made with options.replay (closed by the caller)
        # Later jobs also import what the failing run's framework loads lazily.
        jobs.preimports = preimports(snapshot)
        try:
            replay_fixes(
                snapshot,
                options,
                request,
                stderr=stderr,
                pool=pool,
                launch=lambda child: run_distributed_child(child, dist, jobs),
            )
        except Exception as exc:  # oomdoc's own fault: the failing job still counts
            snapshot.notes.append(replays_failed(exc, artifact_dir, stderr))
        finally:
            pool.close()

    _remove_empty_tree(artifact_dir)
    write_and_report(snapshot, path, options.html_path, stderr)
    return result.exit_code


def _nodes(dist: DistOptions) -> int:
    try:
        return int(str(dist.nnodes or "1").split(":")[-1])
    except ValueError:
        return 1


def _remove_empty_tree(directory) -> None:
    """The artifact folder and its per-rank folders, when nothing was saved."""
    if directory.is_dir():
        for child in directory.iterdir():
            if child.is_dir():
                remove_if_empty(child)
    remove_if_empty(directory)
