"""Replays side by side, unit by unit: how many lanes, the lanes' order, the
device lock (a holder that dies or forks releases it), CUDA's start deferred
until the lock is held, the packages imported ahead, and the allocator
replays the failing run's numbers make pointless."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time

import pytest
from adapters import diagnose
from conftest import REPO_ROOT, oomdoc_env, run_python

from oomdoc.fixes import fix_named
from oomdoc.model import Snapshot
from oomdoc.replay.lanes import AHEAD, DEMANDED, SPECULATIVE, Job, Lanes, default_jobs
from oomdoc.replay.plan import plan
from oomdoc.replay.progress import Progress
from oomdoc.replay.replayer import replay_jobs

MiB = 1024 * 1024
GiB = 1024 * MiB


# ------------------------------------------------------------------ lanes


def test_default_jobs_follow_cores_and_memory():
    assert default_jobs("cuda", cpus=16) == 4
    assert default_jobs("cuda", cpus=3) == 2
    assert default_jobs("cuda", cpus=1) == 1
    assert default_jobs("simulated", cpus=2) == 1
    assert default_jobs("simulated", cpus=8) == 2
    assert default_jobs("simulated", cpus=64) == 4
    # A running child and a warm one per lane, in 3/4 of the free memory.
    assert default_jobs("cuda", cpus=16, available_bytes=16 * GiB, child_bytes=3 * GiB) == 2
    assert default_jobs("cuda", cpus=16, available_bytes=4 * GiB, child_bytes=3 * GiB) == 1
    assert default_jobs("cuda", cpus=16, available_bytes=128 * GiB, child_bytes=GiB) == 4
    # Each replay's DataLoader workers take a core each beside it.
    assert default_jobs("cuda", cpus=16, workers=8) == 1
    assert default_jobs("cuda", cpus=16, workers=4) == 3
    assert default_jobs("cuda", cpus=16, workers=2) == 4
    assert default_jobs("simulated", cpus=64, workers=3) == 4
    assert default_jobs("simulated", cpus=32, workers=3) == 2


def test_warm_children_for_every_lane_start_with_the_failing_run(monkeypatch):
    """With lanes to fill, a warm child per lane and two spares start while the
    failing run runs (early_lanes: from what is known before it); on a small
    machine one, as before. Once replays take them, a spare per lane."""
    from oomdoc import warm
    from oomdoc.replay import replayer as replayer_module
    from oomdoc.runner import ChildRequest

    monkeypatch.setattr(replayer_module, "host_available_bytes", lambda: 64 * GiB)
    monkeypatch.setattr(replayer_module, "guess_device_kind", lambda: "cuda")
    monkeypatch.setattr(
        replayer_module.os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False
    )
    assert replayer_module.early_lanes("auto") == replayer_module.early_lanes("cuda") == 4
    assert replayer_module.early_lanes("cpu") == 4  # one lane per four cores
    assert replayer_module.early_lanes("cuda", replay_jobs=2) == 2
    monkeypatch.setattr(replayer_module, "guess_device_kind", lambda: "simulated")
    monkeypatch.setattr(replayer_module.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert replayer_module.early_lanes("auto") == 1

    started = []

    class Child:
        gone = False

        def __init__(self, *args, **kwargs):
            started.append(self)
            self.process = self

        def poll(self):
            return None

        def usable_for(self, request):
            return True

        def discard(self):
            pass

    monkeypatch.setattr(warm, "WarmChild", Child)
    request = ChildRequest(target="train.py", args=[], device="cuda", output_path="log")
    sixteen = {"cpus": 16}
    monkeypatch.setattr(warm.os, "sched_getaffinity", lambda _pid: set(range(sixteen["cpus"])))
    pool = replayer_module.warm_pool(request, lanes=3)
    assert len(started) == 6  # a child per lane and a spare per lane
    assert pool.take(request) is not None
    assert len(pool.spares) == 6  # as many once replays take them
    # Two cores: one lane's child, and no spare (it would take the CPU from
    # the replay it serves, and the last one goes unused).
    sixteen["cpus"] = 2
    small = replayer_module.warm_pool(request)
    assert len(small.spares) == 1 and small.take(request) is not None
    assert len(small.spares) == 1
    assert warm.spares_for(1, cpus=2) == 0 and warm.spares_for(1, cpus=3) == 1
    assert warm.spares_for(4, cpus=16) == 4 and warm.spares_for(4, cpus=8) == 0


def test_replay_jobs_from_the_option_else_the_machine():
    class Options:
        replay_jobs = 4
        distributed = None

    snapshot = Snapshot.from_dict({"device": {"kind": "simulated", "capacity_bytes": 1}})
    assert replay_jobs(snapshot, Options()) == 4
    Options.distributed = object()  # a torchrun job's replays take every GPU: one at a time
    assert replay_jobs(snapshot, Options()) == 1
    Options.distributed, Options.replay_jobs = None, None
    assert replay_jobs(snapshot, Options()) == default_jobs("simulated")
    # On CUDA too: one lane per core beyond the first, at most MAX_JOBS.
    cuda = Snapshot.from_dict({"device": {"kind": "cuda", "capacity_bytes": 1}})
    assert replay_jobs(cuda, Options()) == default_jobs("cuda")
    # With the failing run's DataLoader workers (pytorch/examples' ImageNet `-j 8`).
    cuda.dataloader_workers = [8, 8]
    assert replay_jobs(cuda, Options()) == default_jobs("cuda", workers=8)
    Options.replay_jobs = 3
    assert replay_jobs(cuda, Options()) == 3


class Blocked:
    """Jobs that wait until `release` is set, and the order they started in."""

    def __init__(self):
        self.started: list[str] = []
        self.release = threading.Event()

    def job(self, priority, name):
        def work(job):
            self.started.append(name)
            self.release.wait(10)
            return name

        return Job(work, priority)


@pytest.fixture
def lanes_of():
    made = []
    blocked = Blocked()

    def make(count):
        made.append(Lanes(count))
        return made[-1], blocked

    yield make
    blocked.release.set()
    for lanes in made:
        lanes.close()


def test_one_lane_is_kept_for_what_the_decisions_wait_for(lanes_of):
    lanes, blocked = lanes_of(2)
    ahead = [blocked.job(AHEAD, f"ahead {n}") for n in range(2)]
    for job in ahead:
        lanes.submit(job)
    time.sleep(0.3)
    assert blocked.started == ["ahead 0"]  # the second lane waits for a demanded job
    demanded = blocked.job(DEMANDED, "demanded")
    lanes.submit(demanded)
    time.sleep(0.3)
    assert blocked.started == ["ahead 0", "demanded"]
    blocked.release.set()
    assert demanded.wait() == "demanded" and ahead[1].wait() == "ahead 1"
    assert [ahead[0].number, demanded.number, ahead[1].number] == [1, 2, 3]  # start order


def test_a_running_job_the_decisions_ask_for_frees_a_lane_for_work_ahead(lanes_of):
    """A replay started ahead that the decisions then wait for holds the lane
    kept for them: the lanes it used for work ahead take the next one."""
    lanes, blocked = lanes_of(3)
    combination, probe, prescription = (
        blocked.job(SPECULATIVE, name) for name in ("combination", "probe", "prescription")
    )
    for job in (combination, probe, prescription):
        lanes.submit(job)
    time.sleep(0.3)
    assert blocked.started == ["combination", "probe"]  # one lane kept
    lanes.promote(combination, DEMANDED)
    time.sleep(0.3)
    assert blocked.started == ["combination", "probe", "prescription"]
    late = blocked.job(SPECULATIVE, "late")
    lanes.submit(late)
    time.sleep(0.3)
    assert "late" not in blocked.started  # still one lane's worth kept
    blocked.release.set()
    for job in (combination, probe, prescription, late):
        job.wait()
    assert blocked.started[-1] == "late"


def test_lanes_run_the_highest_priority_first_and_withdraw(lanes_of):
    lanes, blocked = lanes_of(3)
    busy = [blocked.job(AHEAD, f"busy {n}") for n in range(2)]
    for job in busy:
        lanes.submit(job)
    time.sleep(0.3)
    speculative = blocked.job(SPECULATIVE, "speculative")
    single = blocked.job(AHEAD, "single")
    dropped = blocked.job(AHEAD, "dropped")
    for job in (speculative, single, dropped):
        lanes.submit(job)
    assert lanes.withdraw(dropped) and dropped.wait() is None
    lanes.promote(speculative, DEMANDED)
    time.sleep(0.3)
    assert blocked.started[-1] == "speculative"  # promoted: the kept lane runs it now
    blocked.release.set()
    for job in (speculative, single, *busy):
        job.wait()
    assert blocked.started.index("single") > blocked.started.index("speculative")
    assert "dropped" not in blocked.started


def test_progress_lines_of_replays_side_by_side():
    stream = io.StringIO()
    progress = Progress(stream)
    first, second = progress.start("autocast"), progress.start("checkpointing")
    assert (first, second) == (1, 2)
    progress.finish("fits", second)
    progress.finish("out of memory", first)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("oomdoc: replay 2: checkpointing: fits (")
    assert lines[1].startswith("oomdoc: replay 1: autocast: out of memory (")


# ----------------------------------------------------------- the device lock

HOLDER = """
import json, os, signal, sys, time
from oomdoc.capture.gate import DeviceGate
from oomdoc.child_config import DeviceLock
lock, status, waiter_status, fork = sys.argv[1:5]
gate = DeviceGate(DeviceLock(lock, status))
gate.acquire()
if fork == "fork" and os.fork() == 0:
    time.sleep(60)  # a DataLoader worker, say: it must not keep the lock
    os._exit(0)
deadline = time.time() + 60
while time.time() < deadline:  # until the waiter waits
    try:
        if "waiting_since" in json.load(open(waiter_status)):
            break
    except (OSError, ValueError):
        pass
    time.sleep(0.05)
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGKILL)
"""

WAITER = """
import sys
from oomdoc.capture.gate import DeviceGate
from oomdoc.child_config import DeviceLock
gate = DeviceGate(DeviceLock(sys.argv[1], sys.argv[2]))
gate.acquire()
print(round(gate.waited_s, 3))
"""


@pytest.mark.parametrize("fork", ["no-fork", "fork"])
def test_a_holder_that_dies_releases_the_device_lock(tmp_path, fork):
    lock, holder_status, waiter_status = (tmp_path / n for n in ("lock", "h.json", "w.json"))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, lock, holder_status, waiter_status, fork],
        env=oomdoc_env(),
    )
    deadline = time.time() + 60
    while not holder_status.exists() or "held_since" not in holder_status.read_text():
        assert time.time() < deadline and holder.poll() is None
        time.sleep(0.05)
    waiter = run_python(WAITER, lock, waiter_status, timeout=60)
    assert holder.wait(timeout=60) == -9  # SIGKILL while holding the lock
    assert waiter.returncode == 0, waiter.stderr
    status = json.loads(waiter_status.read_text())
    assert status["held_since"] >= status["waiting_since"]
    assert float(waiter.stdout) > 0.3  # it did wait for the holder


CUDA_GATE = """
import json, sys
import torch, torch.cuda, torch.cuda.memory
from oomdoc.capture.gate import DeviceGate
from oomdoc.child_config import DeviceLock

class Tracker:
    excluded = 0.0
    def exclude_seconds(self, seconds):
        self.excluded += seconds

original = torch.cuda._lazy_init
gate = DeviceGate(DeviceLock(sys.argv[1], sys.argv[2]))
gate.install("cuda", Tracker())
patched = torch.cuda._lazy_init is not original and torch.cuda.memory._lazy_init is not original
torch.cuda.set_device(0)  # the device CUDA starts on: nothing to do yet
held_after_set_device = gate.held
try:
    torch.cuda._lazy_init()  # what C++ calls too
except Exception:
    pass  # no CUDA on this machine: the lock was taken before CUDA was asked
print(json.dumps({"patched": patched, "early": held_after_set_device, "held": gate.held}))
"""


def test_cuda_starts_only_after_the_device_lock(tmp_path):
    result = run_python(CUDA_GATE, tmp_path / "lock", tmp_path / "s.json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"patched": True, "early": False, "held": True}
    assert "held_since" in json.loads((tmp_path / "s.json").read_text())


DEFERRED_BACKEND = """
import torch
from oomdoc.capture.backends import CudaBackend
queued = len(torch.cuda._queued_calls)
backend = CudaBackend(16 * 2**30, deferred=True)  # nothing here may start CUDA
backend.install(object())
print(len(torch.cuda._queued_calls) - queued, torch.cuda.is_initialized())
"""


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks that nothing starts CUDA"
)
def test_the_cuda_capture_set_up_waits_for_cuda_to_start():
    result = run_python(DEFERRED_BACKEND)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "False"]


# ------------------------------------------------------ importing ahead

IMPORTS = """
import json, sys
sys.path[:0] = sys.argv[1:3]
from oomdoc.capture.imports import imported_packages, preimport
import torch
before = frozenset(sys.modules)
import heavy, light, local_heavy
for n in range(12):
    __import__(f"heavy.m{n}")
    __import__(f"local_heavy.m{n}")
found = imported_packages(before)
record = {}
preimport(["cuda_at_import", "missing_package_xyz", "heavy"], record)
import builtins
error = getattr(builtins, "CUDA_ERROR", None)
print(json.dumps({"found": found, "record": record, "cuda": torch.cuda.is_initialized(), "error": error}))
"""


def write_package(root, name, modules, body=""):
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(body)
    for n in range(modules):
        (package / f"m{n}.py").write_text("")


def test_heavy_installed_packages_are_recorded_and_imported_ahead(tmp_path):
    installed, local = tmp_path / "lib" / "site-packages", tmp_path / "project"
    write_package(installed, "heavy", 12)
    write_package(installed, "light", 2)
    write_package(local, "local_heavy", 12)  # the script's own code: never imported ahead
    write_package(
        installed,
        "cuda_at_import",
        0,
        "import builtins, torch\n"
        "try:\n"
        "    torch.cuda._lazy_init()\n"
        "except Exception as error:\n"
        "    builtins.CUDA_ERROR = type(error).__name__\n"
        "    raise\n",
    )
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS, installed, local],
        env=oomdoc_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["found"] == ["heavy"]
    # A module that would start CUDA, or is missing, is left to the script.
    assert document["record"]["modules"] == [] and document["record"]["seconds"] >= 0
    assert document["cuda"] is False and document["error"] == "_WouldStartCuda"


# -------------------------------------------- allocator replays that cannot help


def cuda_failing(allocated, reserved, requested, capacity=16 * GiB, **extra):
    document = {
        "device": {"kind": "cuda", "capacity_bytes": capacity, "supports_bf16": True},
        "outcome": "oom",
        "oom": {
            "step": 0,
            "phase": "forward",
            "requested_bytes": requested,
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
            "free_bytes": capacity - reserved,
            "capacity_bytes": capacity,
        },
        "allocator": {
            "reserved_bytes": reserved,
            "allocated_bytes": allocated,
            "inactive_split_bytes": reserved - allocated,
            "inactive_split_blocks": 21,
            "segments": 278,
        },
        "breakdown": {"parameters": GiB, "activations": allocated - GiB},
        "models": [{"class": "GPT2", "parameters_bytes": GiB, "repeated_blocks": []}],
        "optimizers": ["AdamW"],
    }
    document.update(extra)
    return Snapshot.from_dict(document)


def skip_reasons(snapshot, requested=None):
    return {entry.name: entry.reason for entry in plan(snapshot, requested)[1]}


def test_allocator_replays_are_skipped_when_the_cache_cannot_cover_the_need():
    # The H100 GPT-2-medium Trainer run: 71 MiB cached of 16 GiB.
    h100 = cuda_failing(17078010880, 17152606208, 32 * MiB)
    reasons = skip_reasons(h100)
    assert "only 71.14 MiB was reserved but unallocated" in reasons["empty_cache"]
    assert "only 71.14 MiB" in reasons["expandable_segments"]
    # Asked for by name, it is measured anyway.
    assert "empty_cache" in plan(h100, ["empty_cache"])[0]
    # Plenty cached, but what was allocated plus the request exceeds the card.
    over = cuda_failing(15 * GiB, 16 * GiB - 10 * MiB, 1536 * MiB)
    assert "more than the capacity" in skip_reasons(over)["empty_cache"]
    assert "more than the capacity" in skip_reasons(over)["expandable_segments"]
    # Fragmentation that decided the OOM: both are replayed.
    fragmented = cuda_failing(12 * GiB, 15 * GiB, 512 * MiB)
    chosen = plan(fragmented, None)[0]
    assert "empty_cache" in chosen and "expandable_segments" in chosen
    assert fix_named("empty_cache").skip_reason(fragmented, explicit=False) is None


def imagenet_failing(module=None):
    """pytorch/examples' ImageNet trainer on the H200 (ResNet-50 in
    DataParallel, batch 1024, 16 GiB): its first forward ran out of memory
    in `module` with 12.15 GiB allocated and 1.36 GiB reserved but unused."""
    allocated, reserved = 13050302976, 14514388992
    blocks = [("layer1", 3), ("layer2", 4), ("layer3", 6), ("layer4", 3)]
    snapshot = cuda_failing(
        allocated,
        reserved,
        3288334336,
        steps=[{"index": 0, "start_allocated_bytes": 719046144, "phase_peaks": {}}],
        models=[
            {
                "class": "DataParallel",
                "parameters_bytes": 102228128,
                "repeated_blocks": [
                    {"path": f"module.{path}", "class": "Bottleneck", "count": count}
                    for path, count in blocks
                ],
            }
        ],
        optimizers=["SGD"],
        breakdown={"parameters": 102232064, "activations": allocated - 102232064},
    )
    snapshot.oom.module = module
    return snapshot


def test_allocator_replays_are_skipped_when_the_first_forward_ran_out_far_from_its_end():
    """Its expandable-segments and empty_cache replays ran out of memory
    after 14 and 18 s in two of three lanes: the batch needs several
    capacities, and an allocator setting gives back 1.36 GiB at most."""
    early = imagenet_failing("layer1.0.conv3")
    reasons = skip_reasons(early)
    for name in ("empty_cache", "expandable_segments"):
        assert "its first forward ran out of memory early on" in reasons[name], reasons
        assert "1.36 GiB reserved but unallocated leave" in reasons[name]
    assert "empty_cache" in plan(early, ["empty_cache"])[0]  # asked for by name
    # Out of memory in the last block, where the same bytes are nearly all
    # the forward needs: they may still help, and are replayed.
    late = imagenet_failing("layer4.2.conv3")
    chosen = plan(late, None)[0]
    assert "empty_cache" in chosen and "expandable_segments" in chosen
    # Out of memory after the forward: not how far a forward got.
    backward = imagenet_failing("layer1.0.conv3")
    backward.oom.phase = "backward"
    assert "expandable_segments" in plan(backward, None)[0]
    # Without a step or the module the failing run cannot tell: replayed.
    unknown = imagenet_failing()
    assert "expandable_segments" in plan(unknown, None)[0]


def test_fragmentation_is_not_called_decisive_when_the_replays_skipped_its_fixes():
    h100 = cuda_failing(17078010880, 17152606208, 32 * MiB)
    document = h100.to_dict()
    alone = next(d for d in diagnose(document) if d["kind"] == "fragmentation")
    assert "decided the OOM" in alone["summary"]  # no replays: the moment's numbers
    document["replay"] = {
        "replays": 3,
        "skipped": [
            {"name": name, "reason": skip_reasons(h100)[name]}
            for name in ("empty_cache", "expandable_segments")
        ],
    }
    replayed = next(d for d in diagnose(document) if d["kind"] == "fragmentation")
    assert "decided" not in replayed["summary"]
    assert any(
        "did not try empty_cache, expandable_segments" in line for line in replayed["evidence"]
    )


def test_the_parent_modules_stay_torch_free():
    code = "import sys, oomdoc.replay.lanes, oomdoc.replay.orchestrate; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_a_warm_child_imports_ahead_while_it_waits(tmp_path):
    """The pool's children import what configure() names before their work
    comes, and the replay's timings say so."""
    from oomdoc.runner import ChildRequest, WarmPool, run_child

    installed = tmp_path / "site-packages"
    write_package(installed, "slowpkg", 0, "import time\ntime.sleep(1.0)\n")
    script = tmp_path / "script.py"
    script.write_text("import slowpkg\n")
    env = {"PYTHONPATH": str(installed), "OOMDOC_REPLAY": "1"}
    pool = WarmPool("cpu", env)
    try:
        pool.configure(size=1, preimports=["slowpkg"])
        request = ChildRequest(
            target=str(script),
            args=[],
            device="cpu",
            capacity_bytes=64 * MiB,
            extra_env=env,
            output_path=str(tmp_path / "replay.log"),
            timeout_s=120,
        )
        result = run_child(request, pool=pool)
    finally:
        pool.close()
    assert result.warm and result.exit_code == 0, (tmp_path / "replay.log").read_text()
    timings = result.capture["timings"]
    assert timings["preimport_s"] >= 1.0  # done while it waited...
    assert timings["script_s"] < timings["preimport_s"]  # ...not by the script


def test_discarding_checks_a_choice_may_come_back_to_keeps_those_that_have_run():
    """measured_choice discards the checks of configurations it did not
    choose; for one measured within the margin, the flags rule may come
    back to it (flags_choice), so a check that has already run is kept for
    that (it costs nothing more) while one still running is stopped."""
    from oomdoc.replay.replayer import Replayer

    replayer = Replayer.__new__(Replayer)  # only what discard() reads
    replayer._lock = threading.RLock()
    replayer.lanes = None
    replayer._unsubmitted = []
    replayer._discarded = []
    done, running = Job(lambda job: "timed", 0), Job(lambda job: None, 0)
    done.run()
    replayer._ahead = {("flags", 1): done, ("expandable", 2): running}
    replayer.discard([("flags", 1), ("expandable", 2)], keep_finished=True)
    assert list(replayer._ahead) == [("flags", 1)]
    assert running.cancel.is_set() and not done.cancel.is_set()
    replayer.discard([("flags", 1)])
    assert not replayer._ahead and done.cancel.is_set()
