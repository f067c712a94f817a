"""What shows that a run goes through a framework: one declaration each.

The capture child's detector (oomdoc.capture.frameworks) reads these and
holds no table of its own, so adding a framework is its unit (a Framework
subclass in FRAMEWORKS) and its FrameworkSigns in SIGNS. Torch-free, and
nothing here imports the frameworks: the names are matched against the
stack, the model's wrappers and the modules already imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FrameworkSigns:
    """The evidence for one framework (its unit's `name`)."""

    name: str
    # When several show up (the HF Trainer drives an Accelerator), the one
    # with the highest rank drives the others and wins (plain is 0).
    rank: int
    # The packages whose `__version__` is the framework's, by import name.
    version_modules: tuple[str, ...]
    # (path fragment, entry): a frame whose file contains the fragment is the
    # framework's own training code driving the step.
    frames: tuple[tuple[str, str], ...] = ()
    # (module that defines it, class, entry): a live instance in the user's
    # frames shows the framework is used (looked up only in modules already
    # imported).
    instances: tuple[tuple[str, str, str], ...] = ()
    # (module prefix, entry): the model called is the framework's wrapper
    # when its class's module starts with the prefix (Fabric's _FabricModule).
    wrapper_modules: tuple[tuple[str, str], ...] = ()
    # (attribute, entry): the model called carries this true attribute once
    # the framework prepared it (accelerate's `prepare`).
    wrapper_marks: tuple[tuple[str, str], ...] = ()


SIGNS: tuple[FrameworkSigns, ...] = (
    FrameworkSigns(
        name="transformers",
        rank=3,
        version_modules=("transformers",),
        frames=(
            ("/transformers/trainer.py", "Trainer"),
            ("/transformers/trainer_seq2seq.py", "Trainer"),
        ),
        instances=(("transformers.trainer", "Trainer", "Trainer"),),
    ),
    FrameworkSigns(
        name="lightning",
        rank=2,
        version_modules=("lightning", "pytorch_lightning", "lightning_fabric"),
        frames=(
            ("/lightning/pytorch/loops/", "Trainer"),
            ("/lightning/pytorch/trainer/", "Trainer"),
            ("/pytorch_lightning/loops/", "Trainer"),
            ("/pytorch_lightning/trainer/", "Trainer"),
            ("/lightning/fabric/fabric.py", "Fabric"),
            ("/lightning/fabric/wrappers.py", "Fabric"),
            ("/lightning_fabric/fabric.py", "Fabric"),
            ("/lightning_fabric/wrappers.py", "Fabric"),
        ),
        instances=(
            ("lightning.pytorch.trainer.trainer", "Trainer", "Trainer"),
            ("pytorch_lightning.trainer.trainer", "Trainer", "Trainer"),
            ("lightning.fabric.fabric", "Fabric", "Fabric"),
            ("lightning_fabric.fabric", "Fabric", "Fabric"),
        ),
        wrapper_modules=(("lightning.fabric", "Fabric"), ("lightning_fabric", "Fabric")),
    ),
    FrameworkSigns(
        name="accelerate",
        rank=1,
        version_modules=("accelerate",),
        frames=(
            ("/accelerate/accelerator.py", "Accelerator"),
            ("/accelerate/optimizer.py", "Accelerator"),
            ("/accelerate/utils/operations.py", "Accelerator"),
        ),
        instances=(("accelerate.accelerator", "Accelerator", "Accelerator"),),
        wrapper_marks=(("_is_accelerate_prepared", "Accelerator"),),
    ),
)
