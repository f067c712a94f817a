"""Takes the names oomdoc means to write while it runs: each argument is
made a file (`file:PATH`) or a dangling symbolic link (`link:PATH`); `stamps:DIR/STEM`
makes the default snapshot names of the last few seconds."""

import datetime
import os
import sys

print("script ran")
for argument in sys.argv[1:]:
    kind, path = argument.split(":", 1)
    if kind == "file":
        with open(path, "w") as handle:
            handle.write("the user's\n")
    elif kind == "link":
        os.symlink(path + ".nowhere", path)
    elif kind == "stamps":
        directory, stem = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        for seconds in range(-8, 2):
            stamp = (now + datetime.timedelta(seconds=seconds)).strftime("%Y%m%dT%H%M%SZ")
            with open(os.path.join(directory, f"{stem}-{stamp}.json"), "w") as handle:
                handle.write("the user's\n")
