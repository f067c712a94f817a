"""Unit tests of the replay pieces that need no child process: option
checks, command-line rewriting, ranking, the fixes table, progress lines,
which blocks checkpointing wraps, snapshot validation of fixes."""

from __future__ import annotations

import io
import os

import pytest
import torch.nn as nn
from adapters import (
    best_pair,
    not_applied,
    plan,
    rank_fixes,
    render_markdown,
    render_text,
    sharding_estimate,
)

from oomdoc.capture.tracker import checkpoint_targets
from oomdoc.errors import UsageError
from oomdoc.replay import orchestrate, search
from oomdoc.replay.batch_args import find_batch_arg, with_batch_size
from oomdoc.replay.plan import check_replay_options
from oomdoc.replay.progress import Progress
from oomdoc.script_flags import BATCH_FLAGS, LONG_BATCH_FLAGS, batch_flags
from oomdoc.snapshot import SnapshotError, validate

MiB = 1024**2


def test_fix_names():
    assert check_replay_options("autocast, checkpointing", None, None, True) == [
        "autocast",
        "checkpointing",
    ]
    assert check_replay_options("checkpointing+autocast", None, None, True) == [
        "checkpointing+autocast"
    ]
    assert check_replay_options(None, 5.0, "--micro-bs", True) is None
    with pytest.raises(UsageError, match="unknown fix"):
        check_replay_options("autocast,fp8", None, None, True)
    with pytest.raises(UsageError, match="not a combination"):
        check_replay_options("empty_cache+expandable_segments+autocast", None, None, True)


@pytest.mark.parametrize(
    "args,flag,expected",
    [
        (["--batch-size", "64", "--steps", "4"], None, (1, "--batch-size", 64)),
        (["--bs=32"], None, (0, "--bs", 32)),
        (
            ["--per_device_train_batch_size", "8", "--batch_size", "16"],
            None,
            (3, "--batch_size", 16),
        ),
        (["-b", "12"], "-b", (1, "-b", 12)),
        (["--batch-size", "auto"], None, None),
        (["--steps", "4"], None, None),
    ],
)
def test_find_batch_arg(args, flag, expected):
    assert find_batch_arg(args, flag) == expected


@pytest.mark.parametrize("flag", LONG_BATCH_FLAGS)
def test_every_long_batch_flag_of_the_one_list_is_found(flag):
    assert find_batch_arg(["--steps", "3", flag, "8"]) == (3, flag, 8)
    assert find_batch_arg([f"{flag}=8"]) == (0, flag, 8)


@pytest.mark.parametrize(
    "args, expected",
    [
        # minGPT's CfgNode: `--section.key=value` only
        (["--trainer.max_iters=4", "--trainer.batch_size=64"], (1, "--trainer.batch_size", 64)),
        (["--data.train-batch-size", "32"], (1, "--data.train-batch-size", 32)),
        (["--model.micro_batch_size=4", "--lr=1"], (0, "--model.micro_batch_size", 4)),
        # an evaluation's batch, a key that is not a batch, a value that is not a number
        (["--val.batch_size=8", "--eval.data.batch_size=8"], None),
        (["--trainer.batch_sizes=8", "--trainer.batch_size=auto", "--.batch_size=2"], None),
        # Hydra's overrides: `key=value` only, `+`-prefixed to add a key
        (["experiment=tiny", "data.batch_size=64"], (1, "data.batch_size", 64)),
        (["batch_size=64", "trainer.max_epochs=1"], (0, "batch_size", 64)),
        (["++data.train_batch_size=16"], (0, "++data.train_batch_size", 16)),
        (["data.batch_size", "64"], None),  # an override is never `key value`
        (["val.batch_size=8", "data.batch_size=auto", "data..batch_size=8"], None),
    ],
)
def test_a_nested_configuration_s_batch_flag_is_found(args, expected):
    from oomdoc.model import Snapshot
    from oomdoc.replay.batch_args import find_nested_batch_arg, find_search_batch
    from oomdoc.script_flags import spelled

    assert find_nested_batch_arg(args) == expected
    if expected is not None:
        # The search finds it when no known flag is there, and writes it as it was given.
        snapshot = Snapshot.from_dict({"command": ["train.py", *args]})
        assert find_search_batch(args, None, snapshot) == expected
        assert spelled(expected[1], 3) == f"{expected[1]}=3"


def test_one_list_of_batch_flags_for_the_search_the_units_and_the_help():
    """The batch search, the framework units and `oomdoc run --help` read
    the same list (issue 27: two lists disagreed, 4 flags against 8)."""
    import typer.main

    from oomdoc.cli import app
    from oomdoc.frameworks import base

    assert getattr(base, "BATCH_FLAGS", BATCH_FLAGS) is BATCH_FLAGS
    assert not hasattr(orchestrate, "BATCH_FLAGS") and not hasattr(search, "BATCH_FLAGS")
    assert {"-b", "--batch_size", "--batch-size", "--bs", "--train_batch_size"} <= set(BATCH_FLAGS)
    assert {"--per_device_train_batch_size", "--micro_batch_size"} <= set(BATCH_FLAGS)
    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    (batch_arg,) = [param for param in run.params if "--batch-arg" in param.opts]
    assert all(flag in batch_arg.help for flag in BATCH_FLAGS), batch_arg.help


@pytest.mark.parametrize(
    "args", [["-b", "64"], ["-b64"], ["-b=64"], ["--batch-size", "64"], ["--batch-size=64"]]
)
def test_a_short_batch_flag_the_script_declares_is_found_in_every_form(args):
    """imagenet's `-b/--batch-size`: all that argparse takes is found, and
    rewritten in its own form."""
    flags = batch_flags(["-b", "--batch-size", "--lr"], {"-b": "--batch-size"})
    position, flag, value = find_batch_arg(["--lr", "0.1", *args], None, flags)
    assert value == 64 and flag in ("-b", "--batch-size")
    rewritten = with_batch_size(["--lr", "0.1", *args], position, flag, 8)
    assert rewritten == ["--lr", "0.1", *[arg.replace("64", "8") for arg in args]]


def test_a_short_flag_counts_only_for_a_batch_size():
    assert "-b" not in batch_flags(["-b", "--bits"], {"-b": "--bits"})
    assert "-b" not in batch_flags([], {})
    assert "-b" in batch_flags(["-b"], {})
    assert "-B" in batch_flags(["-B", "--batch_size"], {"-B": "--batch_size"})
    assert (
        find_batch_arg(["-b", "4"], None, batch_flags(["-b", "--bits"], {"-b": "--bits"})) is None
    )


def test_with_batch_size_keeps_the_form():
    assert with_batch_size(["--bs=32", "x"], 0, "--bs", 7) == ["--bs=7", "x"]
    assert with_batch_size(["--batch-size", "64"], 1, "--batch-size", 20) == ["--batch-size", "20"]


def fix(name, fits, peak, saved=None):
    return {"name": name, "fits": fits, "peak_allocated_bytes": peak, "saved_bytes": saved}


def test_ranking_fits_first_then_costs_then_saving():
    ranked = rank_fixes(
        [
            fix("smaller_batch", True, 39 * MiB, 7 * MiB),
            fix("autocast", True, 25 * MiB, 21 * MiB),
            fix("lighter_optimizer", False, 41 * MiB),
            fix("checkpointing", True, 14 * MiB, 32 * MiB),
            fix("expandable_segments", True, 30 * MiB, 16 * MiB),
            fix("autocast+checkpointing", True, 9 * MiB, 37 * MiB),
        ]
    )
    assert [f["name"] for f in ranked] == [
        "expandable_segments",
        "checkpointing",
        "autocast",
        "autocast+checkpointing",
        "smaller_batch",
        "lighter_optimizer",
    ]
    assert [f["rank"] for f in ranked] == [1, 2, 3, 4, 5, 6]


def test_best_pair_is_the_lowest_compatible_pair():
    candidates = [
        fix("autocast", True, 25 * MiB),
        fix("checkpointing", True, 14 * MiB),
        fix("empty_cache", False, 41 * MiB),
    ]
    assert best_pair(candidates) == ("checkpointing", "autocast")
    assert best_pair([fix("autocast", True, 1)]) is None


def test_not_applied_reasons():
    assert "no repeated blocks" in not_applied("checkpointing", {"checkpointing": {"wrapped": []}})
    assert "already" in not_applied(
        "autocast", {"autocast": {"regions": 0, "already_enabled": True}}
    )
    assert (
        not_applied(
            "autocast+checkpointing",
            {"autocast": {"regions": 2}, "checkpointing": {"wrapped": [{}]}},
        )
        is None
    )


def failing_document(**overrides):
    document = {
        "device": {"kind": "simulated", "capacity_bytes": 40 * MiB},
        "oom": {
            "step": 0,
            "phase": "forward",
            "allocated_bytes": 39 * MiB,
            "requested_bytes": 2 * MiB,
            "reserved_bytes": 39 * MiB,
        },
        "breakdown": {
            "parameters": 1 * MiB,
            "gradients": 0,
            "optimizer_state": 0,
            "activations": 38 * MiB,
            "other": 0,
        },
        "models": [
            {
                "class": "MLP",
                "parameters_bytes": MiB,
                "repeated_blocks": [{"path": "blocks", "class": "B", "count": 8}],
            }
        ],
        "optimizers": ["AdamW"],
    }
    document.update(overrides)
    return document


def test_plan_skips_what_cannot_help_with_a_reason():
    chosen, skipped = plan(failing_document(), None)
    assert chosen == ["smaller_batch", "autocast", "checkpointing"]
    reasons = {s["name"]: s["reason"] for s in skipped}
    assert "CUDA only" in reasons["empty_cache"] and "CUDA only" in reasons["expandable_segments"]
    assert "before the first optimizer step" in reasons["lighter_optimizer"]
    later = failing_document(
        oom={**failing_document()["oom"], "step": 1},
        steps=[{"index": 0, "optimizer_steps": 1}, {"index": 1}],
    )
    reasons = {entry["name"]: entry["reason"] for entry in plan(later, None)[1]}
    assert "small share" in reasons["lighter_optimizer"]
    # Asked for by name, a lighter optimizer is measured anyway.
    assert plan(failing_document(), ["lighter_optimizer"])[0] == ["lighter_optimizer"]
    # On CUDA with large optimizer state and fragmentation, all six are tried.
    cuda = failing_document(
        device={"kind": "cuda", "capacity_bytes": 16 * 1024 * MiB, "supports_bf16": True},
        breakdown={
            "parameters": 900 * MiB,
            "gradients": 900 * MiB,
            "optimizer_state": 1800 * MiB,
            "activations": 0,
            "other": 0,
        },
        oom={
            "step": 1,
            "phase": "forward",
            "allocated_bytes": 15 * 1024 * MiB,
            "requested_bytes": 2 * MiB,
            "reserved_bytes": 15 * 1024 * MiB + 900 * MiB,
        },
        steps=[{"index": 0, "optimizer_steps": 1}, {"index": 1}],
    )
    assert len(plan(cuda, None)[0]) == 6
    # The same OOM in the first forward, before the optimizer held any state:
    # a lighter optimizer's replay would fail at the same point.
    first_forward = {**cuda, "oom": {**cuda["oom"], "step": 0}, "steps": [{"index": 0}]}
    first_forward["breakdown"] = {**cuda["breakdown"], "gradients": 0, "optimizer_state": 0}
    chosen, skipped = plan(first_forward, None)
    assert "lighter_optimizer" not in chosen
    reason = {entry["name"]: entry["reason"] for entry in skipped}["lighter_optimizer"]
    assert "before the first optimizer step" in reason
    assert "lighter_optimizer" in plan(first_forward, ["lighter_optimizer"])[0]
    no_blocks = failing_document(
        models=[{"class": "Net", "parameters_bytes": 1, "repeated_blocks": []}]
    )
    assert "checkpointing" not in plan(no_blocks, None)[0]


def test_sharding_estimate():
    estimate = sharding_estimate({"parameters": 100, "gradients": 100, "optimizer_state": 200})
    assert estimate["zero1_optimizer_state"] == {"2": 100, "4": 150, "8": 175}
    assert estimate["fsdp_full_shard"]["2"] == 200


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())


def test_checkpoint_targets_are_the_outermost_repeated_blocks():
    targets = {
        path: (name, len(blocks), composite)
        for path, _c, name, blocks, composite in checkpoint_targets(Model())
    }
    assert targets == {"blocks": ("Block", 3, True), "head": ("Linear", 2, False)}
    root = nn.Sequential(*(Block() for _ in range(4)))
    assert [t[0] for t in checkpoint_targets(root)] == [""]
    assert checkpoint_targets(nn.Linear(2, 2)) == []


def test_progress_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    progress = Progress(stream)
    assert not progress.interactive
    progress.start("autocast")
    progress.finish("fits, peak 1 MiB")
    assert stream.getvalue().startswith("oomdoc: replay 1: autocast: fits, peak 1 MiB (")


def test_progress_spinner_on_a_terminal():
    stream = io.StringIO()
    progress = Progress(stream, interactive=True)
    progress.start("checkpointing")
    progress.finish("fits")
    text = stream.getvalue()
    assert "\r" in text and "replay 1: checkpointing" in text and text.endswith("s)\n")


def document_with_fixes():
    return {
        "device": {"kind": "simulated", "name": "sim", "capacity_bytes": 40 * MiB},
        "outcome": "oom",
        "oom": {
            "step": 0,
            "phase": "forward",
            "requested_bytes": 1,
            "allocated_bytes": 1,
            "reserved_bytes": 1,
            "message": "",
            "location": None,
        },
        "breakdown": {
            c: 0 for c in ("parameters", "gradients", "optimizer_state", "activations", "other")
        },
        "steps": [],
        "top_allocations": [],
        "fixes": [
            {
                "name": "checkpointing",
                "rank": 1,
                "fits": True,
                "peak_allocated_bytes": 14 * MiB,
                "saved_bytes": 32 * MiB,
                "step_time_ratio": 1.31,
                "detail": "checkpointed 8 x Block in blocks",
                "snippet": "x = checkpoint(block, x)",
                "outcome": "fits",
                "measured": True,
            },
            {
                "name": "lighter_optimizer",
                "rank": 2,
                "fits": False,
                "peak_allocated_bytes": 41 * MiB,
                "saved_bytes": None,
                "step_time_ratio": None,
                "detail": "ran out of memory",
                "snippet": "",
                "outcome": "oom",
                "measured": True,
            },
        ],
        "max_batch_size": 1755,
        "replay": {
            "replays": 6,
            "total_s": 50.0,
            "max_steps": 2,
            "baseline_need_bytes": 46 * MiB,
            "baseline_need_estimated": True,
            "batch_search": {"original_batch_size": 2048},
            "skipped": [{"name": "empty_cache", "reason": "CUDA only"}],
        },
    }


def test_fixes_table_text_and_markdown():
    document = document_with_fixes()
    text = render_text(document)
    assert "Fixes, measured by replaying the failing step" in text
    assert "checkpointing" in text and "69.6%" in text and "1.31x" in text and "> 41.00 MiB" in text
    assert "46.00 MiB (ESTIMATE from the batch-size model)" in text
    assert "Largest batch size that fits: 1755 (measured: 1756 ran out of memory)" in text
    assert "not tried: empty_cache: CUDA only" in text
    assert text.index("rank") < text.index("    x = checkpoint(block, x)")
    markdown = render_markdown(document)
    lines = markdown.splitlines()
    header = lines[lines.index("### Fixes, measured by replaying the failing step") + 1]
    assert header.startswith("|") and "rank" in header and "% of need" in header
    assert "```python\nx = checkpoint(block, x)\n```" in markdown


def test_snapshot_validation_of_fixes():
    document = document_with_fixes()
    document.update(
        schema_version=1,
        oomdoc_version="0",
        created_at="t",
        torch_version="2",
        command=["x.py"],
        exit_code=1,
    )
    validate(document)
    document["fixes"][0]["fits"] = "yes"
    with pytest.raises(SnapshotError, match="fits"):
        validate(document)
    document["fixes"][0]["fits"] = True
    document["fixes"][0]["step_time_ratio"] = "fast"
    with pytest.raises(SnapshotError, match="step_time_ratio"):
        validate(document)


# ------------------------------------------------ children share compiled bytecode


def _package(tmp_path, compiled: bool):
    package = tmp_path / "site" / "torchlike"
    package.mkdir(parents=True)
    origin = package / "__init__.py"
    origin.write_text("x = 1\n")
    if compiled:
        import py_compile

        py_compile.compile(str(origin))
    return str(origin)


def test_children_that_cannot_write_bytecode_share_a_cache_of_oomdocs(tmp_path):
    from oomdoc.runner import bytecode_cache_env

    origin = _package(tmp_path, compiled=False)
    cache = tmp_path / "cache"
    env = bytecode_cache_env({"PYTHONDONTWRITEBYTECODE": "1"}, origin=origin, cache_root=str(cache))
    assert env == {"PYTHONPYCACHEPREFIX": str(cache)} and cache.is_dir()


def test_bytecode_is_left_alone_when_it_is_there_or_can_be_written(tmp_path):
    from oomdoc.runner import bytecode_cache_env

    compiled = _package(tmp_path / "a", compiled=True)
    assert (
        bytecode_cache_env(
            {"PYTHONDONTWRITEBYTECODE": "1"}, origin=compiled, cache_root=str(tmp_path / "c")
        )
        == {}
    )
    uncompiled = _package(tmp_path / "b", compiled=False)
    assert (
        bytecode_cache_env({}, origin=uncompiled, cache_root=str(tmp_path / "c")) == {}
    )  # Python writes it itself
    chosen = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/somewhere"}
    assert bytecode_cache_env(chosen, origin=uncompiled, cache_root=str(tmp_path / "c")) == {}
    assert not (tmp_path / "c").exists()


def test_child_env_drops_dont_write_bytecode_only_with_a_cache(tmp_path, monkeypatch):
    from oomdoc import warm

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(
        warm, "bytecode_cache_env", lambda env: {"PYTHONPYCACHEPREFIX": str(tmp_path)}
    )
    env = warm.child_env("cpu", {})
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"] == str(tmp_path)
    monkeypatch.setattr(warm, "bytecode_cache_env", lambda env: {})
    assert warm.child_env("cpu", {})["PYTHONDONTWRITEBYTECODE"] == "1"


def test_the_parent_never_imports_torch():
    # `oomdoc run` and `check` leave torch to the children: seconds saved per run.
    import subprocess
    import sys

    code = (
        "import sys, oomdoc.cli, oomdoc.session, oomdoc.runner, oomdoc.check, oomdoc.replay.orchestrate;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("forks", ["0", "1"])
def test_an_unused_warm_child_is_ended_at_once(monkeypatch, forks):
    """Closing the pool does not wait for a spare to finish importing torch:
    a child of its own is killed; a fork the server has not made yet (it is
    still importing) ends once made, killed or finding its pipe closed, and
    the server ends after it."""
    import signal

    from oomdoc.runner import WarmPool

    monkeypatch.setenv("OOMDOC_FORKS", forks)
    pool = WarmPool("cpu", {"OOMDOC_REPLAY": "1"}, size=2)
    pool.fill()
    spares = list(pool.spares)
    assert len(spares) == 2
    pool.close()
    assert pool.spares == [] and not os.path.exists(pool.log_dir)
    if forks == "0":
        assert all(spare.process.returncode == -signal.SIGKILL for spare in spares)
        return
    assert pool._server is not None
    assert pool._server.process.wait(timeout=60) == 0
    assert all(spare.process.wait(timeout=5) in (0, -signal.SIGKILL) for spare in spares)


ACCUMULATION_CHECK = """
import json, torch, torch.nn as nn
from oomdoc.fixes.smaller_batch import accumulate

record = {}
accumulate(3, record)
seen = {}

# A plain loop: zero_grad first, step last.
model = nn.Linear(2, 1, bias=False)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)  # wraps the step of the instance
grads, updates = [], 0
for _ in range(7):
    before = model.weight.detach().clone()
    optimizer.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    grads.append(model.weight.grad[0, 0].item())
    optimizer.step()
    scheduler.step()
    updates += int(not torch.equal(before, model.weight))
seen["loop"] = [grads, updates, dict(record)]

# Lightning's way: optimizer.step(closure), zero_grad between forward and backward.
model = nn.Linear(2, 1, bias=False)
optimizer = torch.optim.AdamW(model.parameters())
grads = []

def closure():
    loss = model(torch.ones(1, 2)).sum()
    model.zero_grad()
    loss.backward()
    grads.append(model.weight.grad[0, 0].item())
    return loss

losses = [optimizer.step(closure) is not None for _ in range(5)]
seen["closure"] = [grads, losses, len(optimizer.state), dict(record)]
print(json.dumps(seen))
"""


def test_the_replays_gradient_accumulation_holds_steps_and_zero_grads_back():
    """smaller_batch's accumulation in the child: only every third step call
    of an optimizer updates; the gradients add up in between, the loop's zero_grad (or one
    inside a Lightning closure) clears them only when a cycle begins, and a
    held-back closure still runs its forward and backward."""
    import json

    from conftest import run_python

    completed = run_python(ACCUMULATION_CHECK)
    assert completed.returncode == 0, completed.stderr[-2000:]
    seen = json.loads(completed.stdout)
    grads, updates, record = seen["loop"]
    assert grads == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0]
    assert updates == 2
    assert record == {"accumulation_steps": 3, "optimizer_steps": 2, "held_back_steps": 5}
    # The loop's optimizer left one call held back: a new optimizer counts
    # its own calls (a GAN's two update each every third of theirs), and
    # the loop's held-back call keeps no other model's zero_grad back.
    grads, losses, state, record = seen["closure"]
    assert grads == [1.0, 2.0, 3.0, 1.0, 2.0]
    assert all(losses) and state == 1
    assert record["optimizer_steps"] == 3


def test_replay_imports_nothing_of_distributed():
    """One direction (issue 27): oomdoc.distributed runs the replays (handing
    replay_fixes its launcher), so no module of oomdoc.replay imports
    oomdoc.distributed, not even lazily or under TYPE_CHECKING."""
    import ast
    import pathlib

    import oomdoc.replay

    offending = []
    for path in sorted(pathlib.Path(oomdoc.replay.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offending += [
                f"{path.name}: {name}" for name in names if name.startswith("oomdoc.distributed")
            ]
    assert offending == []


def test_a_batch_source_from_the_command_line_is_told_from_the_dataloader():
    """Replays, snippets and the own flags write the batch the search found
    on the command line, in its form: a flag, a nested flag or an override."""
    from oomdoc.frameworks.base import with_option
    from oomdoc.script_flags import from_command_line, spelled

    for source in ("-b", "--batch-size", "--trainer.batch_size", "data.batch_size", "+batch_size"):
        assert from_command_line(source), source
    for source in ("DataLoader", ""):  # the DataLoaders; none
        assert not from_command_line(source), source
    assert spelled("data.batch_size", 8) == "data.batch_size=8"
    assert with_option(["data.batch_size=64"], "data.batch_size", "8") == ["data.batch_size=8"]
    assert with_option(["x=1"], "+trainer.accumulate_grad_batches", "2") == [
        "x=1",
        "+trainer.accumulate_grad_batches=2",
    ]


def test_batch_arg_names_a_flag_or_a_dotted_override_key():
    """`--batch-arg data.bs`: a Hydra override's key the known batch keys do
    not cover; a bare word is taken for a flag missing its dashes."""
    from oomdoc.errors import UsageError
    from oomdoc.model import Snapshot
    from oomdoc.replay.batch_args import find_search_batch
    from oomdoc.replay.plan import check_replay_options
    from oomdoc.script_flags import from_command_line

    for name in ("--micro-batch", "-b", "data.bs", "+data.bs"):
        check_replay_options(None, None, name, True)
    for name in ("batch", "-", "--bs=4", "data..bs"):
        with pytest.raises(UsageError, match="is not an option name"):
            check_replay_options(None, None, name, True)
    args = ["experiment=x", "data.bs=64"]
    snapshot = Snapshot.from_dict({"command": ["train.py", *args]})
    assert find_search_batch(args, "data.bs", snapshot) == (1, "data.bs", 64)
    assert from_command_line("data.bs") and not from_command_line("DataLoader")


def test_an_exception_chain_is_walked_afresh_and_holds_nothing():
    """frames.exception_chain once sat under is_user_file's lru_cache: a
    second walk of the same exception found it exhausted, the cache kept the
    script's exceptions (and their frames) alive, and is_user_file, on the
    allocator's hot path, lost its cache."""
    from oomdoc import frames

    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError("outer") from inner
    except ValueError as outer:
        failure = outer
    first = [type(e).__name__ for e in frames.exception_chain(failure, limit=8)]
    assert first == ["ValueError", "KeyError"]
    assert [type(e).__name__ for e in frames.exception_chain(failure, limit=8)] == first
    assert not hasattr(frames.exception_chain, "cache_info")
    assert hasattr(frames.is_user_file, "cache_info")
