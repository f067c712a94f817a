"""The prescription end to end, on the simulated device: a measured
configuration that fits, run by hand with the prescribed changes; and for a
leak, the leak's remedy, with no fix marked as fitting."""

from __future__ import annotations

from conftest import SCRIPTS, load_json, run_oomdoc


def test_a_leak_is_prescribed_its_remedy_and_no_fix_fits(tmp_path):
    snapshot_path = tmp_path / "leak.json"
    completed = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "8MiB",
            "-o",
            snapshot_path,
            SCRIPTS / "suggest_leak_total_loss.py",
            "--steps",
            "80",
            "--mode",
            "sum-retain",
        ],
        timeout=600,
    )
    assert completed.returncode == 1, completed.stderr
    document = load_json(snapshot_path)
    assert document["outcome"] == "oom"
    prescription = document["prescription"]
    assert prescription["kind"] == "leak" and prescription["measured"] is False
    assert "loss.item()" in prescription["snippet"]
    assert document["fixes"], document["replay"]["skipped"]
    assert not any(fix["fits"] for fix in document["fixes"])
    # Every replay ran a few steps, not the failing run's dozens.
    assert document["replay"]["max_steps"] <= 6
    assert any(skip["name"] == "smaller_batch" for skip in document["replay"]["skipped"])
    grows = [fix for fix in document["fixes"] if fix.get("outcome") == "grows"]
    assert grows and all("delays_oom_by_steps" in fix for fix in grows)
    assert "Prescription: fix the leak first" in completed.stderr
