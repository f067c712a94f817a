"""The simulated device's pass-through ops (oomdoc.capture.passthrough).

Ops that cannot make a storage reach the CPU kernel without a Python call.
Checked here: each op of the list is really skipped by the mode and its
kernel calls back into the mode with nothing it would count; a training
loop counts the same bytes, sites and peaks with and without the
pass-through; anything else that uses Python dispatch (another mode, a
tensor subclass with its own __torch_dispatch__, torch.compile) removes it
first; uninstalling removes it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from simulated_training import Net, train
from torch.utils._python_dispatch import TorchDispatchMode

from oomdoc.capture.backends import SimulatedBackend
from oomdoc.capture.passthrough import PASS_THROUGH_OPS


def _record_function():
    with torch.autograd.profiler.record_function("oomdoc"):  # as every optimizer step
        pass


# One call per op of PASS_THROUGH_OPS, on dense CPU tensors.
EXAMPLES = {
    "aten::view": lambda x, y: x.view(-1),
    "aten::_unsafe_view": lambda x, y: torch.ops.aten._unsafe_view(x, [-1]),
    "aten::_reshape_alias": lambda x, y: torch.ops.aten._reshape_alias(x, [64], [1]),
    "aten::alias": lambda x, y: torch.ops.aten.alias(x),
    "aten::t": lambda x, y: x.t(),
    "aten::transpose.int": lambda x, y: x.transpose(0, 1),
    "aten::permute": lambda x, y: x.permute(1, 0),
    "aten::expand": lambda x, y: x[:1].expand(4, 8),
    "aten::as_strided": lambda x, y: x.as_strided((2, 2), (1, 2)),
    "aten::select.int": lambda x, y: x.select(0, 1),
    "aten::slice.Tensor": lambda x, y: x[1:3],
    "aten::unsqueeze": lambda x, y: x.unsqueeze(0),
    "aten::squeeze": lambda x, y: x[:1].squeeze(),
    "aten::squeeze.dim": lambda x, y: x[:1].squeeze(0),
    "aten::squeeze.dims": lambda x, y: torch.ops.aten.squeeze.dims(x[:1], [0]),
    "aten::split.Tensor": lambda x, y: x.split(4),
    "aten::split_with_sizes": lambda x, y: x.split([3, 5]),
    "aten::unbind.int": lambda x, y: x.unbind(0),
    "aten::diagonal": lambda x, y: x.diagonal(),
    "aten::unfold": lambda x, y: x.unfold(0, 2, 2),
    "aten::_local_scalar_dense": lambda x, y: x[0, 0].item(),
    "aten::lerp_.Scalar": lambda x, y: x.lerp_(y, 0.1),
    "aten::zero_": lambda x, y: x.zero_(),
    "aten::fill_.Scalar": lambda x, y: x.fill_(0.5),
    "aten::sqrt_": lambda x, y: x.sqrt_(),
    "aten::neg_": lambda x, y: x.neg_(),
    "profiler::_record_function_enter_new": lambda x, y: _record_function(),
    "profiler::_record_function_exit._RecordFunction": lambda x, y: _record_function(),
}


def _overload(name: str):
    namespace, rest = name.split("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


@pytest.fixture
def device():
    """A simulated device (no tracker) that records the ops its mode sees."""
    installed = []

    def make(pass_through=True):
        backend = SimulatedBackend(1 << 30, pass_through=pass_through)
        seen: list = []
        dispatch = backend.dispatch

        def recording(func, args, kwargs):
            seen.append((func, args))
            return dispatch(func, args, kwargs)

        backend.dispatch = recording
        backend.install(None)
        installed.append(backend)
        return backend, seen

    yield make
    for backend in installed:
        backend.uninstall()


def test_every_op_of_the_list_has_an_example():
    assert set(EXAMPLES) == set(PASS_THROUGH_OPS)


@pytest.mark.parametrize("name", PASS_THROUGH_OPS)
def test_a_pass_through_op_skips_the_mode_and_calls_back_with_nothing_to_count(device, name):
    x, y = torch.rand(8, 8), torch.rand(8, 8)
    backend, seen = device()
    if name not in backend.pass_through_ops:
        pytest.skip(f"{name}: not in this torch")
    EXAMPLES[name](x, y)
    op = _overload(name)
    assert op not in [func for func, _args in seen]
    # Whatever its kernel dispatched back is a view: nothing new to count.
    for func, _args in seen:
        returns = func._schema.returns
        assert all(r.alias_info is not None and not r.alias_info.is_write for r in returns), func
    # Without the pass-through the mode sees the op: the example exercises it.
    backend.uninstall()
    backend, seen = device(pass_through=False)
    EXAMPLES[name](x, y)
    assert op in [func for func, _args in seen]


def test_a_training_loop_counts_the_same_with_and_without_the_pass_through():
    fast, slow = train(Net, native=False), train(Net, pass_through=False, native=False)
    assert fast.pop("pass_through") and not slow.pop("pass_through")
    assert fast == slow
    assert fast["peak"]["allocated_bytes"] > 0 and fast["sites"]


def test_uninstall_removes_the_fallthroughs(device):
    backend, _seen = device()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::view", "Python")
    backend.uninstall()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::view", "Python")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::add.Tensor", "Python")
    assert "_make_wrapper_subclass" not in vars(torch.Tensor)
    assert torch.compile.__module__ == "torch"


class Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class Wrapper(torch.Tensor):
    """A wrapper subclass with its own __torch_dispatch__ (as DTensor)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = [a.inner if isinstance(a, Wrapper) else a for a in args]
        out = func(*unwrap, **(kwargs or {}))
        return Wrapper(out) if isinstance(out, torch.Tensor) else out


def test_another_mode_removes_the_fallthroughs_and_sees_every_op(device):
    backend, _seen = device()
    assert backend.pass_through_active
    native = backend.native_active  # the compiled check's kernels go too (oomdoc.capture.native)
    assert native == torch._C._dispatch_has_kernel_for_dispatch_key("aten::add.Tensor", "Python")
    with Recording() as recording:
        torch.rand(4, 4).t() + 1
    assert torch.ops.aten.t.default in recording.seen
    assert torch.ops.aten.add.Tensor in recording.seen
    assert not backend.pass_through_active and not backend.native_active
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::t", "Python")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::add.Tensor", "Python")


def test_a_subclass_with_its_own_dispatch_removes_the_fallthroughs(device):
    backend, _seen = device()
    parameter = nn.Parameter(torch.ones(3))  # a subclass without its own dispatch
    assert backend.pass_through_active and parameter.sum().item() == 3
    wrapped = Wrapper(torch.arange(6.0).view(2, 3))
    assert not backend.pass_through_active
    transposed = wrapped.t()
    assert isinstance(transposed, Wrapper) and transposed.inner.shape == (3, 2)


def test_torch_compile_removes_the_fallthroughs(device):
    backend, _seen = device()
    torch.compile(lambda x: x + 1)  # compiled on first call, never made here
    assert not backend.pass_through_active
