"""Grid sizes handed to blocks are decided by how the blocks use them, under any name.

Each block is told the patch grid's height and width and reshapes its tokens to that grid
for a depthwise convolution (a Mix-FFN), so ``selection="rows"`` keeps whole rows and each
routed block is told the kept row count. Renaming the block's arguments (random identifiers,
or names the old rules read as something else) changes nothing: same routed output, kept
tokens and grid in the route info under the same seed.
"""

from __future__ import annotations

import torch
from hypothesis import given
from test_side_uses import _SETTINGS, _assert_same, _names, _parameters, renamed
from third_party_checks import Case
from torch import nn

import tread_fx

B, H, W, D = 2, 4, 4, 32


class GridBlock(nn.Module):
    """Token mixing by a depthwise conv over the grid the block is told."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.conv = nn.Conv2d(2 * D, 2 * D, 3, padding=1, groups=2 * D)

    def forward(self, x, height, width):
        h = self.up(self.norm(x))
        grid = h.transpose(1, 2).unflatten(-1, (height, width))
        h = self.conv(grid).flatten(2).transpose(1, 2)
        return x + self.down(torch.nn.functional.gelu(h))


class GridModel(nn.Module):
    block_class: type = GridBlock

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Conv2d(3, D, 2, stride=2), nn.Linear(D, 12)
        self.blocks = nn.ModuleList(self.block_class() for _ in range(4))

    def forward(self, image):
        x = self.embed(image)
        height, width = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, height, width)
        return self.head(x)


def _inputs():
    return (torch.randn(B, 3, 2 * H, 2 * W, generator=torch.Generator().manual_seed(1)),), {}


GRID = Case("grid", GridModel, _inputs, routes=[(1, 3)], route_kwargs={"selection": "rows"})


def test_rows_are_kept_and_the_blocks_told_the_kept_height():
    model = GRID.route(GRID.model()).train()
    model(*_inputs()[0])
    (info,) = tread_fx.route_info(model)
    assert info.grid == (H, W) and info.kept.shape[-1] == (H // 2) * W


@_SETTINGS
@given(names=_names(len(_parameters(GridBlock))))
def test_renaming_the_grid_arguments_changes_nothing(names):
    model = type("GridModel", (GridModel,), {"block_class": renamed(GridBlock, tuple(names))})
    _assert_same(GRID, Case("renamed", model, _inputs, GRID.routes, GRID.route_kwargs))
