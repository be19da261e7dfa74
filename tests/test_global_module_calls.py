"""A module instance held in a global of the model's code (not a submodule) and called from a
block's forward, as the ``kernels`` package turns ``apply_rotary_pos_emb`` into a module-level
``nn.Module`` in transformers' Llama. fx can record no ``call_module`` for it (it has no path in
the model), so the trace used to keep the whole calling submodule as one call, and a mask
handed to that submodule could no longer be seen to reach the attention: refused.

A stateless one traces as the caller's code. One that owns parameters is not traced through
(the graph would hold its weights as constants): its caller stays one call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import INVARIANTS, Case
from torch import nn

import tread_fx
from tread_fx.passes.trace.tracer import trace_call

B, N, D, HEADS = 2, 16, 32, 4


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class FunctionModule(nn.Module):
    """A function wrapped as a stateless module (what ``kernels`` builds)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _rotate_half(x, cos, sin)


rotate = FunctionModule()
weighted = nn.Linear(D // HEADS, D // HEADS)  # a global module with state


class Attention(nn.Module):
    def __init__(self, use_weighted: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.use_weighted = use_weighted

    def forward(self, x, cos, sin, mask):
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.use_weighted:
            v = weighted(v)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(a.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, use_weighted: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = Attention(use_weighted)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm(x), cos, sin, mask)
        return x + self.mlp(x)


class GlobalModuleModel(nn.Module):
    def __init__(self, depth: int = 4, use_weighted: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(Block(use_weighted) for _ in range(depth))
        freqs = torch.arange(N)[:, None] * torch.linspace(0.1, 1.0, D // HEADS)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        mask = (keep[:, None, :, None] & keep[:, None, None, :]).expand(-1, 1, N, N)
        for block in self.blocks:
            h = block(h, self.cos, self.sin, mask)
        return self.out(h)


def _inputs():
    x = torch.randn(B, N, 3, generator=torch.Generator().manual_seed(3))
    return (x, torch.ones(B, N, dtype=torch.bool)), {}


CASE = Case("global-stateless-module", GlobalModuleModel, _inputs, routes=[(1, 3)])


def test_a_global_stateless_module_traces_as_the_callers_code():
    block = Block()
    x, cos, sin = torch.randn(B, N, D), torch.ones(N, D // HEADS), torch.zeros(N, D // HEADS)
    mask = torch.ones(B, 1, N, N, dtype=torch.bool)
    traced = trace_call(block, (x, cos, sin, mask), {}, set())
    assert not traced.auto_leaves
    torch.testing.assert_close(traced.gm(x, cos, sin, mask)[0], block(x, cos, sin, mask))


def test_a_global_module_with_parameters_keeps_its_caller_one_call():
    block = Block(use_weighted=True)
    x, cos, sin = torch.randn(B, N, D), torch.ones(N, D // HEADS), torch.zeros(N, D // HEADS)
    mask = torch.ones(B, 1, N, N, dtype=torch.bool)
    traced = trace_call(block, (x, cos, sin, mask), {}, set())
    assert set(traced.auto_leaves) == {"attn"}
    assert "not installed as a submodule" in traced.auto_leaves["attn"]
    torch.testing.assert_close(traced.gm(x, cos, sin, mask)[0], block(x, cos, sin, mask))


def test_routes_with_the_mask_seen_to_reach_the_attention():
    model = tread_fx.route(GlobalModuleModel(), routes=CASE.routes, rate=0.5, seed=0)
    args, _ = _inputs()
    model.train()(*args)
    assert tread_fx.route_info(model)[0].kept.shape[1] == N // 2


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
def test_invariants(check):
    check(CASE)
