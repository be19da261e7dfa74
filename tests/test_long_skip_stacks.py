"""Stacks split over several lists joined by long skips (U-ViT: ``in_blocks``, a
``mid_block``, ``out_blocks`` whose blocks take ``(x, skip)`` with ``skip`` an in-block's
output, joined by ``cat([x, skip])`` or ``x + skip``). The out blocks take two arguments fed by
the in blocks; the stream is the one they hand on among themselves, so the lists chain (the
mid block, an attribute of the lists' block class, as a one-member run) and a route covers the
whole chain: skips made inside the route are at the kept tokens already,
skips made before it are gathered, skips that cross the route end are scattered."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import INVARIANTS, Case, gather_rows, scatter_rows
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class Block(nn.Module):
    def __init__(self, skip: str | None = None) -> None:
        super().__init__()
        self.skip = skip
        self.skip_proj = nn.Linear(2 * D, D) if skip == "cat" else None
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(),
                                 nn.Linear(2 * D, D))  # fmt: skip

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if self.skip == "cat":
            x = self.skip_proj(torch.cat([x, skip], dim=-1))
        elif self.skip == "add":
            x = x + skip
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class LongSkipViT(nn.Module):
    """A time token in front of the patch tokens; ``half`` in blocks, a mid block, ``half``
    out blocks each taking the matching in block's output."""

    def __init__(self, half: int = 3, skip: str = "cat", mid: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.t_embed = nn.Linear(1, D)
        self.in_blocks = nn.ModuleList(Block() for _ in range(half))
        self.mid_block = Block() if mid else None
        self.out_blocks = nn.ModuleList(Block(skip) for _ in range(half))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.t_embed(t[:, None, None]), self.embed(x)], dim=1)
        skips = []
        for block in self.in_blocks:
            x = block(x)
            skips.append(x)
        if self.mid_block is not None:
            x = self.mid_block(x)
        for block in self.out_blocks:
            x = block(x, skips.pop())
        return self.head(x[:, 1:])


def _inputs():
    g = torch.Generator().manual_seed(13)
    return (torch.randn(B, N, 3, generator=g), torch.rand(B, generator=g)), {}


CASES = [
    Case("cat-whole-chain", LongSkipViT, _inputs, routes=[(1, -1)]),
    Case("cat-skips-cross-the-end", LongSkipViT, _inputs, routes=[(1, 4)]),
    Case("cat-skips-from-before", LongSkipViT, _inputs, routes=[(2, 6)]),
    Case("add-no-mid", lambda: LongSkipViT(skip="add", mid=False), _inputs, routes=[(1, -1)]),
    Case("add-cross-the-end", lambda: LongSkipViT(skip="add"), _inputs, routes=[(2, 5)]),
    Case(
        "named",
        LongSkipViT,
        _inputs,
        routes=[(1, -1)],
        route_kwargs={"blocks": ["in_blocks", "out_blocks"]},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_route_covers_the_whole_chain(case):
    blocks = case.route_kwargs.get("blocks")
    exp = tread_fx.explain(case.model(), case.routes, 0.5, _inputs(), flops=False, blocks=blocks)
    has_mid = case.model().mid_block is not None and blocks is None
    lists = ["in_blocks", "{mid_block}", "out_blocks"] if has_mid else ["in_blocks", "out_blocks"]
    assert [s["path"] for s in exp.stacks] == lists
    depth = 7 if has_mid else 6
    start, end = case.routes[0]
    end = end % depth if end < 0 else end
    kept = 1 + N - N // 2  # the time token is a prefix
    assert [b.tokens_routed for b in exp.blocks] == [
        kept if start <= i < end else N + 1 for i in range(depth)
    ]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


@pytest.mark.parametrize("skip", ["cat", "add"])
def test_skips_follow_tread_semantics(skip):
    """Route (1, 4) by hand (in blocks 1 and 2 and the mid block): a skip made inside the route
    and used after its end is the kept tokens written back into the stream at the route start
    (the routed-around tokens skip the blocks, so their skip is their value at the start); one
    made before it is gathered."""
    torch.manual_seed(0)
    model = LongSkipViT(skip=skip)
    tread_fx.route(model, routes=[(1, 4)], rate=0.5, seed=0)
    args = _inputs()[0]
    routed = model.train()(*args)
    ids = tread_fx.route_info(model)[0].kept
    x, t = args
    with torch.no_grad():
        h = torch.cat([model.t_embed(t[:, None, None]), model.embed(x)], dim=1)
        s0 = model.in_blocks[0](h)
        start = s0
        k = gather_rows(start, ids)
        s1 = model.in_blocks[1](k)
        s2 = model.in_blocks[2](s1)
        h = scatter_rows(start, ids, model.mid_block(s2))
        h = model.out_blocks[0](h, scatter_rows(start, ids, s2))
        h = model.out_blocks[1](h, scatter_rows(start, ids, s1))
        h = model.out_blocks[2](h, s0)
        expected = model.head(h[:, 1:])
    torch.testing.assert_close(routed.detach(), expected)
