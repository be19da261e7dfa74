"""Flux-family joint blocks as their repositories write them (black-forest-labs/flux, Chroma,
HiDream), each class compared with the same model routed by hand:

- a block calls a function of the model's own code kept in another file than its classes
  (Flux's ``attention`` in ``math.py``, beside the blocks in ``layers.py``), where a library
  call (einops) rejects fx proxies. Only the library function may become one graph call: were
  the helper one call, the per-sample rotary table it applies would meet the stream where
  tread_fx cannot see, and the joint text + image table reached the routed blocks uncut.
  Decided by where the code lives (an installed package or not), never by a name;
- each block is also handed a dataclass of modulation tensors (Chroma's ``ModulationOut``):
  the block is still read for how it uses its other inputs (before, a dataclass argument hid
  every use, and the table was passed uncut);
- a joint padding mask ``[B, H, T + N, T + N]`` built from ``cat(text mask, ones)``: cut
  at the text rows and the kept image rows on both its query and its key dim (before, only
  the first).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rotary_parts import rotary_attention
from torch import nn

import tread_fx

B, N, T, D, HEADS = 2, 16, 4, 32, 2
HEAD_DIM = D // HEADS


def _table(ids: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions -> ``[B, 1, L, HEAD_DIM / 2, 2]`` (cos, sin)."""
    freqs = 1.0 / 50 ** (torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))
    angle = ids.float()[..., None] * freqs
    return torch.stack((angle.cos(), angle.sin()), -1).unsqueeze(1)


@dataclasses.dataclass
class Modulation:
    shift: torch.Tensor
    scale: torch.Tensor


class JointBlock(nn.Module):
    """Image and text tokens attend jointly (text first) with one rotary table over both."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.text_qkv = nn.Linear(D, 3 * D), nn.Linear(D, 3 * D)
        self.out, self.text_out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, img, txt, pe, mod=None, mask=None):
        h = img if mod is None else img * (1 + mod.scale) + mod.shift
        both = torch.cat((self.text_qkv(txt), self.qkv(h)), dim=1)
        q, k, v = both.unflatten(-1, (3, HEADS, HEAD_DIM)).permute(2, 0, 3, 1, 4)
        out = rotary_attention(q, k, v, pe, mask)
        t = txt.shape[1]
        return img + self.out(out[:, t:]), txt + self.text_out(out[:, :t])


class JointModel(nn.Module):
    """``chroma``: blocks also get a dataclass of modulation tensors and a joint key mask."""

    def __init__(self, depth: int = 4, chroma: bool = False) -> None:
        super().__init__()
        self.chroma = chroma
        self.embed, self.embed_text = nn.Linear(4, D), nn.Linear(6, D)
        self.cond = nn.Linear(1, 2 * D * depth)
        self.blocks = nn.ModuleList(JointBlock() for _ in range(depth))
        self.head = nn.Linear(D, 4)

    def mods(self, t: torch.Tensor) -> list[Modulation]:
        parts = self.cond(t[:, None, None]).chunk(2 * len(self.blocks), dim=-1)
        return [Modulation(parts[2 * i], parts[2 * i + 1]) for i in range(len(self.blocks))]

    def forward(self, img, img_ids, txt, txt_ids, t=None, txt_mask=None):
        img, txt = self.embed(img), self.embed_text(txt)
        pe = _table(torch.cat((txt_ids, img_ids), dim=1))
        mods, mask = [None] * len(self.blocks), None
        if self.chroma:
            mods, mask = self.mods(t), _joint_mask(txt_mask, img.shape[1])
        for block, mod in zip(self.blocks, mods):
            img, txt = block(img, txt, pe, mod, mask)
        return self.head(img)


def _joint_mask(txt_mask: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, HEADS, T + n, T + n]``: a pair attends where both its tokens are valid."""
    valid = torch.cat((txt_mask, torch.ones(txt_mask.shape[0], n, dtype=torch.bool)), dim=1)
    return (valid[:, :, None] & valid[:, None, :])[:, None].expand(-1, HEADS, -1, -1)


def _inputs(chroma: bool = False):
    gen = torch.Generator().manual_seed(5)
    img, txt = torch.randn(B, N, 4, generator=gen), torch.randn(B, T, 6, generator=gen)
    img_ids = torch.stack([torch.randperm(N, generator=gen) for _ in range(B)]) + 3
    txt_ids = torch.zeros(B, T, dtype=torch.long)
    if not chroma:
        return img, img_ids, txt, txt_ids
    txt_mask = torch.tensor([[True] * T, [True] * (T - 1) + [False]])
    return img, img_ids, txt, txt_ids, torch.rand(B, generator=gen), txt_mask


def _by_hand(model: JointModel, inputs, kept: torch.Tensor, start: int, end: int):
    """The same model routed by hand: blocks ``start..end - 1`` see the kept image tokens,
    and the table and the mask keep every text row and the kept image tokens' rows of each
    sample."""
    img, img_ids, txt, txt_ids, *rest = inputs
    img, txt = model.embed(img), model.embed_text(txt)
    pe = _table(torch.cat((txt_ids, img_ids), dim=1))
    kept_pe = _table(torch.cat((txt_ids, img_ids.gather(1, kept)), dim=1))
    mods, mask, kept_mask = [None] * len(model.blocks), None, None
    if rest:
        t, txt_mask = rest
        mods, mask, kept_mask = (
            model.mods(t),
            _joint_mask(txt_mask, N),
            _joint_mask(txt_mask, kept.shape[1]),
        )
    for i, (block, mod) in enumerate(zip(model.blocks, mods)):
        if i == start:
            full = img
            img = img.gather(1, kept[..., None].expand(-1, -1, D))
        routed = start <= i < end
        img, txt = block(img, txt, kept_pe if routed else pe, mod, kept_mask if routed else mask)
        if i == end - 1:
            img = full.scatter(1, kept[..., None].expand(-1, -1, D), img)
    return model.head(img)


@pytest.mark.parametrize("chroma", [False, True], ids=["flux", "chroma"])
def test_the_joint_table_applied_in_a_helper_file_is_cut_with_the_stream(chroma):
    torch.manual_seed(0)
    model = JointModel(chroma=chroma)
    inputs = _inputs(chroma)
    routed = tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0).train()
    out = routed(*inputs)
    kept = tread_fx.route_info(routed)[0].kept
    assert kept.shape == (B, N // 2)
    assert not torch.equal(kept[0], kept[1])  # per sample: each sample's own rows
    torch.testing.assert_close(out, _by_hand(model, inputs, kept, 1, 3))
