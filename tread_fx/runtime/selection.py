"""Token selection strategies: which tokens a route keeps.

A strategy splits the routable tokens into *units* (tokens for ``"random"``, rows of the
patch grid for ``"rows"``) and keeps ``units - floor(units * rate)`` of them, uniformly at
random per sample and step, ascending. The noise is drawn outside the graph (``noise`` [B,
units]), so the routed graph is a pure function of its inputs (reproducible when seeded).

Example:
    >>> import torch
    >>> from tread_fx.runtime.selection import get_strategy
    >>> random_sel = get_strategy("random")
    >>> idx = random_sel.select(torch.rand(2, 8), keep=4, prefix=1, grid=None)
    >>> idx.shape, bool((idx[:, 1:] > idx[:, :-1]).all())
    (torch.Size([2, 5]), True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tread_fx.errors import SelectionError

__all__ = [
    "Strategy",
    "register_strategy",
    "get_strategy",
    "select_random",
    "select_rows",
    "kept_units",
    "with_prefix",
    "with_suffix",
]


@dataclass(frozen=True)
class Strategy:
    """A named selection strategy.

    Attributes:
        name: The ``selection=`` name.
        needs_grid: Whether the patch grid (H, W), or (F, H, W) for video, must be known.
        units: ``units(num_routable_tokens, grid) -> number of selectable units``.
        select: ``select(noise [B, units], keep, prefix, grid) -> kept token ids [B, k]``,
            ascending, prefix tokens first. Runs inside the routed graph.
    """

    name: str
    needs_grid: bool
    units: Callable[[int, tuple[int, int] | None], int]
    select: Callable[..., torch.Tensor]

    def __reduce__(self) -> tuple:
        """Pickle by registered name (a loading process must have registered it too)."""
        return (get_strategy, (self.name,))


_STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
    """Register a selection strategy under ``strategy.name``.

    Example:
        >>> from tread_fx.runtime.selection import Strategy, register_strategy, select_random
        >>> s = register_strategy(Strategy("random-copy", False, lambda n, g: n, select_random))
    """
    _STRATEGIES[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    """Return the strategy registered as ``name``."""
    if name not in _STRATEGIES:
        raise SelectionError(
            f"selection={name!r} was asked for, but the known strategies are "
            f"{sorted(_STRATEGIES)}; use one of them or register_strategy() your own."
        )
    return _STRATEGIES[name]


def kept_units(units: int, rate: float) -> int:
    """Number of units kept at ``rate``: ``units - floor(units * rate)``."""
    return units - math.floor(units * rate)


def with_prefix(kept: torch.Tensor, prefix: int) -> torch.Tensor:
    """Shift kept ids [B, k] of the routable tokens past ``prefix`` never-routed leading
    tokens and put those tokens' ids first; still ascending."""
    if prefix == 0:
        return kept
    head = torch.arange(prefix, device=kept.device, dtype=kept.dtype).expand(kept.shape[0], prefix)
    return torch.cat([head, kept + prefix], dim=1)


def with_suffix(kept: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Append the ids ``first .. first + count - 1`` of never-routed trailing tokens (a text
    stream behind the image tokens) to every sample's kept ids [B, k]; still ascending.

    Example:
        >>> with_suffix(torch.tensor([[0, 2]]), 4, 2).tolist()
        [[0, 2, 4, 5]]
    """
    tail = torch.arange(first, first + count, device=kept.device, dtype=kept.dtype)
    return torch.cat([kept, tail.expand(kept.shape[0], count)], dim=1)


def _smallest_sorted(noise: torch.Tensor, keep: int) -> torch.Tensor:
    return noise.topk(keep, dim=1, largest=False).indices.sort(dim=1).values


def select_random(
    noise: torch.Tensor, keep: int, prefix: int, grid: tuple[int, int] | None = None
) -> torch.Tensor:
    """Keep ``keep`` uniformly random tokens per sample, ascending, after ``prefix`` tokens."""
    return with_prefix(_smallest_sorted(noise, keep), prefix)


def select_rows(
    noise: torch.Tensor, keep: int, prefix: int, grid: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Keep ``keep`` whole rows of the (H, W) grid per sample, ascending: an r x W grid.

    A video grid (F, H, W) keeps the same rows in every frame (rows and frames): an
    F x r x W grid, so blocks that reshape their tokens to (frames, height, width) still can.
    """
    frames, height, width = (1, *grid) if len(grid) == 2 else grid
    rows = _smallest_sorted(noise, keep)
    cols = torch.arange(width, device=noise.device)
    in_frame = (rows[:, :, None] * width + cols).flatten(1)  # [B, r * W]
    starts = torch.arange(frames, device=noise.device) * (height * width)
    return with_prefix((starts[:, None] + in_frame[:, None, :]).flatten(1), prefix)


register_strategy(Strategy("random", False, lambda n, grid: n, select_random))
register_strategy(Strategy("rows", True, lambda n, grid: grid[-2], select_rows))
# "auto" is resolved per trace (tread_fx.pipeline): "random" unless the routed blocks reshape
# their tokens to the patch grid, then "rows"; as a strategy it selects like "random"
register_strategy(Strategy("auto", False, lambda n, grid: n, select_random))
