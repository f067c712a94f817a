"""Warm jobs: a distributed replay's launcher and ranks started before its
work is known, so that their start-up overlaps the replay before it.

A replay of a job pays, before the script's first line, for torchrun's own
start (importing torch) and then each rank's (importing torch, oomdoc's
capture, the script's framework): 3.3 to 4.3 s of every replay of a GPT
trainer on two H100s, where a replay took 10 to 12 s in all. A warm job is
that job started ahead: its ranks import, then wait for their configuration
file (oomdoc.capture.CONFIG_WAIT_ENV), and the replay that takes it writes
the file. One is kept ready while the replays run.

Only for a single-node job on a port oomdoc chooses: a port the user named
would be bound by two jobs at once, and other nodes' ranks are not started
here. A warm rank touches no device until it has its work (importing torch
does not initialise CUDA), and it ends when oomdoc does.
"""

from __future__ import annotations

import json
import os

from oomdoc.capture import CONFIG_WAIT_ENV
from oomdoc.distributed import DistOptions
from oomdoc.distributed.launch import StartedJob, end_job, launched_port, start_job
from oomdoc.runner import ChildRequest, child_env

# A job no replay took is ended this fast: its ranks only wait.
UNUSED_GRACE_S = 2.0


class WarmJobs:
    """One job kept started ahead for replays run with `extra_env` on
    `device`; `take` hands it over and starts the next."""

    def __init__(
        self,
        dist: DistOptions,
        device: str,
        extra_env: dict[str, str],
        preimports: list[str] | None = None,
    ):
        self.dist = dist
        self.device = device
        self.extra_env = dict(extra_env)
        self.preimports = list(preimports or [])
        self.enabled = launched_port(dist) is not None
        self.spare: StartedJob | None = None

    def fill(self) -> None:
        """Start the spare job, if there is none."""
        if not self.enabled or self.spare is not None:
            return
        env = child_env(self.device, self.extra_env)
        env[CONFIG_WAIT_ENV] = json.dumps(
            {"preimports": self.preimports, "parent_pid": os.getpid()}
        )
        # Its output goes to a file of its own, copied into the log of the
        # replay that takes it (oomdoc.distributed.launch.run_job).
        self.spare = start_job(self.dist, env, None, launched_port(self.dist))

    def usable_for(self, request: ChildRequest) -> bool:
        return (
            self.enabled
            and request.device == self.device
            and dict(request.extra_env) == self.extra_env
            and bool(request.output_path)
        )

    def take(self, request: ChildRequest) -> StartedJob | None:
        """The spare job, when it suits `request` and is still waiting
        (the next one starts); else None, for a job started cold."""
        if not self.usable_for(request):
            return None
        job, self.spare = self.spare, None
        if job is not None and job.launcher.poll() is not None:
            end_job(job, UNUSED_GRACE_S)  # it ended while waiting: not usable
            job = None
        self.fill()
        return job

    def close(self) -> None:
        """End the spare job: no replay will take it."""
        job, self.spare = self.spare, None
        if job is not None:
            end_job(job, UNUSED_GRACE_S)
