"""A short training loop under the simulated device's capture, and what the
capture made of it: the tests that compare two ways of counting (with and
without the pass-through, with and without the compiled check) compare these."""

from __future__ import annotations

from typing import Callable

import torch

from oomdoc.capture.backends import OutOfMemoryError, SimulatedBackend
from oomdoc.capture.tracker import Tracker


class Net(torch.nn.Module):
    """Linear layers, views, a tensor-list op and a Python number."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU()
        )
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        features = self.body(x).view(x.shape[0], 8, 8).transpose(1, 2).reshape(x.shape[0], 64)
        halves = features.chunk(2, dim=1)
        joined = torch.cat([halves[1], halves[0]], dim=1)
        return self.head(joined * 0.5)


def train(
    make_model: Callable[[], torch.nn.Module],
    pass_through: bool = True,
    native: bool = True,
    capacity: int = 1 << 30,
    grow_a_buffer: bool = False,
) -> dict:
    """Four AdamW steps (clipped gradients, the losses kept); `grow_a_buffer`:
    a storage also grows in place every step. The result holds the OOM, if
    the capacity was too small, and how the capture ran (`pass_through`,
    `native`)."""
    backend = SimulatedBackend(capacity, pass_through=pass_through, native=native)
    tracker = Tracker(backend)
    tracker.install()
    backend.install(tracker)
    result: dict = {"pass_through": backend.pass_through_active, "native": backend.native_active}
    try:
        torch.manual_seed(0)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        buffer = torch.empty(0)
        kept = []
        for step in range(4):
            x = torch.randn(32, 16)
            loss = model(x).square().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if grow_a_buffer:
                buffer.resize_(64 * (step + 1))
            kept.append(loss.item())
        tracker.finish()
    except OutOfMemoryError as error:
        result.update(oom=str(error), oom_event=tracker.oom)
    finally:
        backend.uninstall()
        tracker.uninstall()
    sample = tracker.peak_sample or {}
    result.update(
        # Without the timings (a step's duration, its wait for a CPU).
        steps=[
            {k: v for k, v in step.items() if k not in ("duration_s", "cpu_wait_s")}
            for step in tracker.steps
        ],
        category_peaks=dict(tracker.category_peaks),
        peak={key: sample.get(key) for key in ("allocated_bytes", "step", "phase", "breakdown")},
        sites=sample.get("top_allocations"),
        modules=sample.get("modules"),
        registered=backend.capture_stats()["storages_registered"],
        end=backend.allocated_bytes(),
    )
    return result
