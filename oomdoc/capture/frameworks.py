"""Which training framework the script actually uses, and the command-line
options it declares, so that the parent can give each fix in the framework's
own knobs and verify a knob the script already has.

A framework counts only when the run goes through it: `import lightning`
imports parts of `transformers`, and the Hugging Face `Trainer` builds an
`accelerate.Accelerator` itself, so imports say nothing. The stack does: the
detector looks at the Python stack at the first outermost model call, the
first outermost backward, the first optimizer step and an OOM (a handful of
stack walks per run), for frames of the framework's training code, for the
wrappers it puts around the model, and for live `Trainer`/`Fabric`/
`Accelerator` objects in the user's own frames.

The command-line options come from `argparse`: every parser that parses
`sys.argv` (the script's own, `HfArgumentParser`, a LightningCLI built on
argparse) is recorded just before it parses; nothing it returns changes.
A script that no parser reads, whose `--key=value` arguments each name a
global of its module (a configurator exec'd over its globals, as nanoGPT's
`configurator.py`), takes `--NAME=value` for each plain global: they are
read at the first model call, the configuration done by then.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import os
import sys

from oomdoc.capture.training_settings import FirstTrainingCall
from oomdoc.frameworks.signs import SIGNS
from oomdoc.script_flags import ARGPARSE, CONFIGURATOR

# The tables below are built from each framework's declaration
# (oomdoc.frameworks.signs): a new framework edits none of them.
# Path fragments of a framework's own training code, as (fragment, name,
# entry). A frame whose file contains the fragment is the framework driving
# the step.
FRAME_SIGNS: tuple[tuple[str, str, str], ...] = tuple(
    (fragment, signs.name, entry) for signs in SIGNS for fragment, entry in signs.frames
)
# Classes whose live instances in the user's frames show the framework is
# used: (module that defines it, class, name, entry). Looked up only in
# modules already imported; nothing is imported here.
INSTANCE_SIGNS: tuple[tuple[str, str, str, str], ...] = tuple(
    (module, class_name, signs.name, entry)
    for signs in SIGNS
    for module, class_name, entry in signs.instances
)
# When several show up (the HF Trainer drives an Accelerator), the one that
# drives the others wins.
PRIORITY = {"plain": 0, **{signs.name: signs.rank for signs in SIGNS}}
ENTRY_PRIORITY = {"Fabric": 0, "Trainer": 1}
# Packages whose version is reported for a framework name, by the import
# name that the evidence came from.
VERSION_MODULES = {signs.name: signs.version_modules for signs in SIGNS}
_FRAME_LIMIT = 400
_FRAME_OBJECTS = 200


def _import_name(filename: str, fragment: str) -> str:
    """`lightning` or `pytorch_lightning` (...): the package the frame is in."""
    return fragment.strip("/").split("/")[0]


class FrameworkDetector:
    """Watches the first model call, backward, optimizer step and OOM for
    evidence of a framework, and records the parsers that read sys.argv."""

    def __init__(self) -> None:
        self.found: dict | None = None  # {"name", "entry", "module", "seen_at"}
        self.done = False
        self.options: list[str] = []
        self.option_values: dict[str, list[str]] = {}
        self.option_defaults: dict[str, str] = {}
        self.aliases: dict[str, str] = {}
        self.syntax: str | None = None  # `argparse` or `configurator`
        self.dataclasses: dict[str, list[str]] = {}
        self._seen: set[str] = set()
        # The autocast and checkpointing the first training model call ran under.
        self.first_training_call = FirstTrainingCall()
        self.ooms_seen: dict = {}  # (_oom_seen)
        self._parsers: set[int] = set()
        self._restore: list = []
        self._tracker = None

    # ------------------------------------------------------------ install
    def install(self, tracker) -> None:
        """Hook the tracker's model calls and backward passes, the optimizer
        step, the OOM and argparse. Cheap: each hook returns at once after
        its first call."""
        self._tracker = tracker
        tracker.forward_start_callbacks.append(self._on_forward)
        tracker.backward_start_callbacks.append(self._on_backward)
        try:
            import torch.optim.optimizer as optim

            handle = optim.register_optimizer_step_pre_hook(self._on_optimizer_step)
            self._restore.append(handle.remove)
        except Exception:
            pass
        original_on_oom = tracker.on_oom

        def on_oom(*args, **kwargs):
            self._observe("oom", sys._getframe(1))
            try:
                return original_on_oom(*args, **kwargs)
            finally:
                self._oom_seen(getattr(tracker, "oom", None))

        tracker.on_oom = on_oom
        self._restore.append(lambda: tracker.__dict__.pop("on_oom", None))
        self._restore.append(self.first_training_call.stop)
        self._patch_argparse()

    def uninstall(self) -> None:
        for restore in reversed(self._restore):
            try:
                restore()
            except Exception:
                pass
        self._restore.clear()

    def _patch_argparse(self) -> None:
        original = argparse.ArgumentParser.parse_known_args
        detector = self

        @functools.wraps(original)
        def parse_known_args(parser, *args, **kwargs):
            try:
                given = args[0] if args else kwargs.get("args")
                if parses_command_line(given, sys.argv[1:]):
                    detector.record_parser(parser)
            except Exception:
                pass  # recording must never change what the script sees
            return original(parser, *args, **kwargs)

        argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign,assignment]  # patched on the class for every parser
        self._restore.append(lambda: setattr(argparse.ArgumentParser, "parse_known_args", original))

    # ------------------------------------------------------------ argparse
    def record_parser(self, parser: argparse.ArgumentParser) -> None:
        """The option strings of a parser that reads the command line (help
        and version left out), which of them need a value (with their choices),
        each other spelling's option (`-b` of `-b/--batch-size`), and an
        HfArgumentParser's dataclass fields."""
        if id(parser) in self._parsers:
            return
        self._parsers.add(id(parser))
        self.syntax = ARGPARSE
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            name = next(
                (option for option in action.option_strings if option.startswith("--")),
                action.option_strings[0] if action.option_strings else None,
            )
            for option in action.option_strings:
                if option not in self.options:
                    self.options.append(option)
                if option != name and name is not None:
                    self.aliases.setdefault(option, name)
                if action.nargs not in (0, "?") and _plain(action.default):
                    self.option_defaults.setdefault(option, str(action.default))
                if action.nargs not in (0, "?") and option not in self.option_values:
                    choices = action.choices
                    self.option_values[option] = (
                        [str(choice) for choice in choices][:200]
                        if choices is not None and not isinstance(choices, dict)
                        else []
                    )
        for dataclass_type in getattr(parser, "dataclass_types", None) or ():
            if isinstance(dataclass_type, type) and dataclasses.is_dataclass(dataclass_type):
                self.dataclasses[dataclass_type.__name__] = [
                    f.name for f in dataclasses.fields(dataclass_type) if f.init
                ]

    # ------------------------------------------------------------ configurator
    def learn_configurator(self, namespace: dict, argv: list[str]) -> None:
        """A configurator script's options: when no parser read the command
        line and each `--key=value` on it names a plain global of the
        script's module (`namespace`), every such global is an option
        `--NAME` that takes its value as `--NAME=value` only."""
        if self.syntax is not None:
            return
        keys = [arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--") and "=" in arg]
        if not keys or not all(_is_setting(namespace, key) for key in keys):
            return
        self.syntax = CONFIGURATOR
        for name in list(namespace):
            option = f"--{name}"
            if _is_setting(namespace, name) and option not in self.options:
                self.options.append(option)
                self.option_values[option] = []
        for name, value in configurator_defaults(namespace.get("__file__"), argv).items():
            if f"--{name}" in self.options:
                self.option_defaults.setdefault(f"--{name}", value)

    # ------------------------------------------------------------ evidence
    def _on_forward(self, module) -> None:
        self.first_training_call.start(module)
        if self.done or "forward" in self._seen:
            return
        self._seen.add("forward")
        try:
            main = sys.modules.get("__main__")
            if main is not None:
                self.learn_configurator(vars(main), sys.argv[1:])
        except Exception:
            pass  # best effort, like the rest of the detection
        self._observe_module(module)
        self._observe("forward", sys._getframe(1))

    def _oom_seen(self, oom: dict | None) -> None:
        """Count every OOM raised (a script that catches one goes on: the
        last is then not the run's end), keeping the first."""
        self.ooms_seen["count"] = self.ooms_seen.get("count", 0) + 1
        if self.ooms_seen["count"] == 1 and oom is not None:
            location = oom.get("location") or {}
            self.ooms_seen.update(
                {
                    key: oom.get(key)
                    for key in ("step", "phase", "requested_bytes", "allocated_bytes")
                },
                **{key: location.get(key) for key in ("file", "line", "function")},
            )

    def _on_backward(self) -> None:
        self.first_training_call.stop()
        if self.done or "backward" in self._seen:
            return
        self._seen.add("backward")
        self._observe("backward", sys._getframe(1))

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.done:
            return
        self._observe("optimizer_step", sys._getframe(1))
        # A whole step has been seen: every framework shows itself by now.
        self.done = True

    def _observe_module(self, module) -> None:
        """The wrappers a framework puts around the model: Fabric's
        `_FabricModule`, accelerate's `prepare` mark."""
        module_name = type(module).__module__ or ""
        for signs in SIGNS:
            for prefix, entry in signs.wrapper_modules:
                if module_name.startswith(prefix):
                    self._offer(signs.name, entry, module_name.split(".")[0], "forward")
                    return
            for attribute, entry in signs.wrapper_marks:
                if getattr(module, attribute, False):
                    self._offer(signs.name, entry, signs.version_modules[0], "forward")
                    return

    def _observe(self, moment: str, frame) -> None:
        try:
            self._observe_stack(moment, frame)
        except Exception:
            pass  # detection is best effort; the script must not notice it
        if self.found is not None and self.found["name"] == "transformers":
            self.done = True

    def _observe_stack(self, moment: str, frame) -> None:
        classes = _instance_classes()
        scanned: set[int] = set()
        depth = 0
        while frame is not None and depth < _FRAME_LIMIT:
            raw_filename = frame.f_code.co_filename
            filename = raw_filename.replace(os.sep, "/")
            for fragment, name, entry in FRAME_SIGNS:
                if fragment in filename:
                    if name == "transformers":
                        owner = frame.f_locals.get("self")
                        if owner is not None and _is_hf_trainer(owner):
                            entry = type(owner).__name__
                    self._offer(name, entry, _import_name(filename, fragment), moment)
                    break
            if classes and not _is_library(raw_filename):
                self._scan_objects(frame, classes, moment, scanned)
            frame = frame.f_back
            depth += 1

    def _scan_objects(self, frame, classes, moment: str, scanned: set[int]) -> None:
        values = []
        for namespace in (frame.f_locals, frame.f_globals):
            if id(namespace) not in scanned:
                scanned.add(id(namespace))
                values += list(namespace.values())[:_FRAME_OBJECTS]
        for value in values:
            for cls, name, entry, module in classes:
                if isinstance(value, cls):
                    self._offer(name, entry, module, moment)

    def _offer(self, name: str, entry: str | None, module: str | None, moment: str) -> None:
        """Keep the strongest evidence: the framework that drives the others."""
        current = self.found
        rank = (PRIORITY[name], ENTRY_PRIORITY.get(entry or "", 0))
        if current is not None:
            current_rank = (PRIORITY[current["name"]], ENTRY_PRIORITY.get(current["entry"], 0))
            if rank <= current_rank:
                return
        self.found = {"name": name, "entry": entry, "module": module, "seen_at": moment}

    # ------------------------------------------------------------ result
    def capture(self) -> dict:
        """The capture keys: `framework`, `script_options`,
        `script_option_values`, `script_option_aliases`,
        `script_option_syntax`, `script_dataclasses` and `ooms_seen`."""
        found = self.found or {"name": "plain", "entry": None, "module": None, "seen_at": None}
        framework = dict(found)
        framework["version"] = _version_of(found["name"], found.get("module"))
        first = self.first_training_call
        if first.autocast is not None:
            framework.update(autocast=dict(first.autocast))
        if first.checkpointed is not None:
            framework.update(checkpointed=dict(first.checkpointed))
        seen = {"ooms_seen": dict(self.ooms_seen)} if self.ooms_seen else {}
        return {
            "framework": framework,
            "script_options": list(self.options),
            "script_option_values": dict(self.option_values),
            "script_option_aliases": dict(self.aliases),
            "script_option_defaults": dict(self.option_defaults),
            "script_option_syntax": self.syntax,
            "script_dataclasses": dict(self.dataclasses),
            **seen,
        }


def _plain(value: object) -> bool:
    return type(value) in (int, float, str) and len(str(value)) < 200


def configurator_defaults(script: object, argv: list[str]) -> dict[str, str]:
    """What each global of a configurator script holds when the command line
    does not set it: the file's own constants, as overridden by each
    configuration file the command line names (a positional `.py`, exec'd
    over the globals in order; a global it sets to anything but a constant
    has no default known). Read from the files, because by now the script
    may have changed its globals itself (nanoGPT divides the accumulation
    steps by the world size). nanoGPT's train.py says
    `gradient_accumulation_steps = 5 * 8` and its
    config/train_shakespeare_char.py says 1: taken from train.py alone, the
    own flags of an accumulation of 2 were `--gradient_accumulation_steps=80`."""
    defaults = module_constants(script)
    for arg in argv:
        if arg.startswith("-") or "=" in arg:
            continue
        for name, value in _module_assignments(arg):
            if value is None:
                defaults.pop(name, None)
            else:
                defaults[name] = value
    return defaults


def module_constants(path: object) -> dict[str, str]:
    """A script's module-level `NAME = <constant expression>` assignments
    (numbers, strings, + - * // / of them), each the first one, as text."""
    found: dict[str, str] = {}
    for name, value in _module_assignments(path):
        if value is not None:
            found.setdefault(name, value)
    return found


def _module_assignments(path: object) -> list[tuple[str, str | None]]:
    """A Python file's module-level `NAME = ...` assignments in order, each
    with its value as text where it is a constant expression, else None."""
    if not isinstance(path, str) or not path.endswith(".py"):
        return []
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return []
    assignments: list[tuple[str, str | None]] = []
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            value = _constant(node.value)
            assignments.append((node.targets[0].id, None if value is None else str(value)))
    return assignments


_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Div: lambda a, b: a / b,
}


def _constant(node: ast.expr) -> object:
    """The value of a constant expression of numbers and strings, else None."""
    if isinstance(node, ast.Constant) and _plain(node.value) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constant(node.operand)
        return -inner if isinstance(inner, (int, float)) else None
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _constant(node.left), _constant(node.right)
        if isinstance(left, (int, float)) and isinstance(right, (int, float)):
            try:
                return _OPERATORS[type(node.op)](left, right)
            except ArithmeticError:
                return None
    return None


def _is_setting(namespace: dict, name: str) -> bool:
    """A plain global a configurator can set: a public int, float, bool or str."""
    return (
        name.isidentifier()
        and not name.startswith("_")
        and type(namespace.get(name)) in (int, float, bool, str)
    )


def parses_command_line(given, argv: list[str]) -> bool:
    """Whether a parser is parsing the script's command line: no argument
    list (argparse then reads sys.argv), or one that ends with the command
    line (HfArgumentParser prepends an args file) or with which it ends (a
    subparser gets what follows its command)."""
    if given is None:
        return True
    if isinstance(given, (str, bytes)):
        return False
    try:
        strings = [str(item) for item in given]
    except TypeError:
        return False
    if not strings or not argv:
        return not strings and not argv
    shorter = min(len(strings), len(argv))
    return strings[-shorter:] == argv[-shorter:]


def _is_hf_trainer(owner) -> bool:
    trainer_module = sys.modules.get("transformers.trainer")
    trainer_class = getattr(trainer_module, "Trainer", None)
    return trainer_class is not None and isinstance(owner, trainer_class)


def _instance_classes() -> list[tuple[type, str, str, str]]:
    """(class, name, entry, import name) for the framework classes already imported."""
    classes = []
    for module_name, class_name, name, entry in INSTANCE_SIGNS:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if isinstance(cls, type):
            classes.append((cls, name, entry, module_name.split(".")[0]))
    return classes


def _is_library(filename: str) -> bool:
    """Only the user's frames are searched for framework objects: library
    frames are many, and hold the framework's own objects anyway."""
    from oomdoc.frames import is_user_file

    return not is_user_file(filename)


def _version_of(name: str, module: str | None) -> str | None:
    """The framework's version, from the module already imported (nothing is
    imported here)."""
    candidates = VERSION_MODULES.get(name, ())
    if module in candidates:
        candidates = (module, *[c for c in candidates if c != module])
    for candidate in candidates:
        version = getattr(sys.modules.get(candidate), "__version__", None)
        if isinstance(version, str):
            return version
    return None


def install(tracker) -> FrameworkDetector:
    """Start watching; the detector is kept on the tracker for write_capture."""
    detector = FrameworkDetector()
    detector.install(tracker)
    tracker.framework_detector = detector
    return detector


def capture_keys(tracker) -> dict:
    """What the detector found, as capture keys (empty when it was not installed)."""
    detector = getattr(tracker, "framework_detector", None)
    if detector is None:
        return {}
    try:
        return detector.capture()
    except Exception:
        return {}
