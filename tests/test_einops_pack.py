"""einops ``pack`` results unpacked in the model's forward (``x, ps = pack([x], "b * d")``)
and ``unpack`` after the blocks: ``pack`` runs as a leaf function, its ``(tensor, shapes)``
result is unpacked by its length, which the routed graph checks on every call; the shapes
stay graph values for ``unpack``."""

from __future__ import annotations

import pytest
import torch
from einops import pack, rearrange, unpack
from stream_models import AttentionBlock
from third_party_checks import INVARIANTS, Case
from torch import nn

import tread_fx
from tread_fx.runtime.guards import GUARD_MARK, check_traced_length

B, H, W, D = 2, 4, 4, 32


class PackedGridDiT(nn.Module):
    """Patch features ``[B, C, H, W]`` packed to tokens with einops and unpacked after."""

    def __init__(self, depth: int = 4, channels_first: bool = True) -> None:
        super().__init__()
        self.channels_first = channels_first
        self.proj_in = nn.Linear(3, D)
        self.blocks = nn.ModuleList(AttentionBlock(D) for _ in range(depth))
        self.proj_out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_first:
            x = rearrange(x, "b c h w -> b h w c")
        x = self.proj_in(x)
        x, packed_shapes = pack([x], "b * d")
        for block in self.blocks:
            x = block(x)
        (x,) = unpack(x, packed_shapes, "b * d")
        x = self.proj_out(x)
        return rearrange(x, "b h w c -> b c h w") if self.channels_first else x


def _inputs():
    return (torch.randn(B, 3, H, W, generator=torch.Generator().manual_seed(7)),), {}


def _channels_last_inputs():
    return (torch.randn(B, H, W, 3, generator=torch.Generator().manual_seed(8)),), {}


CASES = [
    Case("channels-first", PackedGridDiT, _inputs, routes=[(1, -1)]),
    Case(
        "channels-last",
        lambda: PackedGridDiT(channels_first=False),
        _channels_last_inputs,
        routes=[(1, 4)],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_packed_tokens_are_routed(case):
    exp = tread_fx.explain(case.model(), case.routes, 0.5, case.inputs(), flops=False)
    assert exp.stacks[0]["path"] == "blocks"
    assert exp.blocks[1].tokens_original == H * W and exp.blocks[1].tokens_routed == H * W // 2
    model = case.route(case.model())
    model.train()(*case.inputs()[0])
    graph = tread_fx.routed_graphs(model)[0].gm.graph
    assert any(n.target is check_traced_length for n in graph.nodes)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def test_the_length_guard_fails_on_another_length():
    check_traced_length([torch.ones(1), [torch.Size([4, 4])]], 2, "model.py:1")
    with pytest.raises(RuntimeError, match=GUARD_MARK):
        check_traced_length((torch.ones(1),), 2, "model.py:1")
