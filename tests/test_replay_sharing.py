"""Replays side by side that share the device (oomdoc.capture.gate): their
untimed device work holds the lock shared and overlaps, the steps whose
times are used hold it alone, a child waiting for it alone goes before new
shared holders, and the parent shares only when the card has room for every
lane's capped process. The numbers do not change: a replay whose step time
came from a step timed while shared is timed again, alone."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from conftest import SCRIPTS, load_json, oomdoc_env, run_oomdoc

from oomdoc.capture.backends import SimulatedBackend
from oomdoc.capture.tracker import StopRun, Tracker
from oomdoc.model import Snapshot
from oomdoc.replay import batch, lanes, replayer
from oomdoc.replay.timing import timed_steps
from oomdoc.runner import ChildRequest

MiB = 1024 * 1024
GiB = 1024 * MiB

# A child's use of the lock, one action after another: `shared` (its first
# device work), `alone` (its timed steps), `release`, `turn` (an untimed
# child's step ended), or `wait` (until the test creates the file `go`). Each action done is logged with its time.
GATE_USER = """
import os, sys, time
from oomdoc.capture.gate import DeviceGate
from oomdoc.child_config import DeviceLock
lock, status, go, *actions = sys.argv[1:]
gate = DeviceGate(DeviceLock(lock, status, shared=True, turnstile=lock + ".turnstile"))
for action in actions:
    # A release is logged as it starts (the lock still held): logged after,
    # another user could take the lock and log first on a busy machine.
    when = time.time()
    if action == "shared":
        gate.acquire()
    elif action == "alone":
        gate.take_alone()
    elif action == "release":
        gate.release()
    elif action == "turn":
        gate.pass_turn()
    elif action == "wait":
        while not os.path.exists(go):
            time.sleep(0.02)
    with open(status + ".log", "a") as log:
        log.write(f"{action} {when if action == 'release' else time.time()!r}\\n")
"""


class GateUser:
    def __init__(self, tmp_path, name, *actions):
        self.status = tmp_path / f"{name}.json"
        self.log = tmp_path / f"{name}.json.log"
        self.go = tmp_path / f"{name}.go"
        self.process = subprocess.Popen(
            [sys.executable, "-c", GATE_USER, tmp_path / "lock", self.status, self.go, *actions],
            env=oomdoc_env(),
        )

    def done(self) -> dict:
        """{action: when it was done} so far."""
        if not self.log.exists():
            return {}
        return {
            action: float(when)
            for action, when in (line.split() for line in self.log.read_text().splitlines())
        }

    def waiting(self) -> bool:
        """Waiting for the lock now (its status says so)."""
        try:
            status = json.loads(self.status.read_text())
        except (OSError, ValueError):
            return False
        return "waiting_since" in status and "held_since" not in status

    def let_go(self) -> None:
        self.go.touch()

    def end(self) -> None:
        assert self.process.wait(timeout=60) == 0


def until(condition, *users: GateUser) -> None:
    """Wait until `condition()`; fail if a user died or a minute went by."""
    deadline = time.time() + 60
    while not condition():
        assert time.time() < deadline, "timed out"
        for user in users:
            assert user.process.poll() is None, "a lock user ended early"
        time.sleep(0.02)


@pytest.fixture
def users():
    started: list[GateUser] = []
    yield started
    for user in started:
        if user.process.poll() is None:
            user.process.kill()
            user.process.wait()


def test_shared_holders_hold_the_device_lock_at_once_and_alone_waits_for_them(tmp_path, users):
    first = GateUser(tmp_path, "first", "shared", "wait")
    users.append(first)
    until(lambda: "shared" in first.done(), first)
    second = GateUser(tmp_path, "second", "shared", "alone", "release")
    users.append(second)
    # Its untimed device work runs while the first still holds the lock.
    until(lambda: "shared" in second.done(), first, second)
    until(second.waiting, first, second)
    assert "alone" not in second.done()  # the first still holds it shared
    first.let_go()
    first.end()
    second.end()
    assert second.done()["alone"] >= first.done()["wait"]


def test_a_child_waiting_to_be_alone_goes_before_new_shared_holders(tmp_path, users):
    first = GateUser(tmp_path, "first", "shared", "wait")
    users.append(first)
    until(lambda: "shared" in first.done(), first)
    timed = GateUser(tmp_path, "timed", "shared", "alone", "wait", "release")
    users.append(timed)
    until(lambda: "shared" in timed.done() and timed.waiting(), first, timed)
    late = GateUser(tmp_path, "late", "shared")
    users.append(late)
    until(late.waiting, first, timed, late)
    first.let_go()
    first.end()
    until(lambda: "alone" in timed.done(), timed)
    timed.let_go()
    timed.end()
    late.end()
    # The late one waited at the turnstile: a stream of shared holders
    # cannot keep a replay's timed steps waiting.
    assert late.done()["shared"] >= timed.done()["alone"]


def test_shared_holders_that_both_want_to_be_alone_take_turns(tmp_path, users):
    pair = [GateUser(tmp_path, name, "shared", "wait", "alone", "release") for name in "ab"]
    users.extend(pair)
    until(lambda: all("shared" in user.done() for user in pair), *pair)
    for user in pair:
        user.let_go()
    for user in pair:
        user.end()  # neither waits for the other for ever
    (a_alone, a_released), (b_alone, b_released) = (
        (user.done()["alone"], user.done()["release"]) for user in pair
    )
    assert a_released <= b_alone or b_released <= a_alone  # never alone together


def test_an_untimed_holder_passes_its_turn_to_a_child_waiting_to_be_alone(tmp_path, users):
    """An untimed child (DeviceLock.untimed: a check of a peak) gives the lock
    up at each step's end: a child waiting to time its steps goes then, not
    once the untimed one has ended, and the untimed one goes on after it."""
    untimed = GateUser(tmp_path, "untimed", "shared", "wait", "turn", "release")
    users.append(untimed)
    until(lambda: "shared" in untimed.done(), untimed)
    timed = GateUser(tmp_path, "timed", "alone", "release")
    users.append(timed)
    until(timed.waiting, untimed, timed)
    untimed.let_go()  # its step ends
    timed.end()
    untimed.end()
    assert timed.done()["alone"] <= untimed.done()["turn"] <= untimed.done()["release"]


# ---------------------------------------------------------- the tracker


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


def train(tracker: Tracker, steps: int) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture
def tracker():
    backend = SimulatedBackend(1 << 30)
    tracker = Tracker(backend, max_steps=3)
    tracker.install()
    backend.install(tracker)
    yield tracker
    backend.uninstall()
    tracker.uninstall()


@pytest.mark.parametrize("autotunes", [False, True])
def test_the_steps_whose_times_are_used_have_the_device_alone(tracker, autotunes):
    calls = []
    tracker.share_device(
        lambda: calls.append(("alone", len(tracker.steps))),
        lambda: calls.append(("done", len(tracker.steps))),
        lambda: autotunes,
    )
    with pytest.raises(StopRun):
        train(tracker, 10)
    # Alone before the first step's end is timed (or, when kernels are
    # chosen by timing them, from the first step on), until the last step's.
    assert calls == [("alone", 0), ("done", 3)]
    assert [step.get("device_shared", False) for step in tracker.steps] == [True, False, False]


def test_a_replay_that_shares_its_first_steady_step_times_the_steps_after_it():
    """With shared_steps=2 (replayer.SHARED_STEPS, CUDA replays that share the
    device) the first steady step runs sharing it too: a replay near the
    limit that runs out of memory there never waits for the device alone.
    Between the two it passes its turn (a replay waiting to time its steps
    goes first); the device is taken alone before the second step's end is
    timed, and the step time is made of the steps after it."""
    backend = SimulatedBackend(1 << 30)
    tracker = Tracker(backend, max_steps=4)
    tracker.install()
    backend.install(tracker)
    calls = []
    try:
        tracker.share_device(
            lambda: calls.append(("alone", len(tracker.steps))),
            lambda: calls.append(("done", len(tracker.steps))),
            lambda: False,
            shared_steps=2,
            pass_turn=lambda: calls.append(("turn", len(tracker.steps))),
        )
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _step in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        # The second step has run its update: ending here (an OOM in it)
        # never took the device alone.
        assert calls == [("turn", 1)]
        with pytest.raises(StopRun):
            train(tracker, 10)
    finally:
        backend.uninstall()
        tracker.uninstall()
    assert calls == [("turn", 1), ("alone", 1), ("done", 4)]
    assert [step.get("device_shared", False) for step in tracker.steps] == [
        True,
        True,
        False,
        False,
    ]
    steps = Snapshot.from_dict({"steps": tracker.steps}).steps
    assert [step.index for step in timed_steps(steps)] == [2, 3]
    assert not batch.timed_on_a_shared_device(steps)


def test_replays_that_share_a_cuda_device_run_one_step_more_sharing_it(tmp_path, monkeypatch):
    """The parent's side: CUDA replays with an optimizer that share the
    device run SHARED_STEPS steps sharing it and one step more, so that
    three steps are still timed; alone, or under a leak, as before."""
    monkeypatch.setattr(replayer, "device_has_room", lambda *args: True)
    snapshot = Snapshot.from_dict(
        {"device": {"kind": "cuda", "capacity_bytes": 16 * GiB}, "step_unit": "optimizer"}
    )
    options = SimpleNamespace(max_steps=None, replay_timeout_s=60.0)
    pool = SimpleNamespace(log_dir=str(tmp_path))
    request = ChildRequest(target="train.py", args=[], device="cuda")

    def made(jobs: int, leak: bool = False) -> replayer.Replayer:
        return replayer.Replayer(
            snapshot, options, request, progress=None, pool=pool, jobs=jobs, leak=leak
        )

    shared = made(4)
    assert shared.share_device and shared.shared_steps == replayer.SHARED_STEPS
    assert shared.max_steps == replayer.OPTIMIZER_REPLAY_STEPS + replayer.SHARED_STEPS - 1
    alone = made(1)
    assert (alone.shared_steps, alone.max_steps) == (1, replayer.OPTIMIZER_REPLAY_STEPS)
    leaking = made(4, leak=True)
    assert (leaking.shared_steps, leaking.max_steps) == (1, replayer.LEAK_REPLAY_STEPS)


def test_a_step_whose_work_is_done_when_the_timed_steps_end_was_timed_alone(tracker):
    """Lightning and a plain loop fetch the next batch after the optimizer
    step and before the next forward: the whole-run data ends the replay's
    steps there (timed_steps_done) while the last step is still open. Its
    time ends then, before the device is given up, so it was timed alone
    (and the replay is not timed again); what follows is not in it."""
    calls = []
    tracker.share_device(lambda: calls.append("alone"), lambda: calls.append("done"), lambda: False)
    three_updates(Net())
    tracker.timed_steps_done()  # the next batch is asked for: the steps are done
    time.sleep(0.3)  # the script's own end (the device shared again)
    tracker.finish()
    assert calls == ["alone", "done"]
    assert [step.get("device_shared", False) for step in tracker.steps] == [True, False, False]
    assert tracker.steps[-1]["duration_s"] < 0.3


def three_updates(model: nn.Module, after_each: float = 0.0) -> None:
    """Three SGD steps; `after_each`: seconds of the loop's own work after
    each update (zero_grad, a scheduler, logging: the step's)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(after_each)


@pytest.mark.parametrize("evaluates", [False, True], ids=["checkpoint", "evaluation"])
def test_a_step_the_scripts_end_closes_is_timed_to_its_optimizer_step(tracker, evaluates):
    """A loop that ends on its own after an optimizer step (a framework
    whose step limit is reached: Lightning counting oomdoc's accumulated
    micro-batches as its steps) closes its last step only at the script's
    end, after the framework's end of training (a checkpoint written, a
    final evaluation): that is not the step's time. Every step before is
    timed as before: to the next step's start."""
    model = Net()
    three_updates(model, after_each=0.05)
    if evaluates:
        with torch.no_grad():
            model.eval()(torch.randn(4, 8))
    time.sleep(0.4)  # the end of training
    tracker.finish()
    durations = [step["duration_s"] for step in tracker.steps]
    assert len(durations) == 3
    assert all(duration >= 0.05 for duration in durations[:2]), durations
    assert durations[-1] < 0.3, durations


@pytest.mark.parametrize("autotunes", [False, True])
def test_an_untimed_replay_passes_the_device_on_at_each_steps_end(tracker, autotunes):
    calls = []
    tracker.share_device_untimed(
        lambda: calls.append(("turn", len(tracker.steps))),
        lambda: calls.append(("done", len(tracker.steps))),
        lambda: autotunes,
        lambda: calls.append(("alone", len(tracker.steps))),
    )
    with pytest.raises(StopRun):
        train(tracker, 10)
    if autotunes:  # kernels chosen by timing them: the device alone, as a timed replay
        assert calls == [("alone", 0), ("done", 3)]
    else:  # never alone: its step times are never used
        assert calls == [("turn", 1), ("turn", 2), ("done", 3)]
        assert all(step.get("device_shared") for step in tracker.steps)


# ---------------------------------------------------------- the parent


def test_replays_share_the_device_only_when_it_has_room_for_every_lane(monkeypatch):
    assert lanes.room_to_share(3, 16 * GiB, 64 * GiB, lanes.CUDA_CONTEXT_BYTES)
    assert not lanes.room_to_share(3, 16 * GiB, 48 * GiB, lanes.CUDA_CONTEXT_BYTES)
    assert not lanes.room_to_share(3, None, 640 * GiB, 0)  # no cap: each may take it all
    assert not lanes.room_to_share(3, 16 * GiB, None, 0)  # what is free is unknown
    assert not lanes.room_to_share(1, 16 * GiB, 64 * GiB, 0)  # one lane: nothing to share
    monkeypatch.setenv(lanes.OVERLAP_ENV, "0")
    assert not lanes.room_to_share(3, 16 * GiB, 64 * GiB, 0)


def test_the_room_is_read_now_else_from_the_failing_run(monkeypatch):
    device_has_room = replayer.device_has_room
    cuda = Snapshot.from_dict(
        {"device": {"kind": "cuda", "capacity_bytes": 16 * GiB, "nvml_free_bytes": 60 * GiB}}
    )
    monkeypatch.setattr(replayer, "cuda_free_bytes", lambda index: 80 * GiB, raising=False)
    assert device_has_room(cuda, 16 * GiB, 3)
    assert not device_has_room(cuda, 32 * GiB, 3)
    # NVML unreadable now: what the failing run saw free, its own memory still held.
    monkeypatch.setattr(replayer, "cuda_free_bytes", lambda index: None)
    assert device_has_room(cuda, 16 * GiB, 3)
    assert not device_has_room(cuda, 16 * GiB, 4)
    simulated = Snapshot.from_dict(
        {"device": {"kind": "simulated"}, "host": {"process_rss_bytes": GiB}}
    )
    monkeypatch.setattr(replayer, "host_available_bytes", lambda: 8 * GiB)
    assert device_has_room(simulated, GiB, 2)
    assert not device_has_room(simulated, 4 * GiB, 2)


# ---------------------------------------------------------- end to end


def replay_run(tmp_path, name, jobs):
    snapshot = tmp_path / f"{name}.json"
    result = run_oomdoc(
        [
            *("run", "--device", "cpu", "--device-memory", "40MiB", "-o", snapshot),
            *("--replay-jobs", jobs, "--fixes", "autocast,checkpointing"),
            *(SCRIPTS / "replay_mlp_train.py", "--batch-size", "2048", "--steps", "1"),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    return load_json(snapshot)


def test_a_replay_timed_only_while_sharing_is_timed_again_alone(tmp_path):
    """With --steps 1 a replay's only step is its first, timed while the
    device was shared: it runs again with the device to itself, and the
    peaks are those of replays run one after another."""
    shared = replay_run(tmp_path, "shared", 2)
    alone = replay_run(tmp_path, "alone", 1)
    runs = shared["replay"]["runs"]
    assert any(run.get("timed_again_alone") for run in runs if run["outcome"] == "fits"), runs
    assert not any(run.get("timed_again_alone") for run in alone["replay"]["runs"])

    def peaks(document):
        return {
            fix["name"]: (fix["fits"], fix["peak_allocated_bytes"]) for fix in document["fixes"]
        }

    assert peaks(shared) == peaks(alone)


def test_replays_side_by_side_with_steps_to_time_are_not_timed_again(tmp_path):
    """A plain DataLoader loop: each replay's last step ends when the next
    batch is asked for, with its time already taken alone (before,
    every replay that fit was timed a second time, and the lanes stopped
    sharing the device for the rest of the diagnosis)."""
    snapshot = tmp_path / "steps.json"
    result = run_oomdoc(
        [
            *("run", "--device", "cpu", "--device-memory", "40MiB", "-o", snapshot),
            *("--replay-jobs", 2, "--fixes", "autocast,checkpointing"),
            *(SCRIPTS / "replay_mlp_train.py", "--batch-size", "2048", "--steps", "8"),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    runs = load_json(snapshot)["replay"]["runs"]
    fitted = [run for run in runs if run["outcome"] == "fits"]
    assert fitted and not any(run.get("timed_again_alone") for run in fitted), runs
