"""Where a script keeps an object: the name a report can point at.

At an OOM, a copy of the model's weights found in a list or a dict (a saved
state_dict, diffusers' `EMAModel.shadow_params`) is worth naming by where the
script holds it: `EMAModel.shadow_params`, `best_state` (a global of
`__main__`), `snapshot` (a local of `train`). The frames on the stack and the
collector's referrers of the object say it; only exact dicts, frames and the
instance dictionaries that CPython's own descriptors give are read, so no code
of the script's objects runs (a property named `__dict__`, a `__getattr__`).
One collector pass per object named, and one more for each instance
dictionary it is found in, to find that dictionary's owner (59 ms per name in
a transformers process of 400k objects on a busy 2-core CPU; up to five
uncalled models named, and up to three copies a model): at the OOM only.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import Any, Optional

from oomdoc.frames import is_user_file

# CPython's own `__dict__` descriptors: instances' (getset), modules' (member).
_OWN_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)


def holder_names(obj: Any, ignore: set[int], limit: int = 2) -> list[str]:
    """Up to `limit` names of where `obj` is kept (`ignore`: ids of
    oomdoc's own lists that hold it). What refers to it otherwise (another
    container, a closure) is not named."""
    names: list[str] = []
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None and len(names) < limit:
        # A running function's locals are no collector referrer: its frame is read.
        name = _name_in(frame, obj)
        if name and name not in names:
            names.append(name)
        frame = frame.f_back
    for referrer in gc.get_referrers(obj) if len(names) < limit else ():
        if id(referrer) in ignore:
            continue
        try:
            name = _name_in(referrer, obj)
        except Exception:  # an object in the middle of being torn down
            name = None
        if name and name not in names:
            names.append(name)
            if len(names) >= limit:
                break
    return names


def _name_in(referrer: Any, obj: Any) -> Optional[str]:
    kind = type(referrer)
    if kind is types.FrameType:
        code = referrer.f_code
        if not is_user_file(code.co_filename):
            return None  # a library's frame (torch's, diffusers', oomdoc's own scan)
        if referrer.f_locals is referrer.f_globals:  # a module's own code
            return _name_in(referrer.f_globals, obj)
        local = next((k for k, v in referrer.f_locals.items() if v is obj), None)
        return None if local is None else f"{local} (a local of {code.co_name})"
    if kind is dict:
        key = _key_of(referrer, obj)
        if key is None:
            return None
        module_name = referrer.get("__name__")
        module = sys.modules.get(module_name) if isinstance(module_name, str) else None
        if module is not None and _instance_dict(module) is referrer:
            return f"{key} (a global of {module_name})"
        owner = next(
            (r for r in gc.get_referrers(referrer) if _instance_dict(r) is referrer),
            None,
        )
        return None if owner is None else f"{type(owner).__name__}.{key}"
    # An object whose attributes CPython keeps inline (3.11+): it is the referrer.
    attributes = _instance_dict(referrer)
    key = None if attributes is None else _key_of(attributes, obj)
    return None if key is None else f"{type(referrer).__name__}.{key}"


def _key_of(mapping: Any, obj: Any) -> Optional[str]:
    if not isinstance(mapping, dict):
        return None
    return next(
        (key for key, value in dict.items(mapping) if value is obj and isinstance(key, str)),
        None,
    )


def _instance_dict(obj: Any) -> Optional[dict]:
    """obj's `__dict__` through CPython's own descriptor only (never a
    property or `__getattr__` of the script's class)."""
    for klass in type(obj).__mro__:
        descriptor = klass.__dict__.get("__dict__")
        if descriptor is None:
            continue
        if type(descriptor) not in _OWN_DESCRIPTORS:
            return None
        attributes = descriptor.__get__(obj, type(obj))
        return attributes if type(attributes) is dict else None
    return None
