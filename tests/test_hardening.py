"""Issue 26: defects found by trying to break oomdoc, each pinned by a test."""

from __future__ import annotations

import json

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


def test_a_name_taken_during_the_run_never_loses_the_snapshot(tmp_path):
    """Item 1: the -o file, the --html file or the default name made while
    the script runs (another run in the same second, a dangling link): the
    snapshot goes beside it, the user's file stays as it was."""
    script = SCRIPTS / "take_output_names.py"
    wanted, html = tmp_path / "run.json", tmp_path / "run.html"
    common = ["run", "--device", "cpu", "--device-memory", "64MiB"]
    ran = run_oomdoc(
        [*common, "-o", wanted, "--html", html, script, f"file:{wanted}", f"link:{html}"],
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert wanted.read_text() == "the user's\n" and html.is_symlink()
    assert load_json(tmp_path / "run-1.json")["outcome"] == "ok"
    assert (tmp_path / "run-1.html").read_text().startswith("<!")
    assert "Snapshot: " + str(tmp_path / "run-1.json") in ran.stderr

    stamps = f"stamps:{tmp_path / '.oomdoc' / 'take_output_names'}"
    ran = run_oomdoc([*common, script, stamps], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    written = [
        path for path in (tmp_path / ".oomdoc").glob("*.json") if path.read_text() != "the user's\n"
    ]
    assert len(written) == 1 and load_json(written[0])["outcome"] == "ok", ran.stderr
    assert f"Snapshot: .oomdoc/{written[0].name}" in ran.stderr or str(written[0]) in ran.stderr


def one_line_usage_error(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "script ran" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("oomdoc: error: "), result.stderr
    return lines[0]


def test_unwritable_output_paths_are_refused_before_the_run(tmp_path):
    """Item 10: -o, --html, check --junit/--html and the baseline that cannot
    be written: one line and exit status 2, before the script runs."""
    script = SCRIPTS / "take_output_names.py"
    a_file = tmp_path / "a_file"
    a_file.write_text("the user's\n")
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    run = ["run", "--device", "cpu", "--device-memory", "64MiB", "--no-replay"]
    check = ["check", "--device", "cpu", "--device-memory", "64MiB"]
    baseline = ["--baseline", tmp_path / "baseline.json", "--update-baseline"]
    cases = {
        "not a directory": [*run, "-o", a_file / "run.json", script],
        "permission denied": [*run, "-o", "/proc/oomdoc-run.json", script],
        "is a directory": [*run, "-o", tmp_path, script],
        "the path is empty": [*run, "-o", "", script],
        "already exists (a symbolic link": [*run, "-o", dangling, script],
        "file name too long": [*run, "--html", tmp_path / ("x" * 300), script],
        "already exists (a file": [*run, "--html", a_file, script],
        "cannot write in /proc": [*check, *baseline, "--junit", "/proc/junit.xml", script],
        "never overwrites": [*check, *baseline, "--html", a_file, script],
        "is not a regular file": [*check, *baseline, "--junit", dangling, script],
        "--baseline": [*check, "--baseline", "/proc/b.json", "--update-baseline", script],
    }
    for expected, arguments in cases.items():
        assert expected in one_line_usage_error(run_oomdoc(arguments, cwd=tmp_path)), expected
    assert a_file.read_text() == "the user's\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_file", "dangling.json"]


def test_bad_tolerances_are_refused_before_the_run(tmp_path):
    """Item 11 (and a bare number, which would have meant bytes)."""
    for tolerance in ("nan%", "inf%", "1e400%", "-inf%", "5"):
        result = run_oomdoc(
            [
                "check",
                "--device",
                "cpu",
                "--tolerance",
                tolerance,
                "--baseline",
                tmp_path / "b.json",
                "--update-baseline",
                SCRIPTS / "take_output_names.py",
            ],
            cwd=tmp_path,
        )
        assert "--tolerance" in one_line_usage_error(result), tolerance
    fraction = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", "1.5", SCRIPTS / "take_output_names.py"],
        cwd=tmp_path,
    )
    assert "a fraction of a byte" in one_line_usage_error(fraction)


def test_no_smaller_batch_replay_for_a_script_without_a_dataloader(tmp_path):
    """Item 8: the failing run shows that the script made no DataLoader (and
    has no batch flag): no smaller-batch replay runs, and the report's "not
    tried" says why."""
    snapshot_path = tmp_path / "oom.json"
    ran = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "96MiB",
            "-o",
            snapshot_path,
            SCRIPTS / "oom_without_dataloader.py",
        ],
        cwd=tmp_path,
    )
    assert ran.returncode == 1, ran.stderr
    assert "smaller_batch (DataLoader" not in ran.stderr
    assert "not tried: smaller_batch: the script has no batch-size flag" in ran.stderr
    document = load_json(snapshot_path)
    assert document["dataloader_batch_sizes"] == []
    labels = [run["label"] for run in document["replay"]["runs"]]
    assert labels and not [label for label in labels if "smaller_batch" in label], labels


def test_bounded_steps_keep_the_first_the_peaks_and_the_last():
    """Item 12, the unit: however many records, the first, the highest peaks
    and the last stay exact; the list never grows past twice its bound."""
    from oomdoc.capture.step_records import BoundedSteps

    bounded = BoundedSteps(keep_first=3, keep_last=4, keep_peaks=2)
    steps: list[dict] = []
    peaks = {500: 900, 7000: 800, 9000: 100}
    for index in range(10_000):
        peak = peaks.get(index, index % 7)
        steps.append({"index": index, "peak_allocated_bytes": peak, "peak_reserved_bytes": peak})
        bounded.trim(steps)
        assert len(steps) <= 2 * bounded.bound
    kept = [step["index"] for step in steps]
    assert kept[:3] == [0, 1, 2] and kept[-4:] == [9996, 9997, 9998, 9999]
    assert 500 in kept and 7000 in kept and kept == sorted(kept)


def test_a_long_run_writes_a_bounded_snapshot_with_the_steps_that_matter(tmp_path):
    """Item 12: 2,000 steps keep a bounded list of records, the first, the
    peak and the last exact, and the run still counts every step."""
    from oomdoc.capture.step_records import BoundedSteps

    snapshot_path = tmp_path / "long.json"
    ran = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "64MiB",
            "-o",
            snapshot_path,
            SCRIPTS / "many_steps.py",
            "2000",
            "1000",
        ],
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    document = load_json(snapshot_path)
    indices = [step["index"] for step in document["steps"]]
    assert len(indices) <= 2 * BoundedSteps().bound
    assert len(indices) + document["steps_omitted"] == 2000
    assert indices[0] == 0 and indices[-1] == 1999 and 1000 in indices
    assert document["peak"]["step"] == 1000
    assert "over 2000 step(s)" in ran.stderr


def test_check_with_dataloader_workers_gives_the_same_numbers_every_run(tmp_path):
    """Item 3: with num_workers > 0, how many batches had arrived from the
    workers at the peak changed from run to run; check now loads them in the
    script's process and says so, and five checks count the same bytes."""
    baseline = tmp_path / "baseline.json"
    script = SCRIPTS / "check_dataloader_workers.py"
    common = ["check", "--device", "cpu", "--tolerance", "0%", "--baseline", baseline]
    made = run_oomdoc([*common, "--update-baseline", script], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "loaded in the script's process instead" in made.stderr
    for _ in range(5):
        checked = run_oomdoc([*common, script], cwd=tmp_path)
        assert checked.returncode == 0, checked.stderr


def test_version_and_help_in_plain_words():
    """Smaller findings: `--version` exists; help shows no Python types
    (`<bool>`, `<str>`) and no `{SCRIPT} [[ARGS]...]...`."""
    version = run_oomdoc(["--version"])
    assert version.returncode == 0 and version.stdout.startswith("oomdoc "), version
    for command in (["--help"], ["run", "--help"], ["check", "--help"], ["suggest", "--help"]):
        shown = run_oomdoc(command)
        assert shown.returncode == 0, shown.stderr
        assert "<" not in shown.stdout.replace("<script>", "").replace("<UTC", ""), shown.stdout
        assert "{" not in shown.stdout and "[[" not in shown.stdout, shown.stdout
    assert "Usage: oomdoc run [OPTIONS] SCRIPT [ARGS]..." in run_oomdoc(["run", "--help"]).stdout


def test_a_script_that_never_ran_gets_its_own_error_and_no_empty_report(tmp_path):
    """Smaller finding: a SyntaxError prints as python prints it (no runpy
    frames) and the report is the headline, without tables of zeros."""
    script = tmp_path / "broken.py"
    script.write_text("import torch\nx = (\n")
    ran = run_oomdoc(["run", "--device", "cpu", "-o", tmp_path / "s.json", script], cwd=tmp_path)
    assert ran.returncode == 1, ran.stderr
    assert "SyntaxError: '(' was never closed" in ran.stderr
    assert "runpy" not in ran.stderr and "Traceback" not in ran.stderr
    assert "The script failed (SyntaxError)" in ran.stderr
    assert "What filled" not in ran.stderr and "parameters" not in ran.stderr


def test_a_run_that_fit_with_room_to_spare_gets_no_breakdown_diagnoses(tmp_path):
    """Smaller finding: a run that used a sliver of the device is not told
    what filled it."""
    snapshot_path = tmp_path / "fit.json"
    ran = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "1GiB",
            "-o",
            snapshot_path,
            SCRIPTS / "many_steps.py",
            "3",
            "1",
        ],
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert "The run fit" in ran.stderr and "Diagnosis" not in ran.stderr
    suggested = run_oomdoc(["suggest", "--format", "json", snapshot_path])
    assert json.loads(suggested.stdout)["diagnoses"] == []


def test_suggest_refuses_impossible_sizes_and_the_same_file_twice_and_escapes_controls(tmp_path):
    """Smaller findings: negative sizes and a 0-byte device are refused in one
    line; the same snapshot given twice is not a 2-rank job; escape sequences
    in a snapshot's strings are written out, not sent to the terminal."""
    from suggest_builders import MiB, oom_document

    def write(name, document):
        path = tmp_path / name
        path.write_text(json.dumps(document))
        return path

    negative = oom_document(allocated=100 * MiB, requested=-5, capacity=128 * MiB)
    zero = oom_document(allocated=100 * MiB, requested=8 * MiB, capacity=0)
    for path, expected in (
        (write("negative.json", negative), "oom.requested_bytes must be at least 0"),
        (write("zero.json", zero), "device.capacity_bytes must be positive"),
    ):
        assert expected in one_line_usage_error(run_oomdoc(["suggest", path]))

    good = write(
        "good.json", oom_document(allocated=100 * MiB, requested=60 * MiB, capacity=128 * MiB)
    )
    twice = run_oomdoc(["suggest", good, tmp_path / "." / "good.json"])
    assert "given twice" in one_line_usage_error(twice)

    hostile = oom_document(allocated=100 * MiB, requested=60 * MiB, capacity=128 * MiB)
    hostile["oom"]["location"]["function"] = "main\x1b[2J\x1b[31m"
    shown = run_oomdoc(["suggest", write("hostile.json", hostile)])
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "main\\x1b[2J\\x1b[31m" in shown.stdout


def test_check_refuses_the_baseline_of_another_script(tmp_path):
    """Smaller finding: a baseline recorded for another script is refused
    before the run, one line, exit status 2."""
    baseline = tmp_path / "baseline.json"
    common = ["check", "--device", "cpu", "--baseline", baseline]
    made = run_oomdoc(
        [*common, "--update-baseline", SCRIPTS / "many_steps.py", "3", "1"], cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr
    other = run_oomdoc([*common, SCRIPTS / "take_output_names.py"], cwd=tmp_path)
    assert "recorded for" in one_line_usage_error(other)
    same = run_oomdoc([*common, SCRIPTS / "many_steps.py", "3", "2"], cwd=tmp_path)
    assert same.returncode == 0, same.stderr  # other arguments are only noted
