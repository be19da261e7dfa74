"""Tables a routed block builds itself are decided by how the block uses them (issue 28).

``tests/test_inblock_token_tables.py`` covers the token tables (a bias added to the scores, a
RoPE table rotated with q/k). Here, the other side of the same rule: a tensor the block
computes without its inputs whose size equals the token count only by coincidence (a fixed
rotation of the features, ``[D, D]`` with ``D == N``) is no token table and is left whole;
a table that meets another sequence of the same length (the context) is left whole; a
learned table used per token is cut; a bias given to ``baddbmm`` is a mask; a table blended
with the attention probabilities is cut on both token dims; a table met in any elementwise op
(by torch's op tags: ``maximum``) is cut; and a table that meets the tokens only in an op no
rule reads (``cdist``) is refused, naming the op.
"""

from __future__ import annotations

import pytest
import torch
from test_inblock_token_tables import (
    HEADS,
    B,
    Backbone,
    D,
    _attend,
    _Block,
    _inputs,
    routed_equals_by_hand,
)
from third_party_checks import Case, train_forward
from torch import nn

import tread_fx

N = D  # the token count equals the width: any [D, D] buffer is token-sized by its shape


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n**0.5


class RotatedBlock(_Block):
    """A fixed orthogonal rotation of the features (a buffer), as quantized models do."""

    def __init__(self, linear: bool = False) -> None:
        super().__init__()
        self.register_buffer("rotation", _hadamard(D))
        self.linear = linear

    def forward(self, x, keep=None):
        x = nn.functional.linear(x, self.rotation) if self.linear else x @ self.rotation
        return self.finish(x, _attend(*self.heads(x)))


class ContextTableBlock(_Block):
    """Cross-attends to a context whose length equals the token count, after adding a
    position table built for the context's own length inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.context_positions = nn.Embedding(64, D)
        self.kv = nn.Linear(D, 2 * D)

    def forward(self, x, context, keep=None):
        c = context + self.context_positions(torch.arange(context.shape[1]))
        b, n, _ = x.shape
        q = self.qkv(self.norm(x))[..., :D].reshape(b, n, HEADS, -1).transpose(1, 2)
        k, v = self.kv(c).reshape(b, c.shape[1], 2, HEADS, -1).permute(2, 0, 3, 1, 4)
        return self.finish(x, _attend(q, k, v))


class LearnedTableBlock(_Block):
    """A learned per-token table (a parameter) added inside every block."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.randn(1, N, D))

    def forward(self, x, keep=None):
        x = x + (self.positions if keep is None else self.positions[:, keep])
        return self.finish(x, _attend(*self.heads(x)))


class BaddbmmBiasBlock(_Block):
    """A fixed pair bias added to the scores through ``baddbmm`` (bias + q @ k^T)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pair_bias", torch.randn(1, N, N))

    def forward(self, x, bias=None, keep=None):
        q, k, v = (t.flatten(0, 1) for t in self.heads(x))
        bias = self.pair_bias if bias is None else bias
        bias = bias if keep is None else bias[:, keep][:, :, keep]
        scores = torch.baddbmm(bias, q, k.transpose(-2, -1), alpha=q.shape[-1] ** -0.5)
        out = (scores.softmax(-1) @ v).unflatten(0, (x.shape[0], HEADS))
        return self.finish(x, out)


class HandedBiasBackbone(Backbone):
    """Hands every block the model's own pair bias (the blocks' copies hold the same)."""

    def __init__(self) -> None:
        super().__init__(BaddbmmBiasBlock, N)
        self.register_buffer("pair_bias", self.blocks[0].pair_bias.clone())
        for block in self.blocks:
            block.pair_bias.copy_(self.pair_bias)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, self.pair_bias)
        return self.out(x)


class GatedPositionBlock(_Block):
    """Blends the content attention with a positional attention computed from a fixed
    ``[N, N]`` distance buffer, both after their softmax (a gated positional attention)."""

    def __init__(self) -> None:
        super().__init__()
        positions = torch.arange(N, dtype=torch.float32)
        self.register_buffer("distance", (positions[:, None] - positions[None]).abs())
        self.position_scores = nn.Linear(1, HEADS)
        self.gate = nn.Parameter(torch.zeros(HEADS))

    def forward(self, x, keep=None):
        q, k, v = self.heads(x)
        content = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1)
        where = self.position_scores(self.distance[..., None]).permute(2, 0, 1).softmax(-1)
        where = where if keep is None else where[:, keep][:, :, keep]
        gate = torch.sigmoid(self.gate)[:, None, None]
        attention = (1 - gate) * content + gate * where
        attention = attention / attention.sum(-1, keepdim=True)
        return self.finish(x, attention @ v)


class FloorBlock(_Block):
    """Meets its tokens with a table of its own in ``torch.maximum``: elementwise by torch's
    op tags (issue 44), so a per-token table, cut to the kept rows."""

    def forward(self, x, keep=None):
        positions = torch.arange(x.shape[1], dtype=x.dtype) if keep is None else keep.to(x)
        floor = positions[:, None].expand(-1, D) * 0.01
        return self.finish(x, _attend(*self.heads(torch.maximum(x, floor))))


class DistanceBlock(_Block):
    """Meets its tokens with a table of its own in ``torch.cdist`` (no rule reads it)."""

    def forward(self, x, keep=None):
        table = torch.arange(x.shape[1], dtype=x.dtype)[:, None].expand(-1, D) * 0.01
        near = torch.cdist(x, table.expand(x.shape[0], -1, -1)).neg().softmax(-1)
        return self.finish(x, _attend(*self.heads(x + near @ x)))


class ContextBackbone(Backbone):
    def __init__(self) -> None:
        super().__init__(ContextTableBlock, N)

    def forward(self, x, context):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, context)
        return self.out(x)


def _case(name: str, make_block) -> Case:
    return Case(name, lambda: Backbone(make_block, N), _inputs(N), routes=[(1, 4)])


@pytest.mark.parametrize("linear", [False, True], ids=["matmul", "linear"])
def test_a_buffer_token_sized_by_coincidence_is_left_whole(linear):
    case = _case("rotated", lambda: RotatedBlock(linear))
    routed_equals_by_hand(case)
    exp = str(tread_fx.explain(case.model(), case.routes, 0.5, case.inputs(), flops=False))
    assert "inlined" not in exp


def test_a_table_of_a_context_as_long_as_the_tokens_is_left_whole():
    gen = torch.Generator().manual_seed(2)
    inputs = (torch.randn(B, N, 4, generator=gen), torch.randn(B, N, D, generator=gen)), {}
    case = Case("context", ContextBackbone, lambda: inputs, routes=[(1, 4)])
    model = case.route(case.model())
    out = train_forward(model, case)
    kept = tread_fx.route_info(model)[0].kept
    x, context = inputs[0]
    with torch.no_grad():
        h = model.embed(x)
        ids = kept[:, :, None].expand(-1, -1, D)
        sub = h.gather(1, ids)
        h = model.blocks[0](h, context)
        sub = h.gather(1, ids)
        for block in model.blocks[1:4]:
            sub = block(sub, context)
        h = h.scatter(1, ids, sub)
        expected = model.out(model.blocks[4](h, context))
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


def test_a_learned_table_used_per_token_is_cut():
    routed_equals_by_hand(_case("learned", LearnedTableBlock))


@pytest.mark.parametrize("handed", [False, True], ids=["built", "handed-in"])
def test_a_bias_given_to_baddbmm_is_cut_as_a_mask(handed):
    if handed:
        case = Case("handed", HandedBiasBackbone, _inputs(N), routes=[(1, 4)])
    else:
        case = _case("baddbmm", BaddbmmBiasBlock)
    routed_equals_by_hand(case)


def test_a_table_blended_with_the_attention_probabilities_is_cut_on_both_token_dims():
    routed_equals_by_hand(_case("gated", GatedPositionBlock))


def test_a_table_met_in_any_elementwise_op_is_cut():
    routed_equals_by_hand(_case("floor", FloorBlock))


def test_a_table_no_rule_reads_is_refused_naming_the_op():
    case = _case("distance", DistanceBlock)
    model = case.route(case.model())
    with pytest.raises(tread_fx.errors.SideInputError, match="cdist") as err:
        train_forward(model, case)
    assert "blocks=" in str(err.value)
