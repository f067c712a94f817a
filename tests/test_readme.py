"""The README's commands run as written (issue 26): the install block's
oomdoc command, and the quick start's `$ oomdoc ...` commands in a fresh copy
of the examples, each printing the lines the README shows for it.

The slow parts (creating a virtual environment, pip, make) are left out:
their logic is checked with `make -n`-style dry runs instead.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

from conftest import REPO_ROOT, run_oomdoc

README = (REPO_ROOT / "README.md").read_text()
# Installing (venv, pip, make) is slow and needs the network: not run here.
SLOW = ("python3 -m venv", ". .venv/bin/activate", "pip install", "make ")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def console_commands() -> list[tuple[str, list[str]]]:
    """Each `$ command` of the console blocks, with the output lines shown under it."""
    found: list[tuple[str, list[str]]] = []
    for block in blocks("console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                found.append((line[2:], []))
            elif found:
                found[-1][1].append(line)
    return found


def oomdoc_arguments(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "oomdoc", command
    return words[1:]


def test_the_readme_keeps_make_demo_and_make_test():
    assert "make demo" in README and "make test" in README
    assert "docs/benchmarks.md" in README and (REPO_ROOT / "docs" / "benchmarks.md").exists()


def test_the_install_block_runs_as_written():
    (install,) = [block for block in blocks("sh") if "python3 -m venv" in block]
    for line in install.splitlines():
        if not line.strip() or line.startswith("#") or line.startswith(SLOW):
            continue
        result = run_oomdoc(oomdoc_arguments(line))
        assert result.returncode == 0 and result.stdout.startswith("oomdoc "), result


def test_make_installs_the_cpu_build_of_torch_without_a_gpu(tmp_path):
    """`make demo` on a CPU-only machine installs torch==2.13.0 from the CPU
    index, not the CUDA wheel (pip stubbed by echo, torch missing)."""
    if shutil.which("make") is None or shutil.which("nvidia-smi") is not None:
        import pytest

        pytest.skip("needs make and a machine without nvidia-smi")
    dry = subprocess.run(
        ["make", "-s", "install", "PYTHON=false", "PIP=echo"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    assert "install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in dry.stdout


def test_the_quick_start_commands_run_as_written(tmp_path):
    shutil.copytree(REPO_ROOT / "examples", tmp_path / "examples")
    commands = console_commands()
    assert [oomdoc_arguments(command)[0] for command, _ in commands][:3] == [
        "run",
        "suggest",
        "check",
    ]
    for command, shown in commands:
        result = run_oomdoc(oomdoc_arguments(command), cwd=tmp_path)
        output = result.stdout + result.stderr
        assert result.returncode in (0, 1), (command, output)
        assert "oomdoc: error" not in output, (command, output)
        # Every line the README shows for it, but those shortened or timed.
        for line in shown:
            if line.strip() in ("", "...") or "ms)" in line or line.startswith("  File "):
                continue
            assert line in output, (command, line)
