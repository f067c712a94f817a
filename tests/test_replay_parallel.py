"""Replays side by side (`--replay-jobs`) end to end on the simulated device:
replays that hang or die, holding the device lock or not, end and let the
others report; Ctrl-C stops them all and keeps what was measured; the
failing run's framework is imported ahead by the replays' warm children."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO_ROOT, SCRIPTS, load_json, oomdoc_env, run_oomdoc

MLP = SCRIPTS / "replay_mlp_train.py"
LANE = SCRIPTS / "replay_lane.py"


def oomdoc_run(tmp_path, name, memory, *args, env=None):
    """`oomdoc run` on the simulated device of `memory`; (result, snapshot)."""
    snapshot = tmp_path / f"{name}.json"
    result = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", memory, "-o", snapshot, *args],
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 1, result.stderr[-3000:]  # the failing run's status
    return result, load_json(snapshot)


def test_hanging_replays_side_by_side_end_at_their_timeout(tmp_path):
    """Both replays of replay_hang.py hang before their first step: they run
    together and each is killed at its own timeout."""
    timeout = 5
    _, document = oomdoc_run(
        tmp_path,
        "hang",
        "16MiB",
        *["--fixes", "smaller_batch,autocast", "--replay-jobs", 2, "--replay-timeout", timeout],
        SCRIPTS / "replay_hang.py",
        # A batch flag: without one (nor a DataLoader) no smaller-batch replay runs.
        *["--batch-size", 4096],
    )
    fixes = {fix["name"]: fix for fix in document["fixes"]}
    assert fixes["autocast"]["outcome"] == "timeout"
    assert fixes["smaller_batch"]["outcome"] == "timeout"
    assert "--replay-timeout" in fixes["smaller_batch"]["detail"]
    runs = document["replay"]["runs"]
    assert [run["outcome"] for run in runs] == ["timeout", "timeout"]
    # Side by side: the second started before the first was killed.
    assert all(run["started_s"] < timeout for run in runs)
    assert list((tmp_path / "hang.files").glob("replay-*-autocast.log"))


@pytest.mark.parametrize("misbehaviour", ["die", "hang"])
def test_a_replay_that_dies_or_hangs_holding_the_device_lock_lets_the_others_run(
    tmp_path, misbehaviour
):
    """The autocast replay of replay_lane.py dies (SIGKILL) or hangs inside
    its first step, holding the device lock: the checkpointing replay still
    gets the device and fits; its wait for the lock does not count toward its
    timeout."""
    _, document = oomdoc_run(
        tmp_path,
        misbehaviour,
        "24MiB",
        # The hang lasts the timeout: long enough for the other replay (a few
        # seconds alone) on a loaded two-core machine, no longer.
        *["--fixes", "autocast,checkpointing", "--replay-jobs", 2, "--replay-timeout", 25],
        LANE,
        "--under-autocast",
        misbehaviour,
    )
    fixes = {fix["name"]: fix for fix in document["fixes"]}
    assert fixes["checkpointing"]["fits"], fixes["checkpointing"]["detail"]
    autocast = fixes["autocast"]
    if misbehaviour == "die":
        assert autocast["outcome"] == "error" and "exit status 137" in autocast["detail"]
    else:
        assert autocast["outcome"] == "timeout" and "--replay-timeout" in autocast["detail"]
    if misbehaviour == "hang":
        runs = {run["label"]: run for run in document["replay"]["runs"]}
        assert runs["checkpointing"]["started_s"] < runs["autocast"]["wall_s"]  # side by side


def test_ctrl_c_stops_replays_side_by_side_and_keeps_what_was_measured(tmp_path):
    snapshot = tmp_path / "interrupted.json"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oomdoc",
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "40MiB",
            "--replay-jobs",
            "2",
            "--fixes",
            "autocast,checkpointing,lighter_optimizer",
            "-o",
            str(snapshot),
            str(MLP),
            "--batch-size",
            "2048",
        ],
        cwd=tmp_path,
        env=oomdoc_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's Ctrl-C signals the whole group
    )
    finished = re.compile(r"oomdoc: replay \d+: \S+: (fits|out of memory)")
    stderr = []
    deadline = time.time() + 300
    assert process.stderr is not None
    while time.time() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        stderr.append(line)
        if finished.search(line):
            os.killpg(process.pid, signal.SIGINT)
            break
    else:
        process.kill()
        raise AssertionError("no replay finished")
    _, rest = process.communicate(timeout=120)
    stderr.append(rest or "")
    text = "".join(stderr)
    assert process.returncode == 1, text[-3000:]  # the failing run's own status
    document = load_json(snapshot)
    assert any("Replays were interrupted" in note for note in document["notes"])
    kept = document["fixes"]
    assert kept and len(kept) < 3, text[-3000:]
    assert all(fix["outcome"] in ("fits", "oom") for fix in kept)
    assert "interrupted" in text


def test_the_failing_runs_packages_are_imported_ahead_by_the_replays(tmp_path, tmp_path_factory):
    """The script imports an installed package (12 modules, a second to
    import): the snapshot records it, and the replay's warm child imported it
    while it waited, so the replay's script did not. (Its import times go to
    a folder outside the working directory: what the replay writes there is
    put back, oomdoc.kept_files.)"""
    probes = tmp_path_factory.mktemp("import-times")
    installed = tmp_path / "lib" / "site-packages" / "slowpkg"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text(
        "import time\ntime.sleep(1.0)\n" + "".join(f"from . import m{n}\n" for n in range(12))
    )
    for n in range(12):
        (installed / f"m{n}.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, runpy, sys, time\n"
        "started = time.perf_counter()\n"
        "import slowpkg  # noqa\n"
        "probe = 'import-' + os.environ.get('OOMDOC_REPLAY', '0') + '.txt'\n"
        "with open(os.path.join(os.environ['PROBES'], probe), 'w') as f:\n"
        "    f.write(str(time.perf_counter() - started))\n"
        f"sys.argv[0] = {str(LANE)!r}\n"
        f"runpy.run_path({str(LANE)!r}, run_name='__main__')\n"
    )
    _, document = oomdoc_run(
        tmp_path,
        "imports",
        "24MiB",
        *["--fixes", "checkpointing", script],
        env={
            "PYTHONPATH": os.pathsep.join((str(REPO_ROOT), str(installed.parent))),
            "PROBES": str(probes),
        },
    )
    assert document["imported_packages"] == ["slowpkg"]
    (run,) = document["replay"]["runs"]
    assert run["outcome"] == "fits"
    assert run["preimport_s"] >= 1.0  # while it waited for its work
    # The script's own `import slowpkg`: a second in the failing run, nothing in the replay.
    assert float((probes / "import-0.txt").read_text()) >= 1.0
    assert float((probes / "import-1.txt").read_text()) < 0.5
