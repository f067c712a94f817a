"""Replays end to end on the simulated device, through the real CLI.

The MLP trainer (batch 2048, DataLoader, AdamW) runs out of memory on a 40 MiB
simulated device. The ranked fixes must hold smaller_batch with an exact
max_batch_size (checked by running the script at max and max+1), and
autocast and checkpointing whose peaks are within 5% of the same fixes
written into the script by hand (its --autocast and --checkpointing flags).
"""

from __future__ import annotations

import os

import pytest
from conftest import SCRIPTS, load_json, run_as_replay, run_oomdoc, tree

MLP = SCRIPTS / "replay_mlp_train.py"
CAPACITY = "40MiB"


def run_no_replay(tmp_path, name, *script_args):
    snapshot = tmp_path / f"{name}.json"
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            CAPACITY,
            "--no-replay",
            "-o",
            snapshot,
            MLP,
            *script_args,
        ],
        cwd=tmp_path,
    )
    return result, load_json(snapshot)


def run_replays(tmp_path, name, jobs):
    """The MLP at batch 2048 on 40 MiB, replayed with `jobs` side by side."""
    snapshot = tmp_path / f"{name}.json"
    result = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", CAPACITY, "--replay-jobs", jobs]
        + ["-o", snapshot, MLP, "--batch-size", "2048"],
        cwd=tmp_path,
    )
    return result, load_json(snapshot)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("replay")
    result, document = run_replays(tmp_path, "mlp", 1)
    return result, document, tmp_path


def by_name(document):
    return {fix["name"]: fix for fix in document["fixes"]}


def test_the_ranked_list_and_the_report(replayed):
    result, document, _ = replayed
    assert result.returncode == 1, result.stderr
    fixes = by_name(document)
    assert {"smaller_batch", "autocast", "checkpointing"} <= set(fixes)
    assert all(fix["measured"] for fix in document["fixes"])
    assert [fix["rank"] for fix in document["fixes"]] == list(range(1, len(document["fixes"]) + 1))
    # Fits first, then the catalogue's costs: checkpointing (compute only)
    # before autocast (numerics) before a smaller batch (optimisation).
    names = [fix["name"] for fix in document["fixes"]]
    assert names.index("checkpointing") < names.index("autocast") < names.index("smaller_batch")
    for name in ("smaller_batch", "autocast", "checkpointing"):
        fix = fixes[name]
        assert fix["fits"] and fix["peak_allocated_bytes"] <= document["device"]["capacity_bytes"]
        assert fix["saved_bytes"] > 0 and fix["snippet"]
        assert isinstance(fix["step_time_ratio"], float)
    # A combination of the two best compatible fixes was measured too.
    assert any("+" in name for name in names)
    replay = document["replay"]
    assert (
        replay["baseline_need_estimated"]
        and replay["baseline_need_bytes"] > document["device"]["capacity_bytes"]
    )
    assert [s["name"] for s in replay["skipped"]][:2] == ["empty_cache", "expandable_segments"]
    assert len(replay["batch_search"]["trials"]) <= 4
    # Each replay's child was started (Python, `import torch`) while the one
    # before it ran, and says where its time went.
    runs = replay["runs"]
    assert len(runs) == replay["replays"] and all(run["warm"] for run in runs)
    assert all(run["script_s"] > 0 and run["startup_s"] > 0 for run in runs)

    stderr = result.stderr
    assert "OOMDOC_REPLAY=1" in stderr
    # Plain lines (not a TTY); the first replay at the failing run's own
    # estimate of the limit, the search's other replays verifying it.
    first = replay["batch_search"]["trials"][0][0]
    assert f"oomdoc: replay 1: smaller_batch (--batch-size {first})" in stderr
    assert abs(first - document["max_batch_size"]) <= 0.2 * document["max_batch_size"]
    assert "Fixes, measured by replaying the failing step" in stderr
    assert "(ESTIMATE from the batch-size model)" in stderr
    assert f"Largest batch size that fits: {document['max_batch_size']}" in stderr
    assert "checkpoint(block, x, use_reentrant=False)" in stderr
    assert "not tried: expandable_segments: CUDA only" in stderr


def test_max_batch_size_is_exact(replayed, tmp_path):
    _, document, _ = replayed
    maximum = document["max_batch_size"]
    assert isinstance(maximum, int) and 1 < maximum < 2048
    fits, fits_snapshot = run_no_replay(tmp_path, "max", "--batch-size", str(maximum))
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert fits_snapshot["outcome"] == "ok"
    over, over_snapshot = run_no_replay(tmp_path, "over", "--batch-size", str(maximum + 1))
    assert over.returncode == 1 and over_snapshot["outcome"] == "oom"
    # The smaller-batch fix reports the peak of the run at the maximum.
    assert (
        by_name(document)["smaller_batch"]["peak_allocated_bytes"]
        == fits_snapshot["peak"]["allocated_bytes"]
    )


@pytest.mark.parametrize(
    "name,flag", [("autocast", "--autocast"), ("checkpointing", "--checkpointing")]
)
def test_replayed_fix_matches_the_fix_written_by_hand(replayed, tmp_path, name, flag):
    _, document, _ = replayed
    result, by_hand = run_no_replay(tmp_path, name, "--batch-size", "2048", flag)
    assert result.returncode == 0, result.stderr[-2000:]
    replayed_peak = by_name(document)[name]["peak_allocated_bytes"]
    hand_peak = by_hand["peak"]["allocated_bytes"]
    assert abs(replayed_peak - hand_peak) <= 0.05 * hand_peak, (replayed_peak, hand_peak)


def test_dataloader_batch_size_and_lighter_optimizer(replayed, tmp_path):
    """Without a batch flag on the command line the DataLoader's batch size
    is patched; the search finds the same maximum."""
    _, document, _ = replayed
    snapshot = tmp_path / "loader.json"
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            CAPACITY,
            "--fixes",
            "smaller_batch,lighter_optimizer",
            "-o",
            snapshot,
            MLP,
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    loader = load_json(snapshot)
    assert loader["max_batch_size"] == document["max_batch_size"]
    assert loader["replay"]["batch_search"]["source"] == "DataLoader"
    assert "smaller_batch (DataLoader batch / 2)" in result.stderr
    fixes = by_name(loader)
    assert set(fixes) == {"smaller_batch", "lighter_optimizer"}
    lighter = fixes["lighter_optimizer"]
    # Activations fill the device: a lighter optimizer alone does not fit, and says so.
    assert not lighter["fits"] and "ran out of memory" in lighter["detail"]
    assert "ESTIMATE" in lighter["detail"] and "FSDP" in lighter["detail"]
    estimate = lighter["sharding_estimate"]["per_rank_saved_bytes"]
    assert estimate["fsdp_full_shard"]["8"] > estimate["zero1_optimizer_state"]["8"] > 0


def test_a_hung_replay_is_killed_and_reported(tmp_path):
    snapshot = tmp_path / "hang.json"
    result = run_oomdoc(
        [
            "run",
            "--device",
            "cpu",
            "--device-memory",
            "16MiB",
            "--fixes",
            "autocast",
            "--replay-timeout",
            "3",
            "-o",
            snapshot,
            SCRIPTS / "replay_hang.py",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 1
    document = load_json(snapshot)
    (fix,) = document["fixes"]
    assert fix["outcome"] == "timeout" and not fix["fits"]
    assert "--replay-timeout" in fix["detail"]
    assert (tmp_path / "hang.files" / "replay-1-autocast.log").exists()
    assert "timed out" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--fixes", "bogus"], "unknown fix 'bogus'"),
        (["--fixes", "smaller_batch+autocast"], "smaller_batch cannot be part of one"),
        (["--fixes", "autocast+autocast"], "not a combination"),
        (["--fixes", ","], "at least one fix"),
        (["--no-replay", "--fixes", "autocast"], "no effect with --no-replay"),
        (["--replay-timeout", "0"], "--replay-timeout must be a positive"),
        (["--batch-arg", "batch"], "is not an option name"),
    ],
)
def test_replay_options_are_checked_before_anything_runs(tmp_path, args, message):
    result = run_oomdoc(["run", "--device", "cpu", *args, MLP], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("oomdoc: error:") and message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_prescription_fits_when_run_by_hand(replayed, tmp_path):
    """The measured prescription, applied by hand with the script's own
    flags, fits with a peak within 5% of the reported one."""
    result, document, _ = replayed
    prescription = document["prescription"]
    assert prescription["kind"] == "config" and prescription["measured"] and prescription["fits"]
    capacity = document["device"]["capacity_bytes"]
    assert prescription["peak_allocated_bytes"] <= capacity - prescription["margin_bytes"]
    assert prescription["samples_per_second"] > 0
    assert "Prescription (measured)" in result.stderr
    flags = {"autocast": ["--autocast"], "checkpointing": ["--checkpointing"]}
    by_hand = ["--batch-size", str(prescription["batch_size"])]
    for fix in prescription["fixes"]:
        by_hand += flags[fix]
    run, checked = run_no_replay(tmp_path, "prescribed", *by_hand)
    assert run.returncode == 0, run.stderr[-2000:]
    peak = checked["peak"]["allocated_bytes"]
    assert abs(peak - prescription["peak_allocated_bytes"]) <= 0.05 * peak, (peak, prescription)


def test_replays_side_by_side_measure_what_one_at_a_time_measures(replayed, tmp_path):
    """--replay-jobs 2 runs independent replays together (their device work
    in turn): the same replays, peaks, fix table and batch search as one at
    a time. Timings differ, so the throughput-ranked prescription may pick
    another measured configuration: its peak is one of those measured."""
    _, sequential, _ = replayed
    result, parallel = run_replays(tmp_path, "parallel", 2)
    assert result.returncode == 1, result.stderr[-3000:]

    def table(document):
        return [
            (fix["name"], fix["rank"], fix["outcome"], fix["fits"], fix["peak_allocated_bytes"])
            for fix in document["fixes"]
        ]

    # The prescription's own replays (with its accumulation, with the script's
    # flags) follow the throughput-ranked choice, which timings may change.
    def measured(document):
        return {
            run["label"]: (run["outcome"], run["peak_allocated_bytes"])
            for run in document["replay"]["runs"]
            if not run["label"].startswith(("the script's own flags", "the prescription"))
        }

    assert table(parallel) == table(sequential)
    assert measured(parallel) == measured(sequential)
    for key in ("max_batch_size",):
        assert parallel[key] == sequential[key]
    for key in ("batch_search", "skipped", "baseline_need_bytes", "max_steps"):
        assert parallel["replay"][key] == sequential["replay"][key], key
    assert parallel["replay"]["jobs"] == 2 and sequential["replay"]["jobs"] == 1
    # The speculative combination was the one wanted: nothing ran for nothing.
    assert "unused_runs" not in parallel["replay"]
    runs = parallel["replay"]["runs"]
    first_probe = runs[0]
    assert any(
        run["started_s"] < first_probe["started_s"] + first_probe["wall_s"] for run in runs[1:]
    )
    for document in (sequential, parallel):
        prescription = document["prescription"]
        assert prescription["measured"] and prescription["fits"]
        peaks = {run["peak_allocated_bytes"] for run in document["replay"]["runs"]}
        assert prescription["peak_allocated_bytes"] in peaks
    assert "up to 2 side by side" in result.stderr
    # Numbered as they start: the batch search's first probe first.
    first_batch = parallel["replay"]["batch_search"]["trials"][0][0]
    assert f"oomdoc: replay 1: smaller_batch (--batch-size {first_batch})" in result.stderr


def test_the_files_the_replays_write_are_named(tmp_path):
    """A script that writes as it trains writes in every replay too (its
    log, its checkpoints): the report names what the replays wrote, and
    leaves out oomdoc's own files and the bytecode cache."""
    snapshot = tmp_path / "logged.json"
    result = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", CAPACITY, "--fixes", "smaller_batch"]
        + ["-o", snapshot, MLP, "--batch-size", "2048", "--log", "train.log"],
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    document = load_json(snapshot)
    assert document["framework"]["autocast"] == {}  # its forward ran without autocast
    assert document["files_written"] is None  # the failing run is the user's own run
    (note,) = [note for note in document["notes"] if note.startswith("The replays wrote")]
    assert note.startswith(
        "The replays wrote this file, as the script does when it runs: train.log."
    )
    assert "OOMDOC_REPLAY=1" in note
    assert "The replays wrote this file" in result.stderr


def test_the_replays_leave_the_user_s_files_as_the_run_left_them(tmp_path):
    """A trainer that writes as most do (a new versioned run folder, a log
    appended to, the latest weights saved atomically, checkpoints rotated, a
    metrics file rewritten): every replay that fits writes them all, and
    after the diagnosis the folder holds what it held before plus what the
    user's own run made (its empty run folder: it ran out of memory before
    its first save)."""
    out = tmp_path / "out"
    (out / "runs" / "version_0").mkdir(parents=True)
    (out / "runs" / "version_0" / "step-9.pt").write_bytes(b"an earlier run's checkpoint")
    (out / "last.pt").write_bytes(b"the weights the user resumes from")
    (out / "train.log").write_text("an earlier run\n")
    (out / "metrics.json").write_text('{"loss": 1.0}')
    before = tree(out)
    snapshot = tmp_path / "writes.json"
    result = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", "8MiB", "--fixes", "smaller_batch"]
        + ["-o", snapshot, SCRIPTS / "writes_as_it_trains.py", "--batch-size", "4096"],
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    document = load_json(snapshot)
    assert document["replay"]["batch_search"]["max_batch_size"]  # replays fit, and wrote
    assert tree(out) == {**before, "runs/version_1": ("folder",)}
    (note,) = [note for note in document["notes"] if note.startswith("The replays wrote")]
    assert "out/last.pt" in note
    assert "oomdoc put them back as your run left them: 3 paths restored" in note


# A fix the script already applies, by its own flag: (the flag, the capacity,
# the fix left out, the other replayed, what the failing run records, the
# reason it is not tried, the activations advice's end, the fixes offered).
ALREADY_IN_EFFECT = {
    # nanoGPT runs its forward under bf16 autocast by default: its autocast
    # replays (5 of 15 on the H200) changed nothing.
    "autocast": (
        "--autocast",
        "22MiB",
        "checkpointing",
        ("autocast", lambda recorded: recorded == {"cpu": "bfloat16"}),
        "the script already runs its forward pass under bfloat16 autocast",
        "(the forward already runs under autocast)",
        "checkpointing, smaller_batch",
    ),
    # The HF `Trainer`'s `--gradient_checkpointing` checkpoints every block:
    # oomdoc's would nest a checkpoint in each. (The OOM comes in the first
    # forward, after some of the blocks: the count is theirs.)
    "checkpointing": (
        "--checkpointing",
        "6MiB",
        "autocast",
        ("checkpointed", lambda recorded: list(recorded) == ["MLPBlock"]),
        "the script already checkpoints its blocks ({count} x MLPBlock under "
        "torch.utils.checkpoint)",
        "(the blocks are already checkpointed)",
        "autocast, smaller_batch",
    ),
}


@pytest.mark.parametrize("fix", sorted(ALREADY_IN_EFFECT))
def test_a_fix_the_script_applies_already_is_not_replayed(tmp_path, fix):
    """The failing run records what its first training call already does;
    that fix is "not tried", and the diagnosis no longer offers it."""
    flag, capacity, other, (key, recorded_ok), reason, advice, offered = ALREADY_IN_EFFECT[fix]
    snapshot = tmp_path / f"{fix}.json"
    result = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", capacity, "--fixes", f"{fix},{other}"]
        + ["-o", snapshot, MLP, "--batch-size", "2048", flag],
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    document = load_json(snapshot)
    recorded = document["framework"][key]
    assert recorded_ok(recorded), document["framework"]
    labels = [run["label"] for run in document["replay"]["runs"]]
    assert not any(label.startswith(fix) for label in labels), labels
    assert other in labels
    count = sum(recorded.values()) if key == "checkpointed" else None
    assert f"not tried: {fix}: {reason.format(count=count)}" in result.stderr
    (activations,) = [line for line in result.stderr.splitlines() if "1. activations:" in line]
    assert activations.endswith(advice), activations
    assert f"     fixes: {offered}\n" in result.stderr


def test_an_oom_the_script_turns_into_an_exit_is_diagnosed_and_replayed(tmp_path):
    """Hydra's `@hydra.main` catches every error of the job, prints it and
    calls `sys.exit(1)`: the OOM reached oomdoc as a SystemExit, and the run
    was reported as a script that failed, with no replay. The exit status
    stays the script's own."""
    snapshot = tmp_path / "exits.json"
    result = run_oomdoc(
        ["run", "--device", "cpu", "--device-memory", CAPACITY, "--fixes", "smaller_batch"]
        + ["-o", snapshot, MLP, "--batch-size", "2048"],
        cwd=tmp_path,
        env={"MLP_EXITS_ON_ERROR": "1"},
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Error executing job: OutOfMemoryError" in result.stderr
    document = load_json(snapshot)
    assert document["outcome"] == "oom" and document["exit_code"] == 1
    assert document["oom"]["requested_bytes"] > 0
    assert isinstance(document["max_batch_size"], int) and document["max_batch_size"] < 2048


def test_an_oom_behind_another_error_is_still_the_oom():
    import torch

    from oomdoc.capture.backend_base import oom_behind

    oom = torch.OutOfMemoryError("out of memory")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as caught:
            raise RuntimeError("training failed") from caught
    except RuntimeError as wrapped:
        assert oom_behind(wrapped) is oom
    try:
        try:
            raise ValueError("not memory")
        except ValueError:
            raise SystemExit(1)
    except SystemExit as exit_:
        assert oom_behind(exit_) is None


def test_a_replay_s_files_written_leave_out_oomdoc_s_and_scratch_files(tmp_path, monkeypatch):
    from oomdoc.capture.replay_writes import WrittenFiles

    monkeypatch.chdir(tmp_path)
    written = WrittenFiles([str(tmp_path / "run.files")])
    for path, mode, flags in [
        ("ckpt.pt", "wb", 0),
        ("data.txt", "r", 0),  # read: not written
        ("ckpt.pt", "ab", 0),  # once
        (str(tmp_path / "run.files" / "x.pickle"), "wb", 0),  # oomdoc's own
        (str(tmp_path / "pkg" / "__pycache__" / "m.pyc"), "wb", 0),
        ("/proc/self/status", "w", 0),
        (b"raw.bin", None, os.O_WRONLY | os.O_CREAT),  # os.open
        (5, "wb", 0),  # a file descriptor
        (os.path.expanduser("~/.cache/torch/kernels.bin"), "wb", 0),
    ]:
        written.hook("open", (path, mode, flags))
    written.hook("exec", (None,))
    assert written.fields() == {
        "paths": [str(tmp_path / "ckpt.pt"), str(tmp_path / "raw.bin")],
        "count": 2,
    }


def test_watching_a_replay_s_writes_never_waits_on_what_opened_the_file(tmp_path):
    """The first tempfile.gettempdir() opens a file to test the folder while
    it holds a lock: a hook that asked for the folder there waited on that
    lock for good, and every replay whose script made a DataLoader hung."""
    script = (
        "import os, tempfile\n"
        "import torch\n"  # as in the child: imported before the watch starts
        "from oomdoc.capture import replay_writes\n"
        "tempfile.tempdir = None\n"  # as in a fresh process: not yet worked out
        "replay_writes.watch([])\n"
        "tempfile.tempdir = None\n"
        "print(tempfile.gettempdir())\n"
        "open('written.txt', 'w').close()\n"
        "torch.save({'w': torch.zeros(2)}, 'ckpt.pt')\n"  # opened in native code
        "assert torch.load('ckpt.pt')['w'].shape == (2,)\n"
        "print(replay_writes.fields()['paths'])\n"
    )
    result = run_as_replay(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert str(tmp_path / "written.txt") in result.stdout
    assert str(tmp_path / "ckpt.pt") in result.stdout
