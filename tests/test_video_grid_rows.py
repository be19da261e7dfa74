"""Video blocks told ``(frames, height, width)``: rows and frames.

The blocks reshape their tokens to the ``(F, H, W)`` grid they are told (a depthwise 3-D
conv, as in Sana-Video's Mix-FFN), so a random subset cannot run through them. The model
has no ``grid_size`` attribute: the grid is found in the numbers the blocks receive.
``selection="auto"`` keeps the same whole rows in every frame and tells the blocks the kept
row count. Self-written model; docs/design.md#invariants.
"""

from __future__ import annotations

import pytest
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
from tread_fx.inspection.flops import flop_counter

B, F, H, W, D = 2, 2, 4, 4, 32


class VideoGridBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.conv = nn.Conv3d(D, D, 3, padding=1, groups=D)

    def forward(self, x: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        grid = x.transpose(1, 2).unflatten(2, (frames, height, width))
        return x + self.conv(grid).flatten(2).transpose(1, 2)


class VideoGridModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(VideoGridBlock() for _ in range(4))
        self.head = nn.Linear(D, 3)

    def forward(self, video: torch.Tensor) -> torch.Tensor:  # [B, 3, F, H, W]
        _, _, frames, height, width = video.shape
        h = self.embed(video.flatten(2).transpose(1, 2))
        for block in self.blocks:
            h = block(h, frames, height, width)
        return self.head(h)


def _inputs() -> tuple[tuple, dict]:
    return (torch.randn(B, 3, F, H, W, generator=torch.Generator().manual_seed(0)),), {}


CASE = Case("video-grid", VideoGridModel, _inputs, routes=[(1, -1)])


def test_invariants():
    check_eval_is_bitwise_unrouted(CASE)
    check_rate_zero_equals_training(CASE)
    check_routed_shape_count_and_change(CASE)
    check_gradients(CASE)


def test_auto_keeps_the_same_whole_rows_in_every_frame():
    model = CASE.route(CASE.model())
    model.train()(*_inputs()[0])
    (info,) = tread_fx.route_info(model)
    assert info.selection == "rows" and info.grid == (F, H, W)
    kept = info.kept.view(B, F, H // 2, W)
    assert (kept - kept[..., :1] == torch.arange(W)).all()  # whole rows
    rows = kept[..., 0] % (H * W) // W
    assert (rows == rows[:, :1]).all()  # the same rows in every frame
    assert (kept[:, :, 0, 0] // (H * W) == torch.arange(F)).all()


def test_forward_flops_drop():
    x = _inputs()[0][0]
    model = CASE.model().train()
    with flop_counter() as full:
        model(x)
    CASE.route(model)
    model(x)  # the first call traces (and runs the blocks once more)
    with flop_counter() as routed:
        model(x)
    assert routed.get_total_flops() < 0.8 * full.get_total_flops()


def test_an_explicit_random_selection_is_refused_naming_the_frames():
    model = CASE.route(CASE.model(), selection="random")
    with pytest.raises(tread_fx.SelectionError, match=r"frames=2, height=4"):
        model.train()(*_inputs()[0])
