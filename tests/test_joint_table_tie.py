"""A joint model's ``[T + N, d]`` rotary table with ``T == N``: which rows are the tokens'.

The blocks attend over text and image tokens joined in one sequence and rotate q/k with one
table whose rows follow that order. With as many text as image tokens, the concatenation
that builds the table has two parts of ``N`` rows. The part computed from the main input (its
positions from ``x.shape[1]``) is the tokens', wherever it is and whatever the inputs are
called; when no part is (position ids handed in as inputs), the last part is taken, with a
warning naming the choice and the override. Never an input's name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tread_fx

B, N, D, HEADS = 2, 16, 24, 2
HEAD_DIM = D // HEADS  # 12: neither N nor 2N


def _rotate(q: torch.Tensor) -> torch.Tensor:
    a, b = q.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _table(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / 100 ** (torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))
    angle = positions.float()[:, None] * freqs
    return angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)


class JointBlock(nn.Module):
    def __init__(self, text_first: bool) -> None:
        super().__init__()
        self.text_first = text_first
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, zq, zr):
        text, (cos, sin) = zq, zr
        h = torch.cat([text, x] if self.text_first else [x, text], dim=1)
        heads = (
            t.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2) for t in self.qkv(h).chunk(3, -1)
        )
        q, k, v = heads
        q, k = q * cos + _rotate(q) * sin, k * cos + _rotate(k) * sin
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        n = x.shape[1]
        mine = h[:, -n:] if self.text_first else h[:, :n]
        return x + self.out(mine)


class JointModel(nn.Module):
    """``ids_from_inputs``: positions handed in (Flux's ids) instead of read from x's length."""

    def __init__(self, text_first: bool = True, ids_from_inputs: bool = False) -> None:
        super().__init__()
        self.text_first, self.ids_from_inputs = text_first, ids_from_inputs
        self.embed, self.embed_text = nn.Linear(4, D), nn.Linear(4, D)
        self.blocks = nn.ModuleList(JointBlock(text_first) for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x, zs, za=None, zb=None):
        x, text = self.embed(x), self.embed_text(zs)
        if self.ids_from_inputs:
            mine, theirs = za, zb
        else:
            mine, theirs = torch.arange(x.shape[1]), 100 + torch.arange(text.shape[1])
        table = _table(torch.cat([theirs, mine] if self.text_first else [mine, theirs]))
        for block in self.blocks:
            x = block(x, text, table)
        return self.head(x)


def _inputs(ids: bool = False):
    gen = torch.Generator().manual_seed(3)
    x, text = torch.randn(B, N, 4, generator=gen), torch.randn(B, N, 4, generator=gen)
    return (x, text, torch.arange(N), 100 + torch.arange(N)) if ids else (x, text)


def _seen_table(model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    seen = []
    handle = model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[2]))
    model(*inputs)
    handle.remove()
    return seen[-1][0], tread_fx.route_info(model)[0].kept


@pytest.mark.parametrize("text_first", [True, False])
def test_the_part_computed_from_the_main_input_holds_the_token_rows(text_first):
    model = tread_fx.route(JointModel(text_first), routes=[(1, 4)], seed=0).train()
    cos, kept = _seen_table(model, _inputs())
    full, _ = _table(torch.arange(N))
    text, _ = _table(100 + torch.arange(N))
    image_rows = full[kept[0]]  # the selection is shared: every sample keeps the same rows
    expected = torch.cat([text, image_rows] if text_first else [image_rows, text])
    assert torch.equal(cos, expected)


def test_ids_handed_in_take_the_last_part_with_a_warning():
    model = tread_fx.route(JointModel(True, True), routes=[(1, 4)], seed=0).train()
    with pytest.warns(UserWarning, match=r"the last of them .*register a tread_fx\.adapters"):
        cos, kept = _seen_table(model, _inputs(ids=True))
    text, _ = _table(100 + torch.arange(N))
    assert torch.equal(cos, torch.cat([text, _table(torch.arange(N))[0][kept[0]]]))
