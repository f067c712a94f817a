"""`oomdoc check` end to end through the real CLI on the simulated device."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ElementTree

from conftest import SCRIPTS, run_oomdoc


def numbers_table(stderr: str) -> str:
    """The comparison table of a check report (the numbers, without notes)."""
    match = re.search(r"Peak memory against the baseline\n(.*?)(?:\n\n|\nnote:|\Z)", stderr, re.S)
    assert match, stderr
    return match.group(1)


def test_batch_growth_fails_on_activations_and_same_batch_passes_identically(tmp_path):
    """The issue's done-when: baseline at batch 512, check at 640 exits 1 and
    names activations; the check at 512 passes twice with identical numbers."""
    shutil.copy(SCRIPTS / "check_mlp.py", tmp_path / "train.py")
    baseline = tmp_path / "memory-baseline.json"
    common = ["check", "--device", "cpu", "--baseline", baseline]

    made = run_oomdoc(
        [*common, "--update-baseline", "train.py", "--batch-size", "512"], cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr
    assert "baseline written to" in made.stderr
    recorded = json.loads(baseline.read_text())
    assert baseline.read_text() == json.dumps(recorded, indent=2, sort_keys=True) + "\n"
    assert recorded["device"]["kind"] == "simulated" and recorded["torch_version"]
    assert recorded["command"] == ["train.py", "--batch-size", "512"] and recorded["steps_run"] == 3
    assert (
        recorded["top_allocations"][0]["location"]["file"] == "train.py"
    )  # relative: portable across checkouts

    first = run_oomdoc([*common, "train.py", "--batch-size", "512"], cwd=tmp_path)
    second = run_oomdoc([*common, "train.py", "--batch-size", "512"], cwd=tmp_path)
    for passed in (first, second):
        assert passed.returncode == 0, passed.stderr
        assert "oomdoc check: OK" in passed.stderr
        assert "GREW" not in passed.stderr
    assert numbers_table(first.stderr) == numbers_table(second.stderr)
    assert "0 bytes (0.0%)" in numbers_table(
        first.stderr
    )  # identical to the baseline, byte for byte

    summary = tmp_path / "summary.md"
    junit = tmp_path / "report.xml"
    grown = run_oomdoc(
        [*common, "--junit", junit, "train.py", "--batch-size", "640"],
        cwd=tmp_path,
        env={"GITHUB_STEP_SUMMARY": str(summary)},
    )
    assert grown.returncode == 1, grown.stderr
    verdict = next(line for line in grown.stderr.splitlines() if line.startswith("oomdoc check:"))
    assert "FAIL" in verdict and "activations" in verdict
    activations_row = next(
        line for line in numbers_table(grown.stderr).splitlines() if line.startswith("activations")
    )
    assert "+25.0%" in activations_row and activations_row.rstrip().endswith("GREW")
    assert "Allocation sites that differ from the baseline" in grown.stderr
    assert "train.py:" in grown.stderr.split("Allocation sites that differ")[1]
    assert "--batch-size 640" in grown.stderr  # says the arguments differ from the baseline's
    assert (
        json.loads(baseline.read_text()) == recorded
    )  # a failing check never touches the baseline

    markdown = summary.read_text()
    assert markdown.startswith("### oomdoc check: `train.py --batch-size 640`")
    assert "| activations" in markdown
    suite = ElementTree.parse(junit).getroot().find("testsuite")
    failed = [
        case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None
    ]
    assert "activations" in failed and "parameters" not in failed


def test_an_oom_during_the_check_fails_and_writes_no_baseline(tmp_path):
    baseline = tmp_path / "baseline.json"
    result = run_oomdoc(
        [
            "check",
            "--device",
            "cpu",
            "--device-memory",
            "24MiB",
            "--baseline",
            baseline,
            "--update-baseline",
            SCRIPTS / "check_mlp.py",
            "--batch-size",
            "512",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert "ran out of memory" in result.stderr and "The baseline was not written" in result.stderr
    assert not baseline.exists()


def test_usage_errors_are_one_line_with_status_2(tmp_path):
    missing = run_oomdoc(
        [
            "check",
            "--device",
            "cpu",
            "--baseline",
            tmp_path / "none.json",
            SCRIPTS / "check_mlp.py",
        ],
        cwd=tmp_path,
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "--update-baseline" in missing.stderr
    # Options after SCRIPT belong to the script, so --baseline there is not oomdoc's.
    after = run_oomdoc(["check", SCRIPTS / "check_mlp.py", "--baseline", "b.json"], cwd=tmp_path)
    assert after.returncode == 2 and "Missing option '--baseline'" in after.stderr
    assert "Traceback" not in after.stderr
    tolerance = run_oomdoc(
        ["check", "--tolerance", "lots", "--baseline", "b.json", SCRIPTS / "check_mlp.py"],
        cwd=tmp_path,
    )
    assert (
        tolerance.returncode == 2
        and "--tolerance" in tolerance.stderr
        and "Traceback" not in tolerance.stderr
    )


def test_whole_run_gates_the_longest_batch_and_the_evaluation_and_names_a_gap(tmp_path):
    """--whole-run: the check measures the run's worst case (the longest
    batch first, then the script's evaluation) and fails, naming the gap,
    when part of it cannot be covered (an iterable dataset)."""
    script = SCRIPTS / "whole_run_loaders.py"
    baseline = tmp_path / "memory-baseline.json"
    common = ["check", "--whole-run", "--device", "cpu", "--baseline", baseline]
    made = run_oomdoc([*common, "--update-baseline", script, "--batch_size", "4"], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    # Its three steps: the longest batch, again with the optimizer's state
    # alive, the next longest; then the evaluation's longest.
    assert made.stdout.splitlines()[:4] == [
        "train 0 (4, 40)",
        "train 0 (4, 40)",
        "train 0 (4, 32)",
        "eval 0 (8, 33)",
    ]
    assert "certified for the whole run: longest input 40 elements (sample 37" in made.stderr
    assert "evaluation at batch 8" in made.stderr
    junit = tmp_path / "report.xml"
    streamed = run_oomdoc(
        [*common, "--junit", junit, script, "--batch_size", "4", "--iterable"], cwd=tmp_path
    )
    assert streamed.returncode == 1, streamed.stderr
    assert "FAIL: --whole-run" in streamed.stderr
    assert "not covered: the training batches came as the data gave them: an iterable" in (
        streamed.stderr
    )
    cases = {case.get("name"): case for case in ElementTree.parse(junit).iter("testcase")}
    assert cases["whole run"].find("failure") is not None
