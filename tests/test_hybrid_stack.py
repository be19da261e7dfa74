"""Hybrid stacks: one ModuleList interleaving attention and scan layers of different classes
(Jamba-style), each handing the token stream to the next."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import (
    INVARIANTS,
    Case,
    check_eval_is_bitwise_unrouted,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class AttentionLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class ScanLayer(nn.Module):
    """An order-sensitive layer: a decaying causal scan over the tokens (cumsum form)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(x))
        steps = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)
        decay = torch.exp(-0.1 * steps)[None, :, None]
        return x + torch.cumsum(h * decay, dim=1) / decay


class Hybrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.layers = nn.ModuleList(
            [AttentionLayer(), ScanLayer(), AttentionLayer(), ScanLayer(), AttentionLayer()]
        )
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _inputs():
    return (torch.randn(B, N, 4, generator=torch.Generator().manual_seed(4)),), {}


CASE = Case("hybrid", Hybrid, _inputs, routes=[(1, -1)])


def test_a_mixed_class_list_is_the_stack_and_explain_names_each_blocks_class():
    exp = tread_fx.explain(Hybrid(), [(1, -1)], 0.5, _inputs(), flops=False)
    assert exp.stacks[0]["path"] == "layers" and exp.stacks[0]["count"] == 5
    assert [b.tokens_routed for b in exp.blocks] == [N, N // 2, N // 2, N // 2, N]
    text = str(exp)
    assert "AttentionLayer" in text and "ScanLayer" in text


CHECKS = INVARIANTS


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_invariants(check):
    check(CASE)


def test_jamba_routes_with_default_arguments():
    transformers = pytest.importorskip("transformers")
    config = transformers.JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
        mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
    )  # fmt: skip
    torch.manual_seed(0)

    def inputs():
        embeds = torch.randn(B, N, 32, generator=torch.Generator().manual_seed(1))
        return (), {"inputs_embeds": embeds, "use_cache": False}

    case = Case("jamba", lambda: transformers.JambaModel(config), inputs, routes=[(1, -1)])
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    (info,) = check_routed_shape_count_and_change(case)
    assert info.num_tokens == N
