"""A stack of torch's own ``nn.TransformerDecoder`` layers with a causal target mask, as
diffusion_policy's ``TransformerForDiffusion`` uses it: the decoder compares the mask with a
causal one (``_detect_is_causal_mask``, a read of tensor data) before calling its layers.
The decoder holds the routed blocks, so its code stays in the graph and is traced through;
such a read there now gets a runtime guard, as in the model's own forward. Before, the read
made the whole decoder one call and no block stack was found. Compared with a hand route: the
routed layers see the kept tokens and the mask's kept rows and columns."""

from __future__ import annotations

import torch
from torch import nn

import tread_fx

B, N, T, D = 2, 16, 4, 32


class CausalDecoderPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cond = nn.Linear(3, D), nn.Linear(5, D)
        layer = nn.TransformerDecoderLayer(D, 2, 64, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=4)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(N))
        self.head = nn.Linear(D, 3)

    def forward(self, actions, obs):
        x, memory = self.embed(actions), self.cond(obs)
        return self.head(self.decoder(x, memory, tgt_mask=self.mask))


def test_the_layers_of_a_torch_decoder_route_with_the_mask_cut():
    torch.manual_seed(0)
    model = CausalDecoderPolicy()
    gen = torch.Generator().manual_seed(8)
    actions, obs = torch.randn(B, N, 3, generator=gen), torch.randn(B, T, 5, generator=gen)
    routed = tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0).train()
    out = routed(actions, obs)
    rows = tread_fx.route_info(routed)[0].kept[0]  # the [N, N] mask: one subset for all samples
    x, memory, layers = model.embed(actions), model.cond(obs), model.decoder.layers
    x = layers[0](x, memory, tgt_mask=model.mask, tgt_is_causal=True)
    kept_mask = model.mask[rows][:, rows]
    inner = layers[2](layers[1](x[:, rows], memory, tgt_mask=kept_mask), memory, tgt_mask=kept_mask)
    x = x.clone()
    x[:, rows] = inner
    x = layers[3](x, memory, tgt_mask=model.mask, tgt_is_causal=True)
    torch.testing.assert_close(out, model.head(x))
