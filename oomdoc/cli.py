"""The `oomdoc` command line. Thin: parse, call, print.

Usage errors are one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated, List, Optional

import typer

from oomdoc.errors import UsageError
from oomdoc.reporters import REPORTERS, formats_rendering
from oomdoc.script_flags import listed
from oomdoc.sizes import parse_size
from oomdoc.snapshot import SnapshotError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    help="oomdoc: the out-of-memory doctor for PyTorch.",
)


def _print_version(value: bool) -> None:
    if value:
        import oomdoc

        print(f"oomdoc {oomdoc.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print oomdoc's version and exit.",
    ),
) -> None:
    """oomdoc: the out-of-memory doctor for PyTorch."""


# Everything after SCRIPT belongs to the script, even --help or --output.
PASS_THROUGH = {"allow_interspersed_args": False, "ignore_unknown_options": True}


def size_option(value: Optional[str], flag: str) -> Optional[int]:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def check_script_token(target: str, command: str = "run") -> None:
    if target.startswith("-") and target != "-":
        raise UsageError(
            f"no such option: {target} (options go before SCRIPT; see oomdoc {command} --help)"
        )


# The options shared by every command that runs a script (run, check), declared
# once so that their names, defaults and help stay the same everywhere.
ScriptArgument = Annotated[
    str, typer.Argument(metavar="SCRIPT", help="The training script (or, with -m, a module).")
]
ScriptArgs = Annotated[
    Optional[List[str]], typer.Argument(metavar="[ARGS]...", help="Passed to the script untouched.")
]
ModuleFlag = Annotated[
    bool, typer.Option("-m", help="Run SCRIPT as a module, as `python -m` does.")
]
DeviceOption = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="auto|cuda|cpu",
        help="auto (CUDA when available), cuda, or cpu (the simulated device).",
    ),
]
DeviceMemoryOption = Annotated[
    Optional[str],
    typer.Option(
        "--device-memory",
        metavar="SIZE",
        help="Cap the device: 512MiB, 16GiB, 1.5GB or bytes. On CUDA a per-process memory fraction; on CPU the simulated device's capacity.",
    ),
]


def script_run_options(
    command: str,
    target: str,
    args: Optional[List[str]],
    module: bool,
    device: str,
    device_memory: Optional[str],
    **extra,
):
    """The RunOptions of a command that runs SCRIPT, from the shared options."""
    from oomdoc.runner import RunOptions

    check_script_token(target, command)
    return RunOptions(
        target=target,
        args=list(args or []),
        is_module=module,
        device=device,
        capacity_bytes=size_option(device_memory, "--device-memory"),
        **extra,
    )


@app.command(context_settings=PASS_THROUGH)
def run(
    target: ScriptArgument,
    args: ScriptArgs = None,
    module: ModuleFlag = False,
    device: DeviceOption = "auto",
    device_memory: DeviceMemoryOption = None,
    output: Optional[str] = typer.Option(
        None,
        "-o",
        "--output",
        metavar="PATH",
        help="Where to write the snapshot (default .oomdoc/<script>-<UTC time>.json).",
    ),
    max_steps: Optional[int] = typer.Option(
        None,
        "--max-steps",
        min=1,
        metavar="N",
        help="Stop the script cleanly (exit 0) after N training steps.",
    ),
    no_replay: bool = typer.Option(
        False, "--no-replay", help="Do not replay the failing step with fixes."
    ),
    first_batches: bool = typer.Option(
        False,
        "--first-batches",
        help=(
            "Replay the data as it comes, not the longest batches first and the script's "
            "evaluation (faster; no whole-run certificate)."
        ),
    ),
    fixes: Optional[str] = typer.Option(
        None, "--fixes", metavar="a,b", help="Only try these fixes (comma-separated)."
    ),
    replay_timeout: Optional[float] = typer.Option(
        None,
        "--replay-timeout",
        metavar="SECONDS",
        help="Kill a replay that runs longer than this.",
    ),
    replay_jobs: Optional[int] = typer.Option(
        None,
        "--replay-jobs",
        metavar="N",
        help="Replays that may run side by side (their timed steps still run one at a time); default: from the machine's cores and memory.",
    ),
    batch_arg: Optional[str] = typer.Option(
        None,
        "--batch-arg",
        metavar="FLAG",
        help=(
            f"The script's batch-size flag, if not one of {listed()} "
            "(or a Hydra override's dotted key: data.bs)."
        ),
    ),
    html: Optional[str] = typer.Option(
        None,
        "--html",
        metavar="PATH",
        help="Also write the report as one self-contained HTML page (never overwritten).",
    ),
    margin: str = typer.Option(
        "auto",
        "--margin",
        metavar="PERCENT",
        help=(
            "Safety margin the prescribed configuration leaves free, as a share of the capacity; "
            "auto: measured (the allocator's overhead and its growth over the steps, at least 2%)."
        ),
    ),
    # A distributed job through torch.distributed.run (oomdoc.distributed).
    nproc_per_node: Optional[int] = typer.Option(
        None,
        "--nproc-per-node",
        metavar="N",
        help="Run SCRIPT as a torchrun job of N ranks per node, every rank under capture.",
    ),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="torchrun --nnodes."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="torchrun --node-rank."),
    master_addr: Optional[str] = typer.Option(
        None, "--master-addr", help="torchrun --master-addr."
    ),
    master_port: Optional[int] = typer.Option(
        None, "--master-port", help="torchrun --master-port (default: a free port on one node)."
    ),
    rdzv_backend: Optional[str] = typer.Option(
        None, "--rdzv-backend", help="torchrun --rdzv-backend."
    ),
    rdzv_endpoint: Optional[str] = typer.Option(
        None, "--rdzv-endpoint", help="torchrun --rdzv-endpoint."
    ),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="torchrun --rdzv-id."),
    rank_timeout: Optional[float] = typer.Option(
        None,
        "--rank-timeout",
        metavar="SECONDS",
        help="End the job this long after its first rank failed (default 60).",
    ),
) -> int:
    """Run SCRIPT under oomdoc: catch and explain an OOM, and measure fixes."""
    from oomdoc.distributed import launch_from_cli
    from oomdoc.replay.orchestrate import check_replay_options
    from oomdoc.session import run_session

    fix_names = check_replay_options(
        fixes, replay_timeout, batch_arg, replay=not no_replay, replay_jobs=replay_jobs
    )
    target, args, module, distributed = launch_from_cli(
        target,
        list(args or []),
        module,
        rank_timeout,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
    )
    options = script_run_options(
        "run",
        target,
        args,
        module,
        device,
        device_memory,
        output=output,
        max_steps=max_steps,
        replay=not no_replay,
        whole_run=not first_batches,
        fixes=fix_names,
        replay_timeout_s=replay_timeout,
        replay_jobs=replay_jobs,
        batch_arg=batch_arg,
        margin_fraction=margin_option(margin),
        html_path=new_file_option(html, "--html"),
        distributed=distributed,
    )
    return run_session(options)


def margin_option(text: str) -> float | None:
    """`--margin 5%` (or 0.05): a share of the capacity below 50%; `auto`:
    None, measured from the failing run."""
    stripped = text.strip()
    if stripped.lower() == "auto":
        return None
    try:
        value = float(stripped[:-1]) / 100 if stripped.endswith("%") else float(stripped)
    except ValueError:
        raise UsageError(f"--margin: {text!r} is not a percentage (e.g. 5%) or auto") from None
    if not 0 <= value < 0.5:
        raise UsageError(f"--margin: {text!r} must be at least 0% and below 50%")
    return value


# Every registered reporter of a snapshot: a new format needs no edit here.
SUGGEST_FORMATS = tuple(formats_rendering("snapshot"))


def new_file_option(path: Optional[str], flag: str) -> Optional[str]:
    """A file oomdoc will write: refused before anything runs when it exists
    (nothing the user had is overwritten) or cannot be written."""
    from oomdoc.output_paths import check_output_file

    return check_output_file(path, flag)


@app.command()
def suggest(
    snapshot: List[str] = typer.Argument(
        ...,
        metavar="SNAPSHOT...",
        help="An oomdoc snapshot (.json), or PyTorch's memory snapshot (the _dump_snapshot() pickle, or _snapshot() saved as JSON). Several snapshots, or a directory of them: the ranks of one distributed job, merged.",
    ),
    output_format: str = typer.Option(
        "table",
        "--format",
        metavar="|".join(SUGGEST_FORMATS),
        help=", ".join(f"{name} ({REPORTERS[name].summary})" for name in SUGGEST_FORMATS) + ".",
    ),
    top: int = typer.Option(
        5, "--top", metavar="N", min=1, help="Show at most N fixes and allocation sites."
    ),
    output: Optional[str] = typer.Option(
        None,
        "-o",
        "--output",
        metavar="PATH",
        help="Write the report to PATH (never overwritten) instead of stdout.",
    ),
) -> int:
    """Diagnose a saved snapshot offline: what filled the device, why, and the fixes."""
    from oomdoc.suggest import run_suggest

    if output_format not in SUGGEST_FORMATS:
        raise UsageError(
            f"--format must be one of {', '.join(SUGGEST_FORMATS)}, not {output_format!r}"
        )
    return run_suggest(
        snapshot[0] if len(snapshot) == 1 else snapshot,
        output_format,
        top,
        output=new_file_option(output, "-o/--output"),
    )


@app.command(context_settings=PASS_THROUGH)
def check(
    target: ScriptArgument,
    args: ScriptArgs = None,
    baseline: str = typer.Option(
        ...,
        "--baseline",
        metavar="FILE",
        help="The baseline JSON to compare with (written by --update-baseline).",
    ),
    tolerance: str = typer.Option(
        "5%",
        "--tolerance",
        metavar="5%|256MiB",
        help="How much each quantity may grow: a percentage of its baseline value, or a size.",
    ),
    steps: int = typer.Option(
        3, "--steps", min=1, metavar="N", help="Training steps to run before stopping the script."
    ),
    update_baseline: bool = typer.Option(
        False,
        "--update-baseline",
        help="Write (or refresh) the baseline from this run instead of failing on growth.",
    ),
    junit: Optional[str] = typer.Option(
        None,
        "--junit",
        metavar="FILE",
        help="Also write the comparison as JUnit XML (replaced if it exists).",
    ),
    html: Optional[str] = typer.Option(
        None,
        "--html",
        metavar="PATH",
        help="Also write the run's report as one HTML page (a CI artifact; never overwritten).",
    ),
    whole_run: bool = typer.Option(
        False,
        "--whole-run",
        help=(
            "Gate the run's worst case: DataLoaders yield their longest batches first and the "
            "script's evaluation runs after the steps; fail when something is not covered."
        ),
    ),
    module: ModuleFlag = False,
    device: DeviceOption = "auto",
    device_memory: DeviceMemoryOption = None,
) -> int:
    """Gate memory regressions: run SCRIPT for a few steps and compare its peak
    memory, overall and per category, with a baseline file.

    oomdoc's options go before SCRIPT; everything after SCRIPT is passed to the
    script. Exit status 0 within tolerance, 1 on growth beyond it, an OOM or a
    failed script, 2 on a usage error.
    """
    from oomdoc.check import CheckOptions, run_check
    from oomdoc.output_paths import check_output_file
    from oomdoc.sizes import parse_tolerance

    try:
        fraction, absolute_bytes = parse_tolerance(tolerance)
    except ValueError as exc:
        raise UsageError(f"--tolerance: {exc}") from None
    options = CheckOptions(
        run=script_run_options(
            "check", target, args, module, device, device_memory, max_steps=steps
        ),
        baseline_path=baseline,
        tolerance_fraction=fraction,
        tolerance_bytes=absolute_bytes,
        tolerance_text=tolerance.strip(),
        update_baseline=update_baseline,
        junit_path=check_output_file(junit, "--junit", replace=True),
        html_path=new_file_option(html, "--html"),
        whole_run=whole_run,
    )
    return run_check(options)


def _click_exception_types() -> tuple[
    tuple[type[BaseException], ...], tuple[type[BaseException], ...]
]:
    """Usage-error and abort classes of click, and of the copy of click that
    newer typer releases vendor as `typer._click`."""
    usage_errors: list[type[BaseException]] = []
    aborts: list[type[BaseException]] = []
    for module_name in ("click.exceptions", "typer._click.exceptions"):
        try:
            module = __import__(module_name, fromlist=["UsageError"])
        except ImportError:
            continue
        usage_errors.append(module.UsageError)
        abort = getattr(module, "Abort", None) or getattr(__import__("typer"), "Abort", None)
        if abort is not None:
            aborts.append(abort)
    return tuple(usage_errors), tuple(aborts)


def plain_help(command) -> None:
    """Help in the words of the usage line: `SCRIPT [ARGS]...` rather than
    typer's `{SCRIPT} [[ARGS]...]...`, and an option's value named (`N`,
    `DEVICE`) rather than its Python type (`<int range>`, `<str>`)."""
    for sub in getattr(command, "commands", {}).values():
        plain_help(sub)
    for param in getattr(command, "params", []):
        if param.param_type_name == "argument":
            name = param.metavar or param.name.upper()
            param._usage_display_name = lambda name=name: name
            param._rich_display_name = lambda name=name: name
            param.display_type_rich = lambda ctx=None: None
        elif not getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = param.name.upper()


def main(argv: Optional[List[str]] = None) -> None:
    click_usage_errors, click_aborts = _click_exception_types()
    command = typer.main.get_command(app)
    plain_help(command)
    try:
        status = command.main(args=argv, prog_name="oomdoc", standalone_mode=False)
    except click_usage_errors as exc:
        lines = (getattr(exc, "format_message", lambda: "")() or str(exc)).splitlines()
        if lines:  # empty when click already printed the help (bare `oomdoc`)
            print(f"oomdoc: error: {lines[0]}", file=sys.stderr)
        sys.exit(2)
    except (UsageError, SnapshotError) as exc:
        print(f"oomdoc: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except click_aborts:
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(status if isinstance(status, int) else 0)
