"""Every launcher's ranks are capped and captured as ranks of one job
(issue 25, item 4), end to end on the simulated device:

- Lightning's `ddp` strategy: rank 0 is the script's own process, Lightning
  starts rank 1 by running the script again (`python train.py ARGS`);
- a launcher called inside the script, as accelerate's `accelerate launch`
  does: torch.distributed.run's elastic agent starts every rank as
  `python -u train.py ARGS` and trains nothing itself.

torchrun (`--nproc-per-node`) and torch.multiprocessing.spawn have their own
tests (test_distributed, test_corpus_e2e)."""

from __future__ import annotations

from conftest import SCRIPTS, run_capped

LIGHTNING = SCRIPTS / "fw_lightning_trainer.py"
IN_SCRIPT = SCRIPTS / "launch_in_script.py"
DDP = SCRIPTS / "ddp_rank0_cache.py"


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
        _completed, plain = run_capped(
            tmp_path / f"by-hand-{batch}.json",
            capacity,
            LIGHTNING,
            [*lightning, "--batch-size", str(batch)],
            ["--no-replay"],
            cwd=tmp_path,
        )
        assert len(plain["ranks"]) == 2
        return plain

    assert [r["outcome"] for r in by_hand(maximum)["ranks"]] == ["ok", "ok"]
    assert by_hand(maximum + 1)["outcome"] == "oom"


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
