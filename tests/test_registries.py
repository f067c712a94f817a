"""The registries are complete, by test (issue 27): every fix the prescription
may combine has words in every framework, the batch-size flags are one list,
and no room names a fix by string outside the fix's own unit (a room asks
the fix for a capability instead: `changes_batch`, `searches_batch`, ...)."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import oomdoc
from oomdoc.fixes import FIXES, Fix, batch_fix
from oomdoc.frameworks import FRAMEWORKS, Framework
from oomdoc.script_flags import BATCH_FLAGS, EVAL_BATCH_FLAGS

PACKAGE = pathlib.Path(oomdoc.__file__).parent

# Everything a replay may have learned for a snippet, and what the snapshot
# gives every unit (oomdoc.frameworks.context_from_snapshot).
CONTEXT = {
    "micro_batch": 12,
    "accumulation_steps": 2,
    "how": "--batch-size",
    "device_type": "cuda",
    "dtype": "bfloat16",
    "blocks_path": "transformer.h",
    "blocks_class": "GPT2Block",
    "blocks_count": 24,
    "blocks_groups": [{"path": "transformer.h", "class": "GPT2Block", "count": 24}],
    "optimizer": "Adafactor",
    "entry": None,
    "module": None,
    "version": None,
    "command": ["train.py", "--batch-size", "24"],
    "update": "optimizer",
    "script_options": [],
    "script_option_values": {},
    "script_option_aliases": {},
    "script_option_syntax": None,
}


def prescribed_fixes() -> list[Fix]:
    """What a prescription may hold: the savers it combines and the batch change."""
    return [fix for fix in FIXES if fix.prescribable or fix.changes_batch]


def test_there_are_fixes_a_prescription_combines():
    names = {fix.name for fix in prescribed_fixes()}
    assert batch_fix().name in names and len(names) >= 3


@pytest.mark.parametrize("framework", FRAMEWORKS, ids=lambda framework: framework.name)
@pytest.mark.parametrize("fix", prescribed_fixes(), ids=lambda fix: fix.name)
def test_every_prescribed_fix_has_words_in_every_framework(fix: Fix, framework: Framework):
    """The real snippet, rendered: a framework unit that does not know the
    fix writes nothing for it, or leaves the prescription's block as it is
    without it."""
    snippet = framework.snippet(fix.name, dict(CONTEXT))
    assert snippet.strip(), f"{framework.name} has no snippet for {fix.name}"
    others = [other.name for other in prescribed_fixes() if other is not fix]
    with_it = framework.prescription_snippet([*others, fix.name], dict(CONTEXT))
    without = framework.prescription_snippet(others, dict(CONTEXT))
    assert with_it.strip() and with_it != without, (
        f"{framework.name}'s prescription block ignores {fix.name}"
    )


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _string_sequences(tree: ast.AST):
    """Every tuple, list or set literal and the string constants it holds."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            strings = [
                item.value
                for item in node.elts
                if isinstance(item, ast.Constant) and isinstance(item.value, str)
            ]
            yield node, strings


def test_batch_size_flags_are_one_list():
    """oomdoc.script_flags.BATCH_FLAGS (and its evaluation batches) is the
    only list of batch-size flags in the package: two lists disagreed once
    (4 flags against 8)."""
    known = set(BATCH_FLAGS) | set(EVAL_BATCH_FLAGS)
    others = []
    for path in _modules():
        if path == PACKAGE / "script_flags.py":
            continue
        for node, strings in _string_sequences(ast.parse(path.read_text())):
            flags = [value for value in strings if value in known or "batch_size" in value]
            if len([flag for flag in flags if flag.startswith("-")]) >= 2:
                others.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {flags}")
    assert others == []


def test_the_batch_flags_list_catches_a_second_list(tmp_path):
    """The check above finds a second list when there is one."""
    tree = ast.parse('FLAGS = ("--batch-size", "--bs")\nOTHER = ("--lr", "--bs")\n')
    found = [strings for _node, strings in _string_sequences(tree)]
    assert ["--batch-size", "--bs"] in found


def _unit_of(fix: Fix) -> pathlib.Path:
    return pathlib.Path(sys.modules[type(fix).__module__].__file__ or "").resolve()


def _names_of_fixes(tree: ast.AST, names: set[str]):
    """(line, name) of each string constant that is a fix's name, except where
    it is a record's key (a dict key, `.get`'s key: the snapshot's allocator
    field `expandable_segments` is no fix) or in a fix's `combines_with`."""
    ignored: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            ignored.update(id(key) for key in node.keys if key is not None)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            ignored.add(id(node.args[0]))
        elif isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "combines_with" for target in node.targets
        ):
            ignored.update(id(inner) for inner in ast.walk(node.value))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in names
            and id(node) not in ignored
        ):
            yield node.lineno, node.value


def test_no_fix_is_named_outside_its_unit():
    """A room that needs a particular fix asks the catalogue for a capability
    (`batch_fix()`, `searches_batch`, `prescribable`) or uses the class's
    `name`; the string is written once, in the fix's unit. The framework
    units are the exception: their words are tables by fix name, and
    test_every_prescribed_fix_has_words_in_every_framework keeps them
    complete."""
    units = {fix.name: _unit_of(fix) for fix in FIXES}
    frameworks = PACKAGE / "frameworks"
    named = []
    for path in _modules():
        if frameworks in path.parents:
            continue
        for line, name in _names_of_fixes(ast.parse(path.read_text()), set(units)):
            if path.resolve() != units[name]:
                named.append(f"{path.relative_to(PACKAGE)}:{line}: {name!r}")
    assert named == []


def test_the_fix_name_check_finds_a_name():
    tree = ast.parse(
        'payload = {"name": "smaller_batch"}\n'
        'x = {"expandable_segments": True}\n'
        'combines_with = ("autocast",)\n'
    )
    assert list(_names_of_fixes(tree, {"smaller_batch", "expandable_segments", "autocast"})) == [
        (1, "smaller_batch")
    ]


def test_the_categories_are_one_table():
    """oomdoc.categories.TABLE is the one list of the memory categories (issue
    25: a sixth one was added): the Breakdown record has a field for each, in
    its order, and no other module spells all of them out."""
    import dataclasses

    from oomdoc.categories import CATEGORIES, REQUIRED, TABLE
    from oomdoc.model import Breakdown
    from oomdoc.reporters.html.drawing import CATEGORY_COLORS

    fields = [spec.name for spec in dataclasses.fields(Breakdown) if spec.name != "extra"]
    assert tuple(fields) == CATEGORIES
    assert set(CATEGORY_COLORS) == set(CATEGORIES)
    assert all(category.advice and category.kind and category.title for category in TABLE)
    others = []
    for path in _modules():
        if path == PACKAGE / "categories.py":
            continue
        for node, strings in _string_sequences(ast.parse(path.read_text())):
            if set(REQUIRED) <= set(strings):
                others.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert others == []
