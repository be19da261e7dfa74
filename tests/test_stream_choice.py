"""Which block argument is the token stream, when larger tensors also "come from" the input.

Two patterns made the locator pick the wrong value:

* an additive attention mask cast with ``mask.type_as(hidden_states)`` (only the dtype of the
  stream is read, so the mask does not carry the input's values), larger than the stream;
* a per-token modulation ``[B, N, 6, D]`` computed from the timestep and the stream's length,
  passed unchanged to every block, while the stream itself is what block ``i`` hands to
  block ``i + 1``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import (
    INVARIANTS,
    Case,
    check_compiled,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx
from tread_fx.passes.locate.dataflow import data_ancestors

B, N, D, H = 2, 48, 32, 2  # the [B, 1, N, N] mask is larger than the stream


class MaskedBlock(nn.Module):
    """Self-attention with an additive [B, 1, N, N] mask, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj, self.mlp = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x).unflatten(-1, (3, H, D // H)).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        x = x + self.proj(mixed.transpose(1, 2).flatten(2))
        return x + self.mlp(x)


class CastMaskDiT(nn.Module):
    """The mask is cast with ``type_as(hidden)``: a dtype-only use of the stream."""

    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.layers = nn.ModuleList(MaskedBlock() for _ in range(depth))
        self.out = nn.Linear(D, 4)

    def forward(self, x, padding_mask):
        hidden = self.embed(x)
        pair = padding_mask[:, None, :] * padding_mask[:, :, None]
        mask = ((1 - pair) * torch.finfo(hidden.dtype).min).unsqueeze(1).type_as(hidden)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask)
        return self.out(hidden)


def _mask_inputs():
    gen = torch.Generator().manual_seed(5)
    padding = torch.ones(B, N)
    padding[1, -3:] = 0.0  # the second sample's last tokens are padding
    return (torch.randn(B, N, 4, generator=gen), padding), {}


def test_dtype_device_and_shape_uses_are_not_data_flow():
    def f(x, mask):
        cast = mask.type_as(x).to(x)
        zeros = x.new_zeros(x.shape) + torch.zeros_like(x)
        return cast * x.size(1), zeros

    graph = torch.fx.symbolic_trace(f).graph
    x, mask = (n for n in graph.nodes if n.op == "placeholder")
    cast, zeros = next(n for n in graph.nodes if n.op == "output").args[0]
    assert x not in data_ancestors(cast, set()) and mask in data_ancestors(cast, set())
    assert x not in data_ancestors(zeros, set())


class ModulatedBlock(nn.Module):
    """adaLN with a per-token modulation [B, N, 6, D] (shift/scale/gate for attn and MLP),
    received under a conditioning name (``temb``), yet gathered per token."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, 1, 6, D) / D**0.5)
        self.norm = nn.LayerNorm(D, elementwise_affine=False)
        self.qkv, self.proj, self.mlp = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, temb):
        shift, scale, gate, shift2, scale2, gate2 = (self.table + temb).unbind(2)
        h = self.norm(x) * (1 + scale) + shift
        q, k, v = self.qkv(h).unflatten(-1, (3, H, D // H)).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v)
        x = x + gate * self.proj(mixed.transpose(1, 2).flatten(2))
        return x + gate2 * self.mlp(self.norm(x) * (1 + scale2) + shift2)


class PerTokenModulationDiT(nn.Module):
    """A per-token modulation larger than the stream, built for the stream's length."""

    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.embed, self.time = nn.Linear(4, D), nn.Linear(1, 6 * D)
        self.blocks = nn.ModuleList(ModulatedBlock() for _ in range(depth))
        self.out = nn.Linear(D, 4)

    def forward(self, x, t):
        hidden = self.embed(x)
        modulation = self.time(t[:, None]).view(x.shape[0], 1, 6, D)
        modulation = modulation.expand(-1, hidden.shape[1], -1, -1).type_as(hidden)
        for block in self.blocks:
            hidden = block(hidden, modulation)
        return self.out(hidden)


def _modulation_inputs():
    gen = torch.Generator().manual_seed(6)
    return (torch.randn(B, N, 4, generator=gen), torch.rand(B, generator=gen)), {}


CASES = [
    Case("type-as-mask", CastMaskDiT, _mask_inputs, routes=[(1, 4)]),
    Case("per-token-modulation", PerTokenModulationDiT, _modulation_inputs, routes=[(1, 4)]),
]
CHECKS = INVARIANTS


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_stream_is_the_handed_on_value(case):
    exp = tread_fx.explain(case.model(), case.routes, 0.5, case.inputs())
    (info,) = check_routed_shape_count_and_change(case)
    assert info.num_tokens == N and info.kept.shape[1] == N // 2
    assert exp.flops.speedup > 1.05


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled(case):
    check_compiled(case)


class ClassAttention(nn.Module):
    """Attends from the class token to [cls, tokens]; returns the new class token only."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.proj = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)

    def forward(self, x, cls):
        both = torch.cat([cls, x], dim=1)
        k, v = self.kv(both).chunk(2, dim=-1)
        return cls + self.proj(F.scaled_dot_product_attention(self.q(cls), k, v))


class ClassAttentionViT(nn.Module):
    """Self-attention blocks, then class-attention blocks that all take the same tokens and
    hand on the class token, made with ``expand(x.shape[0], ...)`` (a shape-only use)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, D), nn.Linear(D, 3)
        self.cls = nn.Parameter(torch.randn(1, 1, D) * 0.02)
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(4))
        self.cls_blocks = nn.ModuleList(ClassAttention() for _ in range(2))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, None)
        cls = self.cls.expand(x.shape[0], -1, -1)
        for block in self.cls_blocks:
            cls = block(x, cls)
        return self.head(cls[:, 0])


def test_a_list_that_does_not_hand_the_stream_on_ends_the_stack():
    exp = tread_fx.explain(ClassAttentionViT(), [(1, -1)], 0.5, _modulation_inputs()[0][:1])
    assert [s["path"] for s in exp.stacks] == ["blocks"]
    assert exp.flops.speedup > 1.05
