"""A default stack that holds under half the blocks the stream flows through is reported.

The stack below is split over two lists; how the stream enters the second is ambiguous by
data (its blocks carry two values, both computed from the first list's output, of the same
shape), so the located stack ends after the first list: 3 of the 11 blocks.
"""

from __future__ import annotations

import linecache
import warnings

import torch
from torch import nn

import tread_fx
from tread_fx.errors import ThinRouteWarning

B, N, D = 2, 16, 32


class InBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class PairBlock(nn.Module):
    """Carries two values of the same shape, each updated from both."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + self.a(y), y + self.b(x)


class SplitStack(nn.Module):
    def __init__(self, first: int = 3, second: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.first = nn.ModuleList(InBlock() for _ in range(first))
        self.second = nn.ModuleList(PairBlock() for _ in range(second))
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.first:
            h = block(h)
        a, b = h, h.flip(1)
        for block in self.second:
            a, b = block(a, b)
        return self.out(a + b)


def _call(model: nn.Module) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.train()(torch.randn(B, N, 4))
    return [w for w in caught if w.category is ThinRouteWarning]


def test_a_thin_default_stack_warns_with_the_count_and_a_wider_blocks():
    model = tread_fx.route(SplitStack(), [(1, -1)], 0.5)
    (warning,) = _call(model)
    assert tread_fx.routed_graphs(model)[0].info.depth == 3
    text = str(warning.message)
    assert "3 of the 11 blocks" in text and "blocks='second'" in text
    # shown at the user's call (the model's first training call), not inside tread_fx or torch
    assert warning.filename == __file__ and "model.train()" in linecache.getline(
        warning.filename, warning.lineno
    )


def test_the_suggested_blocks_routes_more_without_warning():
    model = tread_fx.route(SplitStack(), [(1, -1)], 0.5, blocks="second")
    assert not _call(model)
    assert tread_fx.routed_graphs(model)[0].info.depth == 8


def test_a_stack_holding_half_or_more_does_not_warn():
    model = tread_fx.route(SplitStack(first=3, second=3), [(1, -1)], 0.5)
    assert not _call(model)
