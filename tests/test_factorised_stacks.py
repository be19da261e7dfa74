"""Factorised video blocks: spatial and temporal stacks interleaved, the batch folded.

Spatial blocks attend over the tokens of each frame (``[B * F, N, C]``), temporal blocks over
the frames of each position (``[B * N, F, C]``); the model reshapes between them. A route
over one stack would also run the other stack's blocks on the kept tokens, and a subset per
folded row (per frame) is no consistent per-sample selection once the temporal blocks mix
frames: tread_fx refuses, listing the candidate stacks with their token counts and why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tread_fx
from tread_fx.errors import AmbiguousBlockStackError, TokenStreamError

B, FRAMES, N, C = 2, 4, 16, 32


class Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = nn.LayerNorm(C), nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 2, C // 2)).permute(2, 0, 3, 1, 4)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class FactorisedVideoDiT(nn.Module):
    def __init__(self, depth: int = 4, frames: int = FRAMES) -> None:
        super().__init__()
        self.embed, self.out = nn.Linear(4, C), nn.Linear(C, 4)
        self.spatial = nn.ModuleList(Attend() for _ in range(depth))
        self.temporal = nn.ModuleList(Attend() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, F, N, 4]
        b, f, n, _ = x.shape
        h = self.embed(x).reshape(b * f, n, C)
        for spatial, temporal in zip(self.spatial, self.temporal):
            h = spatial(h)
            h = h.reshape(b, f, n, C).transpose(1, 2).reshape(b * n, f, C)
            h = temporal(h)
            h = h.reshape(b, n, f, C).transpose(1, 2).reshape(b * f, n, C)
        return self.out(h).reshape(b, f, n, 4)


class TemporalOnly(nn.Module):
    """Every spatial position is its own sequence of frames ([B * N, F, C])."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed, self.out = nn.Linear(4, C), nn.Linear(C, 4)
        self.blocks = nn.ModuleList(Attend() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, F, N, 4]
        b, f, n, _ = x.shape
        h = self.embed(x).transpose(1, 2).reshape(b * n, f, C)
        for block in self.blocks:
            h = block(h)
        return self.out(h).reshape(b, n, f, 4).transpose(1, 2)


def _video(frames: int = FRAMES) -> torch.Tensor:
    return torch.randn(B, frames, N, 4, generator=torch.Generator().manual_seed(9))


def _first_call(model: nn.Module, x: torch.Tensor, **kwargs) -> None:
    tread_fx.route(model, routes=[(1, -1)], rate=0.5, **kwargs).train()(x)


def test_interleaved_stacks_are_listed_with_their_token_counts():
    with pytest.raises(AmbiguousBlockStackError) as err:
        _first_call(FactorisedVideoDiT(), _video())
    message = str(err.value)
    assert f"spatial: 4 blocks on [{B * FRAMES}, {N}, {C}] ({N} tokens)" in message
    assert f"temporal: 4 blocks on [{B * N}, {FRAMES}, {C}] ({FRAMES} tokens)" in message
    assert "interleaved" in message and "blocks=" in message


def test_a_stack_on_a_folded_batch_is_refused_with_the_reason():
    with pytest.raises(TokenStreamError, match=r"folds the batch .*\(4 sequences per sample"):
        _first_call(FactorisedVideoDiT(), _video(), blocks="spatial")


def test_sequences_of_one_frame_are_never_routed():
    with pytest.raises(TokenStreamError, match="sequences of 1 token: routing them would save"):
        _first_call(TemporalOnly(), _video(frames=1))
