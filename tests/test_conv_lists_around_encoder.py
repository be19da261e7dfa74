"""A list of small conv blocks around an attention encoder (depthwise position convs on the
``[B, C, H, W]`` map before and after the tokens): a conv list never beats a token list, a
chain never joins lists of different forms, and ``blocks=`` naming the real stack is accepted
also inside ``nn.TransformerEncoder`` (a torch.nn module holding the blocks is traced through
so its layers are seen)."""

from __future__ import annotations

import pytest
import torch
from stream_models import AttentionBlock
from third_party_checks import INVARIANTS, Case
from torch import nn

import tread_fx

B, H, W, D = 2, 4, 4, 32


class DepthwiseConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(D, D, 3, padding=1, groups=D)
        self.pointwise = nn.Conv2d(D, D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pointwise(torch.relu(self.depthwise(x)))


class ConvAroundEncoder(nn.Module):
    """``convs`` conv blocks before and after ``depth`` attention blocks (own class, or
    ``nn.TransformerEncoder`` when ``torch_encoder``)."""

    def __init__(self, convs: int = 5, depth: int = 4, torch_encoder: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, D, 1)
        self.convs_in = nn.ModuleList(DepthwiseConvBlock() for _ in range(convs))
        if torch_encoder:
            layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        else:
            self.encoder = nn.Sequential(*(AttentionBlock(D) for _ in range(depth)))
        self.convs_out = nn.ModuleList(DepthwiseConvBlock() for _ in range(convs))
        self.head = nn.Conv2d(D, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for conv in self.convs_in:
            x = conv(x)
        b, c, h, w = x.shape
        x = self.encoder(x.flatten(2).transpose(1, 2))
        x = x.transpose(1, 2).reshape(b, c, h, w)
        for conv in self.convs_out:
            x = conv(x)
        return self.head(x)


def _inputs():
    return (torch.randn(B, 3, H, W, generator=torch.Generator().manual_seed(9)),), {}


CASES = [
    Case("more-convs-than-blocks", ConvAroundEncoder, _inputs, routes=[(1, -1)]),
    Case("fewer-convs", lambda: ConvAroundEncoder(convs=2), _inputs, routes=[(1, -1)]),
    Case(
        "torch-encoder",
        lambda: ConvAroundEncoder(convs=2, torch_encoder=True),
        _inputs,
        routes=[(1, -1)],
    ),
    Case(
        "torch-encoder-named",
        lambda: ConvAroundEncoder(torch_encoder=True),
        _inputs,
        routes=[(1, -1)],
        route_kwargs={"blocks": "encoder.layers"},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_token_list_is_the_stack(case):
    blocks = case.route_kwargs.get("blocks")
    exp = tread_fx.explain(case.model(), case.routes, 0.5, _inputs(), flops=False, blocks=blocks)
    path = "encoder.layers" if "torch" in case.name else "encoder"
    assert [s["path"] for s in exp.stacks] == [path] and exp.stacks[0]["count"] == 4
    assert [b.tokens_routed for b in exp.blocks] == [H * W, H * W // 2, H * W // 2, H * W]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)
