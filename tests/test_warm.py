"""What a warm replay child imports ahead from the script's own import
statements (oomdoc.warm.script_preimports), read without running it."""

from __future__ import annotations

import sys
import textwrap

from oomdoc.warm import script_preimports

SCRIPT = '''
"""A training script."""
from __future__ import annotations

import os, json
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from torch.utils.data import *
from . import sibling
from .helpers import thing
import localmod
from localpkg.sub import name
try:
    import yaml
except ImportError:
    yaml = None
import numpy as np


def main():
    import scipy


class Model:
    import tokenizers


if __name__ == "__main__":
    import PIL
'''


def test_the_scripts_top_level_imports_of_installed_packages_are_read(tmp_path):
    (tmp_path / "localmod.py").write_text("raise SystemExit('never imported')\n")
    (tmp_path / "localpkg").mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert script_preimports(str(script)) == [
        "torch",
        "transformers",
        "transformers:GPT2Config",
        "transformers:GPT2LMHeadModel",
        "torch.utils.data",
        "yaml",
        "numpy",
    ]


def test_nothing_after_the_first_other_statement_is_read(tmp_path):
    """A statement before an import may change what importing does."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import os
            os.environ["HF_HOME"] = "/elsewhere"
            import transformers
            """
        )
    )
    assert script_preimports(str(script)) == ["torch"]


def test_a_module_that_shadows_an_installed_package_is_never_imported(tmp_path, monkeypatch):
    """The script's folder and the current folder come first on the child's path."""
    (tmp_path / "yaml.py").write_text("")
    elsewhere = tmp_path / "cwd"
    (elsewhere / "numpy").mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    script = tmp_path / "train.py"
    script.write_text("import yaml\nimport numpy\nimport torch\n")
    assert script_preimports(str(script)) == ["torch"]


def test_an_unreadable_script_gives_nothing(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\ndef (:\n")
    assert script_preimports(str(broken)) == []
    assert script_preimports(str(tmp_path / "missing.py")) == []


def test_a_warm_child_takes_names_as_from_imports_do(tmp_path, monkeypatch):
    """`module:name`: an attribute a lazy package loads on access, else a
    submodule; a name that fails is left for the script."""
    from oomdoc.capture.imports import preimport

    package = tmp_path / "lazypkg_for_warm"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import importlib\n"
        "def __getattr__(name):\n"
        "    if name == 'Model':\n"
        "        return importlib.import_module('lazypkg_for_warm.modeling').Model\n"
        "    raise AttributeError(name)\n"
    )
    (package / "modeling.py").write_text("class Model: pass\n")
    (package / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    record: dict = {}
    names = ["lazypkg_for_warm:Model", "lazypkg_for_warm:sub", "lazypkg_for_warm:Missing"]
    try:
        preimport(names, record)
        assert "lazypkg_for_warm.modeling" in sys.modules and "lazypkg_for_warm.sub" in sys.modules
        assert record["modules"] == names[:2]
    finally:
        for name in [name for name in sys.modules if name.startswith("lazypkg_for_warm")]:
            del sys.modules[name]


def test_once_replays_take_children_one_more_waits(tmp_path):
    """Not while the failing run runs (it would slow it); once replays do, a
    child's start-up outlasts a short replay: a spare waits where the host
    has more than two cores per lane (spares_for)."""
    from oomdoc.runner import ChildRequest
    from oomdoc.warm import WarmPool, spares_for

    pool = WarmPool("cpu", {"OOMDOC_REPLAY": "1"}, size=1)
    try:
        pool.fill()
        assert len(pool.spares) == 1
        request = ChildRequest(
            target="train.py",
            args=[],
            device="cpu",
            extra_env={"OOMDOC_REPLAY": "1"},
            output_path=str(tmp_path / "replay.log"),
        )
        taken = pool.take(request)
        assert taken is not None and taken not in pool.spares
        assert len(pool.spares) == 1 + spares_for(1)
        taken.discard()
    finally:
        pool.close()


def test_a_warm_child_takes_the_allocators_settings_when_it_is_handed_its_work(
    tmp_path, monkeypatch
):
    """A replay with expandable segments starts warm: the child started
    without PYTORCH_CUDA_ALLOC_CONF and sets it before the script runs; the
    script sees it as a child started with it would. A child that started
    with a value other than the one asked for is not used."""
    from oomdoc.runner import ChildRequest, run_child
    from oomdoc.warm import WarmPool

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "open(sys.argv[1], 'w').write(os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'unset'))\n"
    )
    replay_env = {"OOMDOC_REPLAY": "1"}
    seen = tmp_path / "seen.txt"

    def request(extra: dict) -> ChildRequest:
        return ChildRequest(
            target=str(script),
            args=[str(seen)],
            device="cpu",
            capacity_bytes=64 * 1024 * 1024,
            extra_env={**replay_env, **extra},
            output_path=str(tmp_path / "replay.log"),
            timeout_s=120,
        )

    expandable = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    pool = WarmPool("cpu", replay_env, size=1)
    try:
        pool.fill()
        result = run_child(request(expandable), pool=pool)
        assert result.warm and result.exit_code == 0, (tmp_path / "replay.log").read_text()
        assert seen.read_text() == "expandable_segments:True"
        result = run_child(request({}), pool=pool)
        assert result.warm and seen.read_text() == "unset"
    finally:
        pool.close()

    collect = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    started_with = WarmPool("cpu", {**replay_env, **collect})
    try:
        started_with.fill()
        assert started_with.take(request(expandable)) is None
        same = started_with.take(request(collect))
        assert same is not None and same.late_env_for(request(collect)) == {}
        same.discard()
    finally:
        started_with.close()


def test_a_replay_ends_without_the_interpreters_teardown(tmp_path):
    """A replay's child (quick_exit) ends once its capture is written: the
    script's atexit handlers run, the interpreter's teardown (objects freed
    one by one, which on the H100 took 1.3 to 2.0 s of an HF Trainer replay)
    does not, and the exit status is the script's. The user's own run keeps
    the teardown."""
    from oomdoc.runner import ChildRequest, run_child

    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, sys

            out = sys.argv[1]
            atexit.register(lambda: open(out + ".atexit", "w").close())

            class FreedAtTeardown:
                def __del__(self):
                    open(out + ".teardown", "w").close()

            kept = FreedAtTeardown()
            sys.exit(3)
            """
        )
    )
    for quick in (True, False):
        out = tmp_path / f"quick-{quick}"
        result = run_child(
            ChildRequest(
                target=str(script),
                args=[str(out)],
                device="cpu",
                capacity_bytes=64 * 1024 * 1024,
                extra_env={"OOMDOC_REPLAY": "1"},
                output_path=str(tmp_path / f"{quick}.log"),
                timeout_s=120,
                quick_exit=quick,
            )
        )
        log = (tmp_path / f"{quick}.log").read_text()
        assert result.exit_code == 3, log
        assert result.capture is not None and result.capture["exit_code"] == 3
        assert (tmp_path / f"quick-{quick}.atexit").exists(), log
        assert (tmp_path / f"quick-{quick}.teardown").exists() is not quick, log
