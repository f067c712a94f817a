"""Starts a training script's ranks the way accelerate's `accelerate launch`
does: torch.distributed.run's elastic agent, called in this process, starts
each rank as a new `python -u SCRIPT ARGS` process with LOCAL_RANK, RANK and
WORLD_SIZE in its environment. This process itself trains nothing.

    python launch_in_script.py NPROC SCRIPT [ARGS...]
"""

import socket
import sys

from torch.distributed.run import main

if __name__ == "__main__":
    nproc, script, *args = sys.argv[1:]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    main(["--nproc-per-node", nproc, "--master-port", str(port), script, *args])
