"""Per-layer containers with an empty slot: ``ModuleList([None, attn, ff])`` (an optional
skip projection or norm left out in some layers, as ``nn.ModuleList`` allows). An empty slot
takes no input and is not a block; the triple is still one block. Before the fix, ``route()``
raised ``AttributeError: type object 'NoneType' has no attribute 'forward'``."""

from __future__ import annotations

import pytest
import torch
from test_role_containers import FeedForward, RMSNorm, SelfAttention
from third_party_checks import INVARIANTS, Case
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class OptionalNormLayers(nn.Module):
    """``layers[i] = [norm or None, attn, ff]``: every other layer has no extra norm."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.layers = nn.ModuleList(
            nn.ModuleList([RMSNorm() if i % 2 else None, SelfAttention(), FeedForward()])
            for i in range(depth)
        )
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for norm, attn, ff in self.layers:
            if norm is not None:
                x = norm(x)
            x = attn(x)[0] + x
            x = ff(x) + x
        return self.head(x)


def _inputs():
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(3)),), {}


CASE = Case("optional-norm", OptionalNormLayers, _inputs, routes=[(1, -1)])


def test_a_triple_with_an_empty_slot_is_one_block():
    exp = tread_fx.explain(CASE.model(), CASE.routes, 0.5, _inputs(), flops=False)
    assert exp.stacks[0]["path"] == "layers" and exp.stacks[0]["count"] == 4
    assert [b.tokens_routed for b in exp.blocks] == [N, N // 2, N // 2, N]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
def test_invariants(check):
    check(CASE)
