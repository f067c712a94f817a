"""One way to change or watch the arguments every DataLoader is made with:
the batch-size fix, `oomdoc check`'s in-process loading and the failing
run's note of batch sizes each give an `edit` of the bound arguments.
Child side only when called (torch is imported then): the fixes, which the
parent imports too, can name it."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def on_dataloader_init(edit: Callable[[dict], None]) -> None:
    """From now on every `DataLoader(...)` calls `edit(arguments)` with its
    bound arguments by name (changes to them are what it is made with);
    a call that does not bind is left to DataLoader's own error."""
    import torch.utils.data

    loader_class = torch.utils.data.DataLoader
    original_init = loader_class.__init__
    signature = inspect.signature(original_init)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original_init(self, *args, **kwargs)
        edit(bound.arguments)
        return original_init(*bound.args, **bound.kwargs)

    init.__wrapped__ = original_init  # type: ignore[attr-defined]
    loader_class.__init__ = init  # type: ignore[method-assign]
