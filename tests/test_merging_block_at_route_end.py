"""A block that merges token pairs itself, as the last block of a route: refused.

Inside a route, the next block's input shows the change of length (refused before). As the
route's last block nothing did: the routed graph failed at the scatter (a ``RoutedGraphError``
pointing at the model's code), or, where the block also returns a value of the input's shape
(``return x, attn``) and is a one-block list after the others, that value was taken as the
stream and the route ran silently. ``tread_fx/passes/locate/layout.py``
``check_last_block_keeps_length``; a route ending before the block still routes.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import gather_rows, scatter_rows
from torch import nn

import tread_fx
from tread_fx.errors import TokenStreamError

B, N, D = 2, 16, 32


class Block(nn.Module):
    def __init__(self, merge: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.merge = nn.Linear(2 * D, D) if merge else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + a
        if self.merge is not None:
            x = self.merge(x.reshape(x.shape[0], x.shape[1] // 2, 2 * D))
        return x, a


class Merging(nn.Module):
    """Blocks 0..3; block 3 merges pairs of tokens. ``split``: block 3 is a list of its own."""

    def __init__(self, split: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        blocks = [Block(merge=i == 3) for i in range(4)]
        self.first = nn.ModuleList(blocks[:3] if split else blocks)
        self.last = nn.ModuleList(blocks[3:]) if split else None
        self.head = nn.Linear(D, 6)

    def blocks(self) -> list[nn.Module]:
        return [*self.first, *(self.last or [])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for blk in self.blocks():
            x, _ = blk(x)
        return self.head(x)


def _x() -> torch.Tensor:
    return torch.randn(B, N, 3, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("split", [False, True], ids=["one-list", "one-block-list-after"])
@pytest.mark.parametrize("route", [(3, 4), (1, 4)])
def test_a_route_ending_after_a_merging_block_is_refused(split, route):
    model = tread_fx.route(Merging(split), routes=[route], rate=0.5)
    with pytest.raises(TokenStreamError, match="merges or splits tokens itself"):
        model.train()(_x())


@pytest.mark.parametrize("split", [False, True], ids=["one-list", "one-block-list-after"])
def test_a_route_ending_before_it_is_tread_by_hand(split):
    torch.manual_seed(0)
    model = tread_fx.route(Merging(split), routes=[(1, 3)], rate=0.5, seed=0)
    x = _x()
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        h = model.embed(x)
        for i, blk in enumerate(model.blocks()):
            if i == 1:
                full, h = h, gather_rows(h, ids)
            if i == 3:
                h = scatter_rows(full, ids, h)
            h, _ = blk(h)
        expected = model.head(h)
    torch.testing.assert_close(routed.detach(), expected)
