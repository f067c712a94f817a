"""Where the HTML report is written: `suggest --format html -o`, `run --html`,
`check --html`; an existing file is never overwritten by suggest or run."""

from __future__ import annotations

from conftest import REPO_ROOT, SCRIPTS, run_oomdoc

OLD_SNAPSHOT = REPO_ROOT / "tests" / "data" / "pre_refactor" / "gpt.json"


def test_suggest_writes_html_and_never_overwrites(tmp_path):
    page = tmp_path / "report.html"
    completed = run_oomdoc(["suggest", "--format", "html", "-o", page, OLD_SNAPSHOT])
    assert completed.returncode == 0, completed.stderr
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "checkpointing" in text
    again = run_oomdoc(["suggest", "--format", "html", "-o", page, OLD_SNAPSHOT])
    assert again.returncode == 2 and "already exists" in again.stderr
    assert again.stderr.count("\n") == 1
    assert page.read_text() == text


def test_run_and_check_write_html(tmp_path):
    page = tmp_path / "run.html"
    completed = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--html",
            page,
            "-o",
            tmp_path / "s.json",
            SCRIPTS / "check_mlp.py",
        ],
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr
    assert f"HTML report: {page}" in completed.stderr and "<svg" in page.read_text()
    refused = run_oomdoc(
        ["run", "--device", "cpu", "--html", page, SCRIPTS / "check_mlp.py"], cwd=tmp_path
    )
    assert refused.returncode == 2 and "already exists" in refused.stderr
    artifact = tmp_path / "check.html"
    baseline = tmp_path / "baseline.json"
    checked = run_oomdoc(
        [
            "check",
            "--device",
            "cpu",
            "--baseline",
            baseline,
            "--update-baseline",
            "--html",
            artifact,
            SCRIPTS / "check_mlp.py",
        ],
        cwd=tmp_path,
    )
    assert checked.returncode == 0, checked.stderr
    assert "What filled" in artifact.read_text()
