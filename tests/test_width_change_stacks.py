"""Same-class block lists with a width change between them (a masked encoder/decoder DiT:
encoder blocks at one width, a projection, decoder blocks at another): one stack never spans
the change. The longer list is the stack; ``blocks=`` naming both is refused for that reason
(not for a side value that "looks token-aligned")."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import INVARIANTS, Case
from torch import nn

import tread_fx
from tread_fx.errors import BlockStackNotFoundError

B, N = 2, 16


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.ada = nn.Linear(32, width)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) + self.ada(c)[:, None]
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class EncoderDecoderDiT(nn.Module):
    def __init__(self, encoder_depth: int = 4, decoder_depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 32)
        self.t_embed = nn.Linear(1, 32)
        self.encoder = nn.ModuleList(Block(32) for _ in range(encoder_depth))
        self.enc_to_dec = nn.Linear(32, 48)
        self.decoder = nn.ModuleList(Block(48) for _ in range(decoder_depth))
        self.head = nn.Linear(48, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        c = self.t_embed(t[:, None])
        x = self.embed(x)
        for block in self.encoder:
            x = block(x, c)
        x = self.enc_to_dec(x)
        for block in self.decoder:
            x = block(x, c)
        return self.head(x)


def _inputs():
    g = torch.Generator().manual_seed(10)
    return (torch.randn(B, N, 3, generator=g), torch.rand(B, generator=g)), {}


CASES = [
    Case("encoder", EncoderDecoderDiT, _inputs, routes=[(1, -1)]),
    Case(
        "decoder-named",
        EncoderDecoderDiT,
        _inputs,
        routes=[(0, 2)],
        route_kwargs={"blocks": "decoder"},
    ),
]


def test_the_stack_stops_at_the_width_change():
    exp = tread_fx.explain(EncoderDecoderDiT(), [(1, -1)], 0.5, _inputs(), flops=False)
    assert [s["path"] for s in exp.stacks] == ["encoder"] and exp.stacks[0]["count"] == 4
    assert [b.tokens_routed for b in exp.blocks] == [N, N // 2, N // 2, N]


def test_naming_both_lists_is_refused_for_the_width_change():
    model = tread_fx.route(
        EncoderDecoderDiT(), routes=[(1, -1)], rate=0.5, blocks=["encoder", "decoder"]
    )
    with pytest.raises(BlockStackNotFoundError, match="different forms") as err:
        model.train()(*_inputs()[0])
    assert "[2, 16, 32]" in str(err.value) and "[2, 16, 48]" in str(err.value)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


class WideningBlock(nn.Module):
    """A block of one class at every depth, the second one widening the stream (32 -> 48)."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, out)
        self.skip = nn.Identity() if width == out else nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.mix(self.norm(x))


class WideningList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 32)
        sizes = [(32, 32), (32, 48), (48, 48), (48, 48)]
        self.blocks = nn.ModuleList(WideningBlock(a, b) for a, b in sizes)
        self.head = nn.Linear(48, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("route", [(1, 2), (0, 3)])
def test_a_route_over_the_widening_block_is_refused_naming_the_widths(route):
    """Before: the scatter failed on the first call (a RoutedGraphError saying nothing of the
    widths); a route ending after the widening block writes 48-wide tokens beside 32-wide."""
    model = tread_fx.route(WideningList(), routes=[route], rate=0.5, seed=0)
    with pytest.raises(tread_fx.TokenStreamError, match=r"\[2, 16, 32\].*\[2, 16, 48\]"):
        model.train()(torch.randn(B, N, 3))


def test_a_route_after_the_widening_block_routes():
    model = tread_fx.route(WideningList(), routes=[(2, 4)], rate=0.5, seed=0)
    assert model.train()(torch.randn(B, N, 3)).shape == (B, N, 3)
