"""Blocks that hand on two token-aligned tensors: ``hidden, residual = block(hidden,
residual)`` in the ``mamba_ssm`` style (Vim, DiM, ZigMa), the residual ``None`` into the first
block and laid out like the stream afterwards. A route gathers every hand-off slot laid out
like the stream with the stream's selection and scatters it back at its end (into zeros
where the start block was handed nothing, if the block computes the same with zeros there);
a slot computed from the stream but laid out otherwise is refused
(``tread_fx/passes/plan/handoff.py``, ``layout.family_slots``)."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import INVARIANTS, Case, gather_rows, scatter_rows
from torch import nn

import tread_fx
from tread_fx.errors import TokenStreamError

B, N, D = 2, 16, 32


class BiScan(nn.Module):
    """A Vim-style bidirectional mixer: a gated linear recurrence (a running gated mean,
    ``cumsum``) over the tokens, forward and on the flipped sequence, gated by ``z``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, 2 * D)
        self.gate = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def scan(self, u: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(u))
        return torch.cumsum(g * u, dim=1) / torch.cumsum(g, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.inp(x).chunk(2, dim=-1)
        y = self.scan(u) + self.scan(u.flip(1)).flip(1)
        return self.out(y * nn.functional.silu(z))


class PairBlock(nn.Module):
    """``mamba_ssm``'s ``Block``: add, norm, mix; hands on ``(hidden_states, residual)``."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.skip_linear = nn.Linear(2 * D, D) if skip else None
        self.norm = nn.LayerNorm(D)
        self.mixer = BiScan()

    def forward(self, hidden_states, residual=None, skip=None):
        residual = hidden_states if residual is None else residual + hidden_states
        if self.skip_linear is not None:  # U-ViT's long skip: concatenated and projected
            residual = self.skip_linear(torch.cat([residual, skip], dim=-1))
        hidden_states = self.mixer(self.norm(residual))
        return hidden_states, residual


class Vim(nn.Module):
    """Patch embedding, a position table, ``depth`` pair blocks, ``norm_f(hidden + residual)``."""

    def __init__(self, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.pos = nn.Parameter(torch.randn(1, N, D) * 0.1)
        self.layers = nn.ModuleList(PairBlock() for _ in range(depth))
        self.norm_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed(x) + self.pos, None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return self.head(self.norm_f(hidden + residual))


class PairUViT(nn.Module):
    """U-ViT's layout with pair blocks: ``in_blocks`` keep their hidden states, an optional
    ``mid_block``, ``out_blocks`` each taking one (``cat`` + linear)."""

    def __init__(self, half: int = 3, mid: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.in_blocks = nn.ModuleList(PairBlock() for _ in range(half))
        self.mid_block = PairBlock() if mid else None
        self.out_blocks = nn.ModuleList(PairBlock(skip=True) for _ in range(half))
        self.norm_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual, skips = self.embed(x), None, []
        for block in self.in_blocks:
            hidden, residual = block(hidden, residual)
            skips.append(hidden)
        if self.mid_block is not None:
            hidden, residual = self.mid_block(hidden, residual)
        for block in self.out_blocks:
            hidden, residual = block(hidden, residual, skips.pop())
        return self.head(self.norm_f(hidden + residual))


def _inputs():
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(7)),), {}


VIM_ROUTES = {"default": [(1, -1)], "from-block-0": [(0, 4)], "from-block-2": [(2, 6)]}
VIM_ROUTES |= {"block-0-to-the-end": [(0, 6)], "two-routes": [(0, 3), (3, 5)]}
UVIT_ROUTES = {"uvit-default": [(1, -1)], "uvit-skips-cross-the-end": [(1, 4)]}
UVIT_ROUTES |= {"uvit-skips-from-before": [(2, 6)], "uvit-from-block-0": [(0, 6)]}
CASES = [Case(name, Vim, _inputs, routes=r) for name, r in VIM_ROUTES.items()]
CASES += [Case(name, PairUViT, _inputs, routes=r) for name, r in UVIT_ROUTES.items()]


def _resolved(routes: list, depth: int) -> list[tuple[int, int]]:
    return [(s, e % depth if e < 0 else e) for s, e in routes]


def _enter(pair: tuple, ids: torch.Tensor) -> tuple:
    """Both hand-off slots at the kept tokens (a residual not made yet stays ``None``)."""
    return tuple(None if v is None else gather_rows(v, ids) for v in pair)


def _leave(at_start: tuple, pair: tuple, ids: torch.Tensor) -> tuple:
    """Both slots written back into their values at the start (zeros for none there)."""
    full = at_start[0].shape[1]
    bases = [v.new_zeros(B, full, D) if s is None else s for s, v in zip(at_start, pair)]
    return tuple(scatter_rows(s, ids, v) for s, v in zip(bases, pair))


def _blocks(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, Vim):
        return list(model.layers)
    return list(model.in_blocks) + list(model.out_blocks)


def _by_hand(model: nn.Module, x: torch.Tensor, routes: list, kept: list) -> torch.Tensor:
    """TREAD by hand over the pair: gathered at each route's start, written back at its end;
    the mid block (between the lists) and the skips follow the kept tokens inside a route."""
    blocks, pair, at, skips = _blocks(model), (model.embed(x), None), {}, []
    if isinstance(model, Vim):
        pair = (pair[0] + model.pos, None)
    ends = {e: i for i, (_, e) in enumerate(routes)}
    starts = {s: i for i, (s, _) in enumerate(routes)}

    def bound(i: int, pair: tuple) -> tuple:
        if i in ends:
            pair = _leave(at[ends[i]], pair, kept[ends[i]])
        if i in starts:
            at[starts[i]], pair = pair, _enter(pair, kept[starts[i]])
        return pair

    for i, block in enumerate(blocks):
        pair = bound(i, pair)
        if i >= len(blocks) // 2 and not isinstance(model, Vim):
            skip, inside = skips.pop()
            route = next((r for r, (s, e) in enumerate(routes) if s <= i < e), None)
            if route is not None and not inside:
                skip = gather_rows(skip, kept[route])
            elif inside and route is None:
                skip = scatter_rows(at[inside - 1][0], kept[inside - 1], skip)
            pair = block(*pair, skip)
        else:
            pair = block(*pair)
        if not isinstance(model, Vim) and i < len(blocks) // 2:
            route = next((r + 1 for r, (s, e) in enumerate(routes) if s <= i < e), 0)
            skips.append((pair[0], route))
        if not isinstance(model, Vim) and i == len(blocks) // 2 - 1 and model.mid_block:
            pair = model.mid_block(*pair)
    pair = bound(len(blocks), pair)
    return model.head(model.norm_f(pair[0] + pair[1]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_output_is_tread_by_hand_over_both_slots(case):
    model = case.model()
    tread_fx.route(model, routes=case.routes, rate=0.5, seed=0)
    (x,), _ = _inputs()
    routed = model.train()(x)
    kept = [info.kept for info in tread_fx.route_info(model)]
    with torch.no_grad():
        expected = _by_hand(model, x, _resolved(case.routes, len(_blocks(model))), kept)
    torch.testing.assert_close(routed.detach(), expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_routed_block_sees_the_kept_tokens_in_both_slots(case):
    exp = tread_fx.explain(case.model(), case.routes, 0.5, _inputs(), flops=False)
    routes = _resolved(case.routes, len(exp.blocks))
    inside = lambda i: any(s <= i < e for s, e in routes)  # noqa: E731
    assert [b.tokens_routed for b in exp.blocks] == [
        N - N // 2 if inside(i) else N for i in range(len(exp.blocks))
    ]


def test_a_mid_block_between_the_lists_is_inside_a_route_over_both_lists():
    """A mid block outside the lists is traced through as code, so the out blocks are handed
    ``mixer(norm(r + h))`` and ``r + h``, both computed from both in-block slots; blocks of
    one class read one argument alike, so argument ``i`` continues argument ``i`` and the
    route spans both lists (``tests/test_vim_uvit_layout.py`` has the full layout)."""
    model = Case("mid", lambda: PairUViT(mid=True), _inputs).model()
    tread_fx.route(model, routes=[(1, -1)], rate=0.5, seed=0)
    (x,), _ = _inputs()
    routed = model.train()(x)
    kept = [info.kept for info in tread_fx.route_info(model)]
    with torch.no_grad():
        expected = _by_hand(model, x, [(1, 5)], kept)
    torch.testing.assert_close(routed.detach(), expected)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES[:1] + CASES[2:3] + CASES[5:6], ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def test_blend_scales_the_second_slot_and_adds_the_embedded_input_to_the_stream_only():
    """Blend re-entry: the stream's routed-around tokens are ``w0 * start + w1 * embedded``;
    the residual's ``w0 * start`` (blocks that sum the pair see the embedded input once)."""
    model = Case("blend", Vim, _inputs).model()
    reinsert = tread_fx.Reinsert("blend", 0.5, 0.5)
    tread_fx.route(model, routes=[(1, 5)], rate=0.5, seed=0, reinsert=reinsert)
    (x,), _ = _inputs()
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        embedded = model.embed(x) + model.pos
        hidden, residual = model.layers[0](embedded, None)
        pair = _enter((hidden, residual), ids)
        for layer in model.layers[1:5]:
            pair = layer(*pair)
        hidden = scatter_rows(0.5 * hidden + 0.5 * embedded, ids, pair[0])
        residual = scatter_rows(0.5 * residual, ids, pair[1])
        hidden, residual = model.layers[5](hidden, residual)
        expected = model.head(model.norm_f(hidden + residual))
    torch.testing.assert_close(routed.detach(), expected)


class DoublingBlock(PairBlock):
    """Treats a missing residual otherwise than a zero one: ``2 * hidden``."""

    def forward(self, hidden_states, residual=None, skip=None):
        residual = 2 * hidden_states if residual is None else residual + hidden_states
        return self.mixer(self.norm(residual)), residual


class ChannelsFirstBlock(PairBlock):
    """Hands its residual on channels-first, ``[B, D, N]``: tokens on dim 2."""

    def forward(self, hidden_states, residual=None, skip=None):
        step = hidden_states.transpose(1, 2)
        residual = step if residual is None else residual + step
        return self.mixer(self.norm(residual.transpose(1, 2))), residual


class ScoreBlock(nn.Module):
    """RealFormer-style: hands on its attention scores ``[B, N, N]`` (``None`` into the
    first block), added to the next block's scores."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x, scores=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = q @ k.transpose(1, 2) / D**0.5
        s = s if scores is None else s + scores
        return x + s.softmax(-1) @ v, s


def _variant(block: type[nn.Module]) -> nn.Module:
    model = Vim()
    model.layers = nn.ModuleList(block() for _ in range(6))
    return model


class ChannelsFirstStack(Vim):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ChannelsFirstBlock() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed(x) + self.pos, None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return self.head(self.norm_f(hidden + residual.transpose(1, 2)))


class ScoreStack(Vim):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ScoreBlock() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, scores = self.embed(x) + self.pos, None
        for layer in self.layers:
            hidden, scores = layer(hidden, scores)
        return self.head(self.norm_f(hidden))


def test_a_block_that_reads_none_otherwise_than_zeros_refuses_a_route_from_it():
    model = _variant(DoublingBlock)
    (x,), _ = _inputs()
    tread_fx.route(model, routes=[(0, 4)], rate=0.5, seed=0)
    with pytest.raises(TokenStreamError, match="zeros would stand for it only if"):
        model.train()(x)
    tread_fx.route(model, routes=[(1, 4)], rate=0.5, seed=0, reroute=True)
    assert model.train()(x).shape == (B, N, 3)  # from block 1 on both slots are tensors


@pytest.mark.parametrize("make", [ChannelsFirstStack, ScoreStack], ids=["channels-first", "scores"])
@pytest.mark.parametrize("routes", [[(1, -1)], [(0, 4)]], ids=["from-1", "from-0"])
def test_a_second_slot_laid_out_otherwise_is_refused(make, routes):
    model = make()
    tread_fx.route(model, routes=routes, rate=0.5, seed=0)
    with pytest.raises(TokenStreamError, match="not laid out like the stream"):
        model.train()(*_inputs()[0])
