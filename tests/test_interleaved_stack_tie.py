"""Interleaved stacks with as many frames as positions, told apart by the hop count.

Spatial blocks run on ``[B * F, N, C]``, temporal blocks on ``[B * N, F, C]``; with ``F == N``
both streams have one shape, so "most tokens" cannot decide and the hop count does: a frame
embedding added before the first temporal block is one op more in the spatial stack's
hand-offs, so the temporal stack is routed (over the frames, one subset shared by every
position of every video). That is a rule's choice, not the data's: the first routed call
warns naming both stacks and the ``blocks=`` options (generator seeds 646, 889: routed
silently before). Without the embedding the hand-offs tie and the model is refused
(tests/test_factorised_stacks.py).
"""

from __future__ import annotations

import pytest
import torch
from test_factorised_stacks import Attend
from third_party_checks import gather_rows, scatter_rows
from torch import nn

import tread_fx
from tread_fx.errors import StreamChoiceWarning

B, FRAMES, N, C = 2, 4, 4, 32


def _to_temporal(h: torch.Tensor, b: int) -> torch.Tensor:
    h = h.reshape(b, -1, h.shape[-2], C).transpose(1, 2)
    return h.reshape(-1, h.shape[-2], C)  # [B * N, F, C]


def _to_spatial(h: torch.Tensor, b: int) -> torch.Tensor:
    h = h.reshape(b, -1, h.shape[-2], C).transpose(1, 2)
    return h.reshape(-1, h.shape[-2], C)  # [B * F, N, C]


class FramePosVideo(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed, self.out = nn.Linear(4, C), nn.Linear(C, 4)
        self.frame_pos = nn.Parameter(torch.randn(1, FRAMES, C) * 0.1)
        self.spatial = nn.ModuleList(Attend() for _ in range(depth))
        self.temporal = nn.ModuleList(Attend() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, F, N, 4]
        b, f, n, _ = x.shape
        h = self.embed(x).reshape(b * f, n, C)
        for i, (spatial, temporal) in enumerate(zip(self.spatial, self.temporal)):
            h = _to_temporal(spatial(h), b)
            if i == 0:
                h = h + self.frame_pos
            h = _to_spatial(temporal(h), b)
        return self.out(h).reshape(b, f, n, 4)


def _twin(model: FramePosVideo, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Route (0, 2) over the temporal stack by hand: gathered at temporal block 0's input,
    scattered at temporal block 2's."""
    b, f, n, _ = x.shape
    h = model.embed(x).reshape(b * f, n, C)
    for i in range(3):
        h = _to_temporal(model.spatial[i](h), b)
        if i == 0:
            h = h + model.frame_pos
            full, h = h, gather_rows(h, kept)
        if i == 2:
            h = scatter_rows(full, kept, h)
        h = _to_spatial(model.temporal[i](h), b)
    return model.out(h).reshape(b, f, n, 4)


def test_the_hop_count_routes_the_temporal_stack_and_says_so():
    torch.manual_seed(0)
    model, twin = FramePosVideo(), FramePosVideo()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(B, FRAMES, N, 4, generator=torch.Generator().manual_seed(1))
    tread_fx.route(model, routes=[(0, 2)], rate=0.5, seed=0)
    with pytest.warns(StreamChoiceWarning) as caught:
        out = model.train()(x)
    message = str(caught[0].message)
    assert (
        "'temporal'" in message and "blocks='spatial'" in message and "spatial: 3 blocks" in message
    )
    (info,) = tread_fx.route_info(model)
    assert info.kept.shape == (B * N, FRAMES // 2) and (info.kept == info.kept[:1]).all()
    torch.testing.assert_close(out, _twin(twin, x, info.kept), rtol=1e-5, atol=1e-5)
