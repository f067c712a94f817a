"""A replay's random initialisation of large CPU tensors, made cheap.

A replay measures memory and step time; the values a model starts from
change neither. Yet every replay builds the script's model again, and a model
built on the CPU draws its weights one random number at a time, on one
thread: on the H100 machine's CPU, building GPT-2 (12 x 768, vocabulary
32000) took 1.7 to 2.4 s, most of it in `normal_`, and a diagnosis runs a
chain of six or more replays one after another. In a replay on CUDA (never
the user's own run), `Tensor.normal_`, `Tensor.uniform_` and
`torch.nn.init.trunc_normal_` on a CPU tensor of at least MIN_ELEMENTS
elements fill it from one block of numbers drawn once, repeated from a random
offset: the same distribution, scaled as asked, and no NaN a model built from
uninitialised memory could have. The same GPT-2 then took 0.6 s (0.8 s with
three built at once). Smaller tensors, tensors on a device, a `generator`
argument, and in-place calls autograd would refuse go to torch's own. The
global random number generator is not advanced by the large fills: later
random numbers in the replay differ from the failing run's, as they already
do once a replay changes the batch size.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# Tensors smaller than this are drawn by torch (2^20 float32: 4 MiB).
MIN_ELEMENTS = 1 << 20
# The block the large fills repeat: 2^20 numbers, drawn once per distribution.
BLOCK_ELEMENTS = 1 << 20


class QuickInit:
    """The patched fills and the blocks they repeat."""

    def __init__(self) -> None:
        # A private generator: drawing the blocks leaves the global one as it was.
        self.generator = torch.Generator().manual_seed(0x00D0C)
        self._blocks: dict[tuple, torch.Tensor] = {}

    def block(
        self, kind: str, dtype: torch.dtype, draw: Callable[[torch.Tensor], Any]
    ) -> torch.Tensor:
        key = (kind, dtype)
        if key not in self._blocks:
            # Twice the block: a fill from any offset reads one contiguous slice.
            values = torch.empty(BLOCK_ELEMENTS, dtype=torch.float32)
            draw(values)
            self._blocks[key] = torch.cat([values, values]).to(dtype)
        return self._blocks[key]

    def applies(self, tensor: torch.Tensor, generator: Any) -> bool:
        return (
            generator is None
            and isinstance(tensor, torch.Tensor)
            and tensor.device.type == "cpu"
            and tensor.is_floating_point()
            and tensor.numel() >= MIN_ELEMENTS
            and tensor.is_contiguous()
            and not (tensor.requires_grad and torch.is_grad_enabled())
            and type(tensor) in (torch.Tensor, torch.nn.Parameter)
        )

    def fill(self, tensor: torch.Tensor, block: torch.Tensor, scale: float, shift: float) -> None:
        """`tensor` from `block` repeated, times `scale` plus `shift`, on one
        thread: replays run side by side, and on the H100 machine three of
        them filling on all 16 threads each took 3.5 to 5.0 s to build GPT-2
        (0.2 s alone; torch's own normal_, single-threaded, 2.1 to 2.4 s)."""
        flat = tensor.detach().view(-1)
        offset = int(torch.randint(BLOCK_ELEMENTS, (1,), generator=self.generator))
        source = block[offset : offset + BLOCK_ELEMENTS]
        whole, rest = divmod(flat.numel(), BLOCK_ELEMENTS)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if whole:
                rows = flat[: whole * BLOCK_ELEMENTS].view(whole, BLOCK_ELEMENTS)
                rows.copy_(source.expand(whole, BLOCK_ELEMENTS))
            if rest:
                flat[whole * BLOCK_ELEMENTS :].copy_(source[:rest])
            if scale != 1.0:
                flat.mul_(scale)
            if shift != 0.0:
                flat.add_(shift)
        finally:
            torch.set_num_threads(threads)


def _arguments(args: tuple, kwargs: dict, names: tuple[str, ...], defaults: tuple) -> list | None:
    """The call's values of `names` (positional, then by keyword), or None
    for a call spelled otherwise (left to torch)."""
    if len(args) > len(names) or set(kwargs) - set(names) - {"generator"}:
        return None
    values = list(args) + list(defaults[len(args) :])
    for index, name in enumerate(names):
        if name in kwargs:
            if index < len(args):
                return None
            values[index] = kwargs[name]
    if not all(isinstance(value, (int, float)) for value in values):
        return None
    return [float(value) for value in values]


def _patch(owner: Any, name: str, replacement: Callable) -> Callable[[], None]:
    """Set `owner.name`; the undo puts back what was there (or what it inherited)."""
    had_own = name in vars(owner)
    original = vars(owner).get(name)
    setattr(owner, name, replacement)

    def undo() -> None:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)

    return undo


def install() -> Callable[[], None]:
    """Patch the fills for this replay; returns the undo."""
    quick = QuickInit()
    original_normal = torch.Tensor.normal_
    original_uniform = torch.Tensor.uniform_
    original_trunc_normal = torch.nn.init.trunc_normal_

    def from_block(
        kind: str,
        original: Callable,
        names: tuple[str, str],
        scale_and_shift: Callable[[float, float], tuple[float, float]],
    ) -> Callable:
        """Tensor.normal_ or uniform_: a large CPU tensor from the block of
        `kind` (drawn with torch's own `original`), scaled as its arguments ask."""

        def fill_(self, *args, **kwargs):
            values = _arguments(args, kwargs, names, (0.0, 1.0))
            if values is None or not quick.applies(self, kwargs.get("generator")):
                return original(self, *args, **kwargs)
            block = quick.block(
                kind, self.dtype, lambda out: original(out, generator=quick.generator)
            )
            quick.fill(self, block, *scale_and_shift(*values))
            return self

        return fill_

    normal_ = from_block("normal", original_normal, ("mean", "std"), lambda mean, std: (std, mean))
    uniform_ = from_block(
        "uniform", original_uniform, ("from", "to"), lambda low, high: (high - low, low)
    )

    def trunc_normal_(tensor, *args, **kwargs):
        names = ("mean", "std", "a", "b")
        values = _arguments(args, kwargs, names, (0.0, 1.0, -2.0, 2.0))
        if values is None or not quick.applies(tensor, kwargs.get("generator")):
            return original_trunc_normal(tensor, *args, **kwargs)
        # The bounds are in the tensor's units: one block per mean, std and bounds.
        block = quick.block(
            "trunc_normal " + " ".join(map(str, values)),
            tensor.dtype,
            lambda out: original_trunc_normal(out, *values, generator=quick.generator),
        )
        quick.fill(tensor, block, 1.0, 0.0)
        return tensor

    undos = [
        _patch(torch.Tensor, "normal_", normal_),
        _patch(torch.Tensor, "uniform_", uniform_),
        _patch(torch.nn.init, "trunc_normal_", trunc_normal_),
    ]

    def undo() -> None:
        for each in reversed(undos):
            each()

    return undo
