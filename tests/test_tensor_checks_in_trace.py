"""``torch.is_tensor(v)`` / ``isinstance(v, torch.Tensor)`` on traced values hold as they do
eagerly: a time embedding written for Python numbers too (``if not torch.is_tensor(t):
t = torch.tensor([t])``) takes its tensor branch while tracing. A conv U-Net with such an
embedding is then refused for what it is (no token sequence), not with a TypeError from its
non-tensor branch."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import INVARIANTS, Case
from torch import is_tensor, nn

import tread_fx
from tread_fx.errors import TokenStreamError

B, N, D = 2, 16, 32


def timestep_features(t, dim: int = 8) -> torch.Tensor:
    """Sinusoidal features of a timestep given as a number, a 0-d or a ``[B]`` tensor."""
    if not torch.is_tensor(t):
        t = torch.tensor([t], dtype=torch.float32)
    elif t.dim() == 0:
        t = t[None]
    freqs = torch.exp(-torch.arange(dim // 2, dtype=t.dtype, device=t.device))
    angles = t[:, None].float() * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TimeEmbedding(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):  # the other spelling, same rule
            t = torch.tensor([float(t)])
        return self.mlp(timestep_features(t))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.emb = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x) + self.emb(emb)[:, None])


class NumberFriendlyDiT(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.proj_in = nn.Linear(3, D)
        self.t_embed = TimeEmbedding(D)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        if not is_tensor(t):  # `from torch import is_tensor`
            t = torch.tensor([t], dtype=x.dtype, device=x.device)
        elif t.dim() == 0:
            t = t[None]
        t = t * torch.ones(x.shape[0], dtype=t.dtype, device=t.device)
        emb = self.t_embed(t)
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x, emb)
        return self.head(x)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.emb = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return x + self.conv(torch.relu(x + self.emb(emb)[:, :, None, None]))


class TinyConvUNet(nn.Module):
    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, channels, 3, padding=1)
        self.t_embed = TimeEmbedding(channels)
        self.down = nn.ModuleList(ConvBlock(channels) for _ in range(2))
        self.up = nn.ModuleList(ConvBlock(channels) for _ in range(2))
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        emb = self.t_embed(t)
        h = self.conv_in(x)
        skips = []
        for block in self.down:
            h = block(h, emb)
            skips.append(h)
        for block in self.up:
            h = block(h + skips.pop(), emb)
        return self.conv_out(h)


def _inputs():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(B, N, 3, generator=g), torch.rand(B, generator=g)), {}


def _scalar_t_inputs():
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(6)), torch.tensor(0.3)), {}


CASES = [
    Case("batched-t", NumberFriendlyDiT, _inputs, routes=[(1, 3)]),
    Case("0-d-t", NumberFriendlyDiT, _scalar_t_inputs, routes=[(1, 3)]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_tensor_branch_is_traced(case):
    model = case.route(case.model())
    model.train()(*case.inputs()[0])
    graph = tread_fx.routed_graphs(model)[0].gm.graph
    # the number branch would build a constant with torch.tensor([t])
    assert not any(n.target is torch.tensor for n in graph.nodes)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def test_isinstance_is_unchanged_outside_the_trace():
    assert isinstance.__module__ == "builtins" and torch.is_tensor.__module__ == "torch"
    assert is_tensor is torch.is_tensor


def test_a_conv_unet_is_refused_as_what_it_is():
    model = TinyConvUNet()
    tread_fx.route(model, routes=[(1, 3)], rate=0.5)
    x = torch.randn(B, 3, 8, 8)
    with pytest.raises(TokenStreamError, match="channels-first|feature map|token"):
        model.train()(x, torch.rand(B))
