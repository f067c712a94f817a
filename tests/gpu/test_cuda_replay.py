"""Replays on a real CUDA device: the GPT example on an H100 capped to 16 GiB.

The ranked list must hold smaller_batch with an exact max_batch_size (that
batch fits, one more does not, checked by running the script by hand), and
autocast and checkpointing with peaks within 5% of what the same script
measures when the fix is written into it by hand (--autocast/--checkpointing).
"""

from __future__ import annotations

import pytest
import torch

from conftest import EXAMPLES, load_json, run_oomdoc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPT = EXAMPLES / "gpt_train.py"
CAP = ["--device-memory", "16GiB"]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("replay")
    path = workdir / "gpt.json"
    result = run_oomdoc(["run", *CAP, "-o", path, GPT, "--batch-size", "32", "--steps", "4"], timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    return result, load_json(path)


def by_hand(tmp_path, *script_args) -> dict:
    path = tmp_path / f"hand-{len(list(tmp_path.iterdir()))}.json"
    result = run_oomdoc(["run", *CAP, "--no-replay", "--max-steps", "2", "-o", path, GPT, *script_args], timeout=600)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    return load_json(path)


def fix_named(document, name):
    for fix in document["fixes"]:
        if fix["name"] == name:
            return fix
    raise AssertionError(f"no {name} in {[f['name'] for f in document['fixes']]}")


def test_max_batch_size_is_exact(replayed, tmp_path):
    _, document = replayed
    best = document["max_batch_size"]
    assert isinstance(best, int) and 1 <= best < 32
    assert fix_named(document, "smaller_batch")["fits"]
    assert by_hand(tmp_path, "--batch-size", str(best), "--steps", "3")["outcome"] == "ok"
    assert by_hand(tmp_path, "--batch-size", str(best + 1), "--steps", "3")["outcome"] == "oom"


@pytest.mark.parametrize("fix, flags", [("autocast", ["--autocast", "bf16"]), ("checkpointing", ["--checkpointing"])])
def test_replayed_fix_matches_the_fix_by_hand(replayed, tmp_path, fix, flags):
    _, document = replayed
    replay = fix_named(document, fix)
    hand = by_hand(tmp_path, "--batch-size", "32", "--steps", "3", *flags)
    hand_peak = hand["peak"]["allocated_bytes"]
    assert replay["peak_allocated_bytes"] == pytest.approx(hand_peak, rel=0.05), (replay, hand["outcome"])
    assert replay["fits"] == (hand["outcome"] == "ok")


def test_report_ranks_at_least_six_measured_fixes(replayed):
    result, document = replayed
    measured = [fix for fix in document["fixes"] if fix.get("measured", True)]
    assert len(measured) >= 6, [f["name"] for f in document["fixes"]]
    assert "smaller_batch" in result.stderr and "checkpointing" in result.stderr
