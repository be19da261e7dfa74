"""Side values are classified by how the routed blocks use them, never by their names.

One tiny backbone hands every block a rotary table, a key-padding mask, per-token ids, a
text context as long as the image, the token count and a head dim equal to the token count
by coincidence. Renaming the model's and the blocks' arguments (to random identifiers, or
to names the old rules read as something else) changes nothing: same routed output, kept
ids and route info under the same seed. Only the int that sizes the token dim is told the
kept count; the head dim is never touched, whatever its value.
"""

from __future__ import annotations

import keyword
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_packed_streams import CASES as PACKED_CASES
from test_packed_streams import OffsetsBlock, PackedModel, SegmentIdsBlock
from third_party_checks import INVARIANTS, Case, capture_block_inputs
from torch import nn

import tread_fx

B, N, D, HEADS, KINDS = 2, 16, 32, 2, 3
HEAD_DIM = D // HEADS  # == N: a head dim equal to the token count by coincidence
BLOCK_ARGS = ("x", "rope", "keep", "tags", "context", "count", "head_dim")
MODEL_ARGS = ("image", "text", "keep")


def _rotate(q: torch.Tensor) -> torch.Tensor:
    a, b = q.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class SideBlock(nn.Module):
    """Self-attention with RoPE and a key mask, per-token modulation picked by id, and
    cross-attention to a text context."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.q_text, self.kv_text = (
            nn.Linear(D, 3 * D),
            nn.Linear(D, D),
            nn.Linear(D, 2 * D),
        )
        self.modulation = nn.Parameter(torch.randn(KINDS, 2 * D) * 0.1)
        self.out = nn.Linear(D, D)

    def forward(self, x, rope, keep, tags, context, count, head_dim):
        b = x.shape[0]
        shift, scale = self.modulation.index_select(0, tags).chunk(2, dim=-1)
        h = x * (1 + scale) + shift
        q, k, v = (
            t.view(b, count, HEADS, head_dim).transpose(1, 2) for t in self.qkv(h).chunk(3, -1)
        )
        cos, sin = rope
        q, k = q * cos + _rotate(q) * sin, k * cos + _rotate(k) * sin
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        h = h.transpose(1, 2).reshape(x.shape)
        kt, vt = (
            t.view(b, -1, HEADS, head_dim).transpose(1, 2)
            for t in self.kv_text(context).chunk(2, -1)
        )
        qt = self.q_text(h).view(b, count, HEADS, head_dim).transpose(1, 2)
        h = h + F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2).reshape(x.shape)
        return x + self.out(h)


class SideModel(nn.Module):
    """Calls its blocks by keyword, under the block's own parameter names."""

    block_class: type = SideBlock

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed, self.embed_text = nn.Linear(4, D), nn.Linear(4, D)
        self.blocks = nn.ModuleList(self.block_class() for _ in range(depth))
        self.head = nn.Linear(D, 4)
        half = torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)
        angle = torch.arange(N)[:, None] * (1.0 / 100**half)
        self.register_buffer("cos", angle.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angle.sin().repeat(1, 2), persistent=False)

    def forward(self, image, text, keep):
        x, context = self.embed(image), self.embed_text(text)
        tags = torch.arange(x.shape[1]) % KINDS
        names = _parameters(self.block_class)
        values = (None, (self.cos, self.sin), keep, tags, context, x.shape[1], HEAD_DIM)
        for block in self.blocks:
            x = block(**dict(zip(names, (x, *values[1:]))))
        return self.head(x)


def _parameters(cls: type) -> tuple[str, ...]:
    code = cls.forward.__code__
    return code.co_varnames[1 : code.co_argcount]


def _inputs():
    gen = torch.Generator().manual_seed(1)
    keep = torch.rand(B, N, generator=gen) > 0.2
    keep[:, 0] = True
    return (torch.randn(B, N, 4, generator=gen), torch.randn(B, N, 4, generator=gen), keep), {}


def renamed(cls: type, names: tuple[str, ...], **attributes) -> type:
    """A subclass of ``cls`` whose ``forward`` takes its arguments under ``names`` (passed on
    to ``cls.forward`` by position)."""
    params = ", ".join(names)
    namespace = {"base": cls}
    exec(f"def forward(self, {params}):\n    return base.forward(self, {params})\n", namespace)  # noqa: S102
    return type(cls.__name__, (cls,), {"forward": namespace["forward"], **attributes})


SIDE = Case("side-uses", SideModel, _inputs, routes=[(1, 4)])


def _routed(case: Case):
    model = case.route(case.model()).train()
    out = model(*case.inputs()[0])
    return out, tread_fx.route_info(model)


def _assert_same(case: Case, other: Case) -> None:
    (out, infos), (theirs, their_infos) = _routed(case), _routed(other)
    torch.testing.assert_close(out, theirs, rtol=0, atol=0, equal_nan=True)
    assert len(infos) == len(their_infos)
    for mine, yours in zip(infos, their_infos):
        assert torch.equal(mine.kept, yours.kept)
        assert (mine.route, mine.num_tokens, mine.prefix, mine.suffix, mine.grid) == (
            yours.route, yours.num_tokens, yours.prefix, yours.suffix, yours.grid
        )  # fmt: skip


_MISLEADING = ["attention_mask", "rotary_emb", "encoder_hidden_states", "position_ids",
               "cu_seqlens", "segment_ids", "img_ids", "freqs_cis", "context", "temb", "mask",
               "hidden_states", "num_tokens", "head_dim"]  # fmt: skip
_IDENTIFIER = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s) and s not in {"self", "base"}
)


def _names(k: int):
    return st.lists(_IDENTIFIER | st.sampled_from(_MISLEADING), min_size=k, max_size=k, unique=True)


_SETTINGS = settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))


@_SETTINGS
@given(block_names=_names(len(BLOCK_ARGS)), model_names=_names(len(MODEL_ARGS)))
def test_renaming_the_arguments_changes_nothing(block_names, model_names):
    block = renamed(SideBlock, tuple(block_names))
    model = renamed(SideModel, tuple(model_names), block_class=block)
    _assert_same(SIDE, Case("renamed", model, _inputs, SIDE.routes))


_PACKED_BLOCKS = {"packed-cu-seqlens": OffsetsBlock, "packed-segment-ids": SegmentIdsBlock}


@_SETTINGS
@given(data=st.data(), which=st.sampled_from(sorted(_PACKED_BLOCKS)))
def test_renaming_a_packed_models_arguments_changes_nothing(data, which):
    case = next(c for c in PACKED_CASES if c.name == which)
    block_cls = _PACKED_BLOCKS[which]
    block = renamed(block_cls, tuple(data.draw(_names(len(_parameters(block_cls))))))
    model = renamed(PackedModel, tuple(data.draw(_names(3))))
    _assert_same(case, Case("renamed", lambda: model(block), case.inputs, case.routes))


def test_the_head_dim_equal_to_the_token_count_is_never_rewritten():
    model = SIDE.route(SIDE.model()).train()
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*_inputs()[0])
    *_, (_, kwargs) = calls  # the first call may be the tracing one
    assert kwargs["count"] == N // 2  # the token count, under any name, follows the kept tokens
    assert kwargs["head_dim"] == HEAD_DIM == N  # equal to the count by coincidence: untouched


def test_a_token_count_under_a_meaningless_name_is_rewritten():
    block = renamed(SideBlock, ("a", "b", "c", "d", "e", "zq", "zr"))
    case = Case(
        "meaningless", renamed(SideModel, MODEL_ARGS, block_class=block), _inputs, SIDE.routes
    )
    model = case.route(case.model()).train()
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*_inputs()[0])
    *_, (_, kwargs) = calls
    assert (kwargs["zq"], kwargs["zr"]) == (N // 2, HEAD_DIM)


def test_explain_shows_the_rules_that_decided():
    exp = str(tread_fx.explain(SIDE.model(), SIDE.routes, 0.5, _inputs()[0], flops=False))
    for rule in ("rope-batch-shared", "attention-mask", "ids-shared", "context"):
        assert f"adapter '{rule}'" in exp, rule
    assert "tells blocks.1 'count'" in exp and "'head_dim'" not in exp


class OpaqueBlock(nn.Module):
    """Uses a token-aligned value only through its mean (a global statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, x, rotary_emb):
        return x + self.mix(x) * rotary_emb.mean()


class OpaqueModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OpaqueBlock() for _ in range(4))

    def forward(self, x, table):
        for block in self.blocks:
            x = block(x, table)
        return x


def test_a_rotary_name_does_not_make_a_table():
    """A table the blocks only take the mean of is global: passed whole, whatever its name."""
    model = tread_fx.route(OpaqueModel(), routes=[(1, 3)], seed=0).train()
    x, table = torch.randn(B, N, D), torch.randn(N, D)
    seen = []
    handle = model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    model(x, table)
    handle.remove()
    plan = tread_fx.routed_graphs(model)[0].plans[0]
    assert [c.reason for c in plan.entering if c.node.op == "placeholder"] == [
        "adapter 'not-per-token'"
    ]
    assert torch.equal(seen[-1], table)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
def test_invariants(check):
    check(SIDE)


def layer_dropped(module: nn.Module) -> bool:
    """Layer drop drawn from Python's RNG (probability 0 here): a block whose forward calls
    it cannot be traced through (fx cannot record a Python random number)."""
    return module.training and random.random() < 0.0


class UsesTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, x, table):
        if layer_dropped(self):
            return x
        return x + self.mix(x + table)


class IgnoresTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, x, table):
        return x + self.mix(x)


class Hybrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([UsesTable(), IgnoresTable(), UsesTable(), IgnoresTable()])

    def forward(self, x, table):
        for block in self.blocks:
            x = block(x, table)
        return x


def test_a_value_an_untraceable_block_receives_is_never_taken_for_unused():
    """The traced blocks ignore the table, the others cannot be seen into: not 'none'."""
    model = tread_fx.route(Hybrid(), routes=[(0, 4)], seed=0).train()
    with pytest.raises(tread_fx.SideInputError, match=r"(?s)\[.table.\].*traced through"):
        model(torch.randn(B, N, D), torch.randn(B, N, D))
