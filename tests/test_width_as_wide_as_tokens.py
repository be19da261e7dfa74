"""A stream whose width equals its routable token count (tiny configs: 16 tokens of width 16).

By value, a dim of 16 is then the tokens' or the features'. Two decisions read such a dim:
- the grid by use (``plan/grid_uses.py``): blocks that split their 16 channels into 4 heads of
  4 beside 2 register tokens (a stream ``[B, 18, 16]``, 16 routable) would read as a 4 x 4
  grid; the grid is not taken, and a warning names ``grid=``;
- the hand-off check (``plan/handoff.py``): a second value handed from block to block,
  ``[B, 5, 16]`` computed from the input, has 16 on its last dim where the stream has its
  width; it reads as features (passed on), not as tokens the selection misses (refused).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from third_party_checks import (
    Case,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, N, D, HEADS, REGISTERS, CONTEXT = 2, 16, 16, 4, 2, 5


class HeadsBlock(nn.Module):
    """Self-attention whose heads split the channels: ``view(B, T, HEADS, D // HEADS)``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p.view(b, t, HEADS, D // HEADS).transpose(1, 2)
            for p in self.qkv(self.norm(x)).chunk(3, -1)
        )
        attn = nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(attn.transpose(1, 2).reshape(b, t, D))


class RegistersAndHeads(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.registers = nn.Parameter(torch.randn(1, REGISTERS, D))
        self.blocks = nn.ModuleList(HeadsBlock() for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = torch.cat([self.registers.expand(h.shape[0], -1, -1), h], 1)
        for block in self.blocks:
            h = block(h)
        return self.head(h[:, REGISTERS:])


class ContextBlock(nn.Module):
    """Hands on ``(x, context)``; the context attends nowhere, it is refined beside ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.mix, self.ctx = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.mix(x) * context.mean(1, keepdim=True)
        return x, context + self.ctx(context)


class HandsOnContext(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed, self.to_context = nn.Linear(3, D), nn.Linear(D, D)
        self.blocks = nn.ModuleList(ContextBlock() for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        context = self.to_context(h[:, :CONTEXT])  # computed from the input: [B, 5, 16]
        for block in self.blocks:
            h, context = block(h, context)
        return self.head(h)


def _inputs() -> tuple[tuple, dict]:
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(1)),), {}


CASES = [
    Case("registers-and-heads", RegistersAndHeads, _inputs, routes=[(1, -1)]),
    Case("hands-on-context", HandsOnContext, _inputs, routes=[(1, -1)]),
]
CHECKS = [
    check_eval_is_bitwise_unrouted,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
    check_gradients,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routes_by_default(case, check):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(case)


def test_a_head_split_as_wide_as_the_tokens_is_not_taken_for_the_grid():
    case = CASES[0]
    model = case.route(case.model())
    with pytest.warns(
        UserWarning, match=r"cannot tell whether that is a patch grid.*grid=\(H, W\)"
    ):
        model.train()(*case.inputs()[0])
    (info,) = tread_fx.route_info(model)
    assert info.selection == "random" and info.grid is None and info.prefix == REGISTERS
