"""The patch grid found by use: Vision-RWKV-style token shifts by the grid, wherever its ints
come from.

Each block shifts a quarter of its channels by one pixel in each of 4 directions on the patch
grid (``x.transpose(1, 2).reshape(B, C, H, W)``, ``F.pad``, back to ``[B, N, C]``) before a
time-mix and a channel-mix of linear layers. The grid ``(H, W)`` reaches the reshape as an
attribute tuple of the model handed to every block (``patch_resolution``), as int attributes
of the block, or as a closure: no ``grid_size`` attribute anywhere. The ints that split the
token dim into rows x cols are the grid; the default ``selection="auto"`` keeps whole rows and
the routed blocks get the kept grid (an argument rewritten, or the block inlined with the kept
numbers). Routing equals a hand-written routed forward on the kept rows. Self-written models;
docs/design.md (``selection="auto"``), tests/test_video_grid_rows.py for grids told as ints.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import (
    Case,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    gather_rows,
    scatter_rows,
    train_forward,
)
from torch import nn

import tread_fx

B, H, W, D, DEPTH = 2, 4, 4, 32, 4


def q_shift(x: torch.Tensor, resolution: tuple[int, int]) -> torch.Tensor:
    """Vision-RWKV's token shift: channel quarters from the left, right, upper, lower pixel."""
    b, _, c = x.shape
    grid = x.transpose(1, 2).reshape(b, c, resolution[0], resolution[1])
    q = c // 4
    left = F.pad(grid[:, :q], (1, 0))[..., :-1]
    right = F.pad(grid[:, q : 2 * q], (0, 1))[..., 1:]
    up = F.pad(grid[:, 2 * q : 3 * q], (0, 0, 1, 0))[..., :-1, :]
    down = F.pad(grid[:, 3 * q :], (0, 0, 0, 1))[..., 1:, :]
    return torch.cat([left, right, up, down], dim=1).flatten(2).transpose(1, 2)


class TimeMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.rand(D))
        self.key, self.value, self.recept, self.out = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor, resolution: tuple[int, int]) -> torch.Tensor:
        xk = x * self.mix + q_shift(x, resolution) * (1 - self.mix)
        k, v, r = self.key(xk), self.value(xk), self.recept(xk)
        return self.out(torch.sigmoid(r) * torch.tanh(k) * v)


class ChannelMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.rand(D))
        self.key, self.value = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.recept = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, resolution: tuple[int, int]) -> torch.Tensor:
        xk = x * self.mix + q_shift(x, resolution) * (1 - self.mix)
        return torch.sigmoid(self.recept(xk)) * self.value(torch.relu(self.key(xk)) ** 2)


class Block(nn.Module):
    """Told the grid as an argument: ``blk(x, patch_resolution)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.att, self.ffn = TimeMix(), ChannelMix()

    def forward(self, x: torch.Tensor, patch_resolution: tuple[int, int]) -> torch.Tensor:
        x = x + self.att(self.ln1(x), patch_resolution)
        return x + self.ffn(self.ln2(x), patch_resolution)

    def run(self, x: torch.Tensor, resolution: tuple[int, int]) -> torch.Tensor:
        return Block.forward(self, x, resolution)


class IntAttributeBlock(Block):
    """Holds the grid as int attributes, read inside."""

    def __init__(self) -> None:
        super().__init__()
        self.height, self.width = H, W

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x, (self.height, self.width))


def closure_block() -> Block:
    """A block whose forward reads the grid from a closure."""
    height, width = H, W

    class ClosureBlock(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x, (height, width))

    return ClosureBlock()


class VisionRWKV(nn.Module):
    def __init__(self, make_block=Block) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, D, 2, stride=2)
        self.patch_resolution = (H, W)
        self.blocks = nn.ModuleList(make_block() for _ in range(DEPTH))
        self.head = nn.Linear(D, 12)
        self.told = make_block is Block

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[i](x, self.patch_resolution) if self.told else self.blocks[i](x)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.embed(image).flatten(2).transpose(1, 2)
        for i in range(DEPTH):
            x = self.layer(i, x)
        return self.head(x)


def _inputs() -> tuple[tuple, dict]:
    return (torch.randn(B, 3, 2 * H, 2 * W, generator=torch.Generator().manual_seed(2)),), {}


CASES = [
    Case("argument-tuple", VisionRWKV, _inputs, routes=[(1, -1)]),
    Case("int-attributes", lambda: VisionRWKV(IntAttributeBlock), _inputs, routes=[(1, -1)]),
    Case("closure", lambda: VisionRWKV(closure_block), _inputs, routes=[(1, -1)]),
]
OPTIONS = [{}, {"grid": (H, W), "strict": False}, {"selection": "rows"}]


def _by_hand(model: VisionRWKV, image: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Route (1, -1) written out: the kept rows through blocks 1 .. depth - 2, told the kept
    grid, written back before the last block."""
    x = model.embed(image).flatten(2).transpose(1, 2)
    x = model.blocks[0].run(x, (H, W))
    kept = gather_rows(x, ids)
    for block in model.blocks[1:-1]:
        kept = block.run(kept, (ids.shape[1] // W, W))
    return model.head(model.blocks[-1].run(scatter_rows(x, ids, kept), (H, W)))


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_by_default_equals_the_hand_written_routed_forward(case, options):
    model = tread_fx.route(case.model(), [(1, -1)], 0.5, seed=0, **options)
    out = train_forward(model, case)
    (info,) = tread_fx.route_info(model)
    assert info.selection == "rows" and info.grid == (H, W)
    rows = info.kept.view(B, H // 2, W)
    assert (rows - rows[..., :1] == torch.arange(W)).all()  # whole rows
    with torch.no_grad():
        expected = _by_hand(model, _inputs()[0][0], info.kept)
    torch.testing.assert_close(out.detach(), expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case):
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    check_gradients(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_an_explicit_random_selection_is_refused(case):
    model = case.route(case.model(), selection="random")
    with pytest.raises(tread_fx.SelectionError, match="selection='rows'"):
        train_forward(model, case)


class TwoGridsBlock(Block):
    """Reshapes its 16 tokens to 4 x 4 for the shift and to 2 x 8 elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x, (H, W))
        b, n, c = x.shape
        return x + x.transpose(1, 2).reshape(b, c, 2, 8).flip(-1).flatten(2).transpose(1, 2)


def test_grids_that_no_one_grid_refines_are_refused_naming_grid():
    case = Case("two-grids", lambda: VisionRWKV(TwoGridsBlock), _inputs, routes=[(1, -1)])
    model = case.route(case.model())
    with pytest.raises(tread_fx.SelectionError, match=r"\(4, 4\).*\(2, 8\)|\(2, 8\).*\(4, 4\)"):
        train_forward(model, case)


class PlainBlock(nn.Module):
    """No grid inside: a linear mix of each token."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(x)


class NamedGrid(VisionRWKV):
    def __init__(self) -> None:
        super().__init__(PlainBlock)
        self.grid_size = (H, W)


def test_a_grid_read_from_an_attribute_is_reported():
    case = Case("named", NamedGrid, _inputs, routes=[(1, -1)], route_kwargs={"selection": "rows"})
    model = case.route(case.model())
    with pytest.warns(UserWarning, match=r"read from the attribute 'grid_size'"):
        train_forward(model, case)
    assert tread_fx.route_info(model)[0].grid == (H, W)
