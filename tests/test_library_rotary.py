"""A rotary table applied inside the blocks by a library function that calls another library
(x-transformers' ``apply_rotary_pos_emb``, whose ``rotate_half`` calls einops; F5-TTS and
CosyVoice route their DiT so). Only the function that rejects a traced value (einops'
``rearrange``) becomes one graph call; the library code around it is traced like the model's,
so the table's use is seen and it is cut at the kept ids (the library then slices the last
``k`` rows of a ``k``-row table: all of them). Before, ``apply_rotary_pos_emb`` itself was one
call, the table's use unseen: refused as undecided, and with ``strict=False`` the library took
the table's *last* ``k`` rows, the positions of other tokens. Compared with a hand route."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

import tread_fx

B, N, D, HEADS = 2, 16, 32, 2
HEAD_DIM = D // HEADS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, rope):
        freqs, scale = rope
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, HEADS, HEAD_DIM)).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary_pos_emb(q, freqs, scale), apply_rotary_pos_emb(k, freqs, scale)
        return x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class RotaryDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rotary = nn.Linear(4, D), RotaryEmbedding(HEAD_DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        h = self.embed(x)
        rope = self.rotary.forward_from_seq_len(h.shape[1])
        for block in self.blocks:
            h = block(h, rope)
        return self.head(h)


def _by_hand(model: RotaryDiT, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Route (1, 3) by hand: blocks 1 and 2 see the kept tokens (the same in every sample: the
    table is batch-shared) and the table's rows of their positions."""
    h = model.blocks[0](model.embed(x), rope := model.rotary.forward_from_seq_len(N))
    kept_rope = (rope[0][:, rows], rope[1])
    kept = model.blocks[2](model.blocks[1](h[:, rows], kept_rope), kept_rope)
    h = h.clone()
    h[:, rows] = kept
    return model.head(model.blocks[3](h, rope))


def test_the_table_a_library_applies_is_cut_at_the_kept_ids():
    torch.manual_seed(0)
    model, x = RotaryDiT(), torch.randn(B, N, 4, generator=torch.Generator().manual_seed(4))
    routed = tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0).train()
    out = routed(x)
    kept = tread_fx.route_info(routed)[0].kept
    assert torch.equal(kept[0], kept[1]) and not torch.equal(kept[0], torch.arange(8, 16))
    torch.testing.assert_close(out, _by_hand(model, x, kept[0]))
