"""The simulated device's compiled op check (oomdoc.capture.native).

It must count exactly what the dispatch mode counts: the same storages,
sites, steps, peaks and OOM, on a training loop with ops that take tensor
lists, resize a storage in place, and take Python numbers. Where it cannot
be built the device falls back to the mode; under CI=true the compiler is
there and these tests must run.
"""

from __future__ import annotations

import os

import pytest
import torch
from simulated_training import Net, train

from oomdoc.capture import native
from oomdoc.capture.backends import SimulatedBackend


@pytest.fixture(scope="module")
def compiled():
    module = native.load()
    if module is None:
        if os.environ.get("CI"):
            pytest.fail(f"the native op check did not build: {native.unavailable_reason()}")
        pytest.skip(f"no native op check here: {native.unavailable_reason()}")
    return module


def test_a_training_loop_counts_the_same_with_the_native_check_and_without(compiled):
    with_native = train(Net, grow_a_buffer=True)
    mode_only = train(Net, native=False, grow_a_buffer=True)
    no_pass_through = train(Net, pass_through=False, native=False, grow_a_buffer=True)
    assert with_native.pop("native") and not mode_only.pop("native")
    assert not no_pass_through.pop("native")
    for result in (with_native, mode_only, no_pass_through):
        result.pop("pass_through")
    assert with_native == mode_only == no_pass_through
    assert with_native["peak"]["allocated_bytes"] > 0 and with_native["sites"]
    assert any("simulated_training.py" in str(site) for site in with_native["sites"])


@pytest.mark.parametrize("capacity", [60_000, 100_000])
def test_the_device_runs_out_of_memory_at_the_same_op_with_the_native_check(compiled, capacity):
    # In the first backward, and in the first optimizer step (its state).
    assert train(Net, grow_a_buffer=True)["peak"]["allocated_bytes"] > capacity
    with_native = train(Net, capacity=capacity, grow_a_buffer=True)
    mode_only = train(Net, native=False, capacity=capacity, grow_a_buffer=True)
    assert "oom" in with_native and with_native.pop("native") and not mode_only.pop("native")
    assert with_native == mode_only


def test_python_numbers_and_known_storages_call_nothing(compiled):
    backend = SimulatedBackend(1 << 30)
    backend.install(None)
    try:
        assert backend.native_active
        x = torch.rand(64)
        x.add_(1.0)  # x is counted here, the number never
        registered = backend.capture_stats()["storages_registered"]
        x.mul_(0.5)
        x.view(8, 8).t()
        assert backend.capture_stats()["storages_registered"] == registered
        y = x * 2.0
        assert backend.capture_stats()["storages_registered"] == registered + 1
        assert (
            backend.allocated_bytes() == x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
        )
    finally:
        backend.uninstall()


def test_native_off_by_environment(monkeypatch):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load() is None and native.DISABLE_ENV in native.unavailable_reason()
    backend = SimulatedBackend(1 << 30)
    backend.install(None)
    try:
        assert not backend.native_active and backend.pass_through_active
    finally:
        backend.uninstall()


def test_a_failed_build_is_not_tried_again_at_every_run(tmp_path, monkeypatch):
    """A compiler that fails (here: one that exits 1) costs its time once:
    the next run says why without compiling, until the mark is removed."""
    failing = tmp_path / "failing-c++"
    failing.write_text("#!/bin/sh\necho 'error: no torch headers' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path / "cache"))
    with pytest.raises(native.BuildError, match="no torch headers"):
        native.build(announce=False)
    failing.write_text("#!/bin/sh\necho called >> " + str(tmp_path / "calls") + "\nexit 1\n")
    with pytest.raises(native.BuildError, match="an earlier build"):
        native.build(announce=False)
    assert not (tmp_path / "calls").exists()
    (native.library_path().parent / "failed").unlink()
    killed_midway = native.library_path().parent / "tmpkilled.so"
    killed_midway.write_bytes(b"")
    with pytest.raises(native.BuildError, match="the compiler failed"):
        native.build(announce=False)
    assert (tmp_path / "calls").read_text() == "called\n"
    assert not killed_midway.exists()


@pytest.fixture
def ledger(compiled):
    backend = SimulatedBackend(1 << 30)
    backend.install(None)
    assert backend.native_active
    yield backend
    backend.uninstall()


def test_temporaries_made_and_freed_between_reads_never_reach_python(ledger):
    kept = torch.rand(256)
    ledger.live_storages()  # a read: the log is empty from here
    before = ledger.capture_stats()["storages_registered"]
    for _ in range(10):
        (kept * 2.0).sum()  # two temporaries, dead before the next read
    assert ledger.capture_stats()["storages_registered"] == before + 20
    keys = {key for key, _nbytes, _record in ledger.live_storages()}
    assert keys == {kept.untyped_storage()._cdata}
    assert ledger.allocated_bytes() == kept.untyped_storage().nbytes()


def test_a_storage_freed_on_another_thread_is_seen_at_once(ledger):
    import threading

    tensors = [torch.rand(1000)]
    made = ledger.allocated_bytes()
    assert made >= 4000
    worker = threading.Thread(target=tensors.clear)  # its deleter runs there, without the GIL
    worker.start()
    worker.join()
    assert ledger.allocated_bytes() == made - 4000
    assert not list(ledger.live_storages())


def test_a_storage_resized_in_place_then_freed_is_counted_both_times(ledger):
    buffer = torch.zeros(10)
    buffer.resize_(1000)  # a new DataPtr for a live storage: a resize, not a free
    assert ledger.allocated_bytes() == 4000
    del buffer  # the new DataPtr is watched too
    assert ledger.allocated_bytes() == 0
    buffer = torch.zeros(10)
    buffer.untyped_storage().resize_(8000)  # not an op: no look at the new size
    del buffer  # its free is still seen
    assert ledger.allocated_bytes() == 0
    assert not list(ledger.live_storages())


def test_another_mode_takes_the_live_storages_over_from_the_ledger(ledger):
    from torch.utils._python_dispatch import TorchDispatchMode

    kept = torch.rand(100)
    dropped = torch.rand(200)

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Other():  # removes the compiled check: Python watches the storages now
        assert not ledger.native_active
        made = kept * 2.0
    assert ledger.allocated_bytes() == 400 + 800 + 400
    del dropped
    assert ledger.allocated_bytes() == 400 + 400
    del made
    assert ledger.allocated_bytes() == 400


def test_batches_from_dataloader_workers_are_counted_and_freed(ledger):
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(64.0).reshape(16, 4))
    base = ledger.allocated_bytes()
    total = 0.0
    for (batch,) in DataLoader(data, batch_size=4, num_workers=2):
        total += float(batch.sum())  # the batch, in shared memory, counted here
        assert ledger.allocated_bytes() >= base + batch.untyped_storage().nbytes()
    del batch
    assert total == sum(range(64))
    assert ledger.allocated_bytes() == base


def test_a_storage_shrunk_in_place_keeps_its_data_pointer_and_is_counted_at_each_size(ledger):
    buffer = torch.zeros(1000)
    buffer.resize_(10)  # smaller: the same DataPtr, a new size
    assert ledger.allocated_bytes() == 4000  # a storage keeps its bytes on a shrink
    buffer.untyped_storage().resize_(40)  # not an op: the next look sees it
    buffer.add_(1.0)
    assert ledger.allocated_bytes() == 40
    buffer.resize_(2000)
    assert ledger.allocated_bytes() == 8000
    buffer.mul_(2.0)
    assert ledger.allocated_bytes() == 8000
    del buffer
    assert ledger.allocated_bytes() == 0


def test_a_new_ledger_counts_storages_an_earlier_one_wrapped(compiled):
    first = SimulatedBackend(1 << 30)
    first.install(None)
    kept = torch.rand(100)  # wrapped by the first ledger
    first.uninstall()
    second = SimulatedBackend(1 << 30)
    second.install(None)
    try:
        assert second.allocated_bytes() == 0
        kept.add_(1.0)  # an old wrapper: not this ledger's, so registered here
        assert second.allocated_bytes() == 400
        del kept
        assert second.allocated_bytes() == 0
    finally:
        second.uninstall()


def test_the_compiled_storage_table_is_the_python_one(ledger):
    weight = torch.rand(8, 8)
    tensors = [weight, weight.t(), weight[0], None, torch.rand(3), torch.tensor(1.0)]
    tensors.append(
        torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=True)
    )  # no storage: left out
    native_table = ledger.storage_table(tensors)
    python_table = super(SimulatedBackend, ledger).storage_table(tensors)
    assert native_table == python_table
    assert native_table[weight.untyped_storage()._cdata] == 256
    assert len(native_table) == 3


def test_the_site_line_is_the_line_of_the_op(ledger):
    import inspect

    line = inspect.currentframe().f_lineno + 1
    kept = torch.zeros(64)
    records = {key: record for key, _nbytes, record in ledger.live_storages()}
    record = records[kept.untyped_storage()._cdata]
    assert record.line == line
    assert record.code is inspect.currentframe().f_code


def _registrations_of(op: str, key: str) -> list[str]:
    return [
        line
        for line in torch._C._dispatch_dump_table(op).splitlines()
        if line.startswith(f"{key}:") and "counter.cpp" in line
    ]


def test_ops_with_the_kernel_skip_the_python_snapshot_until_it_goes(compiled):
    backend = SimulatedBackend(1 << 30)
    backend.install(None)
    try:
        assert _registrations_of("aten::mul.Tensor", "Python")
        assert _registrations_of("aten::mul.Tensor", "PythonTLSSnapshot")
        with torch.inference_mode():  # ops without the kernel reach the mode, snapshot and all
            made = torch.nn.functional.linear(torch.rand(4, 8), torch.rand(2, 8))
        assert backend.allocated_bytes() >= made.untyped_storage().nbytes()
    finally:
        backend.uninstall()
    assert not _registrations_of("aten::mul.Tensor", "Python")
    assert not _registrations_of("aten::mul.Tensor", "PythonTLSSnapshot")


def test_the_stub_names_every_function_of_the_compiled_module(compiled):
    """_oomdoc_counter.pyi (shipped with the package) is what type checkers
    and readers see of the module: it must not drift from counter.cpp."""
    import ast
    from pathlib import Path

    stub = Path(native.__file__).with_name("_oomdoc_counter.pyi")
    declared = {
        node.name for node in ast.parse(stub.read_text()).body if isinstance(node, ast.FunctionDef)
    }
    compiled_functions = {
        name
        for name in dir(compiled)
        if not name.startswith("_") and callable(getattr(compiled, name))
    }
    assert declared == compiled_functions
    assert all(getattr(compiled, name).__doc__ for name in declared)
