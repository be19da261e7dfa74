"""Factorised video blocks: spatial and temporal stacks interleaved, the batch folded.

Spatial blocks attend over the tokens of each frame (``[B * F, N, C]``), temporal blocks over
the frames of each position (``[B * N, F, C]``); the model reshapes between them. A route
over one stack also runs the other stack's blocks on the kept tokens, so data flow alone cannot
tell which to route: by default the stack whose stream has the most tokens is
routed (more to save); equal counts are refused, listing the candidate stacks with their
token counts and the ``blocks=`` choices.
With ``blocks=`` either stack routes: the stream's dim 0 folds frames (or positions) into the
batch, and one selection shared by all folded rows keeps the same tokens in every frame of
every video, so the other stack's blocks (which mix the frames) see consistent sequences.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import (
    INVARIANTS,
    Case,
    capture_block_inputs,
    check_compiled,
)
from torch import nn

import tread_fx
from tread_fx.errors import AmbiguousBlockStackError, SelectionError, TokenStreamError

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
        for spatial, temporal in zip(self.spatial, self.temporal):  # sizes read from h
            h = spatial(h)
            h = h.reshape(b, -1, h.shape[-2], C).transpose(1, 2)
            h = temporal(h.reshape(-1, h.shape[-2], C))
            h = h.reshape(b, -1, h.shape[-2], C).transpose(1, 2)
            h = h.reshape(-1, h.shape[-2], C)
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


def test_interleaved_stacks_of_equal_token_counts_are_listed():
    with pytest.raises(AmbiguousBlockStackError) as err:
        _first_call(FactorisedVideoDiT(frames=N), _video(frames=N))
    message = str(err.value)
    assert f"spatial: 4 blocks on [{B * N}, {N}, {C}] ({N} tokens)" in message
    assert f"temporal: 4 blocks on [{B * N}, {N}, {C}] ({N} tokens)" in message
    assert "interleaved" in message and "pass blocks='spatial' or blocks='temporal'" in message


def test_by_default_the_stack_with_more_tokens_is_routed():
    model = FactorisedVideoDiT()
    _first_call(model, _video())
    (info,) = tread_fx.route_info(model)
    assert info.num_tokens == N and info.kept.shape == (B * FRAMES, N // 2)


CASES = [
    Case("spatial", FactorisedVideoDiT, lambda: ((_video(),), {}), [(1, 4)], {"blocks": "spatial"}),
    Case(
        "temporal", FactorisedVideoDiT, lambda: ((_video(),), {}), [(1, 4)], {"blocks": "temporal"}
    ),
]
CHECKS = INVARIANTS


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants_of_either_stack_on_the_folded_batch(case, check):
    check(case)


def test_every_frame_of_every_video_keeps_the_same_tokens():
    model = CASES[0].route(CASES[0].model()).train()
    with capture_block_inputs(model.temporal[2]) as calls:
        model(_video())
    (info,) = tread_fx.route_info(model)
    assert info.kept.shape == (B * FRAMES, N // 2) and (info.kept == info.kept[:1]).all()
    # the temporal block between two routed spatial blocks sees every frame of the kept tokens
    assert calls[-1][0][0].shape == (B * (N // 2), FRAMES, C)


def test_explain_and_flops_of_the_spatial_stack():
    exp = tread_fx.explain(CASES[0].model(), [(1, 4)], 0.5, ((_video(),), {}), blocks="spatial")
    assert exp.stream["shape"] == [B * FRAMES, N, C] and exp.stream["folded"] == FRAMES
    assert "folds 4 sequences per sample" in str(exp)
    assert exp.flops.speedup > 1.2


def test_share_selection_false_is_refused_on_a_folded_batch():
    model = CASES[0].route(CASES[0].model(), share_selection=False).train()
    with pytest.raises(SelectionError, match="(?s)folds 4 sequences .* share_selection=False"):
        model(_video())


def test_sequences_of_one_frame_are_never_routed():
    with pytest.raises(TokenStreamError, match=r"(?s)sequences of 1 token.*would save nothing"):
        _first_call(TemporalOnly(), _video(frames=1))


@pytest.mark.slow
def test_compiled_spatial_stack():
    check_compiled(CASES[0])
