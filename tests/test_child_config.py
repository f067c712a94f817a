"""The configuration the parent sends the capture child (oomdoc.child_config)."""

from __future__ import annotations

import json

import pytest

from oomdoc.child_config import ChildConfig, ChildConfigError, DeviceLock, DistributedJob
from oomdoc.distributed import DistOptions
from oomdoc.distributed.launch import job_config
from oomdoc.runner import ChildRequest


def test_a_replays_configuration_survives_json():
    config = ChildConfig(
        target="train.py",
        result_path="/tmp/capture.json",
        args=["--batch-size", "64"],
        device="cpu",
        capacity_bytes=1 << 30,
        max_steps=3,
        expected_unit="optimizer",
        stop_after_evaluation=2,
        fix={"name": "smaller_batch", "also": ["amp"]},
        device_lock=DeviceLock("/tmp/lock", "/tmp/lock.json", shared=True, turnstile="/tmp/t"),
        distributed=DistributedJob(nproc_per_node=2, started_path="/tmp/started{rank}.pid"),
    )
    assert ChildConfig.from_json(config.to_json()) == config


def test_unknown_and_missing_keys_are_named():
    data = json.loads(ChildConfig(target="train.py", result_path="c.json").to_json())
    with pytest.raises(ChildConfigError, match="unknown keys .*ChildConfig.*: max_step$"):
        ChildConfig.from_dict({**data, "max_step": 3})
    with pytest.raises(ChildConfigError, match="DeviceLock.*: owner"):
        ChildConfig.from_dict({**data, "device_lock": {"path": "l", "owner": 1}})
    del data["result_path"]
    with pytest.raises(ChildConfigError, match="lacks result_path"):
        ChildConfig.from_dict(data)
    with pytest.raises(ChildConfigError, match="not JSON"):
        ChildConfig.from_json("{")


def test_a_torchrun_jobs_ranks_read_the_replays_fields(tmp_path):
    request = ChildRequest(
        target="train.py",
        args=["--x"],
        device="cpu",
        max_steps=2,
        expected_unit="backward",
        stop_after_evaluation=1,
        fix={"name": "amp"},
    )
    config = job_config(request, str(tmp_path), DistOptions(nproc_per_node=2))
    read = ChildConfig.from_json(config.to_json())
    assert (read.expected_unit, read.stop_after_evaluation, read.fix) == (
        "backward",
        1,
        {"name": "amp"},
    )
    assert read.distributed == DistributedJob(
        nproc_per_node=2, started_path=str(tmp_path / "started-rank{rank}-local{local_rank}.pid")
    )
