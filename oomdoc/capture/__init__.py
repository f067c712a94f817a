"""Capture: everything that runs inside the child process next to the user's
script (hooks, step detection, device backends). It produces the `capture`
part of a snapshot; the parent adds the rest and writes the file."""
