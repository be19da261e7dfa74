"""Side inputs nested in tuples of tuples (``image_rotary_emb=((cos, sin), None)``) or dicts.

Some MMDiTs hand each block one argument holding the image RoPE pair and the text RoPE (or
``None``): the ``[N, d]`` tables sit two tuples deep. They are found there and cut to the
kept rows like any rotary table without a batch dim (``rope-batch-shared``), so the
selection is shared across the batch. A table inside a dict argument
(``rotary_emb={"query": t, "key": t}``) is received as ``rotary_emb.query``: rules match either
part. Self-written models; docs/design.md#invariants.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import (
    INVARIANTS,
    Case,
    capture_block_inputs,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RotaryBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, image_rotary_emb: tuple) -> torch.Tensor:
        (cos, sin), text_rotary = image_rotary_emb
        assert text_rotary is None
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return x + self.out(nn.functional.scaled_dot_product_attention(q, k, v))


class NestedRotary(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(RotaryBlock() for _ in range(depth))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        angles = torch.arange(h.shape[1])[:, None] * torch.linspace(0.1, 1.0, D)  # [N, D]
        rotary = ((angles.cos(), angles.sin()), None)
        for block in self.blocks:
            h = block(h, rotary)
        return self.head(h)


def _inputs() -> tuple[tuple, dict]:
    return (torch.randn(B, N, 4, generator=torch.Generator().manual_seed(0)),), {}


CASE = Case("NestedRotary", NestedRotary, _inputs, routes=[(1, -1)])


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda c: c.__name__)
def test_invariants(check):
    check(CASE)


def test_half_the_tokens_are_kept():
    infos = check_routed_shape_count_and_change(CASE)
    assert infos[0].kept.shape[1] == N // 2


def test_the_nested_tables_are_cut_to_the_kept_rows_shared_across_the_batch():
    model = tread_fx.route(NestedRotary(), routes=[(1, -1)], seed=0).train()
    x = _inputs()[0][0]
    model(x)
    with capture_block_inputs(model.blocks[2]) as calls:
        model(x)
    kept = tread_fx.route_info(model)[0].kept
    assert torch.equal(kept[0], kept[1])  # a table without a batch dim: one selection
    (cos, sin), text = calls[-1][0][1]
    angles = torch.arange(N)[:, None] * torch.linspace(0.1, 1.0, D)
    assert text is None and cos.shape == (N // 2, D)
    torch.testing.assert_close(cos, angles.cos()[kept[0]])
    torch.testing.assert_close(sin, angles.sin()[kept[0]])


class DictRotaryBlock(RotaryBlock):
    """Takes the table as ``rotary_emb={"query": angles, "key": angles}`` ([1, 1, N, D])."""

    def forward(self, x: torch.Tensor, rotary_emb: dict) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q = rotate(q, rotary_emb["query"][0, 0].cos(), rotary_emb["query"][0, 0].sin())
        k = rotate(k, rotary_emb["key"][0, 0].cos(), rotary_emb["key"][0, 0].sin())
        return x + self.out(nn.functional.scaled_dot_product_attention(q, k, v))


class DictRotary(NestedRotary):
    def __init__(self, depth: int = 4) -> None:
        super().__init__(depth)
        self.blocks = nn.ModuleList(DictRotaryBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        angles = torch.arange(h.shape[1])[:, None] * torch.linspace(0.1, 1.0, D)
        rotary_emb = {"query": angles[None, None], "key": angles[None, None]}
        for block in self.blocks:
            h = block(h, rotary_emb)
        return self.head(h)


DICT_CASE = Case("DictRotary", DictRotary, _inputs, routes=[(1, -1)])


def test_a_table_inside_a_dict_argument_is_known_by_the_argument_and_the_key():
    check_eval_is_bitwise_unrouted(DICT_CASE)
    check_rate_zero_equals_training(DICT_CASE)
    assert check_routed_shape_count_and_change(DICT_CASE)[0].kept.shape[1] == N // 2
    check_gradients(DICT_CASE)
    model = tread_fx.route(DictRotary(), routes=[(1, -1)], seed=0).train()
    x = _inputs()[0][0]
    model(x)
    with capture_block_inputs(model.blocks[2]) as calls:
        model(x)
    kept = tread_fx.route_info(model)[0].kept[0]
    table = calls[-1][0][1]["query"]
    angles = torch.arange(N)[:, None] * torch.linspace(0.1, 1.0, D)
    torch.testing.assert_close(table, angles[None, None, kept])
