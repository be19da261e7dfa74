"""``selection="auto"`` (the default): random tokens, or whole rows where blocks need the grid."""

from __future__ import annotations

import torch
from third_party_checks import (
    Case,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, H, W, D = 2, 4, 4, 32


class GridBlock(nn.Module):
    """Attention, then a depthwise conv over the patch grid it is told (a Mix-FFN)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.conv = nn.Conv2d(D, D, 3, padding=1, groups=D)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        grid = x.transpose(1, 2).reshape(x.shape[0], D, height, width)
        return x + self.conv(grid).flatten(2).transpose(1, 2)


class GridModel(nn.Module):
    grid_size = (H, W)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(GridBlock() for _ in range(4))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, H*W, 3]
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, H, W)
        return self.head(h)


def _inputs():
    return (torch.randn(B, H * W, 3, generator=torch.Generator().manual_seed(0)),), {}


CASE = Case("grid", GridModel, _inputs, routes=[(1, 3)])


def test_auto_keeps_rows_where_blocks_reshape_to_the_grid():
    model = CASE.route(CASE.model())
    model.train()(*_inputs()[0])
    (info,) = tread_fx.route_info(model)
    assert info.selection == "rows"
    rows = info.kept.view(B, -1, W)  # whole rows: W consecutive ids each
    assert (rows - rows[:, :, :1] == torch.arange(W)).all()
    exp = tread_fx.explain(CASE.model(), CASE.routes, 0.5, _inputs(), flops=False)
    assert exp.stream["selection"] == "rows"


def test_auto_is_random_where_blocks_do_not_need_the_grid(dit, inputs):
    tread_fx.route(dit, routes=[(1, 3)], seed=0)
    dit.train()(*inputs)
    assert tread_fx.route_info(dit)[0].selection == "random"


def test_an_explicit_random_selection_is_refused_with_the_reason():
    import pytest

    model = CASE.route(CASE.model(), selection="random")
    with pytest.raises(tread_fx.SelectionError, match="selection='rows'"):
        model.train()(*_inputs()[0])


def test_invariants_with_auto_rows():
    check_eval_is_bitwise_unrouted(CASE)
    check_rate_zero_equals_training(CASE)
    check_routed_shape_count_and_change(CASE)
    check_gradients(CASE)
