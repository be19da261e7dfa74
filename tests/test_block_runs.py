"""Blocks outside one long list: a one-block list beside a longer list of its class, and
blocks held as numbered attributes (``self.b0``, ``self.b1`` ... called one after the other).

A one-block ``ModuleList`` before (or after) a list of the same block class, the stream
flowing through both, is part of the stack: routes count over the blocks in the order the
stream passes them (a one-block list used to be no candidate, the longer list alone was routed
at the chain's indices: silently wrong); so is a one-block stage in a list of stages.
Numbered attributes of one class that the stream passes in turn are a stack, ordered by data
flow, not by their names or their definition order (they were refused as "no ModuleList").
Blocks in an ``nn.ModuleDict`` are a stack as a list's are. Same-class modules side by side on
one input (q/k/v projections) are no stack.
``tread_fx/passes/locate/members.py``, ``stacks.py``.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import gather_rows, scatter_rows
from torch import nn

import tread_fx
from tread_fx.errors import BlockStackNotFoundError

B, N, D = 2, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.mlp = nn.Sequential(
            nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)
        )

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x) + c[:, None]).chunk(3, dim=-1)
        x = x + nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.mlp(x)


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.time = nn.Linear(1, D)
        self.head = nn.Linear(D, 3)


class Lists(Stem):
    """``before`` list, then ``after`` list, of one block class (``first`` blocks first)."""

    def __init__(self, first: int, second: int) -> None:
        super().__init__()
        self.before = nn.ModuleList(Block() for _ in range(first))
        self.after = nn.ModuleList(Block() for _ in range(second))

    def blocks(self) -> list[nn.Module]:
        return [*self.before, *self.after]

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x, c = self.embed(x), self.time(t[:, None])
        for blk in self.before:
            x = blk(x, c)
        for blk in self.after:
            x = blk(x, c)
        return self.head(x)


class Numbered(Stem):
    """``b0`` ... ``b4`` defined in another order than the forward calls them."""

    def __init__(self) -> None:
        super().__init__()
        for i in (3, 1, 4, 0, 2):
            setattr(self, f"b{i}", Block())

    def blocks(self) -> list[nn.Module]:
        return [getattr(self, f"b{i}") for i in range(5)]

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x, c = self.embed(x), self.time(t[:, None])
        x = self.b0(x, c)
        x = self.b1(x, c)
        x = self.b2(x, c)
        x = self.b3(x, c)
        x = self.b4(x, c)
        return self.head(x)


class Stages(Stem):
    """A list of equal-width stages, each a list of blocks; the middle stage holds one block
    (it was left out of the chain: the stages beside it were joined, silently misnumbered)."""

    def __init__(self, sizes: tuple[int, ...] = (3, 1, 2)) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(Block() for _ in range(n)) for n in sizes)

    def blocks(self) -> list[nn.Module]:
        return [blk for stage in self.stages for blk in stage]

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x, c = self.embed(x), self.time(t[:, None])
        for stage in self.stages:
            for blk in stage:
                x = blk(x, c)
        return self.head(x)


class Keyed(Stem):
    """Blocks in an ``nn.ModuleDict`` (keys that sort otherwise than they are called), walked
    by its values, its items or its keys (was refused: "no ModuleList/Sequential")."""

    def __init__(self, walk: str = "values") -> None:
        super().__init__()
        self.stack = nn.ModuleDict({k: Block() for k in ("q", "b", "z", "a", "m")})
        self.walk = walk

    def blocks(self) -> list[nn.Module]:
        return list(self.stack.values())

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x, c = self.embed(x), self.time(t[:, None])
        if self.walk == "values":
            for blk in self.stack.values():
                x = blk(x, c)
        elif self.walk == "items":
            for _, blk in self.stack.items():
                x = blk(x, c)
        else:
            for key in self.stack:
                x = self.stack[key](x, c)
        return self.head(x)


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(B, N, 3, generator=gen), torch.rand(B, generator=gen)


def _by_hand(model: Stem, x, t, route: tuple[int, int], ids: torch.Tensor) -> torch.Tensor:
    """TREAD by hand over the blocks in the order the stream passes them."""
    start, end = route
    x, c = model.embed(x), model.time(t[:, None])
    blocks = model.blocks()
    for i, blk in enumerate(blocks):
        if i == start:
            full, x = x, gather_rows(x, ids)
        if i == end:
            x = scatter_rows(full, ids, x)
        x = blk(x, c)
    if end == len(blocks):
        x = scatter_rows(full, ids, x)
    return model.head(x)


CASES = {
    "one-then-four": (lambda: Lists(1, 4), [(0, 2), (1, 3), (3, 5)]),
    "four-then-one": (lambda: Lists(4, 1), [(2, 5), (3, 4), (4, 5)]),
    "numbered": (Numbered, [(0, 2), (1, 4), (3, 5)]),
    "stages-3-1-2": (Stages, [(2, 5), (3, 4), (1, 6)]),
    "module-dict-values": (Keyed, [(1, 4)]),
    "module-dict-items": (lambda: Keyed("items"), [(0, 3)]),
    "module-dict-keys": (lambda: Keyed("keys"), [(2, 5)]),
}
PARAMS = [(name, route) for name, (_, routes) in CASES.items() for route in routes]


@pytest.mark.parametrize(("name", "route"), PARAMS, ids=lambda v: str(v))
def test_routed_output_is_tread_by_hand(name, route):
    torch.manual_seed(0)
    model = CASES[name][0]()
    x, t = _inputs()
    with torch.no_grad():
        reference = model(x, t)
    tread_fx.route(model, routes=[route], rate=0.5, seed=0)
    routed = model.train()(x, t)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        expected = _by_hand(model, x, t, route, ids)
        torch.testing.assert_close(model.eval()(x, t), reference, rtol=0, atol=0)
    torch.testing.assert_close(routed.detach(), expected)
    routed.sum().backward()
    assert all(p.grad is not None for p in model.blocks()[route[0]].parameters())


def test_the_whole_chain_is_the_stack():
    x, t = _inputs()
    exp = tread_fx.explain(Lists(1, 4), [(0, 5)], 0.5, ((x, t), {}), flops=False)
    assert [(s["path"], s["count"]) for s in exp.stacks] == [("before", 1), ("after", 4)]
    exp = tread_fx.explain(Numbered(), [(0, 5)], 0.5, ((x, t), {}), flops=False)
    assert [s["count"] for s in exp.stacks] == [5]
    assert [b.path for b in exp.blocks] == [f"b{i}" for i in range(5)]


def test_a_run_can_be_named():
    model = Numbered()
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, blocks="{b3,b1,b4,b0,b2}")
    x, t = _inputs()
    assert model.train()(x, t).shape == (B, N, 3)


class Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x))


class SideBySide(Stem):
    """q/k/v projections of one class side by side on one input (then mixed): no stack."""

    def __init__(self, blocks: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = Proj(), Proj(), Proj()
        self.b0, self.b1, self.b2 = (Block(), Block(), Block()) if blocks else (None,) * 3

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x, c = self.embed(x), self.time(t[:, None])
        x = x + nn.functional.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))
        if self.b0 is not None:
            x = self.b2(self.b1(self.b0(x, c), c), c)
        return self.head(x)


def test_projections_side_by_side_are_no_stack():
    x, t = _inputs()
    with pytest.raises(BlockStackNotFoundError):
        tread_fx.explain(SideBySide(False), [(0, 1)], 0.5, ((x, t), {}), flops=False)
    exp = tread_fx.explain(SideBySide(True), [(0, 3)], 0.5, ((x, t), {}), flops=False)
    assert [b.path for b in exp.blocks] == ["b0", "b1", "b2"]


class Attend(nn.Module):
    """Attention of ``x`` over ``context`` (itself when none), with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q, self.kv = nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, 2 * D)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        k, v = self.kv(h if context is None else context).chunk(2, dim=-1)
        return x + nn.functional.scaled_dot_product_attention(self.q(h), k, v)


class Stage(nn.Module):
    """``for attn, ff in self.layers``: a list of [attention, feed-forward] pairs."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        ff = lambda: nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D))  # noqa: E731
        self.layers = nn.ModuleList(nn.ModuleList([Attend(), ff()]) for _ in range(depth))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        for attn, ff in self.layers:
            x = attn(x, context)
            x = x + ff(x)
        return x


class ClassAttention(Stem):
    """Patch layers, then class-attention layers over them (CaiT's layout): two same-class
    stages, the second taking the first's output only as its context."""

    def __init__(self, stages: bool) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.patches = Stage(4) if stages else Attend()
        self.classes = Stage(2) if stages else Attend()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) + self.time(t[:, None])[:, None]
        x = self.patches(x)
        return self.head(self.classes(self.cls.expand(x.shape[0], -1, -1), context=x))


def test_stages_holding_block_lists_are_no_run_their_lists_are_the_stack():
    """Before: {patches,classes} was a run of two blocks, its members traced as leaves hid the
    layers, and route (1, -1) was refused as covering no block."""
    x, t = _inputs()
    exp = tread_fx.explain(ClassAttention(True), [(1, -1)], 0.5, ((x, t), {}), flops=False)
    assert [(s["path"], s["count"]) for s in exp.stacks] == [("patches.layers", 4)]
    model = ClassAttention(True)
    tread_fx.route(model, routes=[(1, -1)], rate=0.5)
    assert model.train()(x, t).shape == (B, 1, 3)


def test_a_block_taking_the_one_before_as_context_is_no_run():
    """Same-class blocks whose second takes the first's output only as its context hand no
    stream on (before: a two-block run, routed into the context)."""
    x, t = _inputs()
    with pytest.raises(BlockStackNotFoundError):
        tread_fx.explain(ClassAttention(False), [(0, 2)], 0.5, ((x, t), {}), flops=False)
