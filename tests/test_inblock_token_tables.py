"""Blocks that build tables over their own tokens inside the route (issue 14).

Three self-written families, each a block that computes something from its token count:

- a relative-position bias looked up through an ``[N, N]`` index buffer (with a cls token);
- a relative-position bias computed from the patch grid on every call (an MLP on offsets);
- a RoPE table built from ``arange(N)`` inside the block.

Routed, the blocks are traced through: the tables are built for all ``N`` tokens (original
positions) and cut to the kept tokens on every token dim. Each block also accepts the kept
ids explicitly (``keep=``), so a hand-written routed forward pins the semantics.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import (
    INVARIANTS,
    Case,
    check_compiled,
    train_forward,
)
from torch import nn

import tread_fx
from tread_fx.inspection.flops import profile_graph

B, D, HEADS = 2, 32, 2


def _attend(q, k, v, bias=None):
    """[B, H, n, d] attention with an optional additive bias [.., n, n]."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    return scores.softmax(dim=-1) @ v


class _Block(nn.Module):
    """Pre-norm attention + MLP; subclasses supply the bias / rotation."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def heads(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        return q, k, v

    def finish(self, x, out):
        b, n, _ = x.shape
        x = x + self.proj(out.transpose(1, 2).reshape(b, n, D))
        return x + self.mlp(x)


class IndexBufferBlock(_Block):
    """BEiT-like: a learned table indexed by an [N, N] buffer (cls row/column included)."""

    def __init__(self, grid: tuple[int, int]) -> None:
        super().__init__()
        h, w = grid
        self.tokens = h * w + 1
        self.table = nn.Parameter(torch.randn((2 * h - 1) * (2 * w - 1) + 3, HEADS) * 0.5)
        coords = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"))
        coords = coords.flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
        index = torch.zeros(self.tokens, self.tokens, dtype=torch.long)
        index[1:, 1:] = (rel[..., 0] + h - 1) * (2 * w - 1) + rel[..., 1] + w - 1
        last = (2 * h - 1) * (2 * w - 1)
        index[0, :], index[:, 0], index[0, 0] = last, last + 1, last + 2
        self.register_buffer("index", index)

    def forward(self, x, keep=None):
        bias = self.table[self.index.view(-1)].view(self.tokens, self.tokens, -1)
        bias = bias.permute(2, 0, 1).unsqueeze(0)  # [1, H, N, N]
        if keep is not None:
            bias = bias[:, :, keep][:, :, :, keep]
        return self.finish(x, _attend(*self.heads(x), bias))


class GridBiasBlock(_Block):
    """RelPos-like: a bias computed from the patch grid on every call (MLP on offsets)."""

    def __init__(self) -> None:
        super().__init__()
        self.offsets = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, HEADS))
        self.full = 16  # the token count the reference (keep=...) builds the bias for

    def forward(self, x, keep=None):
        side = int((x.shape[1] if keep is None else self.full) ** 0.5)
        coords = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"))
        coords = coords.flatten(1).float()
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # [N, N, 2]
        bias = self.offsets(torch.sign(rel) * torch.log1p(rel.abs())).permute(2, 0, 1)
        if keep is not None:
            bias = bias[:, keep][:, :, keep]
        return self.finish(x, _attend(*self.heads(x), bias))


class RopeBlock(_Block):
    """Ernie-like: a RoPE table built for the block's own N tokens."""

    def __init__(self) -> None:
        super().__init__()
        half = D // HEADS // 2
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(half) / half))

    def forward(self, x, keep=None):
        positions = torch.arange(x.shape[1]) if keep is None else keep
        angles = positions[:, None].float() * self.inv_freq[None]  # [N, d/2]
        cos, sin = angles.cos(), angles.sin()

        def rotate(t):
            a, b = t.chunk(2, dim=-1)
            return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

        q, k, v = self.heads(x)
        return self.finish(x, _attend(rotate(q), rotate(k), v))


class Backbone(nn.Module):
    """Patch tokens (+ an optional cls token) through a stack of blocks."""

    def __init__(self, make_block, tokens: int, cls_token: bool = False, depth: int = 5):
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.cls = nn.Parameter(torch.randn(1, 1, D)) if cls_token else None
        self.blocks = nn.ModuleList(make_block() for _ in range(depth))
        self.out = nn.Linear(D, 4)
        self.tokens = tokens

    def forward(self, x):
        x = self.embed(x)
        if self.cls is not None:
            x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _inputs(tokens: int):
    def make():
        gen = torch.Generator().manual_seed(1)
        return (torch.randn(B, tokens, 4, generator=gen),), {}

    return make


CASES = {
    "index-buffer": Case(
        "index-buffer",
        lambda: Backbone(lambda: IndexBufferBlock((4, 4)), 16, cls_token=True),
        _inputs(16),
        routes=[(1, 4)],
    ),
    "grid-bias": Case("grid-bias", lambda: Backbone(GridBiasBlock, 16), _inputs(16), [(1, 4)]),
    "rope": Case("rope", lambda: Backbone(RopeBlock, 24), _inputs(24), [(1, 4)]),
}


def _by_hand(model: Backbone, x: torch.Tensor, kept: torch.Tensor, route=(1, 4)) -> torch.Tensor:
    """The routed forward written out: the routed blocks are told the kept ids."""
    h = model.embed(x)
    if model.cls is not None:
        h = torch.cat((model.cls.expand(h.shape[0], -1, -1), h), dim=1)
    start, end = route
    for block in model.blocks[:start]:
        h = block(h)
    ids = kept[:, :, None].expand(-1, -1, D)
    sub = h.gather(1, ids)
    for block in model.blocks[start:end]:
        sub = block(sub, keep=kept[0])
    h = h.scatter(1, ids, sub)
    for block in model.blocks[end:]:
        h = block(h)
    return model.out(h)


@pytest.mark.parametrize("name", list(CASES))
def test_routed_blocks_see_the_tables_of_the_kept_tokens(name):
    case = CASES[name]
    model = case.route(case.model())
    out = train_forward(model, case)
    (info,) = tread_fx.route_info(model)
    assert torch.equal(info.kept[0], info.kept[1]), "tables without a batch dim share it"
    (x,), _ = case.inputs()
    with torch.no_grad():
        expected = _by_hand(model, x, info.kept)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_flops_drop(name):
    case = CASES[name]
    model = case.model().train()
    args, _ = case.inputs()
    built = tread_fx.pipeline.build(
        model, args, {}, tread_fx.config.resolve_config(model, case.routes, 0.5)
    )
    from tread_fx.passes.trace.tracer import trace_call

    paths = [b.path for b in built.info.blocks]
    original = trace_call(model, args, {}, set(paths))
    noise = [torch.zeros(p.layout.batch_size, p.units) for p in built.plans]
    full = profile_graph(original.gm, list(args), paths).total.forward.flops
    routed = profile_graph(built.gm, [*args, *noise], paths).total.forward.flops
    assert routed < 0.85 * full


def test_explain_names_the_cut_tables():
    case = CASES["index-buffer"]
    exp = str(tread_fx.explain(case.model(), case.routes, 0.5, case.inputs(), flops=False))
    assert "in-block token table" in exp and "inlined" in exp


def test_share_selection_false_is_refused():
    case = CASES["rope"]
    model = case.route(case.model(), share_selection=False)
    with pytest.raises(tread_fx.errors.SideInputError, match="build token tables inside"):
        train_forward(model, case)


class BufferBiasBlock(_Block):
    """A fixed [H, N, N] bias buffer used as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pair_bias", torch.randn(HEADS, 16, 16))

    def forward(self, x, keep=None):
        bias = self.pair_bias if keep is None else self.pair_bias[:, keep][:, :, keep]
        return self.finish(x, _attend(*self.heads(x), bias))


class DataReadingBlock(BufferBiasBlock):
    """Reads its input's data in Python: it is not traced through, so it stays a call."""

    def forward(self, x, keep=None):
        bias = self.pair_bias if bool(x.abs().sum() > 0) else None
        return self.finish(x, _attend(*self.heads(x), bias))


def routed_equals_by_hand(case: Case) -> None:
    """The routed training output is the hand-written routed forward's (``_by_hand``)."""
    model = case.route(case.model())
    out = train_forward(model, case)
    (x,), _ = case.inputs()
    with torch.no_grad():
        expected = _by_hand(model, x, tread_fx.route_info(model)[0].kept)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


def test_a_buffer_used_as_it_is_is_cut():
    routed_equals_by_hand(Case("raw", lambda: Backbone(BufferBiasBlock, 16), _inputs(16), [(1, 4)]))


def test_a_block_that_cannot_be_traced_through_is_refused():
    case = Case("data", lambda: Backbone(DataReadingBlock, 16), _inputs(16), [(1, 4)])
    model = case.route(case.model())
    with pytest.raises(tread_fx.errors.SideInputError, match="pair_bias of shape"):
        train_forward(model, case)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(CASES))
def test_invariants(check, name):
    check(CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_compiled(name):
    check_compiled(CASES[name])


def test_hand_routed_forward_matches_at_rate_zero():
    """Sanity of the reference: with every token kept it is the plain forward."""
    case = CASES["index-buffer"]
    model = case.model()
    (x,), _ = case.inputs()
    kept = torch.arange(17).expand(B, 17)
    with torch.no_grad():
        torch.testing.assert_close(_by_hand(model, x, kept), model(x), rtol=1e-5, atol=1e-5)
