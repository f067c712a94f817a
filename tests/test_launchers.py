"""Every launcher's ranks are capped and captured as ranks of one job
(issue 25, item 4), end to end on the simulated device:

- Lightning's `ddp` strategy: rank 0 is the script's own process, Lightning
  starts rank 1 by running the script again (`python train.py ARGS`);
- a launcher called inside the script, as accelerate's `accelerate launch`
  does: torch.distributed.run's elastic agent starts every rank as
  `python -u train.py ARGS` and trains nothing itself;
- Lightning's `ddp_spawn` strategy and accelerate's `notebook_launcher`
  (torch.multiprocessing's start_processes: spawned, and forked by the
  elastic agent);
- `multiprocessing.Process` children that join the process group (spawn and
  fork), beside a data-preparation process that stays uncaptured.

torchrun (`--nproc-per-node`) and torch.multiprocessing.spawn have their own
tests (test_distributed, test_corpus_e2e)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import SCRIPTS, run_capped, two_at_a_time

LIGHTNING = SCRIPTS / "fw_lightning_trainer.py"
IN_SCRIPT = SCRIPTS / "launch_in_script.py"
DDP = SCRIPTS / "ddp_rank0_cache.py"
NOTEBOOK = SCRIPTS / "launch_notebook.py"
MP_PROCESS_DDP = SCRIPTS / "mp_process_ddp.py"
MiB = 2**20


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def assert_every_rank_capped(document: dict, capacity_bytes: int) -> None:
    """Both ranks captured, each under the cap."""
    assert document["world_size"] == 2 and [r["rank"] for r in document["ranks"]] == [0, 1]
    for entry in document["ranks"]:
        assert entry["captured"] and entry["steps"]
        assert entry["device"]["capacity_bytes"] == capacity_bytes
        assert entry["peak"]["allocated_bytes"] <= capacity_bytes


def test_lightning_ddp_ranks_are_captured_and_the_largest_batch_holds_on_both(tmp_path):
    """The largest batch of the job is the largest that fits on every rank:
    by hand, as a 2-process Lightning job under the same cap, it fits on
    both ranks and one more runs out of memory."""
    capacity = "20MiB"
    lightning = ["--devices", "2", "--strategy", "ddp"]
    completed, document = run_capped(
        tmp_path / "lightning.json",
        capacity,
        LIGHTNING,
        [*lightning, "--batch-size", "64"],
        ["--fixes", "smaller_batch"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "oom", completed.stderr[-3000:]
    assert document["world_size"] == 2 and [r["rank"] for r in document["ranks"]] == [0, 1]
    assert all(entry["steps"] for entry in document["ranks"])
    assert document["launch"] == {"launcher": "subprocess"}
    assert "with the script's own process as rank 0" in completed.stderr
    assert f"Rank {document['first_oom_rank']} ran out of memory first" in completed.stderr
    assert all(run["outcome"] in ("fits", "oom") for run in document["replay"]["runs"])
    maximum = document["max_batch_size"]
    assert maximum is not None and maximum < 64

    def by_hand(batch: int) -> dict:
        folder = tmp_path / f"by-hand-{batch}"  # its own lightning_logs
        folder.mkdir()
        _completed, plain = run_capped(
            folder / "by-hand.json",
            capacity,
            LIGHTNING,
            [*lightning, "--batch-size", str(batch)],
            ["--no-replay"],
            cwd=folder,
        )
        assert len(plain["ranks"]) == 2
        return plain

    fits, over = two_at_a_time(by_hand, [maximum, maximum + 1])
    assert [r["outcome"] for r in fits["ranks"]] == ["ok", "ok"]
    assert over["outcome"] == "oom"


LAUNCHER_KILLS_ITS_OWN_PROCESS = """
    import os, signal, subprocess, sys, threading, time
    from oomdoc.capture.relaunch import Relaunches
    from oomdoc.child_config import ChildConfig

    terms = []
    signal.signal(signal.SIGTERM, lambda *_: terms.append(1))
    relaunches = Relaunches(ChildConfig(target="train.py", result_path="c.json"), [])
    undo = relaunches.install()
    relaunches.processes.append(subprocess.Popen([sys.executable, "-c", "pass"]))

    def observer_kills():  # as Lightning's _ChildProcessObserver once a rank failed
        thread = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGKILL))
        thread.start()
        thread.join()
        time.sleep(0.2)  # the main thread runs the SIGTERM handler

    observer_kills()
    print("while the script runs:", "SIGTERM" if terms else "nothing")
    relaunches.script_ended = True
    observer_kills()
    print("once it ended:", len(terms), "SIGTERM")
    undo()
    relaunches.wait(replay=True)
"""


def test_a_launcher_killing_its_own_process_leaves_it_its_capture():
    """Lightning's ddp observer SIGKILLs the script's process once a rank
    failed: the child, still writing rank 0's capture, lost it (the job's
    ranks were [1] under load). Its kill is a SIGTERM during the script and
    nothing after it."""
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LAUNCHER_KILLS_ITS_OWN_PROCESS)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert completed.returncode == 0, (completed.returncode, completed.stderr[-2000:])
    assert completed.stdout.splitlines() == [
        "while the script runs: SIGTERM",
        "once it ended: 1 SIGTERM",
    ]


def test_ranks_started_by_a_launcher_inside_the_script_are_captured(tmp_path):
    completed, document = run_capped(
        tmp_path / "in-script.json",
        "8MiB",
        IN_SCRIPT,
        ["2", DDP, "--batch-size", "2048", "--steps", "3", "--expect-world", "2"],
        ["--no-replay"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "oom", completed.stderr[-3000:]
    assert document["world_size"] == 2 and [r["rank"] for r in document["ranks"]] == [0, 1]
    assert all(entry["device"]["capacity_bytes"] == 8 * 2**20 for entry in document["ranks"])
    assert document["spawned_ranks"] == [
        {"function": "ddp_rank0_cache.py", "nprocs": 2, "launcher": "subprocess"}
    ]
    assert "with the script's own process" not in completed.stderr  # it trained nothing
    assert f"Rank {document['first_oom_rank']} ran out of memory first" in completed.stderr


def test_lightning_ddp_spawn_ranks_are_captured(tmp_path):
    """Lightning's `ddp_spawn` hands the model to its processes through
    shared memory: they start under oomdoc, and each is a capped rank."""
    completed, document = run_capped(
        tmp_path / "ddp-spawn.json",
        "20MiB",
        LIGHTNING,
        ["--devices", "2", "--strategy", "ddp_spawn", "--batch-size", "64"],
        ["--no-replay"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "oom", completed.stderr[-3000:]
    assert_every_rank_capped(document, 20 * MiB)
    assert document["spawned_ranks"][0]["nprocs"] == 2
    assert f"Rank {document['first_oom_rank']} ran out of memory first" in completed.stderr


def test_accelerate_notebook_launcher_ranks_are_captured(tmp_path):
    """notebook_launcher forks its ranks through torch's elastic agent, with
    the script's function wrapped in the agent's: each is a capped rank,
    named by the script's function."""
    completed, document = run_capped(
        tmp_path / "notebook.json",
        "6MiB",
        NOTEBOOK,
        ["--batch-size", "2048", "--port", free_port()],
        ["--no-replay"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "oom", completed.stderr[-3000:]
    assert_every_rank_capped(document, 6 * MiB)
    assert document["spawned_ranks"] == [{"function": "training_function", "nprocs": 2}]
    assert f"Rank {document['first_oom_rank']} ran out of memory first" in completed.stderr


@pytest.mark.parametrize("start_method, function", [("spawn", "TrainerProcess"), ("fork", "train")])
def test_processes_that_join_the_process_group_are_captured_as_ranks(
    tmp_path, start_method, function
):
    """The script starts two DDP ranks (a Process subclass's `run`, or a
    function) and a data-preparation process with multiprocessing.Process:
    the ranks are capped and captured, the data process (no process group)
    is named, not capped. (The spawn start method with a function: the test
    below.)"""
    subclass = ["--as-subclass"] if function == "TrainerProcess" else []
    completed, document = run_capped(
        tmp_path / "processes.json",
        "8MiB",
        MP_PROCESS_DDP,
        ["--batch-size", "4096", "--start-method", start_method, "--port", free_port()] + subclass,
        ["--no-replay"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "oom", completed.stderr[-3000:]
    assert_every_rank_capped(document, 8 * MiB)
    assert document["launch"] == {"launcher": "multiprocessing.Process"}
    assert document["spawned_ranks"] == [
        {"function": function, "nprocs": 2, "launcher": "multiprocessing.Process"}
    ]
    assert document["uncaptured_processes"] == [
        {"function": "prepare_data", "count": 1, "launcher": "multiprocessing.Process"}
    ]
    assert f"Rank {document['first_oom_rank']} ran out of memory first" in completed.stderr


def test_process_ranks_end_together_when_one_finished(tmp_path):
    """With a step limit, rank 1 ends after its steps while rank 0 would
    stall for 10 minutes: oomdoc stops rank 0 within seconds, and both
    finished (rank 0 ended with its peer, where it was)."""
    completed, document = run_capped(
        tmp_path / "together.json",
        "64MiB",
        MP_PROCESS_DDP,
        ["--steps", "2", "--rank0-final-stall", "600", "--start-method", "spawn"]
        + ["--port", free_port()],
        ["--no-replay", "--max-steps", "2"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "ok", completed.stderr[-3000:]
    by_rank = {entry["rank"]: entry for entry in document["ranks"]}
    assert by_rank[0]["ended_with_peers"] and by_rank[0]["stopped_by"] == "SIGTERM"
    assert by_rank[0]["waiting_at"]["function"] == "train"
    assert not by_rank[1]["ended_with_peers"]
    assert all(entry["outcome"] == "ok" and len(entry["steps"]) == 2 for entry in by_rank.values())


def test_a_tensor_moves_to_shared_memory_under_the_simulated_device():
    """torch.multiprocessing hands CPU tensors to its processes through shared
    memory (Lightning's ddp_spawn passes the model so): under the simulated
    device's dispatch mode torch's own check of that move failed; now it
    moves, keeps its values, and the device counts the same bytes."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch

    from oomdoc.capture import shared_memory
    from oomdoc.capture.backends import SimulatedBackend

    backend = SimulatedBackend(1 << 30)
    backend.install(None)
    undo = shared_memory.install()
    try:
        weights = torch.arange(4096, dtype=torch.float32)
        counted = backend.allocated_bytes()
        weights.share_memory_()
        ForkingPickler(io.BytesIO()).dump(torch.ones(256))  # as a process's argument
        assert weights.is_shared() and weights[-1].item() == 4095.0
        assert backend.allocated_bytes() >= counted >= weights.nbytes
    finally:
        undo()
        backend.uninstall()
