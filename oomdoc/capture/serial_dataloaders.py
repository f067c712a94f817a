"""`oomdoc check`: DataLoaders load in the script's process.

With `num_workers > 0` the batches come from worker processes, and how many
of them the script's process holds at a moment (rebuilt as they arrive,
waiting in the DataLoader's queue) depends on how fast the workers ran: the
peak changed from run to run (101.54 vs 109.79 KiB) and a check failed code
that had not changed. A gate must give the same verdict on the same code, so
under `check` every DataLoader is made with `num_workers=0`: the batches are
made one at a time, in the script's own order, the same every run. What the
workers did (the dataset's `__getitem__`, the collate function) is the same
code; only where it runs changes.
"""

from __future__ import annotations

from oomdoc.dataloader_args import on_dataloader_init

# Arguments that only mean something with workers (refused with none).
WORKER_ONLY = {"prefetch_factor": None, "persistent_workers": False}


def load_in_process(changed: list) -> None:
    """Make every DataLoader load in this process; note in `changed` the
    `num_workers` each one asked for."""

    def in_process(arguments: dict) -> None:
        workers = arguments.get("num_workers", 0)
        if isinstance(workers, int) and workers > 0:
            changed.append(workers)
            arguments["num_workers"] = 0
            for name, value in WORKER_ONLY.items():
                if name in arguments:
                    arguments[name] = value
            if "worker_init_fn" in arguments:
                arguments["worker_init_fn"] = None

    on_dataloader_init(in_process)
