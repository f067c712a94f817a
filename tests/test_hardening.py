"""Issue 26: defects found by trying to break oomdoc, each pinned by a test."""

from __future__ import annotations

from conftest import SCRIPTS, load_json, run_oomdoc

MIB = 1024**2


def test_memory_held_outside_any_step_is_the_peak_and_check_gates_it(tmp_path):
    """Item 4: a script without training steps peaks at what it held, and
    `check` fails a 50 -> 100 MiB regression of it."""
    script = SCRIPTS / "hold_outside_steps.py"
    snapshot_path = tmp_path / "held.json"
    ran = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", "256MiB", "-o", snapshot_path, script, "50"],
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert load_json(snapshot_path)["peak"]["allocated_bytes"] >= 50 * MIB
    assert "peak 50.00 MiB allocated" in ran.stderr

    baseline = tmp_path / "baseline.json"
    common = ["check", "--device", "cpu", "--baseline", baseline]
    made = run_oomdoc([*common, "--update-baseline", script, "50"], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    grown = run_oomdoc([*common, script, "100"], cwd=tmp_path)
    assert grown.returncode == 1, grown.stderr
    assert "peak allocated grew" in grown.stderr
