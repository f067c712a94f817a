"""Make PyTorch's own memory snapshot of a fragmented OOM (needs CUDA).

    python suggest_make_torch_snapshot.py OUT.pickle STATS.json

The card is capped to 1 GiB. A 512 MiB block is freed and its cached segment
split into 16 MiB tensors, every other one freed: 256 MiB sits in inactive
split blocks no large request can use. A 600 MiB request then fails. At the
OOM the observer dumps `torch.cuda.memory._dump_snapshot()` and the
allocator's own counters, which the test compares with what oomdoc derives.
"""

import json
import sys

import torch

MiB = 1024**2


def main(snapshot_path: str, stats_path: str) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1024 * MiB / total)
    torch.cuda.memory._record_memory_history(max_entries=2000)

    def on_oom(device, requested, device_allocated, device_free):
        stats = torch.cuda.memory_stats()
        with open(stats_path, "w") as handle:
            json.dump(
                {
                    "requested": int(requested),
                    "allocated_bytes": stats["allocated_bytes.all.current"],
                    "reserved_bytes": stats["reserved_bytes.all.current"],
                    "inactive_split_bytes": stats["inactive_split_bytes.all.current"],
                    "inactive_split_blocks": stats["inactive_split.all.current"],
                },
                handle,
            )
        torch.cuda.memory._dump_snapshot(snapshot_path)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    big = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del big  # the 512 MiB segment stays cached
    pieces = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(32)]
    kept = pieces[::2]  # every other piece freed: split remainders of 16 MiB
    del pieces
    try:
        torch.empty(600 * MiB, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        print(f"OOM as intended ({len(kept)} pieces kept): {str(exc).splitlines()[0][:160]}")
    else:
        sys.exit("expected an OOM")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
