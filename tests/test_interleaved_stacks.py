"""Interleaved spatial/temporal stacks with side values folded with the tokens (Latte-like).

Spatial blocks run on ``[B * F, N, C]`` and receive the per-sample timestep modulation
repeated over the frames (``[B * F, 3 C]``); temporal blocks run on ``[B * N, F, C]`` and
receive it repeated over the token positions (``[B * N, 3 C]``). A route over the spatial
stack runs the temporal blocks between its routed blocks on ``[B * k, F, C]``, so their
``[B * N, 3 C]`` value must keep the kept positions' rows: the ``tokens-folded-into-batch``
rule views it as ``[B, N, 3 C]``, gathers each sample's kept tokens and folds it back.

Without ``blocks=``, the stack whose stream has more tokens (spatial: ``N > F``) is routed
(equal counts: ``tests/test_factorised_stacks.py``).
"""

from __future__ import annotations

from collections.abc import Callable

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
from tread_fx.adapters import SideValue, StreamLayout, TensorMeta, adapters
from tread_fx.adapters.token_tables import gather_folded_rows, rows_per_token, why_not_folded

B, FRAMES, N, C = 2, 3, 16, 32


class ModulatedBlock(nn.Module):
    """Attention over dim 1 with adaLN-single modulation: one ``[3 C]`` row per batch row."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, C) * 0.1)
        self.norm = nn.LayerNorm(C, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = (self.table[None] + timestep.reshape(x.shape[0], 3, -1)).unbind(1)
        h = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, C // 2)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return x + gate[:, None] * self.proj(out)


class InterleavedVideoDiT(nn.Module):
    def __init__(self, depth: int = 4, frames: int = FRAMES) -> None:
        super().__init__()
        self.embed, self.out = nn.Linear(4, C), nn.Linear(C, 4)
        self.time = nn.Sequential(nn.Linear(1, C), nn.SiLU(), nn.Linear(C, 3 * C))
        self.frame_pos = nn.Parameter(torch.randn(1, frames, C) * 0.02)
        self.spatial = nn.ModuleList(ModulatedBlock() for _ in range(depth))
        self.temporal = nn.ModuleList(ModulatedBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # x: [B, F, N, 4]
        b, f, n, _ = x.shape
        h = self.embed(x).reshape(b * f, n, C)
        temb = self.time(t[:, None].float())  # [B, 3C], per sample
        t_spatial = temb.repeat_interleave(f, dim=0)  # [B * F, 3C]
        t_temporal = temb.repeat_interleave(n, dim=0)  # [B * N, 3C]
        for i, (spatial, temporal) in enumerate(zip(self.spatial, self.temporal)):
            h = spatial(h, t_spatial)
            h = h.reshape(b, -1, h.shape[-2], C).transpose(1, 2)
            h = h.reshape(-1, h.shape[-2], C)  # [B * N, F, C]
            if i == 0:
                h = h + self.frame_pos
            h = temporal(h, t_temporal)
            h = h.reshape(b, -1, h.shape[-2], C).transpose(1, 2)
            h = h.reshape(-1, h.shape[-2], C)  # [B * F, N, C]
        return self.out(h).reshape(b, f, n, 4)


def _inputs(frames: int = FRAMES):
    def make():
        video = torch.randn(B, frames, N, 4, generator=torch.Generator().manual_seed(5))
        return (video, torch.tensor([3.0, 700.0])), {}

    return make


def _model(frames: int) -> Callable[[], nn.Module]:
    return lambda: InterleavedVideoDiT(frames=frames)


CASES = [
    Case("blocks=spatial", _model(FRAMES), _inputs(), [(1, 3)], {"blocks": "spatial"}),
    Case("default", _model(FRAMES), _inputs(), [(1, 3)]),
    Case("one-frame", _model(1), _inputs(1), [(1, 3)]),  # no fold: per-sample selection
]
CHECKS = INVARIANTS


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants_of_the_spatial_route(case, check):
    check(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_temporal_blocks_inside_get_the_kept_positions_rows(case):
    model = case.route(case.model()).train()
    video, t = case.inputs()[0]
    with capture_block_inputs(model.temporal[1]) as calls:
        model(video, t)
    *_, (args, _) = calls  # the first call may be the tracing one
    (info,) = tread_fx.route_info(model)
    assert info.num_tokens == N and info.kept.shape[1] == N // 2
    x, timestep = args
    assert x.shape == (B * (N // 2), video.shape[1], C) and timestep.shape == (B * N // 2, 3 * C)
    temb = model.time(t[:, None].float())
    assert torch.equal(timestep, temb.repeat_interleave(N // 2, dim=0))


def test_explain_names_the_rule():
    exp = str(tread_fx.explain(CASES[0].model(), [(1, 3)], 0.5, _inputs()(), blocks="spatial"))
    assert "tokens-folded-into-batch" in exp


def test_frames_as_many_as_tokens_is_refused_not_guessed():
    """With F == N both stream forms have one shape: a refusal, never a shape error."""
    case = Case("F == N", _model(N), _inputs(N), [(1, 3)], {"blocks": "spatial"})
    model = case.route(case.model()).train()
    with pytest.raises(tread_fx.TreadFxError):
        model(*case.inputs()[0])


def _side(shape, rows: int, folded: int, names=frozenset(), inputs=True, use=None) -> SideValue:
    layout = StreamLayout(0, 1, rows, N, 0, None, folded=folded)
    meta = TensorMeta(shape, torch.float32, torch.device("cpu"))
    return SideValue(None, meta, names, frozenset(), layout, False, False, False, inputs, use)


def test_the_rule_matches_values_folding_samples_and_tokens():
    assert rows_per_token(_side((B * N, 3 * C), B * FRAMES, FRAMES)) == 1
    assert rows_per_token(_side((B * N * FRAMES, C), B * FRAMES, FRAMES)) == FRAMES
    assert rows_per_token(_side((B * N * 2, C), B, 1)) is None  # 2 rows per token: unknown
    assert rows_per_token(_side((B * N, C), B, 1, inputs=False)) is None  # a constant table
    assert rows_per_token(_side((B * FRAMES, 3 * C), B * FRAMES, FRAMES)) is None  # per row
    (rule,) = [a for a in adapters() if a.name == "tokens-folded-into-batch"]
    assert rule.matches(_side((B * N, C), B, 1, frozenset({"arg1"})))
    # a [T + N, d] RoPE table with T == N and B == 2 has B * N rows: its own rules decide
    assert not rule.matches(_side((B * N, C), B, 1, use="table"))  # the blocks' use decides
    assert rows_per_token(_side((B * N, C), B * N, N)) is None  # F == N: ambiguous
    assert "may be per row (pass) or per token" in why_not_folded(_side((B * N, C), B * N, N))
    assert why_not_folded(_side((B * N, C), B * N, N, frozenset({"arg1"}))) is None


def test_gather_folded_rows_keeps_each_samples_rows():
    value = torch.arange(B * N * 2.0).view(B * N * 2, 1)  # sample, token, 2 frames
    idx = torch.tensor([[0, 5], [1, 15]])
    got = gather_folded_rows(value, idx, samples=B, num_tokens=N)[:, 0].tolist()
    assert got == [0.0, 1.0, 10.0, 11.0, 34.0, 35.0, 62.0, 63.0]
    folded_idx = idx.repeat_interleave(FRAMES, dim=0)  # a folded stream's [B * F, k] ids
    assert gather_folded_rows(value, folded_idx, samples=B, num_tokens=N)[:, 0].tolist() == got
    every = torch.arange(N).expand(B, N)
    assert gather_folded_rows(value, every, samples=B, num_tokens=N) is value  # rate 0


@pytest.mark.slow
def test_compiled_spatial_route():
    check_compiled(CASES[0])
