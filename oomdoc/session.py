"""`oomdoc run`: run the script once under capture, then (on an OOM) hand the
failure to the replays, write the snapshot and print the report."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import oomdoc
from oomdoc import report
from oomdoc.capture import CUDA_UNAVAILABLE, choose_device
from oomdoc.errors import UsageError
from oomdoc.runner import ChildRequest, run_child
from oomdoc.snapshot import SCHEMA_VERSION, default_snapshot_path, utc_now, write_snapshot


@dataclass
class RunOptions:
    target: str
    args: list[str]
    is_module: bool = False
    device: str = "auto"
    capacity_bytes: int | None = None
    output: str | None = None
    max_steps: int | None = None
    replay: bool = True
    fixes: list[str] | None = None
    replay_timeout_s: float | None = None
    batch_arg: str | None = None
    extra: dict = field(default_factory=dict)


def check_device_choice(requested: str) -> None:
    if requested not in ("auto", "cuda", "cpu"):
        raise UsageError(f"--device must be auto, cuda or cpu, not {requested!r}")


def resolve_device(requested: str) -> str:
    """`auto` means CUDA when this machine has it, else the simulated device.

    Only for callers that must know before running anything: `oomdoc run`
    and `oomdoc check` let the child decide (it imports torch anyway), which
    spares the parent seconds of `import torch`.
    """
    check_device_choice(requested)
    if requested == "cpu":
        return "cpu"
    import warnings

    with warnings.catch_warnings():
        # torch's own import-time warnings (e.g. no NumPy) belong to the
        # script's output, where the child shows them; not twice.
        warnings.simplefilter("ignore")
        import torch

    device = choose_device(requested, torch.cuda.is_available())
    if device is None:
        raise UsageError(CUDA_UNAVAILABLE)
    return device


def device_of(capture: dict | None, requested: str) -> str:
    """The device a child ran on: `cuda` or `cpu` (the simulated device)."""
    kind = ((capture or {}).get("device") or {}).get("kind")
    if kind in ("cuda", "simulated"):
        return "cuda" if kind == "cuda" else "cpu"
    return resolve_device(requested)


def raise_child_usage_error(result) -> None:
    """The child refused its configuration (e.g. --device cuda without CUDA)."""
    message = (result.capture or {}).get("usage_error")
    if message:
        raise UsageError(message)


def check_target(options: RunOptions) -> None:
    if options.is_module:
        import importlib.util

        try:
            spec = importlib.util.find_spec(options.target)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise UsageError(f"no module named {options.target!r}")
        return
    path = Path(options.target)
    if not path.exists():
        raise UsageError(f"can't open file {options.target!r}: no such file")
    if path.is_dir():
        raise UsageError(f"{options.target!r} is a directory, not a Python script")


def output_path(options: RunOptions) -> Path:
    if options.output:
        path = Path(options.output)
        if path.exists():
            raise UsageError(
                f"-o/--output: {path} already exists (oomdoc never overwrites a snapshot)"
            )
        if path.is_dir():
            raise UsageError(f"-o/--output: {path} is a directory")
        return path
    return default_snapshot_path(options.target)


def build_snapshot(options: RunOptions, capture: dict | None, exit_code: int) -> dict:
    """The snapshot document: the child's capture plus what only the parent knows."""
    device = device_of(capture, options.device)
    command = (
        ["-m", options.target, *options.args]
        if options.is_module
        else [options.target, *options.args]
    )
    document = {
        "schema_version": SCHEMA_VERSION,
        "oomdoc_version": oomdoc.__version__,
        "created_at": utc_now(),
        "command": command,
        "cwd": os.getcwd(),
        "python": sys.version.split()[0],
        "torch_version": (capture or {}).get("torch_version") or installed_torch_version(),
        "options": {
            "device": device,
            "capacity_bytes": options.capacity_bytes,
            "max_steps": options.max_steps,
        },
    }
    if capture is None:
        # The child died before it could write anything (killed, crashed).
        document.update(
            {
                "device": {
                    "kind": "cuda" if device == "cuda" else "simulated",
                    "name": "unknown",
                    "capacity_bytes": int(options.capacity_bytes or 0),
                },
                "outcome": "interrupted" if exit_code in (130, 137, 143) else "error",
                "exit_code": int(exit_code),
                "oom": None,
                "breakdown": {
                    c: 0
                    for c in ("parameters", "gradients", "optimizer_state", "activations", "other")
                },
                "breakdown_at": "none",
                "steps": [],
                "top_allocations": [],
                "notes": [
                    "The script's process ended without writing its capture (it was killed or crashed)."
                ],
            }
        )
    else:
        document.update(capture)
        document["exit_code"] = int(exit_code)
    document.setdefault("fixes", [])
    document.setdefault("max_batch_size", None)
    return document


def installed_torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def child_request(options: RunOptions, device: str, **extra) -> ChildRequest:
    """The child run of the script that `options` describe (`extra`: the
    ChildRequest fields a caller sets itself, e.g. artifact_dir, extra_env)."""
    return ChildRequest(
        target=options.target,
        args=list(options.args),
        device=device,
        capacity_bytes=options.capacity_bytes,
        is_module=options.is_module,
        max_steps=options.max_steps,
        **extra,
    )


def run_session(options: RunOptions, stderr=None) -> int:
    if options.extra.get("distributed") is not None:  # torchrun job: oomdoc.distributed
        from oomdoc.distributed.session import run_distributed_session

        return run_distributed_session(options, stderr)
    stderr = stderr or sys.stderr
    # Arguments are checked before torch is imported: a usage error is quick.
    check_device_choice(options.device)
    check_target(options)
    path = output_path(options)
    artifact_dir = path.parent / (path.stem + ".files")
    # The child resolves `--device auto` itself: the parent never imports torch.
    request = child_request(options, options.device, artifact_dir=str(artifact_dir))
    pool = None
    if options.replay:
        from oomdoc.replay.orchestrate import warm_pool

        # The first replay's child starts (and imports torch) while the
        # script runs: most runs that get here end in the OOM they are about.
        pool = warm_pool(request)
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
        document = build_snapshot(options, result.capture, result.exit_code)

        if document["outcome"] == "oom" and options.replay and result.capture is not None:
            from oomdoc.replay.orchestrate import replay_fixes

            replay_fixes(document, options, request, stderr=stderr, pool=pool)
    finally:
        if pool is not None:
            pool.close()

    remove_if_empty(artifact_dir)
    write_snapshot(document, path)
    print(report.render_text(document, snapshot_path=str(path)), file=stderr, end="")
    return result.exit_code


def remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()  # only when nothing was saved there
    except OSError:
        pass
