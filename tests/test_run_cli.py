"""`oomdoc run` end to end, through the real CLI, on the simulated device."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import SCRIPTS, load_json, oomdoc_env, run_oomdoc

MIB = 1024**2


@pytest.fixture(scope="module")
def mlp_oom(tmp_path_factory):
    """One OOM run of the MLP trainer, shared by the field checks below."""
    workdir = tmp_path_factory.mktemp("oom")
    snapshot_path = workdir / "mlp.json"
    result = run_oomdoc(
        [
            "run",
            "--device-memory",
            "256MiB",
            "--no-replay",
            "-o",
            snapshot_path,
            SCRIPTS / "run_mlp.py",
            "--batch-size",
            "2048",
        ],
        cwd=workdir,
    )
    return result, load_json(snapshot_path)


def test_oom_exit_status_and_original_traceback(mlp_oom):
    result, _ = mlp_oom
    assert result.returncode == 1
    assert "Traceback (most recent call last):" in result.stderr
    assert 'run_mlp.py", line' in result.stderr
    # Phrased as CUDA phrases it: scripts that catch an OOM match its words.
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in result.stderr
    assert "Simulated device 0 (oomdoc) has a total capacity" in result.stderr
    # oomdoc's own hooks are not part of the user's traceback.
    assert "oomdoc/capture" not in result.stderr and "runpy" not in result.stderr


def test_oom_report_headline_and_breakdown(mlp_oom):
    result, _ = mlp_oom
    assert (
        "oomdoc: OOM in step 1 during backward: tried to allocate 16.00 MiB with" in result.stderr
    )
    assert "of 256.00 MiB in use" in result.stderr
    for category in ("parameters", "gradients", "optimizer_state", "activations", "other"):
        assert category in result.stderr
    assert "% of capacity" in result.stderr
    assert "Top 5 allocation sites" in result.stderr
    assert "every CPU tensor" in result.stderr
    assert "Snapshot:" in result.stderr


def test_oom_snapshot_fields(mlp_oom):
    _, document = mlp_oom
    assert document["schema_version"] == 1
    assert document["command"][-2:] == ["--batch-size", "2048"]
    assert document["command"][0].endswith("run_mlp.py")
    assert document["device"] == {
        **document["device"],
        "kind": "simulated",
        "capacity_bytes": 256 * MIB,
    }
    assert document["outcome"] == "oom" and document["exit_code"] == 1
    oom = document["oom"]
    assert oom["step"] == 1 and oom["phase"] == "backward"
    assert oom["requested_bytes"] == 16 * MIB  # one 2048x2048 float32 gradient
    assert oom["allocated_bytes"] + oom["requested_bytes"] > 256 * MIB
    assert oom["reserved_bytes"] == oom["allocated_bytes"]
    assert "Tried to allocate 16.00 MiB" in oom["message"]
    assert oom["location"]["file"].endswith("run_mlp.py")
    assert oom["location"]["function"] == "<module>"


def test_oom_breakdown_adds_up_and_names_the_right_owners(mlp_oom):
    _, document = mlp_oom
    breakdown = document["breakdown"]
    assert document["breakdown_at"] == "oom"
    total = sum(breakdown.values())
    assert (
        abs(total - document["oom"]["allocated_bytes"]) <= 0.05 * document["oom"]["allocated_bytes"]
    )
    parameter_bytes = (512 * 2048 + 2048 * 2048 * 3 + 2048 * 10 + 2048 * 4 + 10) * 4
    assert breakdown["parameters"] == parameter_bytes
    # AdamW keeps two moments per parameter (plus a scalar step each).
    assert 2 * parameter_bytes <= breakdown["optimizer_state"] <= 2 * parameter_bytes + 64 * 1024
    assert breakdown["activations"] >= 4 * 2048 * 2048 * 4
    assert breakdown["other"] >= 4096 * 512 * 4  # the dataset held in memory


def test_oom_snapshot_steps_and_sites(mlp_oom):
    _, document = mlp_oom
    steps = document["steps"]
    assert [s["index"] for s in steps] == [0, 1]
    assert document["step_unit"] == "optimizer"
    first = steps[0]
    assert first["peak_phase"] in ("forward", "backward", "optimizer")
    assert first["peak_allocated_bytes"] >= first["end_allocated_bytes"] > 0
    assert first["peak_reserved_bytes"] == first["peak_allocated_bytes"]
    assert set(first["phase_peaks"]) >= {"forward", "backward", "optimizer"}
    assert (
        first["forward_calls"] == 1
        and first["backward_calls"] == 1
        and first["optimizer_steps"] == 1
    )
    top = document["top_allocations"]
    assert 0 < len(top) <= 20
    assert top == sorted(top, key=lambda site: site["bytes"], reverse=True)
    assert top[0]["category"] == "optimizer_state"
    assert top[0]["shape"] == [2048, 2048] and top[0]["dtype"] == "float32"
    assert all(site["location"]["file"].endswith("run_mlp.py") for site in top if site["location"])
    assert document["optimizers"] == ["AdamW"]


def test_run_that_fits(tmp_path):
    snapshot_path = tmp_path / "fit.json"
    result = run_oomdoc(
        [
            "run",
            "--device-memory",
            "256MiB",
            "-o",
            snapshot_path,
            SCRIPTS / "run_mlp.py",
            "--batch-size",
            "512",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout
    document = load_json(snapshot_path)
    assert document["outcome"] == "ok" and document["exit_code"] == 0
    assert len(document["steps"]) == 8
    assert document["oom"] is None
    assert document["breakdown_at"] == "peak"
    assert document["peak"]["allocated_bytes"] == max(
        s["peak_allocated_bytes"] for s in document["steps"]
    )
    assert "oomdoc: The run fit: peak" in result.stderr and "headroom" in result.stderr


def test_default_snapshot_path_is_never_overwritten(tmp_path):
    for _ in range(2):
        result = run_oomdoc(["run", "--device", "cpu", SCRIPTS / "run_exit.py", "0"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    written = sorted((tmp_path / ".oomdoc").glob("run_exit-*.json"))
    assert len(written) == 2
    for path in written:
        assert load_json(path)["outcome"] == "ok"


def test_existing_output_is_refused_and_kept(tmp_path):
    precious = tmp_path / "keep.json"
    precious.write_text("my data")
    result = run_oomdoc(
        ["run", "--device", "cpu", "-o", precious, SCRIPTS / "run_exit.py", "0"], cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "already exists" in result.stderr
    assert precious.read_text() == "my data"


def test_sys_exit_status_is_passed_through(tmp_path):
    result = run_oomdoc(
        ["run", "--device", "cpu", "-o", tmp_path / "s.json", SCRIPTS / "run_exit.py", "3"],
        cwd=tmp_path,
    )
    assert result.returncode == 3
    document = load_json(tmp_path / "s.json")
    assert document["outcome"] == "error" and document["exit_code"] == 3


def test_unrelated_exception_gives_1_and_the_original_traceback(tmp_path):
    result = run_oomdoc(
        ["run", "--device", "cpu", "-o", tmp_path / "s.json", SCRIPTS / "run_raise.py"],
        cwd=tmp_path,
    )
    assert result.returncode == 1
    expected = subprocess.run(
        [sys.executable, str(SCRIPTS / "run_raise.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    # The same traceback plain Python prints, then oomdoc's report.
    assert result.stderr.startswith(expected.stderr)
    assert "ValueError: bad config file: settings.yaml" in result.stderr
    document = load_json(tmp_path / "s.json")
    assert document["outcome"] == "error"
    assert document["error"]["type"] == "ValueError"


def test_everything_after_script_reaches_the_script(tmp_path):
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "-o",
            tmp_path / "s.json",
            SCRIPTS / "run_argv.py",
            "--output",
            "x",
            "--help",
            "7",
            "-m",
            "--device-memory",
            "1",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout.split("ARGV=")[1].splitlines()[0])
    assert argv == [
        str(SCRIPTS / "run_argv.py"),
        "--output",
        "x",
        "--help",
        "7",
        "-m",
        "--device-memory",
        "1",
    ]
    assert "NAME=__main__" in result.stdout
    assert not (tmp_path / "x").exists()


def test_module_mode(tmp_path):
    result = run_oomdoc(
        ["run", "--device", "cpu", "-o", tmp_path / "s.json", "-m", "runpkg", "--flag", "1"],
        cwd=tmp_path,
        env={"PYTHONPATH": f"{SCRIPTS}{os.pathsep}{oomdoc_env()['PYTHONPATH']}"},
    )
    assert result.returncode == 0, result.stderr
    assert 'ARGV=["--flag", "1"]' in result.stdout
    document = load_json(tmp_path / "s.json")
    assert document["command"] == ["-m", "runpkg", "--flag", "1"]
    assert len(document["steps"]) == 2


def test_max_steps_stops_cleanly(tmp_path):
    result = run_oomdoc(
        [
            "run",
            "--device-memory",
            "256MiB",
            "--max-steps",
            "2",
            "-o",
            tmp_path / "s.json",
            SCRIPTS / "run_mlp.py",
            "--batch-size",
            "256",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "step 1:" in result.stdout
        and "step 2:" not in result.stdout
        and "done" not in result.stdout
    )
    document = load_json(tmp_path / "s.json")
    assert document["outcome"] == "ok"
    assert [s["index"] for s in document["steps"]] == [0, 1]


@pytest.mark.parametrize("bad", ["12XB", "lots", "-5MiB", "0"])
def test_bad_size_is_a_one_line_usage_error(tmp_path, bad):
    result = run_oomdoc(["run", "--device-memory", bad, SCRIPTS / "run_exit.py", "0"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("oomdoc: error: --device-memory")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / ".oomdoc").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "missing.py"], "no such file"),
        (["run", "--device", "tpu", "x.py"], "--device must be"),
        (["run"], "Missing argument"),
        (["run", "--bogus", "x.py"], "no such option"),
        (["run", "--max-steps", "0", "x.py"], "--max-steps"),
    ],
)
def test_usage_errors_are_one_line(tmp_path, args, message):
    result = run_oomdoc(args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def _start(args, tmp_path, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "oomdoc", *map(str, args)],
        cwd=tmp_path,
        env=oomdoc_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _wait_for_ready(process):
    deadline = time.time() + 60
    while time.time() < deadline:
        line = process.stdout.readline()
        if "ready" in line:
            return
    raise AssertionError("the script never became ready")


def test_sigterm_reaches_the_script_and_the_capture_is_kept(tmp_path):
    process = _start(
        ["run", "--device", "cpu", "-o", tmp_path / "s.json", SCRIPTS / "run_wait.py"], tmp_path
    )
    _wait_for_ready(process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    document = load_json(tmp_path / "s.json")
    assert document["outcome"] == "interrupted"
    assert len(document["steps"]) >= 3


def test_ctrl_c_reaches_the_script_and_the_capture_is_kept(tmp_path):
    # A terminal's Ctrl-C signals the whole foreground process group.
    process = _start(
        ["run", "--device", "cpu", "-o", tmp_path / "s.json", SCRIPTS / "run_wait.py"],
        tmp_path,
        start_new_session=True,
    )
    _wait_for_ready(process)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "KeyboardInterrupt" in stderr
    document = load_json(tmp_path / "s.json")
    assert document["outcome"] == "interrupted"


def test_sigint_sent_to_oomdoc_alone_stops_the_script(tmp_path):
    """Issue 26, item 2: `kill -INT <oomdoc>` (no terminal, so the children
    did not get it) stops the script, which writes its capture."""
    process = _start(
        ["run", "--device", "cpu", "-o", tmp_path / "s.json", SCRIPTS / "run_wait.py"],
        tmp_path,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    _wait_for_ready(process)
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("the script kept training after oomdoc's SIGINT") from None
    assert process.returncode == 130, stderr
    assert "KeyboardInterrupt" in stderr
    assert load_json(tmp_path / "s.json")["outcome"] == "interrupted"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["run", "check"])
def test_device_cuda_without_cuda_is_a_one_line_usage_error(tmp_path, command):
    # The child decides `--device` (the parent does not import torch); its
    # refusal is still oomdoc's usage error, and nothing is left behind.
    args = [command, "--device", "cuda", SCRIPTS / "run_exit.py", "0"]
    if command == "check":
        args[1:1] = ["--baseline", tmp_path / "baseline.json", "--update-baseline"]
    result = run_oomdoc(args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "CUDA is not available" in result.stderr
    assert not (tmp_path / ".oomdoc").exists() and not (tmp_path / "baseline.json").exists()


@pytest.mark.parametrize(
    "requested, cuda_available, expected",
    [
        ("cpu", True, "cpu"),
        ("cpu", False, "cpu"),
        ("auto", True, "cuda"),
        ("auto", False, "cpu"),
        ("cuda", True, "cuda"),
        ("cuda", False, None),
    ],
)
def test_one_rule_for_what_device_means(requested, cuda_available, expected):
    from oomdoc.capture import choose_device

    assert choose_device(requested, cuda_available) == expected


def test_the_script_sees_what_python_gives_it(tmp_path):
    """As `python script.py`: an absolute `__file__` for a relative path
    (a script that changes directory still finds its files); as `python -m`:
    modules in the current folder are found."""
    (tmp_path / "where.py").write_text(
        "import os, sys\n"
        "print('FILE', __file__, os.path.isabs(__file__))\n"
        "print('ARGV0', sys.argv[0])\n"
    )
    result = run_oomdoc(
        ["run", "--device", "cpu", "--no-replay", "-o", tmp_path / "a.json", "where.py"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert f"FILE {tmp_path / 'where.py'} True" in result.stdout
    assert "ARGV0 where.py" in result.stdout
    result = run_oomdoc(
        ["run", "--device", "cpu", "--no-replay", "-o", tmp_path / "b.json", "-m", "where"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert f"FILE {tmp_path / 'where.py'} True" in result.stdout


def test_replays_that_fail_on_oomdoc_s_own_error_keep_the_failing_run(
    tmp_path, monkeypatch, capsys
):
    """A fault of oomdoc's in the replays (a run on the CPU corpus once ended
    without a snapshot) must not lose the failing run: its snapshot and
    report are written, the error is one line and its traceback is kept
    beside the snapshot, and the exit status is the script's."""
    import oomdoc.replay.orchestrate as orchestrate
    from oomdoc.runner import RunOptions
    from oomdoc.session import run_session

    def broken(*args, **kwargs):
        raise KeyError("a fault of oomdoc's")

    monkeypatch.setattr(orchestrate, "replay_fixes", broken)
    monkeypatch.chdir(tmp_path)
    snapshot_path = tmp_path / "mlp.json"
    options = RunOptions(
        target=str(SCRIPTS / "run_mlp.py"),
        args=["--batch-size", "2048"],
        device="cpu",
        capacity_bytes=256 * MIB,
        output=str(snapshot_path),
        replay_jobs=1,
    )
    assert run_session(options) == 1
    document = load_json(snapshot_path)
    assert document["outcome"] == "oom" and document["oom"]["step"] == 1
    note = next(note for note in document["notes"] if "error of oomdoc's own" in note)
    assert "KeyError" in note and "no fix was measured" in note
    logged = tmp_path / "mlp.files" / "replay-error.txt"
    assert 'raise KeyError("a fault of oomdoc\'s")' in logged.read_text()
    err = capsys.readouterr().err
    assert "oomdoc: the replays stopped on an error of oomdoc's own (KeyError" in err
    assert "What filled" in err  # the report is printed
