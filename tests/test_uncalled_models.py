"""The models no call nor optimizer made known (Attribution.uncalled_models):
at an OOM their weights are `other`, and the OOM names them."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn

from oomdoc.capture.backends import OutOfMemoryError, SimulatedBackend
from oomdoc.capture.tracker import Tracker

MiB = 1 << 20
# model()'s two Linear layers and BatchNorm's weights, and BatchNorm's buffers.
WEIGHTS = (2 * (256 * 256 + 256) + 2 * 256) * 4 + (2 * 256 * 4 + 8)


def model() -> nn.Module:
    # BatchNorm buffers, and a frozen layer left out of the optimizer.
    net = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Linear(256, 256))
    net[0].requires_grad_(False)
    return net


def oom_of(train_first: bool, with_ema: bool, keep: Callable = lambda net: None) -> dict:
    """The OOM's record, the device full after `keep(net)` (what it returns
    is alive at the OOM)."""
    backend = SimulatedBackend(8 * MiB)
    tracker = Tracker(backend)
    tracker.install()
    backend.install(tracker)
    try:
        net = model()
        ema = copy.deepcopy(net).eval() if with_ema else None  # YOLO's ModelEMA
        optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
        if train_first:
            net(torch.randn(8, 256)).square().mean().backward()
            optimizer.step()
        kept = keep(net)
        with pytest.raises(OutOfMemoryError):
            torch.empty(16 * MiB, dtype=torch.uint8)  # more than the device holds
        assert ema is None or ema.training is False
        del kept
        return tracker.oom or {}
    finally:
        backend.uninstall()
        tracker.uninstall()


def test_an_ema_copy_is_named_with_its_weights_and_the_called_models_buffers_are_not():
    named = oom_of(train_first=True, with_ema=True)["uncalled_models"]
    assert [entry["class"] for entry in named] == ["Sequential"]
    assert named[0]["bytes"] == named[0]["weights_bytes"] == WEIGHTS, named
    assert named[0]["held_by"] == ["ema (a local of oom_of)"]  # where the script keeps it
    assert "uncalled_models" not in oom_of(train_first=True, with_ema=False)


def test_before_any_call_the_models_on_the_device_are_named_as_being_loaded():
    """An OOM before any model call (the models built or moved to the
    device): each model holding weights there is named, with all of its
    weights (the diagnosis, model_load, says they do not fit)."""
    named = oom_of(train_first=False, with_ema=True)["uncalled_models"]
    assert [entry["class"] for entry in named] == ["Sequential", "Sequential"]
    # The EMA copy all unknown; the model less what its optimizer knows.
    assert named[0]["bytes"] == named[0]["weights_bytes"] == WEIGHTS
    assert named[1]["weights_bytes"] == WEIGHTS


def test_copies_of_the_weights_are_counted_and_the_forwards_activations_are_not():
    """A saved best state (copy.deepcopy(model.state_dict())) and an EMA's
    shadow weights (diffusers' EMAModel: detached clones in a list): two
    copies of the model's weights, exactly their bytes. The forward's
    output, shaped like a weight (batch 256 = width 256), is an activation,
    not a copy; BatchNorm's running statistics beyond the weights' shapes
    are no third copy."""

    def keep(net):
        state = copy.deepcopy(net.state_dict())
        shadow = [parameter.detach().clone() for parameter in net.parameters()]
        output = net(torch.randn(256, 256))  # (256, 256), made by autograd
        return state, shadow, output

    oom = oom_of(train_first=True, with_ema=False, keep=keep)
    assert "uncalled_models" not in oom
    [found] = oom["weight_copies"]
    per_copy = (2 * 256 * 256 + 4 * 256) * 4  # two Linear layers and BatchNorm's weights
    assert found == {"of": "Sequential", "copies": 2, "tensors": 12, "bytes": 2 * per_copy}
    assert "weight_copies" not in oom_of(train_first=True, with_ema=False)


class Lazy(dict):
    """A mapping whose values() does work (transformers' lazy auto mappings
    import every model module when asked for their values)."""

    asked = 0

    def values(self):
        Lazy.asked += 1
        return super().values()


def test_the_scan_runs_no_code_of_the_scripts_containers():
    """The scan reads dicts and lists of exactly those types with their own
    methods: a dict subclass's values() is never called (at an OOM in a
    transformers process it imported every model, 30 s)."""

    def keep(net):
        return Lazy((str(index), torch.zeros(256)) for index in range(8))

    Lazy.asked = 0
    oom_of(train_first=True, with_ema=False, keep=keep)
    assert Lazy.asked == 0


class EMAModel:
    """diffusers' EMAModel's shape: the shadow weights in a list attribute."""

    def __init__(self, parameters):
        self.shadow_params = [parameter.detach().clone() for parameter in parameters]


def test_copies_are_named_by_where_the_script_keeps_them():
    """An attribute of an object (`EMAModel.shadow_params`) or a local of a
    function on the stack at the OOM (`kept`, oom_of's): the report points
    at it. A copy held only by another container is not named."""
    oom = oom_of(train_first=True, with_ema=False, keep=lambda net: EMAModel(net.parameters()))
    [found] = oom["weight_copies"]
    assert found["copies"] == 1 and found["held_by"] == ["EMAModel.shadow_params"]
    oom = oom_of(
        train_first=True,
        with_ema=False,
        keep=lambda net: list(EMAModel(net.parameters()).shadow_params),
    )
    assert oom["weight_copies"][0]["held_by"] == ["kept (a local of oom_of)"]
    oom = oom_of(
        train_first=True,
        with_ema=False,
        keep=lambda net: (EMAModel(net.parameters()).shadow_params,),
    )
    assert "held_by" not in oom["weight_copies"][0]


def test_the_report_says_where_the_copies_are():
    from oomdoc.diagnosis.breakdown import _category_evidence
    from oomdoc.model import Snapshot

    snapshot = Snapshot.from_dict(
        {
            "device": {"capacity_bytes": 8 * MiB},
            "oom": {
                "phase": "forward",
                "weight_copies": [
                    {
                        "of": "UNet",
                        "copies": 1,
                        "tensors": 12,
                        "bytes": 4 * MiB,
                        "held_by": ["EMAModel.shadow_params"],
                    }
                ],
            },
        }
    )
    assert snapshot.oom is not None and snapshot.oom.weight_copies[0].held_by == [
        "EMAModel.shadow_params"
    ]
    assert Snapshot.from_dict(snapshot.to_dict()).oom.weight_copies[0].held_by == [
        "EMAModel.shadow_params"
    ]
    evidence = _category_evidence(snapshot, "other")
    assert any("in EMAModel.shadow_params" in line for line in evidence), evidence
