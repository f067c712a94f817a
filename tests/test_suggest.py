"""`oomdoc suggest` end to end: snapshots written by `oomdoc run` on the
simulated device for scripts with a leak or an evaluation without no_grad,
PyTorch's own snapshots, and bad input."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from conftest import SCRIPTS, run_capped, run_oomdoc, two_at_a_time
from suggest_builders import oomdoc_document, torch_snapshot

from oomdoc.snapshot import MAX_SNAPSHOT_BYTES

H100_PICKLE = Path(__file__).parent / "data" / "h100_oom_snapshot.pickle"

SCENARIOS = {
    # name: (script, capacity, script args)
    "leak_sum": ("suggest_leak_total_loss.py", "8MiB", ["--steps", "12", "--mode", "sum"]),
    "leak_oom": ("suggest_leak_total_loss.py", "8MiB", ["--steps", "80", "--mode", "sum-retain"]),
    "leak_fixed": ("suggest_leak_total_loss.py", "8MiB", ["--steps", "12", "--mode", "fixed"]),
    "eval_oom": ("suggest_eval_no_grad.py", "20MiB", []),
    "eval_no_grad": ("suggest_eval_no_grad.py", "20MiB", ["--no-grad"]),
    "train_eval": ("suggest_train_then_eval.py", "64MiB", []),
    "train_eval_no_grad": ("suggest_train_then_eval.py", "64MiB", ["--no-grad"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each scenario run once through `oomdoc run`: (snapshot path, report).
    Two at a time: each is a separate process, and one alone leaves a core idle."""
    directory = tmp_path_factory.mktemp("suggest_runs")

    def run_scenario(name: str):
        script, capacity, args = SCENARIOS[name]
        snapshot = directory / f"{name}.json"
        completed, _document = run_capped(
            snapshot, capacity, SCRIPTS / script, args, ["--no-replay"], cwd=directory
        )
        return snapshot, completed

    return dict(zip(SCENARIOS, two_at_a_time(run_scenario, SCENARIOS)))


def suggest_json(path, *extra) -> dict:
    completed = run_oomdoc(["suggest", path, "--format", "json", *extra])
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def kinds(result) -> list[str]:
    return [d["kind"] for d in result["diagnoses"]]


def test_summed_loss_is_a_leak(runs):
    snapshot, completed = runs["leak_sum"]
    assert completed.returncode == 0
    result = suggest_json(snapshot)
    assert kinds(result)[0] == "leak"
    assert "`total_loss`" in result["diagnoses"][0]["summary"]
    assert "1. leak: Memory leak: `total_loss`" in completed.stderr  # oomdoc run's own report


def test_leak_that_runs_out_of_memory(runs):
    snapshot, completed = runs["leak_oom"]
    assert completed.returncode == 1
    result = suggest_json(snapshot)
    assert result["outcome"] == "oom"
    leak = result["diagnoses"][0]
    assert leak["kind"] == "leak"
    assert leak["bytes"] > 1024**2
    assert any("per step" in line for line in leak["evidence"])
    assert "1. leak:" in completed.stderr


def test_fixed_loop_has_no_leak(runs):
    snapshot, completed = runs["leak_fixed"]
    assert completed.returncode == 0
    assert "leak" not in kinds(suggest_json(snapshot))
    assert "leak:" not in completed.stderr


def test_evaluation_without_no_grad(runs):
    snapshot, completed = runs["eval_oom"]
    assert completed.returncode == 1, "the evaluation should run out of memory with autograd on"
    result = suggest_json(snapshot)
    assert kinds(result)[0] == "grad_in_eval"
    assert "torch.no_grad()" in result["diagnoses"][0]["remedy"]
    assert "1. grad_in_eval:" in completed.stderr
    # Training fixes (checkpointing, accumulation) do not apply to an evaluation.
    assert result["fixes"] == []


def test_evaluation_with_no_grad_fits_and_is_not_flagged(runs):
    snapshot, completed = runs["eval_no_grad"]
    assert completed.returncode == 0
    assert "grad_in_eval" not in kinds(suggest_json(snapshot))


def test_validation_pass_inside_training(runs):
    result = suggest_json(runs["train_eval"][0])
    assert kinds(result)[0] == "grad_in_eval"
    assert any("eval mode" in line for line in result["diagnoses"][0]["evidence"])
    assert "grad_in_eval" not in kinds(suggest_json(runs["train_eval_no_grad"][0]))


def test_table_markdown_and_top(runs):
    snapshot = runs["leak_oom"][0]
    table = run_oomdoc(["suggest", snapshot])
    assert table.returncode == 0
    assert table.stdout.startswith("oomdoc: OOM")
    assert "Diagnosis (most important first)" in table.stdout
    assert "estimated from the breakdown" in table.stdout
    assert "note: fix the leak above first" in table.stdout
    markdown = run_oomdoc(["suggest", snapshot, "--format", "markdown"])
    assert markdown.returncode == 0 and "### Diagnosis" in markdown.stdout
    assert len(suggest_json(snapshot, "--top", "1")["fixes"]) == 1


def test_pytorch_pickle_through_the_cli(tmp_path):
    path = tmp_path / "dump_snapshot.pickle"
    path.write_bytes(pickle.dumps(torch_snapshot()))
    result = suggest_json(path)
    assert result["source_format"] == "torch_pickle"
    assert kinds(result)[0] == "fragmentation"
    assert result["trace_before_oom"][-1]["action"] == "free_completed"
    assert any(
        fix["name"] == "expandable_segments" and fix["measured"] is False for fix in result["fixes"]
    )


def test_real_h100_pickle_is_diagnosed():
    result = suggest_json(H100_PICKLE)
    assert result["source_format"] == "torch_pickle"
    assert result["outcome"] == "oom"
    assert result["diagnoses"], "a real OOM must be explained"
    assert result["fixes"]
    table = run_oomdoc(["suggest", H100_PICKLE])
    assert table.returncode == 0 and "Allocator events just before the OOM" in table.stdout


# ------------------------------------------------------------------ bad input


def _huge(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as handle:
        handle.truncate(MAX_SNAPSHOT_BYTES + 1)
    return path


class Hostile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


BAD_INPUTS = {
    "missing": (lambda tmp: tmp / "absent.json", "no such file"),
    "directory": (lambda tmp: tmp, "is a directory"),
    "garbage": (lambda tmp: _write(tmp / "x.bin", b"\x00\x13garbage"), "neither JSON nor a pickle"),
    "truncated_json": (
        lambda tmp: _write(tmp / "t.json", json.dumps(oomdoc_document()).encode()[:300]),
        "not valid JSON",
    ),
    "truncated_pickle": (
        lambda tmp: _write(tmp / "t.pickle", pickle.dumps(torch_snapshot())[:500]),
        "truncated or corrupt pickle",
    ),
    "schema": (
        lambda tmp: _write(tmp / "s.json", json.dumps(oomdoc_document(schema_version=7)).encode()),
        "unknown schema_version 7",
    ),
    "hostile": (
        lambda tmp: _write(
            tmp / "evil.pickle", pickle.dumps({"segments": Hostile(str(tmp / "pwned"))})
        ),
        "refused",
    ),
    "huge": (_huge, "larger than"),
}


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path):
    make, message = BAD_INPUTS[case]
    completed = run_oomdoc(["suggest", make(tmp_path)])
    assert completed.returncode == 2
    assert completed.stdout == ""
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("oomdoc: error: "), completed.stderr
    assert message in lines[0]
    assert "Traceback" not in completed.stderr
    assert not (tmp_path / "pwned").exists()


def test_bad_options_are_usage_errors(tmp_path):
    path = _write(tmp_path / "s.json", json.dumps(oomdoc_document()).encode())
    for args, message in (
        (["--format", "yaml"], "--format must be one of"),
        (["--top", "0"], "--top"),
    ):
        completed = run_oomdoc(["suggest", path, *args])
        assert completed.returncode == 2
        assert completed.stderr.startswith("oomdoc: error:") and message in completed.stderr
        assert "Traceback" not in completed.stderr


def test_every_registered_snapshot_format_is_a_suggest_format(tmp_path):
    """`--format` offers what the reporter registry has: each format of a
    snapshot renders through `oomdoc suggest`; the check formats are not
    offered."""
    from oomdoc.analysis import analyse
    from oomdoc.cli import SUGGEST_FORMATS
    from oomdoc.model import Snapshot
    from oomdoc.reporters import REPORTERS, formats_rendering, render

    assert list(SUGGEST_FORMATS) == formats_rendering("snapshot")
    assert {"table", "json", "markdown", "html"} <= set(SUGGEST_FORMATS)
    assert not {"check-text", "junit", "github-summary"} & set(SUGGEST_FORMATS)
    assert set(REPORTERS) == set(formats_rendering("snapshot")) | set(formats_rendering("check"))
    document = oomdoc_document()
    path = _write(tmp_path / "s.json", json.dumps(document).encode())
    analysis = analyse(Snapshot.from_dict(document), path=str(path))
    for output_format in SUGGEST_FORMATS:
        completed = run_oomdoc(["suggest", path, "--format", output_format])
        assert completed.returncode == 0, (output_format, completed.stderr)
        expected = render(output_format, analysis)
        assert completed.stdout == expected.lstrip("\n"), output_format


NEW_FORMAT = """
import sys
from oomdoc import reporters


class CsvReporter:
    renders = "snapshot"
    summary = "one line"

    def __init__(self, analysis):
        self.analysis = analysis

    @classmethod
    def from_analysis(cls, analysis, snapshot_path=None):
        return cls(analysis)

    def render(self):
        return f"outcome,{self.analysis.snapshot.outcome}\\n"


reporters.REPORTERS["csv"] = CsvReporter
from oomdoc import cli

sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_new_registered_format_needs_no_edit_to_the_cli(tmp_path):
    """A reporter registered before the CLI is built is a `--format` choice,
    listed in the help and rendered: cli.py names no format."""
    import subprocess
    import sys

    from conftest import oomdoc_env

    path = _write(tmp_path / "s.json", json.dumps(oomdoc_document()).encode())

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", NEW_FORMAT, *args],
            env=oomdoc_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    completed = run("suggest", path, "--format", "csv")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "outcome,ok\n"
    help_text = " ".join(run("suggest", "--help").stdout.split())
    assert "table|json|markdown|html|csv" in help_text and "csv (one line)" in help_text
