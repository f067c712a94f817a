"""Distributed jobs (torchrun): launch every rank under capture, merge the
ranks' captures into one job document, and diagnose it rank by rank.

Torch-free (each rank's own part, oomdoc.capture.parallel, runs in the rank):
the parent starts `python -m torch.distributed.run` as a subprocess and
never imports torch itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from oomdoc.errors import UsageError

# Seconds oomdoc waits, after the first rank of a job ends badly (or after
# Ctrl-C / SIGTERM reaches oomdoc), for the launcher to end the job on its own
# before it terminates every process of the job itself.
DEFAULT_RANK_TIMEOUT_S = 60.0
# The `{rank}` and `{local_rank}` in a rank's result path and artifact folder
# are filled in by each rank's process from the environment torchrun sets.
RANK_FIELDS = ("rank", "local_rank")

# torchrun options that take no value (everything else before the script
# takes one, unless written as --option=value).
TORCHRUN_FLAGS = {
    "--standalone",
    "-m",
    "--module",
    "--no-python",
    "--no_python",
    "--run-path",
    "--run_path",
    "--virtual-local-rank",
    "--virtual_local_rank",
}
# The options oomdoc knows by name (both spellings torchrun accepts).
TORCHRUN_NAMED = {
    "--nproc-per-node": "nproc_per_node",
    "--nproc_per_node": "nproc_per_node",
    "--nnodes": "nnodes",
    "--node-rank": "node_rank",
    "--node_rank": "node_rank",
    "--master-addr": "master_addr",
    "--master_addr": "master_addr",
    "--master-port": "master_port",
    "--master_port": "master_port",
    "--rdzv-backend": "rdzv_backend",
    "--rdzv_backend": "rdzv_backend",
    "--rdzv-endpoint": "rdzv_endpoint",
    "--rdzv_endpoint": "rdzv_endpoint",
    "--rdzv-id": "rdzv_id",
    "--rdzv_id": "rdzv_id",
}


@dataclass
class DistOptions:
    """How `oomdoc run` launches a job through torch.distributed.run."""

    nproc_per_node: int
    nnodes: str | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    standalone: bool = False
    # Other torchrun options, passed through as given (e.g. --max-restarts 0).
    launcher_args: list[str] = field(default_factory=list)
    rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S

    @property
    def single_node(self) -> bool:
        return self.nnodes in (None, "1", "1:1")

    def launcher_options(self, master_port: int | None) -> list[str]:
        """torchrun's options for this job (`master_port`: the port chosen
        when none was given)."""
        options = ["--nproc-per-node", str(self.nproc_per_node)]
        for name in ("nnodes", "node_rank", "master_addr", "rdzv_backend", "rdzv_endpoint"):
            value = getattr(self, name)
            if value is not None:
                options += ["--" + name.replace("_", "-"), str(value)]
        if self.rdzv_id is not None:
            options += ["--rdzv-id", self.rdzv_id]
        port = self.master_port if self.master_port is not None else master_port
        if port is not None:
            options += ["--master-port", str(port)]
        if self.standalone:
            options.append("--standalone")
        return options + list(self.launcher_args)

    def as_dict(self) -> dict:
        return asdict(self)


def check_dist_options(dist: DistOptions) -> None:
    if dist.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, not {dist.nproc_per_node}")
    if not dist.rank_timeout_s > 0:
        raise UsageError(
            f"--rank-timeout must be a positive number of seconds, not {dist.rank_timeout_s:g}"
        )
    if dist.node_rank is not None and dist.node_rank < 0:
        raise UsageError(f"--node-rank must be 0 or more, not {dist.node_rank}")
    if dist.master_port is not None and not 0 < dist.master_port < 65536:
        raise UsageError(f"--master-port must be a TCP port (1-65535), not {dist.master_port}")


def is_launcher_command(target: str, is_module: bool) -> bool:
    """`oomdoc run torchrun ...` or `oomdoc run -m torch.distributed.run ...`."""
    if is_module:
        return target in ("torch.distributed.run", "torch.distributed.launch")
    return target == "torchrun"


def parse_launcher_command(
    target: str, args: list[str], is_module: bool, rank_timeout_s: float | None = None
) -> tuple[str, list[str], bool, DistOptions]:
    """Translate `torchrun [OPTIONS] SCRIPT ARGS` (or `-m torch.distributed.run
    ...`) into (script, args, is_module, DistOptions): the same job, launched
    by oomdoc through torch.distributed.run with each rank under capture."""
    if is_module and target == "torch.distributed.launch":
        raise UsageError(
            "torch.distributed.launch is deprecated and not supported: use torchrun (or oomdoc run --nproc-per-node N)"
        )
    named: dict = {}
    passthrough: list[str] = []
    script_is_module = False
    standalone = False
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("-") or arg == "-":
            break
        name, has_value, value = arg.partition("=")
        if name in ("-m", "--module"):
            script_is_module = True
        elif name in ("--no-python", "--no_python"):
            raise UsageError(
                "torchrun --no-python: oomdoc runs Python scripts only (each rank runs under oomdoc's capture)"
            )
        elif name == "--standalone":
            standalone = True
        elif name in TORCHRUN_FLAGS:
            passthrough.append(arg)
        else:
            if not has_value:
                if index + 1 >= len(args):
                    raise UsageError(f"{target}: option {name} needs a value")
                index += 1
                value = args[index]
            if name in TORCHRUN_NAMED:
                named[TORCHRUN_NAMED[name]] = value
            else:
                passthrough += [name, value]
        index += 1
    if index >= len(args):
        raise UsageError(f"{target}: no training script given")
    script, script_args = args[index], list(args[index + 1 :])
    dist = dist_options_from(named, standalone, passthrough, rank_timeout_s)
    return script, script_args, script_is_module, dist


def dist_options_from(
    named: dict, standalone: bool, passthrough: list[str], rank_timeout_s: float | None
) -> DistOptions:
    def as_int(key: str):
        value = named.get(key)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise UsageError(f"--{key.replace('_', '-')} must be an integer, not {value!r}")

    nproc = named.get("nproc_per_node", "1")
    if not str(nproc).isdigit():
        raise UsageError(
            f"--nproc-per-node {nproc}: oomdoc needs a number of processes (gpu/cpu/auto are not supported)"
        )
    dist = DistOptions(
        nproc_per_node=int(nproc),
        nnodes=named.get("nnodes"),
        node_rank=as_int("node_rank"),
        master_addr=named.get("master_addr"),
        master_port=as_int("master_port"),
        rdzv_backend=named.get("rdzv_backend"),
        rdzv_endpoint=named.get("rdzv_endpoint"),
        rdzv_id=named.get("rdzv_id"),
        standalone=standalone,
        launcher_args=passthrough,
    )
    if rank_timeout_s is not None:
        dist.rank_timeout_s = rank_timeout_s
    check_dist_options(dist)
    return dist


def launch_from_cli(
    target: str, args: list[str], is_module: bool, rank_timeout_s: float | None = None, **named
) -> tuple[str, list[str], bool, DistOptions | None]:
    """`oomdoc run`'s launch options (`named`: nproc_per_node, nnodes, ...
    as given, None when not) and a `torchrun ...` / `-m torch.distributed.run
    ...` command, as (script, args, is_module, DistOptions or None)."""
    import os

    given = {key: value for key, value in named.items() if value is not None}
    if is_launcher_command(target, is_module) and not (not is_module and os.path.exists(target)):
        if given:
            raise UsageError(
                f"give the launch options either to oomdoc run or to {target}, not to both"
            )
        return parse_launcher_command(target, args, is_module, rank_timeout_s)
    if not given:
        if rank_timeout_s is not None:
            raise UsageError("--rank-timeout needs --nproc-per-node (a distributed job)")
        return target, args, is_module, None
    if "nproc_per_node" not in given:
        raise UsageError("--nnodes, --node-rank, --master-addr, ... need --nproc-per-node N")
    dist = DistOptions(**given)
    if rank_timeout_s is not None:
        dist.rank_timeout_s = rank_timeout_s
    check_dist_options(dist)
    return target, args, is_module, dist
