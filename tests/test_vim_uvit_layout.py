"""A Vim-style bidirectional Mamba in U-ViT's skip layout (issue 44): pair blocks handing on
``(hidden_states, residual)`` (the residual ``None`` into the first), ``in_blocks``, one
``mid_block`` of the same class between the lists (a block of the stack: a one-member run
``{mid_block}``, so the stack has ``2 * HALF + 1`` blocks), ``out_blocks``
each taking a long skip popped from a stack (concatenated on the channels and projected), a
time token in front of the patch tokens.

The mid block computes both slots the out blocks are handed from both in-block slots, so the
data flow cannot say which continues which; blocks of one class read one argument the same
way, so the out blocks' argument ``i`` continues the in blocks' argument ``i``
(``stream.same_block_class``, ``handoff._slot_in_list``). Without that the route stayed on
the in blocks (a ``ThinRouteWarning``) and a route ending in the out blocks was refused.
"""

from __future__ import annotations

import pytest
import torch
from test_pair_handing_blocks import BiScan  # the Vim-style bidirectional mixer
from third_party_checks import INVARIANTS, Case, gather_rows, scatter_rows
from torch import nn

import tread_fx

B, N, D, HALF = 2, 16, 32, 3


class VimBlock(nn.Module):
    """``mamba_ssm``'s add-norm-mix block; an out block first joins its long skip
    (``skip_linear(cat([hidden, skip]))``, U-ViT's)."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.skip_linear = nn.Linear(2 * D, D) if skip else None
        self.norm = nn.LayerNorm(D)
        self.mixer = BiScan()

    def forward(self, hidden_states, residual=None, skip=None):
        if self.skip_linear is not None:
            hidden_states = self.skip_linear(torch.cat([hidden_states, skip], dim=-1))
        residual = hidden_states if residual is None else residual + hidden_states
        return self.mixer(self.norm(residual)), residual


class VimUViT(nn.Module):
    """Time token + patch tokens, ``in_blocks``, ``mid_block``, ``out_blocks`` (long skips
    from a stack), ``norm_f(hidden + residual)``, a head on the patch tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(3, D)
        self.time = nn.Linear(1, D)
        self.pos = nn.Parameter(torch.randn(1, N + 1, D) * 0.1)
        self.in_blocks = nn.ModuleList(VimBlock() for _ in range(HALF))
        self.mid_block = VimBlock()
        self.out_blocks = nn.ModuleList(VimBlock(skip=True) for _ in range(HALF))
        self.norm_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        hidden = torch.cat([self.time(t[:, None, None]), self.patch(x)], dim=1) + self.pos
        residual, skips = None, []
        for block in self.in_blocks:
            hidden, residual = block(hidden, residual)
            skips.append(hidden)
        hidden, residual = self.mid_block(hidden, residual)
        for block in self.out_blocks:
            hidden, residual = block(hidden, residual, skips.pop())
        return self.head(self.norm_f(hidden + residual)[:, 1:])


def _inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(B, N, 3, generator=g), torch.rand(B, generator=g)), {}


ROUTES = {
    "default": [(1, -1)],
    "spans-the-mid-block": [(2, 5)],
    "ends-before-the-mid-block": [(1, 3)],
    "ends-at-the-mid-block": [(1, 4)],
    "ends-inside-out-blocks": [(1, 5)],
    "starts-in-out-blocks": [(5, 7)],
    "starts-at-the-mid-block": [(3, 5)],
    "from-block-0": [(0, 7)],
    "two-routes": [(1, 3), (4, 6)],
}
DEPTH = 2 * HALF + 1
CASES = [Case(name, VimUViT, _inputs, routes=r) for name, r in ROUTES.items()]


def _resolved(routes: list) -> list[tuple[int, int]]:
    return [(s, e % DEPTH if e < 0 else e) for s, e in routes]


def _enter(pair: tuple, ids: torch.Tensor) -> tuple:
    return tuple(None if v is None else gather_rows(v, ids) for v in pair)


def _leave(at_start: tuple, pair: tuple, ids: torch.Tensor) -> tuple:
    """Both slots written back into their values at the start (zeros where none was)."""
    bases = [torch.zeros_like(at_start[0]) if s is None else s for s in at_start]
    return tuple(scatter_rows(s, ids, v) for s, v in zip(bases, pair))


def _skip(skip: torch.Tensor, made: int | None, used: int | None, at: dict, kept: list):
    """A long skip made inside route ``made`` (or none) and used inside route ``used``: back
    into the stream at ``made``'s start (its routed-around tokens skipped those blocks), then
    the kept tokens of ``used``."""
    if made == used:
        return skip
    if made is not None:
        skip = scatter_rows(at[made][0], kept[made], skip)
    return skip if used is None else gather_rows(skip, kept[used])


def _by_hand(model: VimUViT, x, t, routes: list, kept: list) -> torch.Tensor:
    """TREAD by hand over the pair: gathered at a route's start, written back at its end; the
    mid block is block ``HALF``."""
    blocks = [*model.in_blocks, model.mid_block, *model.out_blocks]
    hidden = torch.cat([model.time(t[:, None, None]), model.patch(x)], dim=1) + model.pos
    pair, at, skips = (hidden, None), {}, []
    inside = lambda i: next((r for r, (s, e) in enumerate(routes) if s <= i < e), None)  # noqa: E731
    for i, block in enumerate([*blocks, None]):
        for r, (s, e) in enumerate(routes):
            if e == i:
                pair = _leave(at[r], pair, kept[r])
            if s == i:
                at[r], pair = pair, _enter(pair, kept[r])
        if block is None:
            break
        if i < HALF:
            pair = block(*pair)
            skips.append((pair[0], inside(i)))
        elif i == HALF:
            pair = block(*pair)
        else:
            pair = block(*pair, _skip(*skips.pop(), inside(i), at, kept))
    return model.head(model.norm_f(pair[0] + pair[1])[:, 1:])


def _routed(case: Case) -> tuple[VimUViT, torch.Tensor, list]:
    model = case.model()
    tread_fx.route(model, routes=case.routes, rate=0.5, seed=0)
    (x, t), _ = _inputs()
    out = model.train()(x, t)
    return model, out, [info.kept for info in tread_fx.route_info(model)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_route_spans_both_lists_and_the_mid_block(case):
    exp = tread_fx.explain(case.model(), case.routes, 0.5, _inputs(), flops=False)
    assert [s["path"] for s in exp.stacks] == ["in_blocks", "{mid_block}", "out_blocks"]
    routes = _resolved(case.routes)
    kept = 1 + N - N // 2  # the time token is a prefix
    assert [b.tokens_routed for b in exp.blocks] == [
        kept if any(s <= i < e for s, e in routes) else N + 1 for i in range(DEPTH)
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_output_and_gradients_are_tread_by_hand(case):
    model, routed, kept = _routed(case)
    routed.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (x, t), _ = _inputs()
    expected = _by_hand(model, x, t, _resolved(case.routes), kept)
    torch.testing.assert_close(routed.detach(), expected.detach())
    expected.square().mean().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES[:1] + CASES[4:5], ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)
