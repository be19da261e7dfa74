"""Blocks that are lists of sub-blocks called in turn, the layout of most community ViT/DiT
code: ``for attn, ff in self.layers: x = attn(x) + x; x = ff(x) + x``. The block boundary is
the first call into member ``i``."""

from __future__ import annotations

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

B, N, D = 2, 16, 32


class PreNormAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.attn(h, h, h, need_weights=False)[0]


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NestedViT(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.layers = nn.ModuleList(
            nn.ModuleList([PreNormAttention(), FeedForward()]) for _ in range(depth)
        )
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.head(x)


def _inputs():
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(2)),), {}


INSIDE = Case("nested", NestedViT, _inputs, routes=[(1, -1)])
TO_THE_END = Case("nested-to-end", NestedViT, _inputs, routes=[(1, 4)])


def test_the_stack_is_found_and_members_are_the_blocks():
    exp = tread_fx.explain(NestedViT(), [(1, -1)], 0.5, _inputs(), flops=False)
    assert exp.stacks[0]["path"] == "layers" and exp.stacks[0]["count"] == 4
    assert [b.tokens_routed for b in exp.blocks] == [N, N // 2, N // 2, N]


@pytest.mark.parametrize("case", [INSIDE, TO_THE_END], ids=lambda c: c.name)
def test_invariants(case):
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    infos = check_routed_shape_count_and_change(case)
    assert infos[0].num_tokens == N
    check_gradients(case)


def test_a_route_to_the_end_scatters_after_the_last_members_residual():
    """With end == depth the stream after the last block is after its last sub-block and
    residual add: the routed-around tokens skip attention AND feed-forward of blocks 1..3."""
    model = TO_THE_END.route(TO_THE_END.model())
    model.train()(*_inputs()[0])
    gm = tread_fx.routed_graphs(model)[0].gm
    scatter = next(n for n in gm.graph.nodes if "scatter_tokens" in str(n.target))
    src = scatter.args[1]
    assert src.op == "call_function" and "add" in str(src.target)
    assert any(
        a.op == "call_module" and a.target.endswith("layers.3.1") for a in src.all_input_nodes
    )
