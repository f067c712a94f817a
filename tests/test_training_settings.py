"""What the first training call already does (oomdoc.capture.training_settings):
the modules it runs under torch.utils.checkpoint, however the script calls
it, and the autocast entered inside the model's forward."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from oomdoc.capture.training_settings import FirstTrainingCall


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Model(nn.Module):
    """Its blocks called as `how` says (None: plainly)."""

    def __init__(self, how, autocast=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.how, self.autocast = how, autocast

    def forward(self, x):
        if self.autocast:  # accelerate's way: entered inside the forward
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.run(x)
        return self.run(x)

    def run(self, x):
        for block in self.blocks:
            x = block(x) if self.how is None else self.how(block, x)
        return x


WAYS = {
    "the module, non-reentrant": lambda b, x: checkpoint(b, x, use_reentrant=False),
    "the module, reentrant": lambda b, x: checkpoint(b, x, use_reentrant=True),
    "a bound forward": lambda b, x: checkpoint(b.forward, x, use_reentrant=False),
    "a partial of __call__": lambda b, x: checkpoint(functools.partial(b), x, use_reentrant=False),
    "a partial of the unbound forward": lambda b, x: checkpoint(
        functools.partial(type(b).forward, b), x, use_reentrant=False
    ),
    "a closure": lambda b, x: checkpoint(lambda y: b(y), x, use_reentrant=False),
}


def first_call(model, x) -> FirstTrainingCall:
    """The watch over one training call, started as the framework detector
    starts it: at the outermost call's start (a pre-hook), stopped at the
    backward."""
    watch = FirstTrainingCall()
    handle = model.register_forward_pre_hook(lambda module, _inputs: watch.start(module))
    try:
        output = model(x)
        watch.stop()
        output.float().sum().backward()
    finally:
        handle.remove()
        watch.stop()
    return watch


@pytest.mark.parametrize("way", sorted(WAYS))
def test_each_checkpointed_block_is_counted_once(way):
    x = torch.randn(4, 8, requires_grad=True)
    watch = first_call(Model(WAYS[way]), x)
    assert watch.checkpointed == {"Block": 3}
    assert watch.autocast == {}


def test_a_model_that_does_not_checkpoint_has_none_and_the_watch_comes_off():
    model = Model(None)
    watch = first_call(model, torch.randn(4, 8))
    assert watch.checkpointed == {}
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    assert not hooks, hooks  # removed at stop
    watch.start(model)  # a later training call is not read again
    assert watch.checkpointed == {}


def test_an_evaluation_call_is_not_the_first_training_call():
    model = Model(WAYS["the module, non-reentrant"])
    watch = FirstTrainingCall()
    model.eval()
    watch.start(model)
    assert watch.checkpointed is None and watch.autocast is None
    model.train()
    with torch.no_grad():
        watch.start(model)
    assert watch.checkpointed is None


def test_autocast_entered_inside_the_forward_is_read():
    x = torch.randn(4, 8, requires_grad=True)
    watch = first_call(Model(WAYS["the module, reentrant"], autocast=True), x)
    assert watch.autocast == {"cpu": "bfloat16"}
    assert watch.checkpointed == {"Block": 3}


def test_a_compiled_model_is_not_watched_inside():
    """Its compiled code would trace the watch's global hook, and removing
    the hook would make it compile again (tests/gpu/test_compiled_gpu.py):
    its checkpointing stays unknown."""
    from oomdoc.capture.training_settings import compiled_inside

    plain = Model(None)
    compiled = torch.compile(Model(None))
    in_place = Model(None)
    in_place.blocks[0].compile()  # (a cycle: the module, its compiled call)
    try:
        assert compiled_inside(compiled) and not compiled_inside(plain)
        assert compiled_inside(in_place)
        watch = FirstTrainingCall()
        watch.start(compiled)
        assert watch.autocast == {} and watch.checkpointed is None
        assert not torch.nn.modules.module._global_forward_pre_hooks
    finally:
        # Other tests in this process scan the collector for modules holding
        # weights (oom.uncalled_models): these must be gone.
        del compiled, in_place
        gc.collect()
