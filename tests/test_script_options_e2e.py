"""The script's own options, as the script takes them, end to end on the
simulated device (issue 23, item 4): the batch search finds the batch where
the script's flag has it, replays and snippets write it in the form the
script accepts, and the largest batch is checked by running the script
plainly at it (fits) and one more (runs out of memory)."""

from __future__ import annotations

from conftest import SCRIPTS, run_capped


def largest_batch_is_exact(tmp_path, capacity, script, args_at):
    """The script run plainly at `args_at(maximum)` fits and at one more
    runs out of memory."""

    def run(batch):
        completed, document = run_capped(
            tmp_path / f"plain-{batch}.json",
            capacity,
            script,
            args_at(batch),
            ["--no-replay"],
            cwd=tmp_path,
        )
        return completed.returncode, document["outcome"]

    return run


def test_a_short_batch_flag_is_found_and_searched(tmp_path):
    """imagenet's `-b/--batch-size`, invoked as `-b 64`: the search rewrites
    `-b`, and the snippet says `-b N`."""
    script = SCRIPTS / "opts_short_batch_flag.py"
    completed, document = run_capped(
        tmp_path / "short.json",
        "1.02MiB",
        script,
        ["-b", "64"],
        ["--fixes", "smaller_batch"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "oom", completed.stderr[-3000:]
    assert document["script_option_aliases"]["-b"] == "--batch-size"
    search = document["replay"]["batch_search"]
    assert search["source"] == "-b" and search["original_batch_size"] == 64, search
    maximum = document["max_batch_size"]
    assert isinstance(maximum, int) and 1 < maximum < 64, search
    smaller = next(fix for fix in document["fixes"] if fix["name"] == "smaller_batch")
    micro = smaller["micro_batch_size"]
    assert f"# -b {micro}: " in smaller["snippet"]
    run = largest_batch_is_exact(tmp_path, "1.02MiB", script, lambda batch: ["-b", str(batch)])
    assert run(maximum) == (0, "ok")
    assert run(maximum + 1) == (1, "oom")
