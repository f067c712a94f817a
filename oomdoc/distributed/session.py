"""`oomdoc run --nproc-per-node N`: one job through torch.distributed.run,
every rank under capture, one snapshot for the job (see merge.py), replays
through the same launcher with the same world size."""

from __future__ import annotations

import sys

from oomdoc import report
from oomdoc.distributed import DistOptions, check_dist_options
from oomdoc.distributed.launch import run_job
from oomdoc.distributed.merge import merge_rank_captures, missing_entry
from oomdoc.distributed.report import diagnosis_lines, rank_section_lines
from oomdoc.distributed.rules import diagnose_distributed
from oomdoc.errors import UsageError
from oomdoc.snapshot import write_snapshot


def run_distributed_session(options, stderr=None) -> int:
    """run_session's counterpart for a distributed job (`options.extra["distributed"]`)."""
    from oomdoc import session as single

    stderr = stderr or sys.stderr
    dist: DistOptions = options.extra["distributed"]
    single.check_device_choice(options.device)
    check_dist_options(dist)
    single.check_target(options)
    path = single.output_path(options)
    artifact_dir = path.parent / (path.stem + ".files")
    request = single.child_request(options, options.device, artifact_dir=str(artifact_dir))
    new_parent = not path.parent.exists()
    artifact_dir.mkdir(parents=True, exist_ok=True)
    result = run_job(request, dist)
    refused = next((c["usage_error"] for c in result.captures if c.get("usage_error")), None)
    if refused:
        _remove_empty_tree(artifact_dir)
        if new_parent:
            single.remove_if_empty(path.parent)
        raise UsageError(refused)

    capture = None
    if result.captures:
        capture = merge_rank_captures(
            result.captures, missing=result.missing, launch=dist.as_dict()
        )
    document = single.build_snapshot(options, capture, result.exit_code)
    if capture is None:
        document["ranks"] = [missing_entry(item) for item in result.missing]
        document["world_size"] = len(result.missing) * _nodes(dist)
        document["first_oom_rank"] = None
        document["notes"].append(
            "No rank wrote its capture: the launcher failed (see its output above) or every rank was killed."
        )
    document.setdefault("notes", []).extend(result.notes)
    document["options"]["distributed"] = dist.as_dict()

    if document["outcome"] == "oom" and options.replay and capture is not None:
        from oomdoc.replay.orchestrate import REPLAY_ENV, replay_fixes
        from oomdoc.runner import WarmPool

        # Never filled: a job's ranks are started by the launcher, not warm.
        pool = WarmPool(request.device, REPLAY_ENV)
        try:
            replay_fixes(document, options, request, stderr=stderr, pool=pool)
        finally:
            pool.close()
        from oomdoc.distributed.sharding_replays import measure_sharding

        try:
            measure_sharding(document, options, request, stderr)
        except Exception as exc:  # the snapshot of the OOM is written whatever happens
            document.setdefault("notes", []).append(
                f"Sharding replays failed ({type(exc).__name__}: {exc})."
            )

    _remove_empty_tree(artifact_dir)
    write_snapshot(document, path)
    text = report.render_text(document, snapshot_path=str(path))
    extra = rank_section_lines(document) + diagnosis_lines(diagnose_distributed(document))
    print(text + "\n".join(extra) + ("\n" if extra else ""), file=stderr, end="")
    return result.exit_code


def _nodes(dist: DistOptions) -> int:
    try:
        return int(str(dist.nnodes or "1").split(":")[-1])
    except ValueError:
        return 1


def _remove_empty_tree(directory) -> None:
    """The artifact folder and its per-rank folders, when nothing was saved."""
    from oomdoc.session import remove_if_empty

    if directory.is_dir():
        for child in directory.iterdir():
            if child.is_dir():
                remove_if_empty(child)
    remove_if_empty(directory)
