"""A route across the change from joint blocks (image and text apart, attending jointly) to
single blocks over ``cat((img, txt), 1)`` (HunyuanImage, musubi-tuner's HunyuanVideo), with one
``[N, d]`` rotary table of the image tokens handed to every block: the single blocks apply it
to the image part of their stream (``q[:, :-T]``). The route is planned in pieces, the later
one over the longer stream; there the table is the image tokens' (the stream's leading ``N``),
cut at the route's kept ids like in the first piece. Before, the later piece read the table
as per-sample data of no token dim and passed it whole: refused by the check before the first
call. Compared with the same model routed by hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tread_fx

B, N, T, D, HEADS = 2, 16, 4, 32, 2
HEAD_DIM = D // HEADS


def _table() -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.arange(N)[:, None] * (1.0 / 30 ** (torch.arange(HEAD_DIM // 2) / 8))
    return angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)


def _rotate(x: torch.Tensor, table) -> torch.Tensor:
    """``x`` [B, H, n, d] rotated by the table's rows [n, d]."""
    cos, sin = table
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def _attend(qkv: torch.Tensor, n_img: int, table) -> torch.Tensor:
    """Joint attention over ``[img | txt]`` tokens; the image part's q and k rotated."""
    q, k, v = qkv.unflatten(-1, (3, HEADS, HEAD_DIM)).permute(2, 0, 3, 1, 4)
    q = torch.cat((_rotate(q[:, :, :n_img], table), q[:, :, n_img:]), dim=2)
    k = torch.cat((_rotate(k[:, :, :n_img], table), k[:, :, n_img:]), dim=2)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class DoubleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.text_qkv = nn.Linear(D, 3 * D), nn.Linear(D, 3 * D)
        self.out, self.text_out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, img, txt, table):
        out = _attend(torch.cat((self.qkv(img), self.text_qkv(txt)), dim=1), img.shape[1], table)
        n = img.shape[1]
        return img + self.out(out[:, :n]), txt + self.text_out(out[:, n:])


class SingleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, txt_len: int, table):
        return x + self.out(_attend(self.qkv(x), x.shape[1] - txt_len, table))


class DoubleThenSingle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.embed_text = nn.Linear(4, D), nn.Linear(6, D)
        self.double_blocks = nn.ModuleList(DoubleBlock() for _ in range(2))
        self.single_blocks = nn.ModuleList(SingleBlock() for _ in range(2))
        self.head = nn.Linear(D, 4)
        cos, sin = _table()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, img, txt):
        img, txt, table = self.embed(img), self.embed_text(txt), (self.cos, self.sin)
        for block in self.double_blocks:
            img, txt = block(img, txt, table)
        x = torch.cat((img, txt), dim=1)
        for block in self.single_blocks:
            x = block(x, txt.shape[1], table)
        return self.head(x[:, : img.shape[1]])


def _by_hand(model: DoubleThenSingle, img, txt, kept: torch.Tensor) -> torch.Tensor:
    """Route (1, 3) by hand: double block 1 and single block 0 see the kept image tokens (the
    same for every sample: the table is batch-shared) and the table's kept rows."""
    rows = kept[0]
    full, cut = (model.cos, model.sin), (model.cos[rows], model.sin[rows])
    img, txt = model.embed(img), model.embed_text(txt)
    img, txt = model.double_blocks[0](img, txt, full)
    kept_img, txt = model.double_blocks[1](img[:, rows], txt, cut)
    img = img.clone()
    img[:, rows] = kept_img
    x = torch.cat((img, txt), dim=1)
    y = model.single_blocks[0](torch.cat((kept_img, txt), dim=1), T, cut)
    x = x.clone()
    x[:, rows], x[:, N:] = y[:, : len(rows)], y[:, len(rows) :]
    x = model.single_blocks[1](x, T, full)
    return model.head(x[:, :N])


def test_the_image_table_is_cut_in_the_piece_after_the_form_change():
    torch.manual_seed(0)
    model = DoubleThenSingle()
    gen = torch.Generator().manual_seed(2)
    img, txt = torch.randn(B, N, 4, generator=gen), torch.randn(B, T, 6, generator=gen)
    routed = tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0).train()
    out = routed(img, txt)
    kept = tread_fx.route_info(routed)[0].kept
    assert kept.shape == (B, N // 2) and torch.equal(kept[0], kept[1])
    torch.testing.assert_close(out, _by_hand(model, img, txt, kept))
