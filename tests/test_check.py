"""Unit tests of `oomdoc check`'s comparison, baseline file and reports
(no child process: the documents are built here)."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ElementTree

import pytest
from adapters import check, snapshot_of

from oomdoc import check as oomdoc_check
from oomdoc.categories import REQUIRED
from oomdoc.errors import UsageError
from oomdoc.model import Snapshot
from oomdoc.runner import RunOptions
from oomdoc.snapshot import SnapshotError

MiB = 1024**2


def make_document(
    *,
    activations=10 * MiB,
    peak=None,
    outcome="ok",
    kind="simulated",
    torch_version="2.13.0",
    command=("train.py", "--batch-size", "8"),
    sites=None,
    cwd="/repo",
) -> dict:
    categories = {
        "parameters": 4 * MiB,
        "gradients": 4 * MiB,
        "optimizer_state": 8 * MiB,
        "activations": activations,
        "other": MiB,
    }
    document = {
        "torch_version": torch_version,
        "cwd": cwd,
        "command": list(command),
        "device": {"kind": kind, "name": f"{kind} device", "capacity_bytes": 1024 * MiB},
        "outcome": outcome,
        "exit_code": 0 if outcome == "ok" else 1,
        "oom": None,
        # The sampled moment has no gradients; the maxima do.
        "breakdown": dict(categories, gradients=0),
        "category_peaks": categories,
        "breakdown_at": "peak",
        "peak": {
            "allocated_bytes": peak or sum(categories.values()),
            "reserved_bytes": peak or sum(categories.values()),
            "step": 2,
            "phase": "forward",
        },
        "steps": [{}, {}, {}],
        "top_allocations": sites
        if sites is not None
        else [
            {
                "bytes": activations,
                "count": 3,
                "category": "activations",
                "location": {"file": f"{cwd}/train.py", "line": 20, "function": "forward"},
                "shape": [8, 1024],
                "dtype": "float32",
            },
            {
                "bytes": 8 * MiB,
                "count": 2,
                "category": "optimizer_state",
                "location": {"file": f"{cwd}/train.py", "line": 30, "function": "main"},
                "shape": [1024, 1024],
                "dtype": "float32",
            },
        ],
    }
    return document


def options(tmp_path=None, tolerance="5%", update=False, **kwargs) -> check.CheckOptions:
    from oomdoc.sizes import parse_tolerance

    fraction, absolute = parse_tolerance(tolerance)
    baseline_path = str((tmp_path or ".") / "baseline.json") if tmp_path else "baseline.json"
    return check.CheckOptions(
        run=RunOptions(target="train.py", args=[], max_steps=3),
        baseline_path=baseline_path,
        tolerance_fraction=fraction,
        tolerance_bytes=absolute,
        tolerance_text=tolerance,
        update_baseline=update,
        **kwargs,
    )


def baseline_of(document) -> dict:
    return json.loads(check.baseline_text(check.measurement(document, 3)))


def test_measurement_takes_each_category_at_its_own_maximum_and_relative_locations():
    document = make_document()
    measured = check.measurement(document, 3)
    assert (
        measured["categories"]["gradients"] == 4 * MiB
    )  # from category_peaks, not the sampled breakdown
    assert measured["top_allocations"][0]["location"] == {
        "file": "train.py",
        "line": 20,
        "function": "forward",
    }
    assert measured["steps_run"] == 3 and measured["steps"] == 3
    assert measured["device"] == {
        "kind": "simulated",
        "name": "simulated device",
        "capacity_bytes": 1024 * MiB,
    }


def test_measurement_without_category_peaks_falls_back_to_the_breakdown():
    document = make_document()
    del document["category_peaks"]
    assert check.measurement(document, 3)["categories"]["activations"] == 10 * MiB


def test_baseline_text_is_sorted_and_stable():
    text = check.baseline_text(check.measurement(make_document(), 3))
    assert text == check.baseline_text(json.loads(text))
    keys = list(json.loads(text).keys())
    assert keys == sorted(keys)
    assert (
        "created_at" not in text
    )  # no timestamps: a refreshed baseline only diffs where memory changed


def test_within_tolerance_passes_and_growth_beyond_it_fails():
    baseline = baseline_of(make_document(activations=10 * MiB))
    small = check.evaluate(make_document(activations=10 * MiB + 100 * 1024), baseline, options())
    assert not small.failed and not small.regressions
    large = check.evaluate(make_document(activations=13 * MiB), baseline, options())
    assert large.failed
    assert [c.name for c in large.regressions] == ["peak allocated", "activations"]
    activations = next(c for c in large.comparisons if c.name == "activations")
    assert activations.change == 3 * MiB and activations.allowed_growth == round(0.05 * 10 * MiB)
    assert "+30.0%" in activations.failure_message("5%")


def test_absolute_tolerance_applies_to_every_quantity():
    baseline = baseline_of(make_document(activations=10 * MiB))
    result = check.evaluate(
        make_document(activations=13 * MiB), baseline, options(tolerance="4MiB")
    )
    assert not result.failed
    assert all(c.allowed_growth == 4 * MiB for c in result.comparisons)
    result = check.evaluate(
        make_document(activations=15 * MiB), baseline, options(tolerance="4MiB")
    )
    assert [c.name for c in result.regressions] == ["peak allocated", "activations"]


def test_a_category_that_appears_from_zero_is_growth():
    document = make_document()
    document["category_peaks"]["gradients"] = 0
    baseline = baseline_of(document)
    result = check.evaluate(make_document(), baseline, options())
    assert [c.name for c in result.regressions] == ["gradients"]


def test_a_baseline_from_before_the_communication_category_loads_and_compares(tmp_path):
    """A baseline written before `communication` existed has no such key: it
    reads, and buckets now counted apart from the gradients are shown but not
    gated (their bytes moved out of gradients: no regression); a baseline
    that records communication gates it like any category."""
    ddp = make_document()
    ddp["category_peaks"]["communication"] = 4 * MiB
    ddp["peak"]["allocated_bytes"] += 4 * MiB
    old = baseline_of(make_document())
    old["peak"]["allocated_bytes"] += 4 * MiB
    del old["categories"]["communication"]
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(old))
    loaded = oomdoc_check.read_baseline(path)
    assert loaded.categories.communication == 0
    result = oomdoc_check.evaluate(snapshot_of(ddp), loaded, options())
    communication = next(c for c in result.comparisons if c.name == "communication")
    assert communication.baseline is None and communication.status() == "new"
    assert not result.failed
    assert "communication: not in the baseline" in check.render_text(result, options())
    # Recorded (0 bytes, written by this oomdoc): growth from it fails.
    recorded = check.evaluate(ddp, baseline_of(make_document()), options())
    assert [c.name for c in recorded.regressions] == ["peak allocated", "communication"]
    assert "communication" in check.render_text(recorded, options())


def test_shrinking_passes_and_suggests_refreshing_the_baseline():
    baseline = baseline_of(make_document(activations=20 * MiB))
    result = check.evaluate(make_document(activations=10 * MiB), baseline, options())
    assert not result.failed
    assert "shrank beyond the tolerance" in check.render_text(result, options())


def test_an_oom_fails_even_without_growth():
    baseline = baseline_of(make_document())
    document = make_document(outcome="oom")
    document["oom"] = {
        "step": 1,
        "phase": "forward",
        "requested_bytes": MiB,
        "allocated_bytes": 30 * MiB,
        "reserved_bytes": 30 * MiB,
        "message": "",
        "location": None,
    }
    result = check.evaluate(document, baseline, options())
    assert result.failed and not result.regressions
    assert "ran out of memory" in check.render_text(result, options())


def test_a_failed_script_compares_nothing_and_fails():
    baseline = baseline_of(make_document())
    document = make_document(outcome="error")
    document["error"] = {"type": "ValueError", "message": "bad"}
    result = check.evaluate(document, baseline, options())
    assert result.failed and result.comparisons == []
    assert "nothing was measured" in check.render_text(result, options())


def test_reserved_is_compared_on_cuda_only():
    names = [
        c.name
        for c in check.evaluate(
            make_document(), baseline_of(make_document()), options()
        ).comparisons
    ]
    assert names == ["peak allocated", *REQUIRED]  # communication: none here
    cuda = make_document(kind="cuda")
    names = [c.name for c in check.evaluate(cuda, baseline_of(cuda), options()).comparisons]
    assert names[:2] == ["peak allocated", "peak reserved"]


def test_different_device_torch_and_arguments_are_said():
    baseline = baseline_of(make_document(kind="cuda", torch_version="2.5.0"))
    result = check.evaluate(
        make_document(command=("train.py", "--batch-size", "16")), baseline, options()
    )
    text = "\n".join(result.notes)
    assert "recorded on a cuda device" in text and "simulated" in text
    assert "torch 2.5.0" in text and "torch 2.13.0" in text
    assert "--batch-size 16" in text


def test_site_changes_match_by_line_not_shape():
    baseline = make_document(activations=10 * MiB)["top_allocations"]
    current = make_document(activations=12 * MiB)["top_allocations"]
    current[0]["shape"] = [10, 1024]
    changes = check.site_changes(baseline, current)
    assert len(changes) == 1
    assert changes[0].change == 2 * MiB and changes[0].location.line == 20
    new_site = {
        "bytes": MiB,
        "category": "other",
        "location": {"file": "x.py", "line": 1, "function": "f"},
    }
    changes = check.site_changes(baseline, current + [new_site])
    assert [c.change for c in changes] == [2 * MiB, MiB]


def test_junit_has_one_case_per_quantity_and_failures_with_messages():
    baseline = baseline_of(make_document(activations=10 * MiB))
    result = check.evaluate(make_document(activations=13 * MiB), baseline, options())
    root = ElementTree.fromstring(check.junit_xml(result, options()))
    suite = root.find("testsuite")
    names = [case.get("name") for case in suite.iter("testcase")]
    assert names == ["run", "peak allocated", *REQUIRED]
    failed = {
        case.get("name"): case.find("failure")
        for case in suite.iter("testcase")
        if case.find("failure") is not None
    }
    assert set(failed) == {"peak allocated", "activations"}
    assert "activations grew by +3.00 MiB" in failed["activations"].get("message")
    assert suite.get("failures") == "2" and suite.get("tests") == str(len(names))


def test_markdown_summary_has_github_tables():
    baseline = baseline_of(make_document(activations=10 * MiB))
    result = check.evaluate(make_document(activations=13 * MiB), baseline, options())
    markdown = check.render_markdown(result, options())
    assert "| activations" in markdown and "GREW" in markdown
    assert "#### Allocation sites that differ from the baseline" in markdown


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "not valid JSON"),
        ('{"format": "something-else"}', "not an oomdoc baseline"),
        ('{"format": "oomdoc-baseline", "version": 99}', "unknown baseline version 99"),
        (
            '{"format": "oomdoc-baseline", "version": 1, "peak": {"allocated_bytes": "1"}}',
            "peak.allocated_bytes",
        ),
    ],
)
def test_bad_baseline_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "baseline.json"
    path.write_text(content)
    with pytest.raises(SnapshotError, match=message):
        check.read_baseline(path)


def test_missing_baseline_without_update_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file .create it with --update-baseline"):
        check.run_check(options(tmp_path))


def test_a_baseline_round_trips_through_read_baseline(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(check.baseline_text(check.measurement(make_document(), 3)))
    assert check.read_baseline(path).categories.activations == 10 * MiB


@pytest.mark.parametrize("example", ["github-actions.yml", "gitlab-ci.yml"])
def test_the_ci_examples_parse_as_oomdoc_check_commands(example):
    """The command lines in examples/ci are what `oomdoc check` accepts, with
    oomdoc's options before the script and the script's after it."""
    import re
    import shlex

    import typer
    from conftest import EXAMPLES

    from oomdoc.cli import app

    text = (EXAMPLES / "ci" / example).read_text()
    commands = [
        re.sub(r"\s*\n\s*#?\s*", " ", found)
        for found in re.findall(r"oomdoc check (.*?train\.py[^\n]*)", text, re.S)
    ]
    assert len(commands) == 2, commands  # the one that makes the baseline, and the check
    group = typer.main.get_command(app)
    command = group.get_command(None, "check")
    for line in commands:
        context = command.make_context("check", shlex.split(line))
        assert context.params["baseline"] == "memory-baseline.json"
        assert context.params["target"] == "train.py" and list(context.params["args"]) == [
            "--batch-size",
            "32",
        ]
    assert context.params["junit"] == "oomdoc-check.xml" and context.params["steps"] == 3
    assert not context.params["update_baseline"]


def test_update_baseline_replaces_an_unreadable_baseline(tmp_path, monkeypatch):
    """A baseline of an older format must not block its own refresh."""
    path = tmp_path / "baseline.json"
    path.write_text('{"format": "oomdoc-baseline", "version": 0}')
    monkeypatch.setattr(
        oomdoc_check, "measure", lambda options: (Snapshot.from_dict(make_document()), 1.0)
    )
    log = io.StringIO()
    assert check.run_check(options(tmp_path, update=True), stderr=log) == 0
    assert check.read_baseline(path).categories.activations == 10 * MiB
    assert "could not be read and is replaced" in log.getvalue()
    path.write_text('{"format": "oomdoc-baseline", "version": 0}')
    with pytest.raises(SnapshotError, match="unknown baseline version 0"):
        check.run_check(options(tmp_path))
