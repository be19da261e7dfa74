"""A token count handed to the blocks as an int and used only inside a call tread_fx does not
see into (einops' ``rearrange(a, 'b h n d -> b n (h d)', n=count)``, a leaf function).

The model reads ``ntok = x.shape[1]`` from the stream entering the blocks and hands it to each
block: by data flow it is the stream's token count, so inside a route it is told the kept
count, and routing equals a hand-written routed forward. The same number held as a literal
(not read from the stream) cannot be told from a coincidence: refused naming the argument.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import tread_fx
from tread_fx.errors import SideInputError

B, N, C, WIDTH, HEADS = 2, 16, 8, 32, 4


class EinopsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, count: int) -> torch.Tensor:
        qkv = self.qkv(self.norm(x))
        q, k, v = rearrange(qkv, "b n (three h d) -> three b h n d", three=3, h=HEADS)
        a = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(rearrange(a, "b h n d -> b n (h d)", n=count))


class CountedModel(nn.Module):
    def __init__(self, literal: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(C, WIDTH)
        self.blocks = nn.ModuleList(EinopsBlock() for _ in range(4))
        self.out = nn.Linear(WIDTH, C)
        self.literal = literal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        ntok = x.shape[1] if self.literal is None else self.literal
        for block in self.blocks:
            x = block(x, ntok)
        return self.out(x)


def _inputs() -> torch.Tensor:
    return torch.randn(B, N, C, generator=torch.Generator().manual_seed(1))


def _reference(model: CountedModel, x: torch.Tensor, kept: torch.Tensor, start, end):
    """TREAD by hand: blocks ``start:end`` see the kept tokens and are told their count."""
    h = model.embed(x)
    index = kept[..., None].expand(-1, -1, WIDTH)
    for block in model.blocks[:start]:
        h = block(h, N)
    part = h.gather(1, index)
    for block in model.blocks[start:end]:
        part = block(part, part.shape[1])
    h = h.scatter(1, index, part)
    for block in model.blocks[end:]:
        h = block(h, N)
    return model.out(h)


def test_a_count_read_from_the_stream_is_told_the_kept_count():
    torch.manual_seed(0)
    model = CountedModel()
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    x = _inputs()
    out = model.train()(x)
    (info,) = tread_fx.route_info(model)
    assert info.kept.shape == (B, N // 2)
    with torch.no_grad():
        expected = _reference(model, x, info.kept, 1, 3)
    torch.testing.assert_close(out.detach(), expected)


def test_eval_is_unrouted():
    torch.manual_seed(0)
    model = CountedModel()
    x = _inputs()
    with torch.no_grad():
        reference = model.eval()(x)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    model.train()(x)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), reference)


def test_a_literal_equal_to_the_count_is_refused_naming_it():
    torch.manual_seed(0)
    model = CountedModel(literal=N)
    with pytest.raises(SideInputError, match=r"(?s)'count'.*rearrange.*blocks="):
        tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
        model.train()(_inputs())
