"""Overrides the configuration globals of the script that execs it, from its
command line (the nanoGPT idiom):

    python train.py [config/file.py] [--key=value ...]

A positional argument is a configuration file, exec'd over the globals; an
option is `--key=value` only, its key one of the globals, its value of the
global's type. `--key value` and unknown keys are errors.
"""

import sys
from ast import literal_eval

for _arg in sys.argv[1:]:
    if "=" not in _arg:
        if _arg.startswith("-"):
            raise SystemExit(f"configurator: options are --key=value, not {_arg!r}")
        print(f"configurator: overriding with {_arg}")
        with open(_arg) as _file:
            exec(_file.read())
        continue
    if not _arg.startswith("--"):
        raise SystemExit(f"configurator: {_arg!r} is not --key=value")
    _key, _value = _arg[2:].split("=", 1)
    if _key not in globals():
        raise SystemExit(f"configurator: unknown config key: {_key}")
    try:
        _parsed = literal_eval(_value)
    except (SyntaxError, ValueError):
        _parsed = _value
    if type(_parsed) is not type(globals()[_key]):
        raise SystemExit(f"configurator: {_key} takes a {type(globals()[_key]).__name__}")
    print(f"configurator: {_key} = {_parsed!r}")
    globals()[_key] = _parsed
