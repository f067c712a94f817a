"""Run each prescription by hand: the script with the prescribed flags under
`oomdoc run --no-replay` on the same capacity, its peak against the one the
prescription reports (issue: within 5%).

    python benchmarks/prescription_by_hand.py DIR hf resnet lightning

reads DIR/<name>.json (snapshots of `oomdoc run ... -o DIR/<name>.json`) and
writes DIR/<name>-byhand.json; prints one line per snapshot. The flags are the
ones the own-flags replay ran (`prescription.verified_by_flags.args`): the
script's own options for what oomdoc prescribed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

GiB = 1 << 30


def by_hand(directory: Path, name: str, device_memory: str) -> str:
    path = directory / f"{name}.json"
    if not path.exists():
        return f"{name}: no snapshot"
    document = json.loads(path.read_text())
    prescription = document.get("prescription") or {}
    flags = prescription.get("verified_by_flags") or {}
    args = flags.get("args")
    if not args:
        return (
            f"{name}: no flags to run by hand (fixes {prescription.get('fixes')}, batch "
            f"{prescription.get('batch_size')} x {prescription.get('accumulation_steps')})"
        )
    output = directory / f"{name}-byhand.json"
    command = [sys.executable, "-m", "oomdoc", "run", "--no-replay"]
    command += ["--device-memory", device_memory, "-o", str(output)]
    command += [document["command"][0], *args]
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    wall_s = time.perf_counter() - started
    try:
        measured = json.loads(output.read_text())
    except (OSError, ValueError) as exc:
        return f"{name}: the by-hand run wrote no snapshot ({exc}), exit {completed.returncode}"
    peak = (measured.get("peak") or {}).get("allocated_bytes")
    reported = prescription.get("peak_allocated_bytes")
    ratio = f"{peak / reported:.3f}" if peak and reported else "-"
    return (
        f"{name}: `{' '.join(args)}` by hand: {measured.get('outcome')}, peak "
        f"{(peak or 0) / GiB:.2f} GiB against the prescription's {(reported or 0) / GiB:.2f} GiB "
        f"(ratio {ratio}), {wall_s:.0f} s"
    )


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    directory = Path(sys.argv[1])
    device_memory = "16GiB"
    for name in sys.argv[2:]:
        print(by_hand(directory, name, device_memory), flush=True)


if __name__ == "__main__":
    main()
