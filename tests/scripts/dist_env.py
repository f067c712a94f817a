"""Prints, per rank, what reached it: sys.argv, __name__ and torchrun's rank variables.

One write per line: the ranks share the output pipe, and print() may write
the text and its newline separately (unbuffered stdout), so two ranks' lines
could run together."""

import json
import os
import sys

line = "RANKINFO=" + json.dumps(
    {
        "argv": sys.argv,
        "name": __name__,
        **{key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
    }
)
sys.stdout.flush()
os.write(sys.stdout.fileno(), (line + "\n").encode())
