"""RoPE tables under rotary-like names, and a text stream's table whose head dim equals N.

The blocks take the image tokens' table as ``img_freqs`` ``[N, d]`` (cut to the kept rows,
a selection shared across the batch) and the condition tokens' table as ``cond_rope``
``[T, d]`` with ``T < N``: it cannot hold image positions and is passed unchanged, although
its head dim ``d`` equals ``N`` here (``rope-other-stream``). Self-written model;
docs/design.md#invariants.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import (
    INVARIANTS,
    Case,
    capture_block_inputs,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, N, T, D = 2, 16, 6, 16  # head dim == N: the condition table looks token-aligned by shape


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


def table(length: int) -> torch.Tensor:
    return torch.arange(length)[:, None] * torch.linspace(0.1, 1.0, D)  # [length, D]


class CrossRotaryBlock(nn.Module):
    """Self-attention over the image tokens, then cross-attention to rotated condition keys."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * D)

    def forward(self, x, cond, img_freqs, cond_rope):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attend = nn.functional.scaled_dot_product_attention
        x = x + attend(rotate(q, img_freqs), rotate(k, img_freqs), v)
        ck, cv = self.kv(cond).chunk(2, dim=-1)
        return x + attend(self.q(x), rotate(ck, cond_rope), cv)


class CrossRotary(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.cond_embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList(CrossRotaryBlock() for _ in range(depth))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h, c = self.embed(x), self.cond_embed(cond)
        img_freqs, cond_rope = table(h.shape[1]), table(c.shape[1])
        for block in self.blocks:
            h = block(h, c, img_freqs, cond_rope)
        return self.head(h)


def _inputs() -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(B, N, 4, generator=gen), torch.randn(B, T, 8, generator=gen)), {}


CASE = Case("CrossRotary", CrossRotary, _inputs, routes=[(1, -1)])


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda c: c.__name__)
def test_invariants(check):
    check(CASE)


def test_half_the_tokens_are_kept():
    infos = check_routed_shape_count_and_change(CASE)
    assert infos[0].kept.shape[1] == N // 2


def test_the_image_table_is_cut_and_the_condition_table_passed():
    model = tread_fx.route(CrossRotary(), routes=[(1, -1)], seed=0).train()
    args = _inputs()[0]
    model(*args)
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*args)
    kept = tread_fx.route_info(model)[0].kept[0]
    _, cond, img_freqs, cond_rope = calls[-1][0]
    torch.testing.assert_close(img_freqs, table(N)[kept])
    assert cond.shape == (B, T, D) and torch.equal(cond_rope, table(T))
