"""The package's structure: no import cycles, a parent that never imports
torch, one registry line per fix, rule and reporter."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT, SCRIPTS, oomdoc_env

PACKAGE = REPO_ROOT / "oomdoc"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """oomdoc modules `path` imports, anywhere in it: inside functions and
    under `if TYPE_CHECKING:` too (a type-only import still ties the two
    modules together: neither can be understood, or moved, alone)."""
    tree = ast.parse(path.read_text())
    package = (
        _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    )
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    resolved = set()
    for name in found:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            resolved.add(name)
    return resolved


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        # A package's __init__ is imported by its submodules; edges to a
        # parent package from its own children are not cycles of code.
        graph[name] = {
            dep for dep in _imports(path, modules) if dep != name and not name.startswith(dep + ".")
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                cycle = walk(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "oomdoc.analysis" in graph and graph["oomdoc.session"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # Two modules that import each other, one of them only under
    # `if TYPE_CHECKING:`: the graph has both edges, and the finder the cycle.
    package = tmp_path / "oomdoc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "results.py").write_text("from oomdoc.reports import render\n")
    (package / "reports.py").write_text(
        "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n"
        "    from oomdoc.results import Result\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    graph = import_graph()
    assert graph["oomdoc.reports"] == {"oomdoc.results"}
    assert find_cycle(graph) == ["oomdoc.reports", "oomdoc.results", "oomdoc.reports"]


MAX_MODULE_LINES = 800


def test_no_module_is_over_800_lines():
    """A module a reader can hold in mind: past 800 lines, split it by what
    its parts do."""
    too_long = {
        str(path.relative_to(REPO_ROOT)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, too_long


def test_parent_side_modules_import_no_child_side_module():
    # capture/ runs in the child (it imports torch); the parent's modules must
    # not depend on it, except for the torch-free constants in its __init__.
    graph = import_graph()
    parent_side = [
        name
        for name in graph
        if not name.startswith("oomdoc.capture") and name != "oomdoc.pytest_plugin"
    ]
    for name in parent_side:
        child_side = {dep for dep in graph[name] if dep.startswith("oomdoc.capture.")}
        assert not child_side, f"{name} imports {child_side}"


PROBE = """
import json, sys
from oomdoc import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def test_the_parent_stays_torch_free_when_the_child_is_killed(tmp_path):
    output = tmp_path / "run.json"
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            "run",
            "--device",
            "auto",
            "-o",
            str(output),
            str(SCRIPTS / "killed_at_start.py"),
        ],
        env=oomdoc_env({"CUDA_VISIBLE_DEVICES": ""}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    verdict = json.loads(completed.stderr.strip().splitlines()[-1])
    assert verdict == {"exit": 137, "torch": False}, completed.stderr
    snapshot = json.loads(output.read_text())
    # SIGKILL is no interruption (issue 26): the kernel's OOM killer sends it.
    assert snapshot["outcome"] == "error" and snapshot["device"]["kind"] == "simulated"
    assert snapshot["error"]["type"] == "killed by SIGKILL"
    assert "without writing its capture" in snapshot["notes"][0]
    assert "Interrupted" not in completed.stderr and "killed by SIGKILL" in completed.stderr


def test_one_registration_line_per_fix_rule_and_reporter():
    from oomdoc.diagnosis import RULES
    from oomdoc.fixes import FIXES
    from oomdoc.reporters import REPORTERS

    registries = {
        PACKAGE / "fixes" / "__init__.py": [type(fix).__name__ for fix in FIXES],
        PACKAGE / "diagnosis" / "__init__.py": [
            rule.__module__.rsplit(".", 1)[1] + ".rule" for rule in RULES
        ],
        PACKAGE / "reporters" / "__init__.py": [
            reporter.__name__ for reporter in REPORTERS.values()
        ],
    }
    for path, names in registries.items():
        text = path.read_text()
        for name in names:
            lines = [
                line
                for line in text.splitlines()
                if re.search(rf"\b{re.escape(name)}\b", line)
                and not line.lstrip().startswith(("from", "import", "#"))
            ]
            assert len(lines) == 1, (path, name, lines)
