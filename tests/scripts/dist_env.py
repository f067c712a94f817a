"""Prints, per rank, what reached it: sys.argv, __name__ and torchrun's rank variables."""

import json
import os
import sys

print(
    "RANKINFO="
    + json.dumps(
        {
            "argv": sys.argv,
            "name": __name__,
            **{key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        }
    ),
    flush=True,
)
