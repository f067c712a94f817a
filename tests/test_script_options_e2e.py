"""The script's own options, as the script takes them, end to end on the
simulated device (issue 23, item 4): the batch search finds the batch where
the script's flag has it, replays and snippets write it in the form the
script accepts, and the largest batch is checked by running the script
plainly at it (fits) and one more (runs out of memory)."""

from __future__ import annotations

import pytest
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


def run_search(tmp_path, name, capacity, script, args):
    """`oomdoc run --fixes smaller_batch` of a script that runs out of
    memory: the batch search and the prescription only."""
    completed, document = run_capped(
        tmp_path / f"{name}.json",
        capacity,
        script,
        args,
        ["--fixes", "smaller_batch"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "oom", completed.stderr[-3000:]
    return completed, document


def searched_through(document, source, original, spelled_as):
    """The batch search went through `source` from `original`, each replay
    labelled with the batch as `spelled_as(batch)`: the largest batch."""
    search = document["replay"]["batch_search"]
    assert search["source"] == source and search["original_batch_size"] == original, search
    maximum = document["max_batch_size"]
    assert isinstance(maximum, int) and 1 < maximum < original, search
    searched = [run["label"] for run in document["replay"]["runs"][: len(search["trials"])]]
    assert searched == [f"smaller_batch ({spelled_as(batch)})" for batch, _ in search["trials"]]
    return maximum


def test_a_short_batch_flag_is_found_and_searched(tmp_path):
    """imagenet's `-b/--batch-size`, invoked as `-b 64`: the search rewrites
    `-b`, and the snippet says `-b N`."""
    script = SCRIPTS / "opts_short_batch_flag.py"
    completed, document = run_search(tmp_path, "short", "1.02MiB", script, ["-b", "64"])
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


CONFIGURATOR = SCRIPTS / "opts_configurator"


def test_a_configurator_scripts_options_are_written_key_equals_value(tmp_path):
    """nanoGPT's idiom: globals overridden by a configurator exec'd over
    them, which takes `--key=value` only (and rejects `--key value`), after
    a configuration file given as a positional. The replays run with
    `--batch_size=N`; the snippets and the prescription's command say
    `--batch_size=N --gradient_accumulation_steps=K` and keep the file."""
    script, config = CONFIGURATOR / "train.py", CONFIGURATOR / "config" / "tiny.py"
    completed, document = run_search(
        tmp_path,
        "configurator",
        "2.45MiB",
        script,
        [config, "--batch_size=16", "--gradient_accumulation_steps=2"],
    )
    assert document["script_option_syntax"] == "configurator"
    assert {"--batch_size", "--gradient_accumulation_steps"} <= set(document["script_options"])
    maximum = searched_through(document, "--batch_size", 16, lambda b: f"--batch_size={b}")
    smaller = next(fix for fix in document["fixes"] if fix["name"] == "smaller_batch")
    micro, steps = smaller["micro_batch_size"], smaller["accumulation_steps"]
    own = [str(config), f"--batch_size={micro}", f"--gradient_accumulation_steps={2 * steps}"]
    assert smaller["snippet"].splitlines()[-1] == f"python {script} {' '.join(own)}"
    prescription = document["prescription"]
    micro, steps = prescription["batch_size"], prescription["accumulation_steps"]
    own = [str(config), f"--batch_size={micro}", f"--gradient_accumulation_steps={2 * steps}"]
    assert prescription["snippet"].splitlines()[-1] == f"python {script} {' '.join(own)}"
    checked = prescription["verified_by_flags"]
    assert checked["args"] == own and checked["outcome"] == "fits", checked
    assert checked["note"].startswith("--max_iters raised to"), checked
    assert " --batch_size " not in completed.stderr and "--batch_size=" in completed.stderr
    run = largest_batch_is_exact(
        tmp_path, "2.45MiB", script, lambda batch: [config, f"--batch_size={batch}"]
    )
    assert run(maximum) == (0, "ok")
    assert run(maximum + 1) == (1, "oom")


def test_a_script_without_an_optimizer_gets_its_own_update_accumulated(tmp_path):
    """word_language_model's idiom: `--batch_size 20`, no optimizer, the
    parameters updated by hand. It fails in its first forward (no backward
    seen), so its update is learned from the search's replays; the
    accumulation snippets show that update and `model.zero_grad()` every
    K micro-batches, never `optimizer.step()`."""
    script = SCRIPTS / "opts_manual_sgd.py"
    completed, document = run_search(tmp_path, "manual", "1.12MiB", script, ["--batch_size", "20"])
    assert document["optimizers"] == []
    search = document["replay"]["batch_search"]
    assert search["source"] == "--batch_size", search
    maximum = document["max_batch_size"]
    assert isinstance(maximum, int) and 1 < maximum < 20, search
    smaller = next(fix for fix in document["fixes"] if fix["name"] == "smaller_batch")
    for snippet in (smaller["snippet"], document["prescription"]["snippet"]):
        assert "optimizer" not in snippet.replace("has no optimizer", ""), snippet
        assert "p.data.add_(p.grad, alpha=-lr)" in snippet and "model.zero_grad()" in snippet
        assert "/ accumulation_steps" in snippet
    assert "optimizer.step()" not in completed.stderr
    run = largest_batch_is_exact(
        tmp_path, "1.12MiB", script, lambda batch: ["--batch_size", str(batch)]
    )
    assert run(maximum) == (0, "ok")
    assert run(maximum + 1) == (1, "oom")


HYDRA = SCRIPTS / "opts_hydra" / "train.py"


def test_a_hydra_override_is_the_batch_the_search_rewrites(tmp_path):
    """Hydra's idiom (the lightning-hydra-template's): `data.batch_size=512`,
    an override with no dashes, which Hydra takes only as `key=value`. The
    replays rewrite it, the snippet says it, and the largest batch is exact
    when the script is run plainly with the override (Hydra turns the OOM
    into `sys.exit(1)`: still an OOM)."""
    pytest.importorskip("hydra")
    completed, document = run_search(tmp_path, "hydra", "4MiB", HYDRA, ["data.batch_size=512"])
    maximum = searched_through(document, "data.batch_size", 512, lambda b: f"data.batch_size={b}")
    smaller = next(fix for fix in document["fixes"] if fix["name"] == "smaller_batch")
    assert f"# data.batch_size={smaller['micro_batch_size']}: " in smaller["snippet"]
    run = largest_batch_is_exact(
        tmp_path, "4MiB", HYDRA, lambda batch: [f"data.batch_size={batch}"]
    )
    assert run(maximum) == (0, "ok")
    assert run(maximum + 1) == (1, "oom")
