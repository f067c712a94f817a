"""Check oomdoc's claims on the real-idiom corpus (tests/corpus) against
plain capped runs, and print a table.

    python benchmarks/corpus_by_hand.py --device cuda --device-memory 16GiB
    python benchmarks/corpus_by_hand.py --device cpu --device-memory 48MiB --cases gpt-cpu

For each case: `oomdoc run` on the script at a batch that runs out of
memory; then the script run plainly under the same cap (on CUDA:
`torch.cuda.set_per_process_memory_fraction`, in this file's `plain` mode;
on the simulated device: `oomdoc run --no-replay`, the only cap it has) at
the reported largest batch (must fit), one more (must run out of memory),
and the prescription written with the script's own knobs (must fit, peak
within 5% of the reported one).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from script_args import prescription_label

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "corpus"

GPT_H100 = [
    "--n_layer=12", "--n_embd=1024", "--n_head=16", "--block_size=512", "--vocab_size=32000",
    "--max_iters=3", "--eval_interval=2", "--eval_iters=2",
]  # fmt: skip
IMAGENET_H100 = [
    "--image-size", "160", "--width", "64", "--train-samples", "2048", "--val-samples", "512",
]  # fmt: skip
DCGAN_H100 = ["--ngf", "64", "--ndf", "64", "--samples", "16384", "--manualSeed", "1"]
CASES = {
    # name: (script, arguments before the batch, batch flag form, failing batch, knobs)
    "gpt": (CORPUS / "gpt_configurator.py", GPT_H100, "--batch_size={}", 48, "configurator"),
    "gpt-cpu": (CORPUS / "gpt_configurator.py", [], "--batch_size={}", 32, "configurator"),
    # Two optimizers in turn (pytorch/examples' DCGAN idiom): no knob for a fix.
    "dcgan": (CORPUS / "dcgan_style.py", DCGAN_H100, "--batchSize {}", 8192, None),
    "dcgan-cpu": (CORPUS / "dcgan_style.py", ["--samples", "256"], "--batchSize {}", 64, None),
    # Lightning Fabric (examples/fabric/language_model's loop, the Transformer
    # shipped in lightning.pytorch.demos); no accumulation flag: the
    # prescription's loop is code. --device-memory 96MiB on the simulated device.
    "fabric-lm-cpu": (
        CORPUS / "fabric_lm.py",
        ["--epochs", "1", "--max-steps", "4", "--vocab-size", "8000"],
        "--batch-size {}",
        64,
        None,
    ),
    "imagenet": (
        CORPUS / "imagenet_style.py",
        ["-j", "2", *IMAGENET_H100],
        "-b {}",
        1024,
        "references",
    ),
    "spawn": (
        CORPUS / "imagenet_style.py",
        [
            "-j",
            "0",
            *IMAGENET_H100,
            "--multiprocessing-distributed",
            "--world-size",
            "1",
            "--dist-backend",
            "nccl",
        ],
        "-b {}",
        1024,
        "references",
    ),  # fmt: skip
}


def plain_main(capacity: int, script: str, args: list[str]) -> None:
    """Run `script args` as `python script args` would, with the CUDA cap,
    and print its peak as JSON on the last line of stderr."""
    import torch

    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, capacity / total), index)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    outcome = "ok"
    try:
        runpy.run_path(script, run_name="__main__")
    except torch.OutOfMemoryError:
        outcome = "oom"
    except SystemExit as exc:
        outcome = "ok" if not exc.code else "error"
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    print(json.dumps({"outcome": outcome, "peak": peak}), file=sys.stderr)


def size(text: str) -> int:
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3}
    lower = text.lower()
    for unit, factor in units.items():
        if lower.endswith(unit):
            return int(float(lower[: -len(unit)]) * factor)
    return int(text)


def split(form: str, batch: int) -> list[str]:
    return form.format(batch).split()


def plain(device: str, capacity: str, script: Path, args: list[str], spawned: bool) -> dict:
    """A plain capped run: its outcome and peak (bytes)."""
    if device == "cuda" and not spawned:
        completed = subprocess.run(
            [sys.executable, __file__, "plain", capacity, str(script), *args],
            capture_output=True, text=True, cwd=tempfile.gettempdir(),
        )  # fmt: skip
        last = completed.stderr.strip().splitlines()[-1]
        return json.loads(last)
    with tempfile.TemporaryDirectory() as directory:
        snapshot = os.path.join(directory, "plain.json")
        subprocess.run(
            [sys.executable, "-m", "oomdoc", "run", "--device", device, "--device-memory",
             capacity, "--no-replay", "-o", snapshot, str(script), *args],
            capture_output=True, text=True, cwd=directory, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        document = json.loads(Path(snapshot).read_text())
        return {"outcome": document["outcome"], "peak": document["peak"]["allocated_bytes"]}


def prescription_args(prescription: dict, base: list[str], form: str, batch: int, knobs):
    """The prescription with the script's own options, or None when the
    script has no knob for one of its fixes."""
    fixes = prescription.get("fixes") or []
    args = list(base)
    if knobs == "configurator":
        table = {"autocast": "--dtype=bfloat16", "checkpointing": "--use_checkpoint=True"}
        if not set(fixes) <= set(table):
            return None
        args += [table[name] for name in fixes]
        steps = prescription.get("accumulation_steps") or 1
        if steps > 1:
            args.append(f"--gradient_accumulation_steps={2 * steps}")
    elif knobs == "references":  # torchvision's and timm's flags
        table = {"autocast": "--amp", "checkpointing": "--checkpoint"}
        if not set(fixes) <= set(table):
            return None
        args += [table[name] for name in fixes]
        steps = prescription.get("accumulation_steps") or 1
        if steps > 1:
            args += ["--grad-accum-steps", str(steps)]
    elif fixes or (prescription.get("accumulation_steps") or 1) > 1:
        return None
    args += split(form, prescription.get("batch_size") or batch)
    return args


def run_case(name: str, device: str, capacity: str) -> dict:
    script, base, form, failing, knobs = CASES[name]
    spawned = "--multiprocessing-distributed" in base
    with tempfile.TemporaryDirectory() as directory:
        snapshot = os.path.join(directory, "run.json")
        started = time.perf_counter()
        completed = subprocess.run(
            [sys.executable, "-m", "oomdoc", "run", "--device", device, "--device-memory",
             capacity, "-o", snapshot, str(script), *base, *split(form, failing)],
            capture_output=True, text=True, cwd=directory, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        wall = time.perf_counter() - started
        if not os.path.exists(snapshot):
            return {"case": name, "error": completed.stderr[-2000:]}
        document = json.loads(Path(snapshot).read_text())
    row = {
        "case": name,
        "oom": f"step {document['oom']['step']} {document['oom']['phase']}" if document.get("oom") else document["outcome"],
        "largest": document.get("max_batch_size"),
        "diagnosis_s": round(wall, 1),
    }  # fmt: skip
    maximum = document.get("max_batch_size")
    if maximum:
        row["largest_fits"] = plain(
            device, capacity, script, [*base, *split(form, maximum)], spawned
        )["outcome"]
        row["next_fits"] = plain(device, capacity, script, [*base, *split(form, maximum + 1)], spawned)["outcome"]  # fmt: skip
    prescription = document.get("prescription") or {}
    row["prescription"] = prescription_label(prescription)
    args = prescription_args(prescription, base, form, failing, knobs) if prescription else None
    if args is not None and prescription.get("peak_allocated_bytes"):
        by_hand = plain(device, capacity, script, args, spawned)
        row["prescription_by_hand"] = by_hand["outcome"]
        if by_hand.get("peak"):
            row["peak_ratio"] = round(by_hand["peak"] / prescription["peak_allocated_bytes"], 3)
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "plain":
        plain_main(size(sys.argv[2]), sys.argv[3], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--device-memory", default="16GiB")
    parser.add_argument("--cases", default="gpt,imagenet,spawn")
    options = parser.parse_args()
    rows = [
        run_case(name, options.device, options.device_memory) for name in options.cases.split(",")
    ]
    keys = ["case", "oom", "largest", "largest_fits", "next_fits", "prescription", "prescription_by_hand", "peak_ratio", "diagnosis_s"]  # fmt: skip
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        if "error" in row:
            print(f"| {row['case']} | error: {row['error'][-300:]!r} |")
            continue
        print("| " + " | ".join(str(row.get(key, "")) for key in keys) + " |")


if __name__ == "__main__":
    main()
