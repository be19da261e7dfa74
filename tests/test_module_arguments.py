"""A module handed to the blocks as an argument that holds token tables: a rotary module with
``[N, d]`` cos/sin buffers, built once by the model and called inside each block
(``block(x, rope)``). The routed blocks are traced through together with the module, and its
tables are cut to the kept tokens like a block's own table."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import INVARIANTS, Case
from torch import nn

import tread_fx

B, N, D = 2, 16, 48  # D / 2 != N: the [N, D / 2] table has one token dim


class Rotary(nn.Module):
    def __init__(self, tokens: int = N, dim: int = D) -> None:
        super().__init__()
        angles = torch.arange(tokens)[:, None] * torch.exp(-torch.arange(dim // 2) / 4)[None]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * self.cos - b * self.sin, a * self.sin + b * self.cos], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor, rope: nn.Module) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        h = nn.functional.scaled_dot_product_attention(rope(q), rope(k), v)
        x = x + self.out(h)
        return x + self.mlp(x)


class RotaryDiT(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.rope = Rotary()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, self.rope)
        return self.head(x)


def _inputs():
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(14)),), {}


CASE = Case("rotary-module-argument", RotaryDiT, _inputs, routes=[(1, 3)])


def test_the_rotary_rows_of_the_kept_tokens_are_used():
    """Block 1 on the kept tokens equals the block run on the full stream, then gathered
    (attention over the kept tokens with their own rotary rows)."""
    torch.manual_seed(0)
    model = tread_fx.route(RotaryDiT(), routes=[(1, 2)], rate=0.5, seed=0)
    x = _inputs()[0][0]
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        h = model.blocks[0](model.embed(x), model.rope)
        kept = h.gather(1, ids[..., None].expand(-1, -1, D))
        q, k, v = model.blocks[1].qkv(model.blocks[1].norm(kept)).chunk(3, dim=-1)
        cos, sin = model.rope.cos[ids], model.rope.sin[ids]
        turn = lambda t: torch.cat(
            [t.chunk(2, -1)[0] * cos - t.chunk(2, -1)[1] * sin,
             t.chunk(2, -1)[0] * sin + t.chunk(2, -1)[1] * cos], -1
        )  # fmt: skip
        y = kept + model.blocks[1].out(
            nn.functional.scaled_dot_product_attention(turn(q), turn(k), v)
        )
        y = y + model.blocks[1].mlp(y)
        h = h.scatter(1, ids[..., None].expand(-1, -1, D), y)
        for block in model.blocks[2:]:
            h = block(h, model.rope)
        expected = model.head(h)
    torch.testing.assert_close(routed.detach(), expected)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
def test_invariants(check):
    check(CASE)
