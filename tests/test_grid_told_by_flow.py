"""The patch grid's height and width handed to each block as ints, found by data flow.

Each block runs a depthwise convolution on its tokens reshaped to the grid
(``h.transpose(1, 2).reshape(b, -1, gh, gw)``, a conditional position encoding) after a linear
layer that widens the features. Two things used to defeat tread_fx here:

- the ints reach the block in another order than (height, width), or apart (``partial(blk,
  w=gw, cond=c, h=gh)``): the height argument was looked for as a run of ints spelling the grid,
  so it was not told the kept row count (the routed graph then failed on its first call);
- the stream's width equals its token count ([B, 16, 16]): a split of 16 values could be the
  features', so no grid was taken (a warning), although data flow shows the reshaped dim is
  the tokens' (the stream's dim 1, through a linear layer and a transpose).

- a block reshaping its tokens by a literal grid width with the rows read from the tokens
  (``u.reshape(b, -1, gw, c)``, a column scan) on such a stream: the input has two dims of 16,
  so the split was not read at all and random tokens were routed (silently another result).

All route by default (whole rows) and equal a hand-written routed forward told the kept grid.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from third_party_checks import INVARIANTS, Case, gather_rows, scatter_rows, train_forward
from torch import nn

import tread_fx
from tread_fx.adapters.values import TensorMeta
from tread_fx.passes.plan.dim_flow import follow_dim

B, GH, GW = 2, 4, 4


class ConvPositionBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.conv = nn.Conv2d(2 * width, 2 * width, 3, padding=1, groups=2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, w: int, cond: torch.Tensor, h: int) -> torch.Tensor:
        b = x.shape[0]
        u = F.gelu(self.up(self.norm(x) + cond[:, None]))
        grid = u.transpose(1, 2).reshape(b, -1, h, w)
        u = u + self.conv(grid).flatten(2).transpose(1, 2)
        return x + self.down(u)


class GridModel(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, by_partial: bool = False) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, width, 2, stride=2)
        self.cond = nn.Linear(1, width)
        self.blocks = nn.ModuleList(ConvPositionBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 12)
        self.by_partial = by_partial

    def call(self, block: nn.Module, x, c, gh: int, gw: int) -> torch.Tensor:
        if self.by_partial:
            return functools.partial(block, w=gw, cond=c, h=gh)(x)
        return block(x, gw, c, gh)

    def forward(self, image: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = self.embed(image).flatten(2).transpose(1, 2)
        gh, gw = image.shape[-2] // 2, image.shape[-1] // 2
        c = self.cond(t[:, None])
        for block in self.blocks:
            x = self.call(block, x, c, gh, gw)
        return self.head(x)


class ColumnScanBlock(nn.Module):
    """Scans its tokens column by column: a literal grid width, the rows read from the tokens
    (``-1``); the stream is as wide as it is long, so only data flow tells which dim of the
    reshaped value is the tokens' (with random tokens the scan ran silently on no grid)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, w: int, cond: torch.Tensor, h: int) -> torch.Tensor:
        b, _, c = x.shape
        u = self.lin(x + cond[:, None])
        cols = u.reshape(b, -1, GW, c).transpose(1, 2).reshape(b, -1, c)
        scanned = cols.cumsum(dim=1) * 0.1
        back = scanned.reshape(b, GW, -1, c).transpose(1, 2).reshape(b, -1, c)
        return x + self.out(back)


class ColumnScanModel(GridModel):
    def __init__(self) -> None:
        super().__init__(width=GH * GW)
        self.blocks = nn.ModuleList(ColumnScanBlock(GH * GW) for _ in range(4))


def _inputs() -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(B, 3, 2 * GH, 2 * GW, generator=gen), torch.rand(B, generator=gen)), {}


CASES = [
    Case("height-after-width", GridModel, _inputs, routes=[(1, 3)]),
    Case("by-partial", lambda: GridModel(by_partial=True), _inputs, routes=[(1, 3)]),
    Case("width-equals-tokens", lambda: GridModel(width=GH * GW), _inputs, routes=[(1, 3)]),
    Case("column-scan-literal-width", ColumnScanModel, _inputs, routes=[(1, 3)]),
]


def _by_hand(model: GridModel, image, t, ids: torch.Tensor) -> torch.Tensor:
    x = model.embed(image).flatten(2).transpose(1, 2)
    c = model.cond(t[:, None])
    x = model.blocks[0](x, GW, c, GH)
    kept = gather_rows(x, ids)
    for block in model.blocks[1:3]:
        kept = block(kept, GW, c, ids.shape[1] // GW)
    x = scatter_rows(x, ids, kept)
    return model.head(model.blocks[3](x, GW, c, GH))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routes_by_default_equal_to_the_hand_written_forward(case, recwarn):
    model = case.route(case.model())
    out = train_forward(model, case)
    (info,) = tread_fx.route_info(model)
    assert info.selection == "rows" and info.grid == (GH, GW)
    assert not [w for w in recwarn if "cannot tell" in str(w.message)]
    with torch.no_grad():
        expected = _by_hand(model, *_inputs()[0], info.kept)
    torch.testing.assert_close(out.detach(), expected)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def _graph(shape: tuple, *steps: tuple) -> list:
    """``x`` of ``shape`` and the nodes of ``(method, args, result shape)`` steps from it."""
    g = fx.Graph()
    nodes = [g.placeholder("x")]
    nodes[0].meta["tread_meta"] = TensorMeta(shape, torch.float32, torch.device("cpu"))
    for method, args, result in steps:
        nodes.append(g.call_method(method, (nodes[-1], *args)))
        nodes[-1].meta["tread_meta"] = TensorMeta(result, torch.float32, torch.device("cpu"))
    return nodes


def test_the_token_dim_follows_transposes_permutes_and_reshapes():
    x, t, p, r = _graph(
        (2, 16, 16),
        ("transpose", (1, 2), (2, 16, 16)),
        ("permute", (0, 2, 1), (2, 16, 16)),
        ("reshape", (2, 4, 4, 16), (2, 4, 4, 16)),
    )
    flow = follow_dim(x, 1)
    assert (flow[t], flow[p], flow[r]) == (2, 1, -1)  # split away by the reshape: lost


def test_the_token_dim_follows_a_concatenation_along_another_dim():
    g = fx.Graph()
    x = g.placeholder("x")
    cat_features = g.call_function(torch.cat, ([x, x], -1))
    cat_tokens = g.call_function(torch.cat, ([x, x], 1))
    shapes = {x: (2, 16, 16), cat_features: (2, 16, 32), cat_tokens: (2, 32, 16)}
    for node, shape in shapes.items():
        node.meta["tread_meta"] = TensorMeta(shape, torch.float32, torch.device("cpu"))
    flow = follow_dim(x, 1)
    assert (flow[cat_features], flow[cat_tokens]) == (1, -1)  # along the tokens: lost


def test_an_op_it_does_not_know_loses_the_dim():
    x, kept, unknown = _graph(
        (2, 16, 16), ("contiguous", (), (2, 16, 16)), ("cummax_like", (), (2, 16, 16))
    )
    flow = follow_dim(x, 1)
    assert (flow[kept], flow[unknown]) == (1, -1)


class ColumnMajorScanBlock(nn.Module):
    """Scans column by column on a square grid, the way back reshaping the column-major
    tokens by the literal width first: ``y.reshape(b, GW, -1, c)``. On a stream wider than
    long that reshape is a grid use whose factor order data flow cannot see (the transpose
    merged the dims): its literal 4 stands where the rows would be, and the grid's width is
    4 too. It was inlined with the kept rows in place of the width: silently another result
    (generator seeds 376, 429)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, w: int, cond: torch.Tensor, h: int) -> torch.Tensor:
        b, _, c = x.shape
        u = self.lin(x + cond[:, None])
        cols = u.reshape(b, -1, GW, c).transpose(1, 2).reshape(b, -1, c)
        back = (cols.cumsum(dim=1) * 0.1).reshape(b, GW, -1, c).transpose(1, 2)
        return x + self.out(back.reshape(b, -1, c))


class ColumnMajorModel(GridModel):
    def __init__(self) -> None:
        super().__init__(width=24)
        self.blocks = nn.ModuleList(ColumnMajorScanBlock(24) for _ in range(4))


def test_a_literal_whose_place_in_the_grid_cannot_be_told_is_refused():
    case = Case("column-major", ColumnMajorModel, _inputs, routes=[(1, 3)])
    model = case.route(case.model())
    with pytest.raises(tread_fx.SelectionError, match=r"(?s)rows or the columns|the rows \(told"):
        train_forward(model, case)
