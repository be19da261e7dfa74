"""Stream classes the research population (issue 58) found in real code, each as a small
self-written model compared with a hand-written route (failure classes of values inside a
route: tests/test_research_classes.py):

- DDT: one block list run as an encoder over one stream and then as a decoder over a new
  stream, conditioned per token on the encoder's output. Before, a route across both wrote
  the skipped decoder tokens back from the *encoder's* stream, silently; now a route crossing
  the restart is refused naming the routes that work, and a route ending there ends at the
  encoder's last block.
- RDT: the noisy input behind two conditioning tokens (``cat([t, freq, x])``), and a context
  the blocks attend to that is as long as the prediction (the shape-matched input). Before,
  that context was taken for the stream and every position routed, the conditioning tokens
  too (*wrong stream*); now a candidate must hand its tokens from block to block, so the noisy
  input is routed with the two conditioning tokens always kept.
- BESO: states and noisy actions interleaved into one stream (``stack([s, a], 1)`` then a
  reshape: ``[s_1, a_1, s_2, a_2, ...]``). Before, every position after the prefix was
  selectable, the states too (*wrong stream*); now a stream whose selectable positions hold
  the routed input's tokens only in part is refused, naming where they are.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import gather_rows, scatter_rows
from torch import nn

import tread_fx

B, D = 2, 32


# -- DDT: an encoder and a decoder over one block list, the decoder on a new stream ----------


class CondBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mod = nn.Linear(D, D)

    def forward(self, x, c):
        h = x * (1 + self.mod(c))
        return x + self.attn(h, h, h, need_weights=False)[0]


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s_embed, self.x_embed = nn.Linear(3, D), nn.Linear(3, D)
        self.blocks = nn.ModuleList(CondBlock() for _ in range(6))
        self.head = nn.Linear(D, 3)

    def forward(self, x, t):
        s = self.s_embed(x)
        for block in self.blocks[:3]:
            s = block(s, t)
        s = torch.nn.functional.silu(s + t)
        h = self.x_embed(x)
        for block in self.blocks[3:]:
            h = block(h, s)  # conditioned per token on the encoder's output
        return self.head(h)


def test_a_route_across_the_start_of_a_new_stream_is_refused() -> None:
    model = tread_fx.route(EncoderDecoder(), routes=[(1, -1)], rate=0.5)
    with pytest.raises(tread_fx.TokenStreamError, match=r"block 3 .*routes=\[\(1, 3\), \(3, 5\)\]"):
        model.train()(torch.randn(B, 16, 3), torch.randn(B, 1, D))


def test_routes_on_each_side_of_a_new_stream_route_each_stream() -> None:
    torch.manual_seed(0)
    model, x, t = EncoderDecoder(), torch.randn(B, 16, 3), torch.randn(B, 1, D)
    tread_fx.route(model, routes=[(1, 3), (3, 5)], rate=0.5, seed=0)
    routed = model.train()(x, t)
    first, second = (info.kept for info in tread_fx.route_info(model))
    with torch.no_grad():
        s = model.blocks[0](model.s_embed(x), t)
        kept = model.blocks[2](model.blocks[1](gather_rows(s, first), t), t)
        s = torch.nn.functional.silu(scatter_rows(s, first, kept) + t)  # ends at block 2's output
        h = model.x_embed(x)
        kept = gather_rows(h, second)
        for block in model.blocks[3:5]:
            kept = block(kept, gather_rows(s, second))
        expected = model.head(model.blocks[5](scatter_rows(h, second, kept), s))
    torch.testing.assert_close(routed.detach(), expected)


# -- RDT: conditioning tokens in front, a context as long as the prediction -----------------


class CrossBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x, c):
        x = x + self.self_attn(x, x, x, need_weights=False)[0]
        return x + self.cross_attn(x, c, c, need_weights=False)[0]


class ActionTransformer(nn.Module):
    horizon = 16

    def __init__(self) -> None:
        super().__init__()
        self.t_embed, self.freq_embed = nn.Linear(1, D), nn.Linear(1, D)
        self.pos = nn.Parameter(torch.randn(1, 19, D) / 4)
        self.blocks = nn.ModuleList(CrossBlock() for _ in range(4))
        self.head = nn.Linear(D, 8)

    def forward(self, x, freq, t, img_c):
        t = self.t_embed(t[:, None, None])
        freq = self.freq_embed(freq[:, None, None])
        x = torch.cat([t, freq, x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x, img_c)
        return self.head(x)[:, -self.horizon :]


def test_a_context_as_long_as_the_prediction_is_not_taken_for_the_stream() -> None:
    torch.manual_seed(0)
    model = ActionTransformer()
    x, freq, t, img_c = torch.randn(B, 17, D), torch.rand(B), torch.rand(B), torch.randn(B, 16, D)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    routed = model.train()(x, freq, t, img_c)
    info = tread_fx.route_info(model)[0]
    assert info.prefix == 2 and info.num_tokens == 19
    ids = info.kept
    assert (ids[:, :2] == torch.tensor([0, 1])).all()  # the conditioning tokens are kept
    with torch.no_grad():
        h = torch.cat(
            [model.t_embed(t[:, None, None]), model.freq_embed(freq[:, None, None]), x], 1
        )
        h = model.blocks[0](h + model.pos, img_c)
        kept = model.blocks[2](model.blocks[1](gather_rows(h, ids), img_c), img_c)
        h = model.blocks[3](scatter_rows(h, ids, kept), img_c)
        expected = model.head(h)[:, -16:]
    torch.testing.assert_close(routed.detach(), expected)


# -- BESO: states and noisy actions interleaved into one stream ------------------------------


class InterleavedGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.state_embed, self.action_embed = nn.Linear(3, D), nn.Linear(2, D)
        self.blocks = nn.ModuleList(CrossBlock() for _ in range(4))
        self.head = nn.Linear(D, 2)

    def forward(self, states, actions, goal):
        b, t, _ = states.shape
        pairs = torch.stack([self.state_embed(states), self.action_embed(actions)], dim=1)
        x = torch.cat([goal, pairs.permute(0, 2, 1, 3).reshape(b, 2 * t, D)], dim=1)
        for block in self.blocks:
            x = block(x, goal)
        return self.head(x[:, 2::2])  # the action positions


def test_a_stream_interleaving_the_noisy_input_with_other_tokens_is_refused() -> None:
    model = tread_fx.route(InterleavedGPT(), routes=[(1, 3)], rate=0.5)
    with pytest.raises(tread_fx.TokenStreamError, match=r"(?s)8 of the 16 selectable .*\[2, 4, 6"):
        model.train()(torch.randn(B, 8, 3), torch.randn(B, 8, 2), torch.randn(B, 1, D))
