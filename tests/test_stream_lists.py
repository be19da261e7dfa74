"""Blocks that carry a list (or tuple) of streams, several scales at once, handed whole from
block to block (``xs = block(xs)``). Parallel patch embedders (one per scale, each on the
image) are no stack; the blocks are, and the stream routed is the list element the data
decides (here the fine scale, the only one the prediction reads per token)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import INVARIANTS, Case
from torch import nn

import tread_fx

B, D = 2, 32


class PatchEmbed(nn.Module):
    def __init__(self, patch: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, D, patch, patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return x + self.out(mixed)


class MultiScaleBlock(nn.Module):
    """Each scale attends within itself; the coarse scale's mean conditions the fine one."""

    def __init__(self, container: type = list) -> None:
        super().__init__()
        self.container = container
        self.fine, self.coarse, self.mix = Attention(), Attention(), nn.Linear(D, D)

    def forward(self, xs):
        fine, coarse = xs
        fine, coarse = self.fine(fine), self.coarse(coarse)
        return self.container([fine + self.mix(coarse.mean(1, keepdim=True)), coarse])


class MultiScale(nn.Module):
    def __init__(self, depth: int = 4, container: type = list) -> None:
        super().__init__()
        self.container = container
        self.embeds = nn.ModuleList([PatchEmbed(2), PatchEmbed(4)])
        self.blocks = nn.ModuleList(MultiScaleBlock(container) for _ in range(depth))
        self.head = nn.Linear(D, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = self.container(embed(x) for embed in self.embeds)
        for block in self.blocks:
            xs = block(xs)
        return self.head(xs[0])


def _inputs():
    return (torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(3)),), {}


CASES = [
    Case("list", MultiScale, _inputs),
    Case("tuple", lambda: MultiScale(container=tuple), _inputs),
    Case("named", MultiScale, _inputs, route_kwargs={"blocks": "blocks"}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_blocks_are_the_stack_and_the_fine_scale_is_routed(case):
    model = case.route(case.model())
    model.train()(*_inputs()[0])
    (info,) = tread_fx.route_info(model)
    assert (info.num_tokens, tuple(info.kept.shape)) == (64, (B, 32))


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def test_the_routed_forward_is_the_hand_written_one():
    """Route (1, 3) by hand: the fine stream is gathered after block 0, blocks 1-2 run on
    [kept fine tokens, whole coarse stream], the kept tokens are written back before block 3."""
    model = CASES[0].route(CASES[0].model())
    (x,) = _inputs()[0]
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept[..., None].expand(-1, -1, D)
    with torch.no_grad():
        fine, coarse = model.blocks[0]([embed(x) for embed in model.embeds])
        kept, coarse = model.blocks[2](model.blocks[1]([fine.gather(1, ids), coarse]))
        xs = model.blocks[3]([fine.scatter(1, ids, kept), coarse])
        expected = model.head(xs[0])
    torch.testing.assert_close(routed.detach(), expected)
