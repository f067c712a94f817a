"""Distributed jobs end to end: torchrun, gloo, 2 ranks on the simulated device
(each rank has its own capacity). Every run is bounded by a timeout."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO_ROOT, SCRIPTS, load_json, oomdoc_env, run_oomdoc

from oomdoc.child_config import ChildConfig
from oomdoc.diagnosis.distributed import data_parallel, rank_imbalance
from oomdoc.distributed import DistOptions, launch_from_cli
from oomdoc.distributed.launch import free_port
from oomdoc.distributed.merge import merge_rank_captures
from oomdoc.errors import UsageError
from oomdoc.model import Snapshot, parse
from oomdoc.snapshot import read_snapshot

DDP = SCRIPTS / "ddp_rank0_cache.py"
SCRIPT_LINES = DDP.read_text().splitlines()
# Bounded: a job that hangs fails the test instead of the suite.
JOB_TIMEOUT = 120


def ddp_replay(tmp_path, log_name: str, *args: str, **fields):
    """A 2-step replay of the DDP script as a 2-rank job (run_distributed_child's
    request), its output in `log_name`."""
    from oomdoc.runner import ChildRequest

    return ChildRequest(
        target=str(DDP),
        args=["--steps", "2", *args, "--expect-world", "2"],
        device="cpu",
        max_steps=2,
        output_path=str(tmp_path / log_name),
        timeout_s=JOB_TIMEOUT,
        **fields,
    )


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(SCRIPT_LINES, 1) if text in line)


CACHE_LINE = line_of("history.append(torch.ones(")
ALL_REDUCE_LINE = line_of("dist.all_reduce(logged)")
STALL_LINE = line_of("time.sleep(args.rank0_stall)")


def imbalance_args(output, *extra):
    """Rank 0 keeps 8 MiB per step on a 32 MiB device: it runs out of memory
    in step 3 while rank 1 waits for it in the logging all_reduce."""
    return [
        "run",
        "--device",
        "cpu",
        "--device-memory",
        "32MiB",
        "--no-replay",
        "-o",
        output,
        *extra,
        DDP,
        "--steps",
        "8",
        "--rank0-cache",
        "8",
    ]


@pytest.fixture(scope="module")
def imbalance_job(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("imbalance")
    snapshot = workdir / "job.json"
    started = time.monotonic()
    result = run_oomdoc(
        imbalance_args(snapshot, "--nproc-per-node", "2"), cwd=workdir, timeout=JOB_TIMEOUT
    )
    print(f"imbalance job: {time.monotonic() - started:.1f} s")
    return result, read_snapshot(snapshot)


def test_rank0_oom_ends_the_job_with_status_1(imbalance_job):
    result, document = imbalance_job
    assert result.returncode == 1, result.stderr[-3000:]
    assert document["world_size"] == 2
    assert [entry["rank"] for entry in document["ranks"]] == [0, 1]
    assert document["first_oom_rank"] == 0 and document["primary_rank"] == 0
    # The top level is rank 0's: every single-process reader sees its OOM.
    assert document["outcome"] == "oom"
    assert document["oom"]["location"]["line"] == CACHE_LINE
    assert document["oom"]["requested_bytes"] == 8 * 2**20
    rank0, rank1 = document["ranks"]
    assert rank0["outcome"] == "oom" and rank0["oom"]["time"] is not None
    assert rank0["device"]["capacity_bytes"] == 32 * 2**20
    assert rank1["device"]["capacity_bytes"] == 32 * 2**20  # a capacity per rank
    assert rank1["outcome"] in ("error", "interrupted")
    assert rank1["steps"] and rank0["steps"]


def test_a_ranks_peak_is_what_it_held_not_what_it_needed(imbalance_job):
    """Issue 26, item 13: the ranks table's peak never exceeds the capacity;
    at an OOM it is what the rank held, and the last column says how much
    more it needed."""
    from oomdoc.model import Snapshot
    from oomdoc.reporters.ranks import rank_rows
    from oomdoc.sizes import format_bytes

    _, document = imbalance_job
    rank0 = document["ranks"][0]
    held = max(rank0["peak"]["allocated_bytes"], rank0["oom"]["allocated_bytes"])
    assert held <= rank0["device"]["capacity_bytes"]
    row = rank_rows(Snapshot.from_dict(document))[0]
    assert row[3] == format_bytes(held)
    assert row[-1] == "needs 8.00 MiB more"


def test_the_waiting_rank_says_where_it_waited(imbalance_job):
    result, document = imbalance_job
    waiting = document["ranks"][1]["waiting_at"]
    assert waiting["collective"] == "all_reduce"
    assert waiting["file"].endswith("ddp_rank0_cache.py")
    assert waiting["line"] == ALL_REDUCE_LINE
    assert "Rank 0 ran out of memory first" in result.stderr
    assert f"Rank 1 was waiting in all_reduce at {DDP}:{ALL_REDUCE_LINE}" in result.stderr


def test_rank_imbalance_names_rank_0(imbalance_job):
    result, document = imbalance_job
    diagnosis = rank_imbalance(parse(Snapshot, document))
    assert diagnosis is not None
    assert diagnosis["summary"].startswith("Rank 0 holds")
    assert any(
        line.startswith("held per rank at step ") and ": rank 0" in line
        for line in diagnosis["evidence"]
    )
    # the cache rank 0 alone keeps: 8 MiB a step, 3 steps before the OOM
    assert diagnosis["bytes"] >= 16 * 2**20
    assert "rank_imbalance: Rank 0 holds" in result.stderr
    assert data_parallel(parse(Snapshot, document)) is None


def test_launch_runs_the_script_as_each_rank(tmp_path):
    """`-m torch.distributed.run` is translated: each rank is the capture
    child running the script as __main__ with the script's own argv."""
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "-o",
            tmp_path / "argv.json",
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            SCRIPTS / "dist_env.py",
            "--output",
            "x",
            "--nproc-per-node",
            "7",
        ],
        cwd=tmp_path,
        timeout=JOB_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    infos = [
        json.loads(line.split("RANKINFO=", 1)[1])
        for line in result.stdout.splitlines()
        if "RANKINFO=" in line
    ]
    assert sorted(info["RANK"] for info in infos) == ["0", "1"]
    for info in infos:
        assert info["argv"] == [
            str(SCRIPTS / "dist_env.py"),
            "--output",
            "x",
            "--nproc-per-node",
            "7",
        ]
        assert info["name"] == "__main__" and info["WORLD_SIZE"] == "2"
    document = read_snapshot(tmp_path / "argv.json")
    assert document["world_size"] == 2 and document["outcome"] == "ok"
    assert sorted(entry["rank"] for entry in document["ranks"]) == [0, 1]
    assert document["options"]["distributed"]["nproc_per_node"] == 2
    assert not (tmp_path / "x").exists()


def test_sigterm_to_oomdoc_stops_every_rank_with_its_capture(tmp_path):
    """Rank 0 stalls in step 1 while rank 1 blocks in the all_reduce (inside
    gloo, where Python signal handlers do not run): SIGTERM to oomdoc still
    gets both ranks' captures, and rank 1 says where it waited."""
    snapshot = tmp_path / "stopped.json"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oomdoc",
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "64MiB",
            "--nproc-per-node",
            "2",
            "-o",
            str(snapshot),
            str(DDP),
            "--steps",
            "3",
            "--rank0-stall",
            "300",
        ],
        cwd=tmp_path,
        env=oomdoc_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        for line in process.stdout:  # rank 0 prints after step 0's all_reduce
            if line.startswith("step 0:") or time.monotonic() > deadline:
                break
        time.sleep(2.0)  # into step 1: rank 0 sleeps, rank 1 waits
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=JOB_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, err[-3000:]
    document = read_snapshot(snapshot)
    rank0, rank1 = document["ranks"]
    assert rank0["outcome"] == rank1["outcome"] == "interrupted"
    assert rank0["waiting_at"]["line"] == STALL_LINE and rank0["waiting_at"]["collective"] is None
    assert rank1["waiting_at"]["line"] == ALL_REDUCE_LINE
    assert rank1["waiting_at"]["collective"] == "all_reduce"
    assert rank1["stopped_by"] == "SIGTERM"


def test_a_rank_that_ignores_sigterm_is_killed_after_the_rank_timeout(tmp_path):
    snapshot = tmp_path / "killed.json"
    result = run_oomdoc(
        imbalance_args(snapshot, "--nproc-per-node", "2", "--rank-timeout", "2")
        + ["--rank1-ignores-sigterm"],
        cwd=tmp_path,
        timeout=JOB_TIMEOUT,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    document = read_snapshot(snapshot)
    rank0, rank1 = document["ranks"]
    assert rank0["outcome"] == "oom" and document["first_oom_rank"] == 0
    assert rank1["captured"] is False and rank1["outcome"] == "no_capture"
    assert any("Rank 1 (local rank 1) left no capture" in note for note in document["notes"])
    assert any("oomdoc ended the job itself" in note for note in document["notes"])


def test_two_nodes_write_their_ranks_and_suggest_merges_them(tmp_path):
    """Two `oomdoc run` (one per node, here on one machine) each write their
    rank's snapshot; suggest merges several files, or a directory, into one job."""
    port = str(free_port())
    nodes = tmp_path / "nodes"
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oomdoc",
                *imbalance_args(
                    nodes / f"node{node}.json",
                    "--nproc-per-node",
                    "1",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    port,
                ),
            ],
            cwd=tmp_path,
            env=oomdoc_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        errors = [process.communicate(timeout=JOB_TIMEOUT)[1] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    assert processes[0].returncode == 1, errors[0][-3000:]
    assert processes[1].returncode != 0, errors[1][-3000:]
    node0 = load_json(nodes / "node0.json")
    assert [entry["rank"] for entry in node0["ranks"]] == [0] and node0["world_size"] == 2

    by_files = run_oomdoc(
        ["suggest", nodes / "node1.json", nodes / "node0.json"], timeout=JOB_TIMEOUT
    )
    by_directory = run_oomdoc(["suggest", "--format", "json", nodes], timeout=JOB_TIMEOUT)
    assert by_files.returncode == 0, by_files.stderr
    assert by_directory.returncode == 0, by_directory.stderr
    assert "Rank 0 ran out of memory first" in by_files.stdout
    assert "rank_imbalance: Rank 0 holds" in by_files.stdout
    assert "Rank 1 was waiting in all_reduce" in by_files.stdout

    merged = merge_rank_captures([load_json(nodes / "node1.json"), node0])
    assert merged["world_size"] == 2 and [e["rank"] for e in merged["ranks"]] == [0, 1]
    assert merged["first_oom_rank"] == 0 and merged["outcome"] == "oom"
    assert merged["oom"]["location"]["line"] == CACHE_LINE
    assert rank_imbalance(parse(Snapshot, merged))["summary"].startswith("Rank 0 holds")


def test_replays_keep_the_world_size(tmp_path):
    """Batch 2048 per rank does not fit 8 MiB per rank: the replays run as
    2-rank jobs (the script refuses any other world size) and find the
    largest batch per rank exactly."""
    snapshot = tmp_path / "replayed.json"
    started = time.monotonic()
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "8MiB",
            "--nproc-per-node",
            "2",
            "--fixes",
            "smaller_batch",
            "-o",
            snapshot,
            DDP,
            "--steps",
            "3",
            "--batch-size",
            "2048",
            "--expect-world",
            "2",
        ],
        cwd=tmp_path,
        timeout=600,
    )
    print(f"replayed job: {time.monotonic() - started:.1f} s")
    assert result.returncode == 1, result.stderr[-3000:]
    document = read_snapshot(snapshot)
    assert document["world_size"] == 2 and document["outcome"] == "oom"
    search = document["replay"]["batch_search"]
    assert search["exact"] is True and document["max_batch_size"] == search["max_batch_size"]
    maximum = document["max_batch_size"]
    assert 1 <= maximum < 2048
    assert [maximum, True] in search["trials"] and [maximum + 1, False] in search["trials"]
    assert all(run["outcome"] in ("fits", "oom") for run in document["replay"]["runs"])


# ---------------------------------------------------------------- no processes


def test_torchrun_commands_are_translated():
    target, args, module, dist = launch_from_cli(
        "torchrun",
        ["--nproc_per_node=2", "--max-restarts", "0", "--standalone", "train.py", "--lr", "1"],
        False,
    )
    assert (target, args, module) == ("train.py", ["--lr", "1"], False)
    assert dist.nproc_per_node == 2 and dist.standalone
    assert dist.launcher_args == ["--max-restarts", "0"]
    target, args, module, dist = launch_from_cli(
        "torch.distributed.run", ["--nnodes", "2", "--nproc-per-node", "4", "-m", "pkg.train"], True
    )
    assert (target, args, module, dist.nnodes) == ("pkg.train", [], True, "2")
    assert launch_from_cli("train.py", ["--x"], False) == ("train.py", ["--x"], False, None)
    for bad in (
        ("torchrun", ["--nproc-per-node", "2"], False, {}),
        ("torchrun", ["--no-python", "x.sh"], False, {}),
        ("train.py", [], False, {"nnodes": "2"}),
        ("torchrun", ["train.py"], False, {"nproc_per_node": 2}),
        ("train.py", [], False, {"nproc_per_node": 0}),
    ):
        with pytest.raises(UsageError):
            launch_from_cli(*bad[:3], **bad[3])


def test_merge_picks_the_first_oom_by_time_and_marks_missing_ranks():
    def capture(rank, outcome, peak, oom_time=None):
        return {
            "rank": {"rank": rank, "local_rank": rank, "world_size": 3},
            "outcome": outcome,
            "exit_code": 1 if outcome != "ok" else 0,
            "oom": {"step": 1, "phase": "forward", "allocated_bytes": peak, "requested_bytes": 1}
            if outcome == "oom"
            else None,
            "oom_time": oom_time,
            "breakdown": {"activations": peak},
            "peak": {"allocated_bytes": peak},
            "steps": [],
        }

    merged = merge_rank_captures(
        [capture(0, "oom", 100, oom_time=20.0), capture(1, "oom", 90, oom_time=10.0)],
        missing=[{"rank": 2, "local_rank": 2, "node_rank": 0}],
    )
    assert merged["first_oom_rank"] == 1 and merged["primary_rank"] == 1
    assert merged["oom"]["allocated_bytes"] == 90 and merged["world_size"] == 3
    assert merged["ranks"][2]["captured"] is False
    fitted = merge_rank_captures([capture(0, "ok", 10), capture(1, "ok", 30)])
    assert fitted["primary_rank"] == 1 and fitted["first_oom_rank"] is None
    assert fitted["outcome"] == "ok"


def _job(*entries, first_oom_rank=None) -> Snapshot:
    return parse(Snapshot, {"ranks": list(entries), "first_oom_rank": first_oom_rank})


def _rank(rank, *phase_peaks, oom=None):
    """A rank whose step i held phase_peaks[i] ({phase: bytes})."""
    steps = [{"index": i, "phase_peaks": peaks} for i, peaks in enumerate(phase_peaks)]
    return {
        "rank": rank,
        "captured": True,
        "outcome": "oom" if oom else "ok",
        "steps": steps,
        "oom": oom,
    }


def test_rank_imbalance_needs_ten_percent_at_the_same_step_and_phase():
    even = {"forward": 100, "backward": 100}
    assert rank_imbalance(_job(_rank(0, {"forward": 109}), _rank(1, {"forward": 100}))) is None
    found = rank_imbalance(
        _job(
            _rank(0, even, even),
            _rank(1, even, {"forward": 100, "backward": 112}),
            _rank(2, even, even),
        )
    )
    assert found["kind"] == "rank_imbalance" and found["summary"].startswith("Rank 1 holds")
    assert "(1, backward)" in found["summary"] and found["bytes"] == 12
    # 50% more during setup, but a small share of the job's peak: no word.
    setup = {"setup": 10, "forward": 100}
    assert rank_imbalance(_job(_rank(0, setup), _rank(1, {**setup, "setup": 15}))) is None


def test_rank_imbalance_compares_only_moments_every_rank_had():
    """Evaluation on rank 0 alone at iteration 0 (nanoGPT) is no imbalance:
    rank 1 has no such moment; at the moments both had they hold the same."""
    step0 = {"forward": 100, "backward": 120}
    rank0 = _rank(0, {**step0, "evaluation": 500}, step0)
    assert rank_imbalance(_job(rank0, _rank(1, step0, step0))) is None


def test_rank_imbalance_never_contradicts_the_first_oom():
    """Rank 0 holds more at its OOM's moment, but rank 1 ran out of memory
    first: the imbalance is not what ended the job (issue 25, item 3); the
    OOM's need (held + request) is never counted as held."""
    oom0 = {"step": 0, "phase": "backward", "allocated_bytes": 150, "requested_bytes": 10_000}
    oom1 = {"step": 0, "phase": "backward", "allocated_bytes": 100, "requested_bytes": 40}
    ranks = (_rank(0, {"forward": 90}, oom=oom0), _rank(1, {"forward": 90}, oom=oom1))
    assert rank_imbalance(_job(*ranks, first_oom_rank=1)) is None
    found = rank_imbalance(_job(*ranks, first_oom_rank=0))
    assert found["bytes"] == 50 and "rank 0 150 bytes, rank 1 100 bytes" in found["evidence"][0]


def test_dist_options_command_line():
    dist = DistOptions(nproc_per_node=2, master_addr="10.0.0.1", rdzv_id="job")
    options = dist.launcher_options(12345)
    assert options[:2] == ["--nproc-per-node", "2"]
    assert options[options.index("--master-addr") + 1] == "10.0.0.1"
    assert options[options.index("--master-port") + 1] == "12345"
    assert options[options.index("--rdzv-id") + 1] == "job"


def test_data_parallel_is_seen_in_a_single_process_run(tmp_path):
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--no-replay",
            "-o",
            tmp_path / "dp.json",
            SCRIPTS / "data_parallel_cpu.py",
        ],
        cwd=tmp_path,
        timeout=JOB_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = read_snapshot(tmp_path / "dp.json")
    assert document["parallel"]["data_parallel"][0]["class"] == "Sequential"
    diagnosis = data_parallel(parse(Snapshot, document))
    assert diagnosis["fixes"] == ["ddp"] and "torchrun --nproc-per-node" in diagnosis["remedy"]


def test_run_distributed_child_measures_zero_optimizer_per_rank(tmp_path):
    """run_distributed_child has run_child's contract: a ZeroRedundancyOptimizer
    replay of the 2-rank job keeps about half of AdamW's state per rank (two
    tensors per parameter over two ranks: one parameter's worth)."""
    from oomdoc.distributed.launch import run_distributed_child

    request = ddp_replay(tmp_path, "zero.log", "--width", "128", fix={"name": "zero_optimizer"})
    result = run_distributed_child(request, DistOptions(nproc_per_node=2))
    assert result.exit_code == 0, (tmp_path / "zero.log").read_text()[-3000:]
    capture = result.capture
    assert capture["world_size"] == 2 and len(capture["ranks"]) == 2
    assert "AdamW" in capture["fix_applied"]["zero_optimizer"]["wrapped"]
    assert "ZeroRedundancyOptimizer" in capture["optimizers"]
    for entry in capture["ranks"]:
        parameters = entry["category_peaks"]["parameters"]
        state = entry["category_peaks"]["optimizer_state"]
        assert 0.8 * parameters <= state <= 1.2 * parameters, (parameters, state)


def test_a_replay_s_ranks_end_together(tmp_path):
    """A replay's rank 1 has ended (its steps done) while rank 0 works on
    alone for minutes (a final evaluation or checkpoint on rank 0): oomdoc
    ends rank 0 within seconds, and the replay's result is read: both ranks
    finished the replay, with their steps, not a failure or a timeout."""
    from oomdoc.distributed.launch import PEER_GRACE_S, run_distributed_child

    request = ddp_replay(tmp_path, "stall.log", "--rank0-final-stall", "600")
    result = run_distributed_child(request, DistOptions(nproc_per_node=2))
    log = (tmp_path / "stall.log").read_text()[-3000:]
    assert not result.timed_out and result.exit_code == 0, log
    assert result.wall_s < 600, log
    capture = result.capture
    assert capture["outcome"] == "ok" and len(capture["ranks"]) == 2
    by_rank = {entry["rank"]: entry for entry in capture["ranks"]}
    assert by_rank[0]["ended_with_peers"] and not by_rank[1]["ended_with_peers"]
    assert all(entry["outcome"] == "ok" and len(entry["steps"]) == 2 for entry in by_rank.values())
    assert any(f"{PEER_GRACE_S:g} s after the first rank" in note for note in capture["notes"])


def test_the_fsdp_replay_keeps_what_ddp_scripts_read(tmp_path):
    """Scripts written for DDP read `model.module`, set
    `require_backward_grad_sync` and call `no_sync()`: the FSDP2 module
    that replaces DDP in the fsdp replay has all three (gloo, one rank)."""
    script = tmp_path / "fsdp_attributes.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch, torch.distributed as dist, torch.nn as nn
            from torch.distributed.fsdp import fully_shard
            from oomdoc.fixes.sharding import keep_ddp_attributes
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
            dist.init_process_group("gloo", rank=0, world_size=1)
            model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
            for block in model:
                fully_shard(block)
            fully_shard(model)
            keep_ddp_attributes(model)
            assert model.module is model and len(list(model.modules())) == 3
            model.require_backward_grad_sync = False
            with model.no_sync():
                model(torch.randn(3, 4)).sum().backward()
            assert model.require_backward_grad_sync is False
            model.require_backward_grad_sync = True
            model(torch.randn(3, 4)).sum().backward()
            assert model[0].weight.grad is not None
            print("ok")
            dist.destroy_process_group()
            """
        )
    )
    completed = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PORT": str(free_port()), "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0 and "ok" in completed.stdout, completed.stderr[-3000:]


def test_a_sigterm_while_the_peer_s_death_is_raised_still_names_the_collective():
    # The launcher's SIGTERM lands as Terminated while the gloo error from the
    # all_reduce is being handled: the Terminated has no frame of the script.
    import torch
    import torch.distributed as dist

    from oomdoc.capture.child import Terminated
    from oomdoc.capture.parallel import ParallelCapture

    def raise_terminated():
        raise Terminated()

    line = None
    try:
        try:
            line = sys._getframe().f_lineno + 1
            dist.all_reduce(torch.zeros(1))  # no process group: raises inside torch.distributed
        except (RuntimeError, ValueError):
            raise_terminated()
    except Terminated as exc:
        failure = exc
    capture = ParallelCapture(ChildConfig(target="train.py", result_path="capture.json"))
    capture.note_failure(failure)
    assert capture.waiting_at is not None
    assert capture.waiting_at["collective"] == "all_reduce"
    assert capture.waiting_at["line"] == line

    stopped_elsewhere = ParallelCapture(ChildConfig(target="train.py", result_path="capture.json"))
    try:
        raise_terminated()
    except Terminated as exc:
        stopped_elsewhere.note_failure(exc)
    assert stopped_elsewhere.waiting_at["collective"] is None  # where it was, no collective


def test_a_collective_noted_without_the_script_s_line_is_filled_in():
    """Once in the clean-clone CI the waiting rank's first look caught a
    stack outside the script's frames: it named the all_reduce but no line,
    and that first note stood. A later look that finds the script's line
    fills it in, keeping the collective; one without a line changes nothing."""
    from oomdoc.capture.parallel import ParallelCapture

    capture = ParallelCapture(ChildConfig(target="train.py", result_path="capture.json"))
    bare = {"file": None, "line": None, "function": None, "collective": "all_reduce"}
    capture._note_waiting(bare)
    capture._note_waiting({**bare, "collective": "broadcast"})
    assert capture.waiting_at == bare
    located = {"file": "/w/train.py", "line": 42, "function": "main", "collective": None}
    capture._note_waiting(located)
    assert capture.waiting_at == {**located, "collective": "all_reduce"}
    capture._note_waiting({"file": "/w/other.py", "line": 1, "function": "f", "collective": "x"})
    assert capture.waiting_at["file"] == "/w/train.py"  # the first with a line stands


def test_ddp_gradient_buckets_are_communication_not_gradients_or_activations(tmp_path):
    """Issue 26, item 14 and issue 25, item 3: DDP's reducer builds flat
    gradient buckets when DDP is made and again at the first forward after
    the first backward; they were counted as other and as activations (8 MiB
    of "activations" for about 100 KiB real here), which drove the activation
    advice, then as gradients. They are communication buffers, a category of
    their own: each rank holds its gradients (one copy of the parameters),
    the buckets (another), and the activations are the batch's own. The
    per-rank table and the module table show the category."""
    completed = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", "512MiB", "--no-replay"]
        + ["--nproc-per-node", "2", "-o", tmp_path / "ddp.json", SCRIPTS / "ddp_rank0_cache.py"]
        + ["--width", "512", "--depth", "2", "--batch-size", "8", "--steps", "3"],
        cwd=tmp_path,
        timeout=JOB_TIMEOUT,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = read_snapshot(tmp_path / "ddp.json")
    for rank in document["ranks"]:
        peaks = rank["category_peaks"]
        assert peaks["activations"] < 1024**2, peaks
        assert peaks["gradients"] == pytest.approx(peaks["parameters"], rel=0.01), peaks
        assert peaks["communication"] == pytest.approx(peaks["parameters"], rel=0.01), peaks
        assert peaks["other"] < 1024**2, peaks
    report = completed.stderr.splitlines()
    ranks_header = report[next(i for i, line in enumerate(report) if line.startswith("Ranks ")) + 1]
    assert "communication" in ranks_header.split()
    assert any("communication" in line.split() and "module" in line for line in report)
    # The DDP advice points at the buckets, measured apart from the gradients.
    assert "communication buffers at the peak" in completed.stderr


def test_ddp_bucket_and_fsdp_buffer_blocks_are_communication_on_cuda():
    """On CUDA the category comes from a block's allocation stack: a block
    allocated while DDP builds its buckets, or in FSDP2's all-gather or
    reduce-scatter, is a communication buffer; PyTorch's own snapshots
    (oomdoc suggest) read the same stacks alike."""
    from oomdoc.capture.modules import category_of, phase_from_frames
    from oomdoc.loaders import infer_category

    distributed = "/site-packages/torch/nn/parallel/distributed.py"
    module = "/site-packages/torch/nn/modules/module.py"
    frames = [
        {"filename": distributed, "name": "_pre_forward", "line": 1775},
        {"filename": distributed, "name": "forward", "line": 1800},
        {"filename": module, "name": "_call_impl", "line": 1700},
    ]
    assert phase_from_frames(frames) == "communication"
    assert category_of(None, "communication") == "communication"
    assert category_of("gradients", "communication") == "gradients"  # known by identity wins
    assert phase_from_frames(frames[1:]) == "forward"
    assert infer_category(frames) == "communication"
    collectives = "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"
    for builder in ("foreach_all_gather", "foreach_reduce"):
        fsdp = [{"filename": collectives, "name": builder, "line": 1}, *frames[1:]]
        assert phase_from_frames(fsdp) == "communication"
        assert infer_category(fsdp) == "communication"
    copy_out = [{"filename": collectives, "name": "foreach_all_gather_copy_out", "line": 1}]
    assert phase_from_frames(copy_out + frames[1:]) == "forward"  # the gathered parameters


def test_fsdp2_collective_buffers_run_in_the_communication_phase(tmp_path, monkeypatch):
    """The simulated device's side: FSDP2's all-gather and reduce-scatter
    run in the `communication` phase (patched at install when FSDP is
    loaded, else when the script imports it: importing it up front would
    cost every run most of a second), and the patches are undone."""
    import importlib

    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group

    from oomdoc.capture import communication

    tracker = type("Tracker", (), {"phase": "backward"})()
    undo = communication.install(tracker)
    try:
        for builder in communication.FSDP_BUILDERS:
            assert getattr(group, builder).__oomdoc_communication__
    finally:
        undo()
    assert not hasattr(group.foreach_reduce, "__oomdoc_communication__")

    seen = []
    marked = communication._in_communication(tracker, lambda: seen.append(tracker.phase))
    marked()
    assert seen == ["communication"] and tracker.phase == "backward"

    # A module imported later is patched once it has run, with its own loader back.
    (tmp_path / "late_collectives.py").write_text("def foreach_reduce():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = communication._AfterImport(
        ("late_collectives",), lambda m: communication._mark_fsdp(tracker, m, [])
    )
    sys.meta_path.insert(0, finder)
    try:
        late = importlib.import_module("late_collectives")
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("late_collectives", None)
    assert late.foreach_reduce.__oomdoc_communication__ and late.foreach_reduce() == 1
    assert late.__loader__ is late.__spec__.loader and "_ThenLoader" not in repr(late.__loader__)


def test_a_job_whose_port_was_taken_is_launched_again(tmp_path):
    """free_port() finds a port, torchrun binds it a moment later: another
    process may take it between the two (seen on the H100, where a replay
    failed with EADDRINUSE before any rank ran). Such a job is launched again."""
    from oomdoc.distributed.launch import JobResult, port_was_taken
    from oomdoc.runner import ChildRequest

    log = tmp_path / "replay.log"
    log.write_text(
        "torch.distributed.DistNetworkError: ... EADDRINUSE, message: address already in use\n"
    )
    request = ChildRequest(target="train.py", args=[], device="cpu", output_path=str(log))
    failed = JobResult(exit_code=1, captures=[], missing=[], launcher_exit_code=1, wall_s=1.0)
    assert port_was_taken(failed, request, DistOptions(nproc_per_node=2))
    # The user's own port is theirs to fix; a job whose ranks ran is not retried.
    assert not port_was_taken(failed, request, DistOptions(nproc_per_node=2, master_port=29500))
    ran = JobResult(
        exit_code=1, captures=[{"outcome": "oom"}], missing=[], launcher_exit_code=1, wall_s=1.0
    )
    assert not port_was_taken(ran, request, DistOptions(nproc_per_node=2))
    log.write_text("some other failure\n")
    assert not port_was_taken(failed, request, DistOptions(nproc_per_node=2))


def test_a_rank_whose_collective_failed_after_its_peer_finished_ended_with_the_replay():
    """gloo raises at once in a rank whose peer has gone: in a replay where
    the peer finished its steps, that rank ended with the replay (its steps
    are read), not with an error. Without a finished rank nothing changes."""
    from oomdoc.distributed.launch import JobResult, finished_with_peers

    def job(*outcomes):
        captures = [
            {"outcome": "ok"}
            if outcome == "ok"
            else {
                "outcome": outcome,
                "error": {"type": "RuntimeError", "message": "Connection closed by peer"},
                "waiting_at": {"file": "train.py", "line": 9, "collective": "all_reduce"},
            }
            for outcome in outcomes
        ]
        return JobResult(
            exit_code=1, captures=captures, missing=[], launcher_exit_code=1, wall_s=1.0
        )

    finished = job("ok", "error")
    finished_with_peers(finished)
    assert finished.exit_code == 0 and finished.captures[1]["outcome"] == "ok"
    assert finished.captures[1]["ended_with_peers"] and finished.captures[1]["error"] is None
    failed = job("oom", "error")
    finished_with_peers(failed)
    assert failed.exit_code == 1 and failed.captures[1]["outcome"] == "error"


def test_a_replay_takes_the_job_started_ahead_and_a_new_one_waits(tmp_path):
    """Warm jobs: a replay's launcher and ranks started before its work is
    known import, then wait for their configuration. The replay that takes
    the spare gets run_child's contract (both ranks' captures, the launcher's
    output in its log), a new spare starts, a request with another
    environment starts cold, and closing ends the spare: nothing is left."""
    import psutil

    from oomdoc.distributed.launch import run_distributed_child
    from oomdoc.distributed.warm_jobs import WarmJobs

    dist = DistOptions(nproc_per_node=2)
    jobs = WarmJobs(dist, "cpu", {"OOMDOC_REPLAY": "1"}, ["torch.nn"])
    try:
        jobs.fill()
        first = jobs.spare
        assert first is not None and first.launcher.poll() is None
        request = ddp_replay(
            tmp_path, "warm.log", "--width", "64", extra_env={"OOMDOC_REPLAY": "1"}
        )
        other = dataclasses.replace(request, extra_env={"OOMDOC_REPLAY": "0"})
        assert not jobs.usable_for(other)
        result = run_distributed_child(request, dist, jobs)
        log = (tmp_path / "warm.log").read_text()
        assert result.exit_code == 0, log[-3000:]
        assert first.launcher.poll() is not None and not os.path.exists(first.workdir)
        assert jobs.spare is not None and jobs.spare is not first
        capture = result.capture
        assert capture["outcome"] == "ok" and len(capture["ranks"]) == 2
        assert all(len(entry["steps"]) == 2 for entry in capture["ranks"])
        assert "waited_s" in capture["timings"], capture["timings"]
        spare = jobs.spare
    finally:
        jobs.close()
    assert spare.launcher.poll() is not None and not os.path.exists(spare.workdir)
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def test_a_warm_rank_stops_waiting_when_oomdoc_is_gone(tmp_path):
    """A rank of a job started ahead waits for its configuration only while
    the oomdoc that started it lives: a killed oomdoc leaves no rank behind."""
    from oomdoc.capture.waiting import wait_for_config_file

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started = time.monotonic()
    has_work, _imported_at, _preimported = wait_for_config_file(
        str(tmp_path / "config.json"), json.dumps({"parent_pid": gone.pid})
    )
    assert not has_work and time.monotonic() - started < 30
    (tmp_path / "config.json").write_text("{}")
    has_work, _imported_at, _preimported = wait_for_config_file(
        str(tmp_path / "config.json"), json.dumps({"parent_pid": os.getpid()})
    )
    assert has_work
