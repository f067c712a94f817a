"""The parameter, gradient and optimizer-state tables a phase boundary reuses.

On CUDA the breakdown at each phase boundary names parameters, gradients and
optimizer state; the tracker reads a table again only when something could
have changed it (a new step, a backward, an optimizer step). These tests run
the CUDA code path on CPU tensors and check, at every boundary, that the
reused tables are exactly the ones a fresh read gives."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import benchmark_module

from oomdoc.capture.backend_base import StorageTableMemo
from oomdoc.capture.tracker import Tracker

# CPU tensors as the device, as benchmarks/host_overhead.py runs the CUDA path.
CpuAsDevice = benchmark_module("host_overhead").HostBackend


TABLE_STATE = (
    "_known",
    "_known_sources",
    "_known_state",
    "_parameters_table",
    "_gradients_table",
    "_parameters_stale",
    "_gradients_stale",
)

MEMOS = ("_parameters_memo", "_gradients_memo", "_state_memo")


def checked_tracker():
    """A tracker whose boundary reads are compared with fresh reads; returns
    (tracker, list of boundaries compared)."""
    tracker = Tracker(CpuAsDevice())
    compared = []
    cached_read = tracker._known_tensors

    def known_tensors(cached: bool = False):
        result = cached_read(cached)
        if cached:
            # The fresh read must not refresh what later boundaries reuse, and
            # reads every storage again (memos of its own, empty).
            saved = {name: getattr(tracker, name) for name in TABLE_STATE + MEMOS}
            for name in MEMOS:
                setattr(tracker, name, StorageTableMemo())
            fresh = cached_read(False)
            assert result == fresh, f"stale tables in phase {tracker.phase}"
            for name, value in saved.items():
                setattr(tracker, name, value)
            compared.append(tracker.phase)
        return result

    tracker._known_tensors = known_tensors
    return tracker, compared


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_a_plain_loop_reuses_tables_and_they_are_never_stale():
    tracker, compared = checked_tracker()
    tracker.install()
    try:
        model = net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(4):
            loss = F.mse_loss(model(torch.randn(8, 16)), torch.zeros(8, 4))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        tracker.finish()
    finally:
        tracker.uninstall()
    assert {"forward", "backward", "optimizer"} <= set(compared)
    stats = tracker.capture_stats()
    assert stats["known_tables_reused"] >= 4  # at least once a step
    assert stats["state_table_builds"] <= 4 + 1  # once per optimizer step


def test_gradients_made_without_a_backward_are_seen_at_the_optimizer_step():
    """A script that sets gradients itself (torch.func, a custom loop)."""
    tracker, compared = checked_tracker()
    tracker.install()
    try:
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            model(torch.randn(8, 16))
            for parameter in model.parameters():
                parameter.grad = torch.ones_like(parameter)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        tracker.finish()
        _parameters, gradients, _state = tracker._known_tensors()
        assert sum(gradients.values()) > 0
    finally:
        tracker.uninstall()
    assert "forward" in compared


def test_accumulation_closure_and_swapped_parameter_data():
    """Micro-batches (gradients grow between optimizer steps), LBFGS's
    closure, and `param.data = ...` between steps."""
    tracker, compared = checked_tracker()
    tracker.install()
    try:
        model = net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            for _micro in range(3):
                F.mse_loss(model(torch.randn(4, 16)), torch.zeros(4, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
        first = model[0]
        first.weight.data = torch.randn(32, 16)  # no registration hook sees this
        lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=2)

        def closure():
            lbfgs.zero_grad()
            loss = F.mse_loss(model(torch.randn(4, 16)), torch.zeros(4, 4))
            loss.backward()
            return loss

        for _ in range(2):
            lbfgs.step(closure)
        tracker.finish()
    finally:
        tracker.uninstall()
    assert {"forward", "backward", "optimizer"} <= set(compared)


def test_a_memo_reads_its_tensors_again_only_when_they_moved():
    """The same tensors give the same table without reading a storage; one
    whose data was swapped (`param.data = ...`), one that grew, or one more
    tensor is read again."""
    backend = CpuAsDevice()
    memo = StorageTableMemo()
    reads = []
    original = backend.storage_table

    def storage_table(tensors):
        reads.append(len(tensors))
        return original(tensors)

    backend.storage_table = storage_table
    weight, bias = torch.randn(32, 16), torch.randn(32)
    first = memo.read(backend, [weight, None, bias])
    assert memo.read(backend, [weight, None, bias]) is first and reads == [2]
    assert first == original([weight, bias])
    weight.data = torch.randn(32, 16)  # the same size elsewhere
    moved = memo.read(backend, [weight, bias])
    assert len(reads) == 2 and moved == original([weight, bias])
    weight.data = torch.randn(64, 16)  # larger
    grown = memo.read(backend, [weight, bias])
    assert grown == original([weight, bias]) and sum(grown.values()) > sum(moved.values())
    assert len(memo.read(backend, [weight, bias, torch.ones(3)])) == 3 and len(reads) == 4


def test_the_forward_s_activations_count_from_the_gradients_alive_when_it_began():
    """Without per-storage tags (CUDA) the activations are what was
    allocated since the step's first forward began, less new gradients. The
    gradients alive at that start are summed at the forward's first
    breakdown (not before its first kernel, where a script that waits for the
    GPU each step pays for it): a forward does not change them, so the
    activations come out as they would have."""
    allocated = [0]

    class Counted(CpuAsDevice):
        def allocated_bytes(self) -> int:
            return allocated[0]

    tracker = Tracker(Counted())
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    activations = 3 * 1024 * 1024
    samples = []

    class Activations(nn.Module):
        def forward(self, x):
            allocated[0] += activations  # what the forward makes
            return x

    wrapped = nn.Sequential(Activations(), model)
    tracker.install()
    try:
        for _ in range(3):
            parameters, gradients, state = tracker._known_tensors()
            known = sum(map(sum, (t.values() for t in (parameters, gradients, state))))
            allocated[0] = known + 1024 * 1024  # a batch, and the known tensors
            F.mse_loss(wrapped(torch.randn(8, 16)), torch.zeros(8, 4)).backward()
            samples.append(tracker.category_peaks.get("activations"))
            optimizer.step()
        tracker.finish()
    finally:
        tracker.uninstall()
    baseline = tracker._forward_baseline
    assert baseline is not None and baseline["gradients"] is not None
    assert baseline["gradients"] == sum(tracker._gradients_table.values()) > 0
    assert samples[-1] == activations
