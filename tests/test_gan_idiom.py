"""Scripts whose optimizers step in turn (a GAN's discriminator and
generator): one iteration is one step (oomdoc.capture.optimizer_cycle), and
the replays' gradient accumulation updates each optimizer every N-th of its
own calls (oomdoc.fixes.smaller_batch.accumulate)."""

from __future__ import annotations

import json

from conftest import REPO_ROOT, run_capped, run_python, two_at_a_time

from oomdoc.capture.optimizer_cycle import OptimizerCycle, merge_steps

DCGAN = REPO_ROOT / "tests" / "corpus" / "dcgan_style.py"


def test_the_cycle_is_learned_when_an_optimizer_steps_again():
    discriminator, generator = object(), object()
    cycle = OptimizerCycle()
    assert cycle.before_step(discriminator, 0) is None and cycle.ends_iteration(discriminator)
    assert cycle.before_step(generator, 1) is None and cycle.learning
    # The discriminator again, in step 2: steps 0 and 1 were one iteration.
    assert cycle.before_step(discriminator, 2) == 0 and not cycle.learning
    assert not cycle.ends_iteration(discriminator) and cycle.ends_iteration(generator)
    assert cycle.before_step(generator, 1) is None  # known: nothing more to merge
    # One optimizer: every step ends an iteration, nothing is merged.
    alone = OptimizerCycle()
    assert alone.before_step(discriminator, 0) is None
    assert alone.before_step(discriminator, 1) is None and alone.ends_iteration(discriminator)
    # A new optimizer (a new phase of training, or one that steps now and
    # then) is learned afresh, without merging the steps closed meanwhile.
    assert alone.before_step(generator, 5) is None and alone.ends_iteration(generator)
    assert alone.before_step(discriminator, 6) is None and alone.learning
    assert alone.before_step(generator, 7) is None and not alone.learning
    assert alone.ends_iteration(discriminator) and not alone.ends_iteration(generator)


def test_merged_steps_keep_the_largest_peak_and_sum_the_work():
    first = {
        "index": 0, "peak_allocated_bytes": 10, "peak_reserved_bytes": 12, "peak_phase": "forward",
        "start_allocated_bytes": 1, "end_allocated_bytes": 5, "phase_peaks": {"forward": 10},
        "forward_calls": 2, "backward_calls": 2, "optimizer_steps": 1, "duration_s": 0.5,
        "retained_graphs": [],
    }  # fmt: skip
    second = {
        "index": 1, "peak_allocated_bytes": 14, "peak_reserved_bytes": 14, "peak_phase": "backward",
        "start_allocated_bytes": 5, "end_allocated_bytes": 6, "phase_peaks": {"backward": 14},
        "forward_calls": 1, "backward_calls": 1, "optimizer_steps": 1, "duration_s": 0.25,
        # The discriminator's loss, made in step 0, alive in step 1: the iteration's own.
        "retained_graphs": [{"variable": "errD_real", "file": "f.py", "from_step": 0}],
    }  # fmt: skip
    merged = merge_steps([first, second])
    assert merged["index"] == 0 and merged["start_allocated_bytes"] == 1
    assert merged["end_allocated_bytes"] == 6 and merged["peak_allocated_bytes"] == 14
    assert merged["peak_phase"] == "backward" and merged["peak_reserved_bytes"] == 14
    assert merged["phase_peaks"] == {"forward": 10, "backward": 14}
    assert (merged["forward_calls"], merged["optimizer_steps"], merged["duration_s"]) == (
        3,
        2,
        0.75,
    )
    assert merged["retained_graphs"] == []
    assert "cpu_wait_s" not in merged  # neither kept its wait for a CPU
    first["cpu_wait_s"], second["cpu_wait_s"] = 0.125, 0.25
    assert merge_steps([first, second])["cpu_wait_s"] == 0.375
    del second["cpu_wait_s"]  # one step's wait alone is not the iteration's
    assert "cpu_wait_s" not in merge_steps([first, second])


GAN_ACCUMULATION = """
import json, torch, torch.nn as nn
from oomdoc.fixes.smaller_batch import accumulate

record = {}
accumulate(2, record)
netD, netG = nn.Linear(2, 1, bias=False), nn.Linear(2, 2, bias=False)
# netG's output flows into netD's gradient too: fixed positive weights keep
# the held-back sum above one micro-batch's (a random netG made it flaky).
with torch.no_grad():
    netG.weight.fill_(0.5)
optimizerD = torch.optim.SGD(netD.parameters(), lr=1.0)
optimizerG = torch.optim.SGD(netG.parameters(), lr=1.0)
updates = {"D": 0, "G": 0}
grads = []
for _ in range(4):
    before = (netD.weight.detach().clone(), netG.weight.detach().clone())
    netD.zero_grad()
    netD(torch.ones(1, 2)).sum().backward()
    grads.append(netD.weight.grad[0, 0].item())
    optimizerD.step()
    netG.zero_grad()
    netD(netG(torch.ones(1, 2))).sum().backward()
    optimizerG.step()
    updates["D"] += int(not torch.equal(before[0], netD.weight))
    updates["G"] += int(not torch.equal(before[1], netG.weight))
print(json.dumps([updates, grads, record]))
"""


def test_accumulation_updates_each_of_a_gans_optimizers_every_other_call():
    """Counted together, the generator's step made every update and the
    discriminator never stepped (its optimizer state never existed)."""
    completed = run_python(GAN_ACCUMULATION)
    assert completed.returncode == 0, completed.stderr[-2000:]
    updates, grads, record = json.loads(completed.stdout)
    assert updates == {"D": 2, "G": 2}
    # netD's zero_grad waits while its optimizer holds a step back: its
    # gradients add up over the two micro-batches of each cycle.
    assert grads[0] == 1.0 and grads[1] > grads[0] and grads[2] == 1.0
    assert record["optimizer_steps"] == 4 and record["held_back_steps"] == 4


def test_a_dcgan_s_iterations_are_its_steps_and_its_largest_batch_is_exact(tmp_path):
    """pytorch/examples' DCGAN idiom at --batchSize 64 on 32 MiB: steps are
    iterations (a discriminator and a generator update each), no leak is
    read into the discriminator's loss alive across them, and the batch
    search finds the largest batch (it had walked down 32, 31, ..., 22 and
    stopped, for a limit of 21). By hand under the same cap, over the
    epoch: that batch fits with the peak the replay measured, one more runs
    out of memory."""
    args = ["--samples", "256", "--manualSeed", "1"]
    completed, document = run_capped(
        tmp_path / "dcgan.json",
        "32MiB",
        DCGAN,
        [*args, "--batchSize", "64"],
        ["--fixes", "smaller_batch"],
        cwd=tmp_path,
    )
    assert document["outcome"] == "oom", completed.stderr[-3000:]
    assert "leak" not in (document.get("prescription") or {}).get("kind", "")
    assert "Memory leak" not in completed.stderr
    # Nor into a replay's with accumulation: each optimizer updates every
    # other iteration, so the order they step in is known only after four;
    # the replay runs until it is (it had stopped after two, its "step 0"
    # the discriminator's update, and every accumulation replay "leaked").
    assert all(run["outcome"] != "grows" for run in document["replay"]["runs"]), [
        (run["label"], run["outcome"]) for run in document["replay"]["runs"]
    ]
    prescription = document["prescription"]
    assert prescription and prescription["fits"] and prescription["accumulation_steps"] > 1
    search = document["replay"]["batch_search"]
    maximum = document["max_batch_size"]
    assert search["exact"] and maximum is not None and 8 <= maximum < 32, search
    assert len(search["trials"]) <= 7, search["trials"]
    replayed = max(
        run.get("peak_allocated_bytes") or 0
        for run in document["replay"]["runs"]
        if run["label"].endswith(f"batch {maximum})") and run["outcome"] == "fits"
    )

    def by_hand(batch: int) -> dict:
        folder = tmp_path / f"by-hand-{batch}"
        folder.mkdir()
        _completed, plain = run_capped(
            folder / "plain.json",
            "32MiB",
            DCGAN,
            [*args, "--batchSize", str(batch)],
            ["--no-replay"],
            cwd=folder,
        )
        return plain

    fits, over = two_at_a_time(by_hand, [maximum, maximum + 1])
    assert fits["outcome"] == "ok" and over["outcome"] == "oom"
    # 256 samples: one step per iteration, not one per optimizer.
    assert len(fits["steps"]) + fits.get("steps_omitted", 0) == -(-256 // maximum)
    assert all(step["optimizer_steps"] == 2 for step in fits["steps"])
    assert abs(fits["peak"]["allocated_bytes"] - replayed) <= 0.05 * replayed


def test_a_mixed_sequential_s_snippet_runs_the_segments_the_replay_measured():
    """A DCGAN's nn.Sequential (Conv2d, BatchNorm2d, LeakyReLU, ...): the
    snippet checkpoints one segment per Conv2d and the layers after it, as
    the replay did, names whose forward each part goes in, and computes
    what the plain Sequential computes."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from oomdoc.fixes.checkpointing import loops

    groups = [
        {"path": "main", "class": "Conv2d", "count": 3, "segments": True, "model": "Discriminator"},
        {
            "path": "main",
            "class": "ConvTranspose2d",
            "count": 2,
            "segments": True,
            "model": "Generator",
        },
    ]
    text = "\n".join(loops({"blocks_groups": groups}, "model"))
    assert "# in Discriminator.forward:" in text and "# in Generator.forward:" in text
    assert "for block in model.main" not in text  # layer by layer is not what ran
    namespace = {"torch": torch, "checkpoint": checkpoint}
    exec(text.split("# in Discriminator.forward:")[0], namespace)
    nn = torch.nn
    layers = nn.Sequential(
        nn.LeakyReLU(0.2),
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.LeakyReLU(0.2),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.Conv2d(4, 2, 3, padding=1),
        nn.Sigmoid(),
    ).eval()
    calls = []
    original = torch.utils.checkpoint.checkpoint
    namespace["checkpoint"] = lambda run, x, **kw: calls.append(len(run)) or original(run, x, **kw)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    out = namespace["checkpointed_segments"](layers, x, "Conv2d")
    assert torch.allclose(out, layers(x)) and calls == [3, 1, 2]
    out.sum().backward()
    assert x.grad is not None
