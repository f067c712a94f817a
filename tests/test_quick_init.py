"""A replay's cheap random initialisation (oomdoc.capture.quick_init): large
CPU tensors get the distribution asked for, without the global generator's
numbers; everything else is torch's own."""

from __future__ import annotations

import pytest
import torch

from oomdoc.capture import quick_init

LARGE = 3 * quick_init.MIN_ELEMENTS + 12345  # not a whole number of blocks


@pytest.fixture
def installed():
    undo = quick_init.install()
    try:
        yield
    finally:
        undo()


def test_large_fills_have_the_distribution_asked_for(installed):
    state = torch.get_rng_state()
    normal = torch.empty(LARGE).normal_(0.5, 0.02)
    uniform = torch.empty(LARGE).uniform_(-3.0, 1.0)
    truncated = torch.nn.init.trunc_normal_(torch.empty(LARGE), std=1.0, a=-0.5, b=0.5)
    kaiming = torch.nn.init.kaiming_uniform_(torch.empty(2048, 1024))  # uniform_ inside
    assert torch.equal(state, torch.get_rng_state())  # the global generator untouched
    assert normal.mean().item() == pytest.approx(0.5, abs=1e-3)
    assert normal.std().item() == pytest.approx(0.02, rel=0.01)
    assert -3.0 <= uniform.min().item() < -2.99 and 0.99 < uniform.max().item() <= 1.0
    assert uniform.mean().item() == pytest.approx(-1.0, abs=0.01)
    assert -0.5 <= truncated.min().item() and truncated.max().item() <= 0.5
    bound = (6 / 1024) ** 0.5  # kaiming_uniform_ at its defaults: sqrt(6 / fan_in)
    assert kaiming.abs().max().item() <= bound and kaiming.std().item() > 0.5 * bound
    for tensor in (normal, uniform, truncated, kaiming):
        assert torch.isfinite(tensor).all()
    # Two weights of one shape are not the same numbers (a random offset each).
    assert not torch.equal(torch.empty(LARGE).normal_(), torch.empty(LARGE).normal_())


def test_everything_else_is_torchs_own():
    def drawn(make):
        torch.manual_seed(7)
        return make()

    def small():
        return torch.empty(1000).normal_(1.0, 2.0)

    def seeded():
        return torch.empty(LARGE).normal_(generator=torch.Generator().manual_seed(3))

    def strided():
        return torch.empty(LARGE * 2)[::2].uniform_()  # not contiguous

    undo = quick_init.install()
    try:
        patched = [drawn(make) for make in (small, seeded, strided)]
        # A leaf that requires grad, filled with autograd on: torch's own error.
        with pytest.raises(RuntimeError, match="leaf Variable"):
            torch.nn.Parameter(torch.empty(LARGE)).normal_()
    finally:
        undo()
    for values, make in zip(patched, (small, seeded, strided)):
        assert torch.equal(values, drawn(make))


def test_undo_puts_torch_back():
    before = (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_)
    undo = quick_init.install()
    assert torch.Tensor.normal_ is not before[0]
    undo()
    assert (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_) == before
    assert "normal_" not in vars(torch.Tensor) and "uniform_" not in vars(torch.Tensor)
