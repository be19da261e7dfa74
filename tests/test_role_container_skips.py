"""A long skip inside a per-layer role container: ``layers`` is a ModuleList of
``ModuleList([skip_proj | None, attn, ff])``; the forward keeps the early layers' inputs and
each later layer pops one, concatenates it beside the features and projects it back before
its attention (U-ViT written as role triples, as in vit-pytorch's SimpleUViT). The block
boundary is the first call into each member, here ``skip_proj`` on the concatenation, but
the stream the member before hands on is the value the concatenation starts from: a route
gathers skips made before it, keeps skips made inside it at the kept tokens and scatters
those that cross its end (``tread_fx/passes/locate/stream.py``, ``layout.py``)."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import INVARIANTS, Case, check_compiled, gather_rows, scatter_rows
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return self.out(nn.functional.scaled_dot_product_attention(q, k, v))


def _feed_forward() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


class SkipTriples(nn.Module):
    """``layers[i] = [skip_proj | None, attn, ff]``: the first half push their input, the
    second half pop one and take ``skip_proj(cat([skip, x], -1))``; ``registers`` learned
    tokens behind the patch tokens (never routed)."""

    def __init__(self, depth: int = 6, registers: int = 0) -> None:
        super().__init__()
        self.depth = depth
        self.embed = nn.Linear(3, D)
        self.registers = nn.Parameter(torch.randn(registers, D)) if registers else None
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [nn.Linear(2 * D, D) if i >= depth / 2 + 1 else None, Attention(), _feed_forward()]
            )
            for i in range(1, depth + 1)
        )
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if self.registers is not None:
            x = torch.cat([x, self.registers.expand(x.shape[0], -1, -1)], dim=1)
        skips = []
        for i, (skip_proj, attn, ff) in enumerate(self.layers):
            if i + 1 <= self.depth / 2:
                skips.append(x)
            if skip_proj is not None:
                x = skip_proj(torch.cat((skips.pop(), x), dim=-1))
            x = attn(x) + x
            x = ff(x) + x
        return self.head(x[:, :N])


def _inputs():
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(5)),), {}


CASES = [
    Case("whole", SkipTriples, _inputs, routes=[(1, -1)]),
    Case("skips-cross-the-end", SkipTriples, _inputs, routes=[(1, 4)]),
    Case("skips-from-before", SkipTriples, _inputs, routes=[(3, 5)]),
    Case("starts-at-a-skip", SkipTriples, _inputs, routes=[(4, 6)]),
    Case("to-the-end", lambda: SkipTriples(depth=5), _inputs, routes=[(2, 5)]),
    Case("registers", lambda: SkipTriples(registers=4), _inputs, routes=[(1, -1)]),
]


def _resolved(case: Case, depth: int) -> tuple[int, int]:
    start, end = case.routes[0]
    return start, end % depth if end < 0 else end


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_member_sees_the_kept_tokens(case):
    model = case.model()
    exp = tread_fx.explain(model, case.routes, 0.5, _inputs(), flops=False)
    depth = len(model.layers)
    assert exp.stacks[0]["path"] == "layers" and exp.stacks[0]["count"] == depth
    start, end = _resolved(case, depth)
    total = N + (model.registers.shape[0] if model.registers is not None else 0)
    kept = total - N // 2
    assert [b.tokens_routed for b in exp.blocks] == [
        kept if start <= i < end else total for i in range(depth)
    ]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def _by_hand(model: SkipTriples, x: torch.Tensor, route: tuple, ids: torch.Tensor):
    """TREAD by hand: the stream is gathered at the start and scattered into its value there
    at the end; a skip is used at the tokens its layer runs on (a skip made before the route
    gathered inside it, one made inside it scattered into the start value after it)."""
    start, end = route
    x = model.embed(x)
    if model.registers is not None:
        x = torch.cat([x, model.registers.expand(x.shape[0], -1, -1)], dim=1)
    skips, at_start = [], None
    for i, (skip_proj, attn, ff) in enumerate(model.layers):
        if i == start:
            at_start, x = x, gather_rows(x, ids)
        if i == end:
            x = scatter_rows(at_start, ids, x)
        inside = start <= i < end
        if i + 1 <= model.depth / 2:
            skips.append((x, inside))
        if skip_proj is not None:
            skip, kept = skips.pop()
            if inside and not kept:
                skip = gather_rows(skip, ids)
            elif kept and not inside:
                skip = scatter_rows(at_start, ids, skip)
            x = skip_proj(torch.cat((skip, x), dim=-1))
        x = attn(x) + x
        x = ff(x) + x
    if end == model.depth:
        x = scatter_rows(at_start, ids, x)
    return model.head(x[:, :N])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_output_is_tread_by_hand(case):
    model = case.model()
    tread_fx.route(model, routes=case.routes, rate=0.5, seed=0)
    (x,), _ = _inputs()
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        expected = _by_hand(model, x, _resolved(case, len(model.layers)), ids)
    torch.testing.assert_close(routed.detach(), expected)


@pytest.mark.slow
def test_compiles_without_recompiling():
    check_compiled(CASES[0])


CONSECUTIVE = Case("meet-at-a-skip", SkipTriples, _inputs, routes=[(1, 4), (4, 6)])


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
def test_consecutive_routes_meeting_at_a_member_with_code_before_its_call(check):
    """The second route starts at the scatter the first put before the member's own code
    (the located stream value is replaced by the rewrite of the first route)."""
    check(CONSECUTIVE)
