"""Framework awareness: the framework units (snippets, prescriptions, flag
variants), the child's detection of the framework and of the script's
command-line options, and real Hugging Face Trainer, Lightning Trainer and
accelerate scripts run through the CLI on the simulated device."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

import pytest
from conftest import SCRIPTS, run_case

from oomdoc import fixes
from oomdoc.frameworks import FRAMEWORKS, Framework, context_from_snapshot, framework_for
from oomdoc.frameworks.accelerate import Accelerate
from oomdoc.frameworks.base import (
    accumulation_in_effect,
    find_option,
    with_enough_steps,
    with_option,
)
from oomdoc.frameworks.huggingface import HuggingFace
from oomdoc.frameworks.lightning import Lightning
from oomdoc.frameworks.plain import Plain
from oomdoc.model import Snapshot

HF_SCRIPT = SCRIPTS / "fw_hf_trainer.py"
LIGHTNING_SCRIPT = SCRIPTS / "fw_lightning_trainer.py"
ACCELERATE_SCRIPT = SCRIPTS / "fw_accelerate_loop.py"
# (script, capacity, a batch that runs out of memory in its first step, a batch that fits)
HF_CASE = (HF_SCRIPT, "24MiB", ["--per_device_train_batch_size", "16"])
LIGHTNING_CASE = (LIGHTNING_SCRIPT, "16MiB", ["--batch-size", "64"])
ACCELERATE_CASE = (ACCELERATE_SCRIPT, "6MiB", ["--batch-size", "512"])

FIX_NAMES = (
    "smaller_batch",
    "autocast",
    "checkpointing",
    "lighter_optimizer",
    "empty_cache",
    "expandable_segments",
)
MEASURED = {
    "micro_batch": 12,
    "accumulation_steps": 2,
    "how": "--per_device_train_batch_size",
    "device_type": "cuda",
    "dtype": "bfloat16",
    "blocks_path": "transformer.h",
    "blocks_class": "GPT2Block",
    "blocks_count": 24,
    "optimizer": "Adafactor",
}
HF_OPTIONS = [
    "--per_device_train_batch_size",
    "--gradient_accumulation_steps",
    "--bf16",
    "--fp16",
    "--gradient_checkpointing",
    "--optim",
    "--torch_empty_cache_steps",
]
HF_VALUES = {
    "--per_device_train_batch_size": [],
    "--gradient_accumulation_steps": [],
    "--optim": ["adamw_torch", "adafactor", "sgd"],
    "--torch_empty_cache_steps": [],
}


# ---------------------------------------------------------------- registry


def test_registry_maps_every_detected_name_and_falls_back_to_plain():
    names = [framework.name for framework in FRAMEWORKS]
    assert len(names) == len(set(names))
    assert set(names) == {"transformers", "lightning", "accelerate", "plain"}
    assert all(isinstance(framework, Framework) for framework in FRAMEWORKS)
    assert isinstance(framework_for("transformers"), HuggingFace)
    assert isinstance(framework_for("lightning"), Lightning)
    assert isinstance(framework_for("accelerate"), Accelerate)
    assert isinstance(framework_for("plain"), Plain)
    assert isinstance(framework_for(None), Plain)
    assert isinstance(framework_for("deepspeed"), Plain)


def test_context_from_snapshot():
    document = {
        "command": ["train.py", "--bs", "8"],
        "device": {"kind": "cuda", "supports_bf16": False},
        "framework": {"name": "lightning", "entry": "Fabric", "module": "lightning"},
        "script_options": ["--bs"],
        "script_option_values": {"--bs": []},
    }
    context = context_from_snapshot(Snapshot.from_dict(document))
    assert context["entry"] == "Fabric" and context["module"] == "lightning"
    assert context["command"] == ["train.py", "--bs", "8"]
    assert context["device_type"] == "cuda" and context["dtype"] == "float16"
    simulated = Snapshot.from_dict({"device": {"kind": "simulated"}})
    assert context_from_snapshot(simulated)["dtype"] == "bfloat16"


# ---------------------------------------------------------------- plain


@pytest.mark.parametrize(
    "context",
    [
        {},
        MEASURED,
        {**MEASURED, "dtype": "float16", "device_type": "cpu"},
        {"optimizer": "SGD"},
        {"micro_batch": 5, "accumulation_steps": 3},
    ],
)
@pytest.mark.parametrize(
    "fix", [*FIX_NAMES, "autocast+checkpointing", "checkpointing+lighter_optimizer"]
)
def test_plain_snippets_are_the_catalogues(fix, context):
    unit = fixes.fix_named(fix)
    assert Plain().snippet(fix, dict(context)) == unit.snippet(dict(context))


def test_plain_prescription_is_one_loop_with_every_fix():
    text = Plain().prescription_snippet(
        ["smaller_batch", "autocast", "checkpointing", "lighter_optimizer"], MEASURED
    )
    assert text.count("for i, (x, y) in enumerate(loader):") == 1
    assert "accumulation_steps = 2" in text
    assert "torch.autocast(device_type='cuda', dtype=torch.bfloat16)" in text
    assert "for block in model.transformer.h:" in text
    assert "torch.optim.Adafactor" in text
    float16 = Plain().prescription_snippet(["autocast"], {**MEASURED, "dtype": "float16"})
    assert "GradScaler" in float16 and "scaler.step(optimizer)" in float16


def test_plain_prescription_offers_the_scripts_own_flags():
    context = {
        **MEASURED,
        "how": "--batch-size",
        "command": ["examples/gpt_train.py", "--batch-size", "32"],
        "script_options": ["--batch-size", "--autocast", "--checkpointing"],
        "script_option_values": {"--batch-size": [], "--autocast": ["bf16", "fp16"]},
    }
    text = Plain().prescription_snippet(["autocast", "checkpointing"], context)
    assert text.endswith(
        "# or with your script's own flags:\n"
        "python examples/gpt_train.py --batch-size 32 --autocast bf16 --checkpointing"
    )
    # No accumulation flag: the command covers only part of the prescription, and says so.
    partial = Plain().prescription_snippet(["smaller_batch", "checkpointing"], context)
    assert partial.endswith(
        "# your script's own flags cover checkpointing (not smaller_batch):\n"
        "python examples/gpt_train.py --batch-size 32 --checkpointing"
    )


# ---------------------------------------------------------------- Hugging Face


def test_hf_snippets_use_training_arguments_and_flags():
    hf = HuggingFace()
    batch = hf.snippet("smaller_batch", MEASURED)
    assert "per_device_train_batch_size=12," in batch
    assert "gradient_accumulation_steps=2," in batch
    assert "--per_device_train_batch_size 12 --gradient_accumulation_steps 2" in batch
    autocast = hf.snippet("autocast", MEASURED)
    assert "bf16=True," in autocast and "--bf16" in autocast and "torch.autocast" not in autocast
    fp16 = hf.snippet("autocast", {**MEASURED, "dtype": "float16"})
    assert "fp16=True," in fp16 and "--fp16" in fp16 and "bf16" not in fp16.split("#")[0]
    checkpointing = hf.snippet("checkpointing", MEASURED)
    assert "gradient_checkpointing=True," in checkpointing
    assert "--gradient_checkpointing" in checkpointing
    assert "model.gradient_checkpointing_enable()" in checkpointing
    assert "24 x GPT2Block in transformer.h" in checkpointing
    optimizer = hf.snippet("lighter_optimizer", MEASURED)
    assert 'optim="adafactor",' in optimizer and "--optim adafactor" in optimizer
    assert "torch_empty_cache_steps=1," in hf.snippet("empty_cache", MEASURED)
    assert "expandable_segments:True" in hf.snippet("expandable_segments", MEASURED)
    # Without the measured batch, still the Trainer's words.
    assert "gradient_accumulation_steps=2" in hf.snippet("smaller_batch", {})


def test_hf_prescription_is_one_training_arguments_block_and_its_command():
    context = {
        **MEASURED,
        "command": ["train.py", "--per_device_train_batch_size", "24", "--bf16", "False"],
        "script_options": HF_OPTIONS,
        "script_option_values": HF_VALUES,
    }
    text = HuggingFace().prescription_snippet(
        ["smaller_batch", "autocast+checkpointing", "lighter_optimizer"], context
    )
    assert text.count("TrainingArguments(") == 1
    for knob in (
        "per_device_train_batch_size=12,",
        "gradient_accumulation_steps=2,",
        "bf16=True,",
        "gradient_checkpointing=True,",
        'optim="adafactor",',
    ):
        assert knob in text
    assert text.endswith(
        "python train.py --per_device_train_batch_size 12 --bf16 "
        "--gradient_accumulation_steps 2 --gradient_checkpointing --optim adafactor"
    )
    # No command known: the HfArgumentParser flags still come with it.
    assert "--gradient_checkpointing --bf16" in HuggingFace().prescription_snippet(
        ["checkpointing", "autocast"], MEASURED
    )


def test_hf_flag_variants():
    hf = HuggingFace()
    args = ["--per_device_train_batch_size", "24", "--output_dir", "out"]
    context = {**MEASURED, "script_option_values": HF_VALUES}
    assert hf.flag_variant("checkpointing", args, HF_OPTIONS, context) == [
        *args,
        "--gradient_checkpointing",
    ]
    assert hf.flag_variant("autocast", args, HF_OPTIONS, context) == [*args, "--bf16"]
    assert hf.flag_variant("autocast", args, HF_OPTIONS, {**context, "dtype": "float16"}) == [
        *args,
        "--fp16",
    ]
    assert hf.flag_variant("lighter_optimizer", args, HF_OPTIONS, context) == [
        *args,
        "--optim",
        "adafactor",
    ]
    assert hf.flag_variant("empty_cache", args, HF_OPTIONS, context) == [
        *args,
        "--torch_empty_cache_steps",
        "1",
    ]
    assert hf.flag_variant("smaller_batch", args, HF_OPTIONS, context) == [
        "--per_device_train_batch_size",
        "12",
        "--output_dir",
        "out",
        "--gradient_accumulation_steps",
        "2",
    ]
    # The script's own accumulation is kept: 3 x 2.
    accumulating = [*args, "--gradient_accumulation_steps=3"]
    assert hf.flag_variant("smaller_batch", accumulating, HF_OPTIONS, context)[-1] == (
        "--gradient_accumulation_steps=6"
    )
    # Not on the command line: the script's default is kept (4 x 2), not 1 x 2.
    defaults = {**context, "script_option_defaults": {"--gradient_accumulation_steps": "4"}}
    assert hf.flag_variant("smaller_batch", args, HF_OPTIONS, defaults)[-1] == "8"
    assert hf.flag_variant("autocast+checkpointing", args, HF_OPTIONS, context) == [
        *args,
        "--bf16",
        "--gradient_checkpointing",
    ]
    # Already on: nothing to verify; a switch set to False is turned on.
    assert hf.flag_variant("autocast", [*args, "--bf16"], HF_OPTIONS, context) is None
    assert hf.flag_variant("autocast", [*args, "--bf16", "False"], HF_OPTIONS, context) == [
        *args,
        "--bf16",
    ]
    # Newer TrainingArguments: activation_checkpointing, gradient_checkpointing its alias.
    newer = [*HF_OPTIONS, "--activation_checkpointing"]
    assert hf.flag_variant("checkpointing", args, newer, context) == [
        *args,
        "--activation_checkpointing",
    ]
    newer_snippet = hf.snippet("checkpointing", {**context, "script_options": newer})
    assert "activation_checkpointing=True," in newer_snippet
    assert "model.activation_checkpointing_enable()" in newer_snippet
    # Not declared by the script, or no flag for the fix: None.
    assert hf.flag_variant("checkpointing", args, ["--per_device_train_batch_size"], {}) is None
    assert hf.flag_variant("expandable_segments", args, HF_OPTIONS, context) is None
    assert hf.flag_variant("autocast+expandable_segments", args, HF_OPTIONS, context) is None


# ---------------------------------------------------------------- Lightning


def test_lightning_trainer_snippets():
    lightning = Lightning()
    context = {**MEASURED, "how": "--batch-size", "entry": "Trainer", "module": "lightning"}
    assert lightning.snippet("autocast", context) == (
        'trainer = L.Trainer(..., precision="bf16-mixed")'
    )
    assert 'precision="16-mixed"' in lightning.snippet("autocast", {"dtype": "float16"})
    batch = lightning.snippet("smaller_batch", context)
    assert "accumulate_grad_batches=2" in batch and "batch_size=12 in your DataModule" in batch
    assert "--batch-size 12" in batch
    checkpointing = lightning.snippet("checkpointing", context)
    assert (
        "L.LightningModule" in checkpointing and "for block in self.transformer.h:" in checkpointing
    )
    assert "checkpoint(block, x, use_reentrant=False)" in checkpointing
    assert "def configure_optimizers(self):" in lightning.snippet("lighter_optimizer", context)
    assert "pl.Trainer(" in lightning.snippet("autocast", {"module": "pytorch_lightning"})
    text = lightning.prescription_snippet(["smaller_batch", "autocast", "checkpointing"], context)
    assert text.count("Trainer(") == 1
    assert 'precision="bf16-mixed",' in text and "accumulate_grad_batches=2," in text
    assert "for block in self.transformer.h:" in text
    # Changes that are all in the module: no empty Trainer(...) block.
    alone = lightning.prescription_snippet(["checkpointing"], context)
    assert "Trainer(" not in alone and "for block in self.transformer.h:" in alone


def test_lightning_fabric_snippets():
    lightning = Lightning()
    context = {**MEASURED, "entry": "Fabric", "module": "lightning"}
    assert lightning.snippet("autocast", context) == (
        'fabric = L.Fabric(..., precision="bf16-mixed")'
    )
    loop = lightning.snippet("smaller_batch", context)
    assert "fabric.no_backward_sync(model, enabled=accumulating)" in loop
    assert "fabric.backward(loss)" in loop and "accumulation_steps = 2" in loop
    text = lightning.prescription_snippet(["autocast", "smaller_batch"], context)
    assert 'L.Fabric(..., precision="bf16-mixed")' in text and "Trainer" not in text


def test_lightning_flag_variants():
    lightning = Lightning()
    options = ["--batch-size", "--precision", "--accumulate-grad-batches"]
    values = {
        "--batch-size": [],
        "--precision": ["32-true", "bf16-mixed"],
        "--accumulate-grad-batches": [],
    }
    context = {**MEASURED, "how": "--batch-size", "script_option_values": values}
    args = ["--batch-size", "64"]
    assert lightning.flag_variant("autocast", args, options, context) == [
        *args,
        "--precision",
        "bf16-mixed",
    ]
    # No choice means float16 here.
    assert (
        lightning.flag_variant("autocast", args, options, {**context, "dtype": "float16"}) is None
    )
    assert lightning.flag_variant("smaller_batch", args, options, context) == [
        "--batch-size",
        "12",
        "--accumulate-grad-batches",
        "2",
    ]
    # A LightningCLI's flags, whose values are free.
    cli = ["--trainer.precision", "--trainer.accumulate_grad_batches", "--data.batch_size"]
    cli_context = {**MEASURED, "how": "DataLoader", "script_option_values": dict.fromkeys(cli, [])}
    assert lightning.flag_variant("autocast", [], cli, cli_context) == [
        "--trainer.precision",
        "bf16-mixed",
    ]
    assert lightning.flag_variant("smaller_batch", [], cli, cli_context) == [
        "--data.batch_size",
        "12",
        "--trainer.accumulate_grad_batches",
        "2",
    ]
    assert lightning.flag_variant("checkpointing", args, options, context) is None


# ---------------------------------------------------------------- accelerate


def test_accelerate_snippets_and_flags():
    accelerate = Accelerate()
    assert accelerate.snippet("autocast", MEASURED) == (
        'accelerator = Accelerator(..., mixed_precision="bf16")'
    )
    assert 'mixed_precision="fp16"' in accelerate.snippet("autocast", {"dtype": "float16"})
    batch = accelerate.snippet("smaller_batch", MEASURED)
    assert "Accelerator(..., gradient_accumulation_steps=2)" in batch
    assert "with accelerator.accumulate(model):" in batch and "batch_size=12" in batch
    assert "accelerator.backward(loss)" in batch
    text = accelerate.prescription_snippet(["smaller_batch", "autocast", "checkpointing"], MEASURED)
    assert text.count("Accelerator(") == 1
    assert 'Accelerator(..., mixed_precision="bf16", gradient_accumulation_steps=2)' in text
    assert "for block in model.transformer.h:" in text

    options = ["--batch-size", "--mixed-precision", "--gradient-accumulation-steps"]
    values = {
        "--batch-size": [],
        "--mixed-precision": ["no", "bf16", "fp16"],
        "--gradient-accumulation-steps": [],
    }
    context = {**MEASURED, "how": "--batch-size", "script_option_values": values}
    args = ["--batch-size=512"]
    assert accelerate.flag_variant("autocast", args, options, context) == [
        *args,
        "--mixed-precision",
        "bf16",
    ]
    assert accelerate.flag_variant("autocast", args, options, {**context, "dtype": "float16"}) == [
        *args,
        "--mixed-precision",
        "fp16",
    ]
    assert accelerate.flag_variant("smaller_batch", args, options, context) == [
        "--batch-size=12",
        "--gradient-accumulation-steps",
        "2",
    ]
    assert accelerate.flag_variant("lighter_optimizer", args, options, context) is None


# ---------------------------------------------------------------- argparse flags


def test_generic_flags_of_an_argparse_script():
    plain = Plain()
    # examples/gpt_train.py: --autocast {bf16,fp16} and a --checkpointing switch.
    options = ["--preset", "--batch-size", "--autocast", "--checkpointing", "--optimizer"]
    values = {
        "--preset": ["reference"],
        "--batch-size": [],
        "--autocast": ["bf16", "fp16"],
        "--optimizer": ["adamw", "adafactor"],
    }
    context = {"dtype": "bfloat16", "optimizer": "Adafactor", "script_option_values": values}
    args = ["--batch-size", "32"]
    assert plain.flag_variant("autocast", args, options, context) == [*args, "--autocast", "bf16"]
    assert plain.flag_variant("checkpointing", args, options, context) == [
        *args,
        "--checkpointing",
    ]
    assert plain.flag_variant("checkpointing", [*args, "--checkpointing"], options, context) is None
    assert plain.flag_variant("lighter_optimizer", args, options, context) == [
        *args,
        "--optimizer",
        "adafactor",
    ]
    # A switch that names no dtype, or a value flag without a matching choice: no variant.
    assert plain.flag_variant("autocast", args, ["--amp"], {"script_option_values": {}}) is None
    assert (
        plain.flag_variant(
            "autocast", args, ["--autocast"], {"script_option_values": {"--autocast": ["fp8"]}}
        )
        is None
    )
    assert plain.flag_variant("autocast", args, ["--bf16"], {"script_option_values": {}}) == [
        *args,
        "--bf16",
    ]
    # A checkpointing option that takes a value (a path, say) is not a switch.
    assert (
        plain.flag_variant(
            "checkpointing",
            args,
            ["--checkpointing"],
            {"script_option_values": {"--checkpointing": []}},
        )
        is None
    )
    # A smaller batch needs the script's own accumulation flag.
    assert (
        plain.flag_variant("smaller_batch", args, options, {**MEASURED, "how": "--batch-size"})
        is None
    )
    assert plain.flag_variant("expandable_segments", args, options, context) is None
    assert plain.flag_variant("autocast", args, [], context) is None


def test_steps_flag_is_raised_for_replays_with_accumulation():
    """A replay with gradient accumulation must run its optimizer steps
    whether the script's steps flag counts optimizer steps or micro-batches:
    a smaller value (or one oomdoc cannot see) is raised, a larger one kept."""
    options = ["--batch-size", "--steps", "--accumulate-grad-batches", "--fast"]
    context = {"script_option_values": {"--batch-size": [], "--steps": []}}
    args = ["--batch-size", "16", "--steps", "6"]
    raised, note = with_enough_steps(args, options, context, 32)
    assert raised == ["--batch-size", "16", "--steps", "32"]
    assert note == "--steps raised to 32 from 6"
    assert with_enough_steps(raised, options, context, 32) == (raised, None)
    assert with_enough_steps(["--steps=40"], options, context, 32) == (["--steps=40"], None)
    added, note = with_enough_steps(["--batch-size", "16"], options, context, 8)
    assert added == ["--batch-size", "16", "--steps", "8"] and "not on the command line" in note
    # HfArgumentParser's --max_steps; a switch or an undeclared flag is left alone.
    hf = {"script_option_values": {"--max_steps": []}}
    assert with_enough_steps([], ["--max_steps"], hf, 4)[0] == ["--max_steps", "4"]
    assert with_enough_steps(["--steps", "2"], ["--steps"], {}, 8) == (["--steps", "2"], None)
    assert with_enough_steps(["--steps", "2"], ["--fast"], context, 8) == (["--steps", "2"], None)
    assert accumulation_in_effect(["--accumulate-grad-batches", "4"], options) == 4
    assert accumulation_in_effect(["--batch-size", "4"], options) == 1
    defaults = {"--accumulate-grad-batches": "3"}
    assert accumulation_in_effect(["--batch-size", "4"], options, defaults) == 3
    assert accumulation_in_effect(["--accumulate-grad-batches", "2"], options, defaults) == 2


def test_short_options_with_their_value_attached():
    """argparse takes `-b 64`, `-b64` and `-b=64`: each is found and
    rewritten in its own form."""
    assert find_option(["-b64", "--x", "1"], "-b") == (0, "64")
    assert find_option(["-b", "64"], "-b") == (0, "64")
    assert find_option(["-b=64"], "-b") == (0, "64")
    assert find_option(["--bs", "64"], "-b") is None
    assert with_option(["-b64", "--x", "1"], "-b", "16") == ["-b16", "--x", "1"]
    assert with_option(["-b", "64"], "-b", "16") == ["-b", "16"]
    assert with_option(["-b=64"], "-b", "16") == ["-b=16"]


def test_the_accumulation_variant_of_a_short_batch_flag():
    """A script invoked as `-b64` that declares `-b/--batch-size` and an
    accumulation flag: the batch is rewritten in place."""
    context = {
        "micro_batch": 16,
        "accumulation_steps": 4,
        "how": "-b",
        "script_option_values": {"-b": [], "--batch-size": [], "--accum-steps": []},
        "script_option_aliases": {"-b": "--batch-size"},
    }
    options = ["-b", "--batch-size", "--accum-steps"]
    variant = Plain().flag_variant("smaller_batch", ["-b64"], options, context)
    assert variant == ["-b16", "--accum-steps", "4"]


def test_option_helpers():
    assert find_option(["--a", "1", "--b"], "--a") == (0, "1")
    assert find_option(["--a=1"], "--a") == (0, "1")
    assert find_option(["--b", "--a"], "--a") == (1, None)
    assert find_option(["--ab", "1"], "--a") is None
    assert with_option(["--a", "1"], "--a", "2") == ["--a", "2"]
    assert with_option(["--a=1", "x"], "--a", "2") == ["--a=2", "x"]
    assert with_option(["x"], "--a", "2") == ["x", "--a", "2"]
    assert with_option(["--a", "False"], "--a") == ["--a"]
    assert with_option(["--a"], "--a", "3") == ["--a", "3"]
    original = ["--a", "1"]
    with_option(original, "--a", "2")
    assert original == ["--a", "1"]


# ---------------------------------------------------------------- the child's detector


class FakeTracker:
    def __init__(self):
        self.forward_start_callbacks = []
        self.backward_start_callbacks = []
        self.oom_calls = 0

    def on_oom(self, requested_bytes, message):
        self.oom_calls += 1


@pytest.fixture
def detector():
    from oomdoc.capture.frameworks import install

    tracker = FakeTracker()
    detector = install(tracker)
    yield detector, tracker
    detector.uninstall()


def test_parses_command_line():
    from oomdoc.capture.frameworks import parses_command_line

    argv = ["--bs", "8", "--lr", "1"]
    assert parses_command_line(None, argv)
    assert parses_command_line(list(argv), argv)
    assert parses_command_line(["--from-file", *argv], argv)  # an args file prepended
    assert parses_command_line(["--lr", "1"], argv)  # a subparser's share
    assert not parses_command_line(["--other"], argv)
    assert not parses_command_line([], argv)
    assert parses_command_line([], [])
    assert not parses_command_line("--bs 8", argv)


def test_argparse_is_recorded_and_unchanged(detector, monkeypatch):
    detector, tracker = detector
    monkeypatch.setattr(sys, "argv", ["train.py", "--batch-size", "8", "--amp"])
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", "-b", type=int, default=4)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--precision", choices=["32", "bf16"], default="32")
    args = parser.parse_args()
    assert (args.batch_size, args.amp, args.precision) == (8, True, "32")
    # A parser of another argument list is not the script's.
    other = argparse.ArgumentParser()
    other.add_argument("--internal")
    other.parse_args(["--internal", "x"])
    keys = detector.capture()
    assert keys["script_options"] == ["--batch-size", "-b", "--amp", "--precision"]
    assert keys["script_option_values"] == {
        "--batch-size": [],
        "-b": [],
        "--precision": ["32", "bf16"],
    }
    assert keys["script_option_aliases"] == {"-b": "--batch-size"}
    assert keys["framework"] == {
        "name": "plain",
        "entry": None,
        "module": None,
        "seen_at": None,
        "version": None,
    }
    # Errors and --help still exit as argparse does.
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    with pytest.raises(SystemExit):
        parser.parse_args()
    detector.uninstall()
    assert argparse.ArgumentParser.parse_known_args.__module__ == "argparse"
    assert "on_oom" not in tracker.__dict__


def test_imports_alone_are_not_a_framework(detector):
    """lightning imports parts of transformers, transformers imports
    accelerate: a plain loop with all of them imported is still plain."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    import accelerate  # noqa: F401
    import lightning  # noqa: F401
    import torch
    import transformers.trainer  # noqa: F401

    detector, tracker = detector
    model = torch.nn.Linear(2, 2)
    for callback in tracker.forward_start_callbacks:
        callback(model)
    for callback in tracker.backward_start_callbacks:
        callback()
    tracker.on_oom(requested_bytes=1, message=None)
    assert tracker.oom_calls == 1
    assert detector.capture()["framework"]["name"] == "plain"


def test_a_live_accelerator_in_the_users_frames_is_accelerate(detector):
    accelerate = pytest.importorskip("accelerate")
    import torch

    detector, tracker = detector
    accelerator = accelerate.Accelerator(cpu=True)  # noqa: F841 (found in this frame)
    for callback in tracker.forward_start_callbacks:
        callback(torch.nn.Linear(2, 2))
    framework = detector.capture()["framework"]
    assert framework["name"] == "accelerate" and framework["entry"] == "Accelerator"
    assert framework["version"] == accelerate.__version__
    assert framework["seen_at"] == "forward"


def test_a_fabric_wrapped_model_is_lightning_fabric(detector):
    fabric_module = pytest.importorskip("lightning.fabric")
    import lightning
    import torch

    detector, tracker = detector
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    model = fabric.setup_module(torch.nn.Linear(2, 2))
    del fabric  # the evidence is the wrapper around the model
    for callback in tracker.forward_start_callbacks:
        callback(model)
    framework = detector.capture()["framework"]
    assert (framework["name"], framework["entry"]) == ("lightning", "Fabric")
    assert framework["module"] == "lightning" and framework["version"] == lightning.__version__


def test_a_pytorch_lightning_trainer_is_lightning_under_its_import_name(detector):
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    import torch

    detector, tracker = detector
    trainer = pytorch_lightning.Trainer(  # noqa: F841 (found in this frame)
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False
    )
    for callback in tracker.backward_start_callbacks:
        callback()
    for callback in tracker.forward_start_callbacks:
        callback(torch.nn.Linear(2, 2))
    framework = detector.capture()["framework"]
    assert (framework["name"], framework["entry"]) == ("lightning", "Trainer")
    assert framework["module"] == "pytorch_lightning"
    assert framework["version"] == pytorch_lightning.__version__
    assert framework["seen_at"] == "backward"


# ---------------------------------------------------------------- end to end


def version_of(package: str) -> str:
    return importlib.metadata.version(package)


def test_hf_trainer_is_detected_with_its_options(tmp_path):
    pytest.importorskip("transformers")
    result, document = run_case(tmp_path, HF_CASE)
    assert document["outcome"] == "oom", result.stderr[-3000:]
    assert document["framework"] == {
        "name": "transformers",
        "entry": "Trainer",
        "module": "transformers",
        "seen_at": "forward",
        "version": version_of("transformers"),
        "autocast": {},  # the case runs without --bf16
        "checkpointed": {},  # nor --gradient_checkpointing
    }
    options = document["script_options"]
    for option in (
        "--per_device_train_batch_size",
        "--gradient_accumulation_steps",
        "--gradient_checkpointing",
        "--bf16",
        "--optim",
        "--n_layer",
    ):
        assert option in options
    assert "adafactor" in document["script_option_values"]["--optim"]
    assert "--gradient_checkpointing" not in document["script_option_values"]  # a switch
    dataclasses = document["script_dataclasses"]
    assert dataclasses["ModelArguments"] == [
        "n_layer",
        "n_embd",
        "seq_len",
        "vocab_size",
        "eval_samples",
        "metrics",
    ]
    assert "gradient_checkpointing" in dataclasses["TrainingArguments"]

    # The Trainer's own knob, from the unit, fits where the script ran out of memory.
    context = context_from_snapshot(Snapshot.from_dict(document))
    args = document["command"][1:]
    variant = framework_for("transformers").flag_variant(
        "checkpointing", args, document["script_options"], context
    )
    # transformers 5 names it activation_checkpointing (gradient_checkpointing: its old alias).
    assert variant in ([*args, "--activation_checkpointing"], [*args, "--gradient_checkpointing"])
    result, fixed = run_case(
        tmp_path, (HF_SCRIPT, HF_CASE[1], variant), options=["--max-steps", "2"]
    )
    assert fixed["outcome"] == "ok", result.stderr[-3000:]
    assert fixed["peak"]["allocated_bytes"] < document["oom"]["capacity_bytes"]


def test_lightning_trainer_is_detected_with_its_options(tmp_path):
    pytest.importorskip("lightning")
    result, document = run_case(tmp_path, LIGHTNING_CASE)
    assert document["outcome"] == "oom", result.stderr[-3000:]
    framework = document["framework"]
    assert (framework["name"], framework["entry"], framework["module"]) == (
        "lightning",
        "Trainer",
        "lightning",
    )
    assert framework["version"] == version_of("lightning")
    assert document["script_options"] == [
        "--batch-size",
        "--steps",
        "--seq-len",
        "--vocab-size",
        "--width",
        "--depth",
        "--precision",
        "--accumulate-grad-batches",
        "--gradient-checkpointing",
        "--accelerator",
        "--devices",
        "--strategy",
    ]
    assert document["script_option_values"]["--precision"] == ["32-true", "bf16-mixed"]
    assert document["script_dataclasses"] == {}


def test_accelerate_loop_is_detected_and_its_accumulation_flag_fits(tmp_path):
    pytest.importorskip("accelerate")
    result, document = run_case(tmp_path, ACCELERATE_CASE)
    assert document["outcome"] == "oom", result.stderr[-3000:]
    framework = document["framework"]
    assert (framework["name"], framework["entry"]) == ("accelerate", "Accelerator")
    assert framework["version"] == version_of("accelerate")
    assert "--mixed-precision" in document["script_options"]
    assert "--gradient-accumulation-steps" in document["script_options"]

    # Half the batch through the script's own accumulation flag fits.
    context = {**context_from_snapshot(Snapshot.from_dict(document)), "how": "--batch-size"}
    context.update(micro_batch=256, accumulation_steps=2)
    args = document["command"][1:]
    variant = framework_for("accelerate").flag_variant(
        "smaller_batch", args, document["script_options"], context
    )
    assert variant == ["--batch-size", "256", "--gradient-accumulation-steps", "2"]
    result, fixed = run_case(
        tmp_path, (ACCELERATE_SCRIPT, ACCELERATE_CASE[1], variant), options=["--max-steps", "2"]
    )
    assert fixed["outcome"] == "ok", result.stderr[-3000:]


def test_autocast_that_accelerate_enters_inside_the_forward_is_seen(tmp_path):
    """accelerate's `prepare` wraps `model.forward` in autocast, so the
    first training call starts outside it: the autocast is read again inside
    the call, and the fix is not replayed for nothing."""
    pytest.importorskip("accelerate")
    script, capacity, args = ACCELERATE_CASE
    case = (script, capacity, [*args, "--mixed-precision", "bf16"])
    result, document = run_case(tmp_path, case)
    assert document["framework"]["autocast"] == {"cpu": "bfloat16"}, result.stderr[-3000:]
    result, plain = run_case(tmp_path, ACCELERATE_CASE)
    assert plain["framework"]["autocast"] == {}, result.stderr[-3000:]


def test_hf_trainer_replays_find_the_exact_max_batch(tmp_path):
    """The batch search goes through --per_device_train_batch_size (12 fits
    and 13 does not, on 24 MiB)."""
    pytest.importorskip("transformers")
    result, document = run_case(
        tmp_path, HF_CASE, replay=True, options=["--fixes", "smaller_batch"]
    )
    assert document["outcome"] == "oom"
    search = document["replay"]["batch_search"]
    assert search["source"] == "--per_device_train_batch_size"
    assert search["exact"] is True
    maximum = document["max_batch_size"]
    assert maximum is not None and 1 < maximum < 16
    trials = dict(map(tuple, search["trials"]))
    assert trials[maximum] is True and trials[maximum + 1] is False
    assert document["framework"]["name"] == "transformers"


def test_lightning_phases_inside_the_closure_and_the_exact_max_batch(tmp_path):
    """Lightning runs forward and backward inside optimizer.step(closure):
    the steps still have their forward, backward and optimizer phases (the
    batch model reads them), and the search through --batch-size is exact."""
    pytest.importorskip("lightning")
    script, capacity, _args = LIGHTNING_CASE
    result, fitting = run_case(tmp_path, (script, capacity, ["--batch-size", "16"]))
    assert fitting["outcome"] == "ok", result.stderr[-3000:]
    peaks = fitting["category_peaks"]
    static = peaks["parameters"] + peaks["gradients"] + peaks["optimizer_state"]
    first, *steady = fitting["steps"]
    # In the order they ran: nothing is labelled optimizer before the
    # closure's forward, and the update (which creates the state) is.
    assert list(first["phase_peaks"])[:4] == ["setup", "forward", "backward", "optimizer"]
    assert static <= first["phase_peaks"]["optimizer"]
    assert steady and all(
        {"forward", "backward", "optimizer"} <= set(step["phase_peaks"]) for step in steady
    )

    result, document = run_case(
        tmp_path, LIGHTNING_CASE, replay=True, options=["--fixes", "smaller_batch"]
    )
    assert document["outcome"] == "oom", result.stderr[-3000:]
    search = document["replay"]["batch_search"]
    assert search["source"] == "--batch-size" and search["exact"] is True
    maximum = document["max_batch_size"]
    assert maximum is not None and 1 < maximum < 64
    trials = dict(map(tuple, search["trials"]))
    assert trials[maximum] is True and trials[maximum + 1] is False
    assert len(search["trials"]) <= 4


def test_checkpointing_snippets_loop_over_every_run_of_blocks_wrapped():
    """A ResNet's replay wraps its four stages: the snippet shows all four, in
    order, not the first alone."""
    stages = [
        {"path": f"layer{index}", "class": "Bottleneck", "count": count}
        for index, count in ((1, 3), (2, 4), (3, 6), (4, 3))
    ]
    context = {"blocks_path": "layer1", "blocks_class": "Bottleneck", "blocks_count": 3}
    context["blocks_groups"] = stages
    text = Plain().snippet("checkpointing", context)
    loops = [line for line in text.splitlines() if line.startswith("for block in")]
    assert loops == [
        "for block in model.layer1:  # Bottleneck x 3",
        "for block in model.layer2:  # Bottleneck x 4",
        "for block in model.layer3:  # Bottleneck x 6",
        "for block in model.layer4:  # Bottleneck x 3",
    ]
    assert text.count("x = checkpoint(block, x, use_reentrant=False)") == 4
    inside = Lightning().snippet("checkpointing", {**context, "entry": "Trainer"})
    assert "        for block in self.layer4:  # Bottleneck x 3" in inside


def test_a_configurators_globals_are_its_options(detector):
    """No parser read the command line and each `--key=value` names a plain
    global of the script's module: each such global is an option, written
    `--key=value` only."""
    detector, _ = detector
    namespace = {"batch_size": 12, "lr": 1e-3, "compile": False, "out": "x", "_p": 1, "os": os}
    detector.learn_configurator(namespace, ["cfg.py", "--batch_size=4"])
    keys = detector.capture()
    assert keys["script_option_syntax"] == "configurator"
    assert keys["script_options"] == ["--batch_size", "--lr", "--compile", "--out"]
    assert set(keys["script_option_values"]) == set(keys["script_options"])


@pytest.mark.parametrize(
    "argv",
    [["--batch_size", "4"], ["--batch_size=4", "--unknown=1"], ["--os=1"], []],
)
def test_no_configurator_without_its_evidence(detector, argv):
    detector, _ = detector
    detector.learn_configurator({"batch_size": 12, "os": os}, argv)
    assert detector.capture()["script_option_syntax"] is None
    assert detector.capture()["script_options"] == []


def test_a_configurator_script_gets_key_equals_value_everywhere():
    """Options appended to a configurator script's command line are
    `--key=value`; the positional configuration file stays."""
    options = ["--batch_size", "--gradient_accumulation_steps", "--max_iters"]
    context = {
        "micro_batch": 4,
        "accumulation_steps": 2,
        "how": "--batch_size",
        "script_option_values": {option: [] for option in options},
        "script_option_syntax": "configurator",
        "command": ["train.py", "config/x.py", "--batch_size=8"],
        "script_options": options,
    }
    args = ["config/x.py", "--batch_size=8"]
    variant = Plain().flag_variant("smaller_batch", args, options, context)
    assert variant == ["config/x.py", "--batch_size=4", "--gradient_accumulation_steps=2"]
    raised, _ = with_enough_steps(variant, options, context, 6)
    assert raised[-1] == "--max_iters=6"
    snippet = Plain().snippet("smaller_batch", context)
    assert snippet.splitlines()[-1] == (
        "python train.py config/x.py --batch_size=4 --gradient_accumulation_steps=2"
    )
    assert "optimizer.step()" not in snippet
    head = Plain().snippet("smaller_batch", {**context, "script_options": []})
    assert head.startswith("# --batch_size=4: 2 micro-batches of 4")


def test_accumulation_snippets_of_a_script_that_updates_by_hand():
    """No optimizer: the loop change keeps the script's own update and
    zeroes the model's gradients every K micro-batches."""
    context = {"micro_batch": 4, "accumulation_steps": 3, "update": "manual", "dtype": "float16"}
    for snippet in (
        Plain().snippet("smaller_batch", context),
        Plain().prescription_snippet(["smaller_batch", "autocast"], context),
    ):
        assert "optimizer.step()" not in snippet and "scaler" not in snippet, snippet
        assert "p.data.add_(p.grad, alpha=-lr)" in snippet
        assert snippet.rstrip().endswith("model.zero_grad()")
    assert "optimizer.step()" in Plain().snippet("smaller_batch", {**context, "update": None})


def test_how_the_script_updates_its_parameters():
    steps = [{"index": 0, "backward_calls": 1}]
    assert Snapshot.from_dict({"steps": steps}).parameter_update == "manual"
    assert Snapshot.from_dict({"steps": steps, "optimizers": ["SGD"]}).parameter_update == (
        "optimizer"
    )
    assert Snapshot.from_dict({"steps": [{"index": 0}]}).parameter_update is None


def test_a_configurator_script_s_defaults_are_read_from_its_file(tmp_path):
    """nanoGPT's defaults are module-level constant expressions; by the first
    forward the script may have changed them (it divides the accumulation
    steps by the world size), so they are read from the file."""
    from oomdoc.capture.frameworks import module_constants

    script = tmp_path / "train.py"
    script.write_text(
        "import os\n"
        "gradient_accumulation_steps = 5 * 8\n"
        "batch_size = 12\n"
        "learning_rate = 6e-4\n"
        "dataset = 'openwebtext'\n"
        "batch_size = 99  # a second assignment: the first is the default\n"
        "device = os.environ.get('DEVICE', 'cuda')\n"
        "flag = True\n"
    )
    assert module_constants(str(script)) == {
        "gradient_accumulation_steps": "40",
        "batch_size": "12",
        "learning_rate": "0.0006",
        "dataset": "openwebtext",
    }
    assert module_constants(str(tmp_path / "missing.py")) == {}


def test_a_configuration_file_on_the_command_line_sets_the_defaults(tmp_path, monkeypatch):
    """nanoGPT's `python train.py config/train_shakespeare_char.py
    --batch_size=64`: the configuration file, exec'd over the globals, sets
    `gradient_accumulation_steps = 1` where train.py says `5 * 8`. An option
    the command line leaves alone defaults to the file's value (the own
    flags of 2 accumulation steps were `--gradient_accumulation_steps=80`);
    one it sets to something that is not a constant has no default."""
    from oomdoc.capture.frameworks import FrameworkDetector

    script = tmp_path / "train.py"
    script.write_text(
        "gradient_accumulation_steps = 5 * 8\nbatch_size = 12\nmax_iters = 600000\n"
        "dataset = 'openwebtext'\n"
    )
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "small.py").write_text(
        "import os\ngradient_accumulation_steps = 1\ndataset = 'shakespeare_char'\n"
        "max_iters = 5000\nmax_iters = int(os.environ.get('ITERS', 10))\nbatch_size = 64\n"
    )
    monkeypatch.chdir(tmp_path)
    detector = FrameworkDetector()
    namespace = {
        "__file__": str(script),
        "gradient_accumulation_steps": 1,
        "batch_size": 64,
        "max_iters": 10,
        "dataset": "shakespeare_char",
    }
    detector.learn_configurator(namespace, ["config/small.py", "--batch_size=32"])
    defaults = detector.capture()["script_option_defaults"]
    assert defaults["--gradient_accumulation_steps"] == "1"
    assert defaults["--dataset"] == "shakespeare_char"
    assert defaults["--batch_size"] == "64"
    assert "--max_iters" not in defaults


def test_an_oom_the_script_catches_and_retries_is_said(tmp_path):
    """accelerate's `find_executable_batch_size` catches the OOM (it matches
    CUDA's words, which the simulated device's error uses) and tries again
    smaller: the script goes on as it would on a GPU, the run fits, and the
    diagnosis says that it ran out of memory first."""
    pytest.importorskip("accelerate")
    script = SCRIPTS / "fw_accelerate_finder.py"
    result, document = run_case(tmp_path, (script, "9MiB", ["--batch-size", "512"]))
    assert result.returncode == 0 and document["outcome"] == "ok", result.stderr[-3000:]
    tried = [line for line in result.stdout.splitlines() if line.startswith("trying batch")]
    assert tried[0] == "trying batch 512" and len(tried) >= 2, result.stdout
    assert f"trained at batch {tried[-1].split()[-1]}" in result.stdout
    seen = document["ooms_seen"]
    assert seen["count"] == len(tried) - 1 and seen["file"].endswith("fw_accelerate_finder.py")
    output = result.stdout + result.stderr
    assert "1. caught_oom: The script ran out of memory once, caught the error itself" in output


def test_lightnings_batch_size_finder_finds_its_batch_under_oomdoc(tmp_path):
    """Lightning's `BatchSizeFinder` tells an OOM by `CUDA` and `out of
    memory` in its message: its binary search runs on the simulated device
    as on a GPU, and the OOMs it caught are said. (It settles on 151 here;
    oomdoc's search of the same encoder finds 159, and 160 runs out of
    memory by hand: the finder's trials carry its own state.)"""
    script = SCRIPTS / "fw_lightning_finder.py"
    result, document = run_case(tmp_path, (script, "48MiB", ["--batch-size", "8"]))
    assert result.returncode == 0 and document["outcome"] == "ok", result.stderr[-3000:]
    (found,) = [line for line in result.stdout.splitlines() if line.startswith("found batch")]
    assert int(found.split()[2].rstrip(",")) > 64 and found.endswith("trained 3 steps"), found
    assert document["ooms_seen"]["count"] >= 1
    assert "1. caught_oom: The script ran out of memory" in result.stdout + result.stderr
