"""Which carried slots hold the routed stream is decided by where their values come from, and
a size read is no data: minRF's MMDiT slices its text condition to the image batch
(``conds["c_seq"][0:b]``, ``b`` from ``x.shape``), and its text tokens are as many as the image
tokens. Before, the size read made the text stream "fed by the image input", so it was
gathered with the image tokens' kept ids as part of the stream's family (and then refused or
failing in the single blocks). Compared with the same model routed by hand: the text stream
passes whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from third_party_checks import gather_rows, scatter_rows
from torch import nn

import tread_fx

B, N, D, HEADS = 2, 16, 32, 2


class JointBlock(nn.Module):
    """Text first, then image tokens, attending jointly; both handed on."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_c, self.qkv_x = nn.Linear(D, 3 * D), nn.Linear(D, 3 * D)
        self.out_c, self.out_x = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, c, x):
        qkv = torch.cat((self.qkv_c(c), self.qkv_x(x)), dim=1)
        q, k, v = qkv.unflatten(-1, (3, HEADS, D // HEADS)).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        t = c.shape[1]
        return c + self.out_c(h[:, :t]), x + self.out_x(h[:, t:])


class SlicedConditionMMDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cond = nn.Linear(4, D), nn.Linear(6, D)
        self.blocks = nn.ModuleList(JointBlock() for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x, conds):
        b = x.shape[0]
        c, x = self.cond(conds["c_seq"][0:b]), self.embed(x)
        for block in self.blocks:
            c, x = block(c, x)
        return self.head(x)


def test_a_text_stream_sliced_by_the_image_batch_is_passed_whole():
    torch.manual_seed(0)
    model = SlicedConditionMMDiT()
    gen = torch.Generator().manual_seed(6)
    x, conds = torch.randn(B, N, 4, generator=gen), {"c_seq": torch.randn(B, N, 6, generator=gen)}
    routed = tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0).train()
    out = routed(x, conds)
    kept = tread_fx.route_info(routed)[0].kept
    c, h = model.blocks[0](model.cond(conds["c_seq"]), model.embed(x))
    c, inner = model.blocks[2](*model.blocks[1](c, gather_rows(h, kept)))
    _, h = model.blocks[3](c, scatter_rows(h, kept, inner))
    torch.testing.assert_close(out, model.head(h))
