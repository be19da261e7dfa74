"""A per-sample gate on the attention's output where the head dim equals the token count
(DyDiT's channel router at a small width: 4 heads of 16 over 16 tokens). ``probs @ v`` is a
product of two stream values with a square ``[N, N]``-looking shape, but it is the attention's
output, not its scores: only a product with no scores among its operands (``q @ k^T``) is.
Before, the gate's input (the timestep embedding ``[B, D]``) was read as an attention mask
and refused. Compared with the same model routed by hand."""

from __future__ import annotations

import torch
from third_party_checks import gather_rows, scatter_rows
from torch import nn

import tread_fx

B, N, D, HEADS = 2, 16, 64, 4  # head dim 16 == N


class GatedAttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.drop, self.router = nn.Dropout(0.0), nn.Linear(D, D)

    def forward(self, x, t):
        q, k, v = (
            self.qkv(self.norm(x)).unflatten(-1, (3, HEADS, D // HEADS)).permute(2, 0, 3, 1, 4)
        )
        probs = self.drop((q @ k.transpose(-2, -1) * (D // HEADS) ** -0.5).softmax(dim=-1))
        h = (probs @ v).transpose(1, 2).reshape(x.shape)
        gate = torch.sigmoid(self.router(t)).unsqueeze(1)  # [B, 1, D]: per sample and channel
        return x + self.out(h * gate)


class GatedDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.time = nn.Linear(4, D), nn.Linear(1, D)
        self.blocks = nn.ModuleList(GatedAttentionBlock() for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x, t):
        h, temb = self.embed(x), self.time(t[:, None])
        for block in self.blocks:
            h = block(h, temb)
        return self.head(h)


def test_a_gate_on_the_attention_output_is_no_mask():
    torch.manual_seed(0)
    model = GatedDiT()
    x, t = torch.randn(B, N, 4), torch.rand(B)
    routed = tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0).train()
    out = routed(x, t)
    kept = tread_fx.route_info(routed)[0].kept
    temb = model.time(t[:, None])
    h = model.blocks[0](model.embed(x), temb)
    inner = model.blocks[2](model.blocks[1](gather_rows(h, kept), temb), temb)
    expected = model.head(model.blocks[3](scatter_rows(h, kept, inner), temb))
    torch.testing.assert_close(out, expected)
