"""Refusals: a short first line (what was asked and found), details after; no empty container
name; lists whose members take no input are refused at route(), before any training call."""

from __future__ import annotations

import pytest
import torch
from conftest import dit_inputs, tiny_dit
from torch import nn

import tread_fx
from tread_fx.errors import FIRST_LINE, BlockStackNotFoundError, TreadFxError, short_first_line


class Table(nn.Module):
    """A learned table read without an input (``forward(self)``): not a block."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(dim))

    def forward(self) -> torch.Tensor:
        return self.table


class TablesNet(nn.Module):
    """A conv net whose only lists hold tables (``forward(self)``) and ModuleDicts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(Table() for _ in range(4))
        self.heads = nn.ModuleList(nn.ModuleDict({"a": nn.Linear(8, 8)}) for _ in range(3))
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = sum(t() for t in self.tables)
        return self.conv(x) + bias[:, None, None]


class ConvBlock(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.conv(h))


def test_lists_of_members_that_take_no_input_are_refused_at_route() -> None:
    model = TablesNet()
    with pytest.raises(BlockStackNotFoundError, match="no list of blocks that take an input"):
        tread_fx.route(model, [(1, 3)])  # no call needed: the structure says so
    assert not tread_fx.is_routed(model)


def test_such_lists_beside_a_real_stack_do_not_stop_routing() -> None:
    model = tiny_dit(depth=4)
    model.tables = nn.ModuleList(Table(32) for _ in range(3))
    tread_fx.route(model, [(1, 3)])
    x, t, y = dit_inputs()
    assert model.train()(x, t, y).shape[0] == x.shape[0]


def test_a_top_level_list_is_named_the_model_itself() -> None:
    model = nn.Sequential(*(ConvBlock() for _ in range(4)))
    with pytest.raises(TreadFxError) as caught:
        tread_fx.route(model, [(1, 3)], example_inputs=(torch.randn(2, 4, 8, 8),))
    message = str(caught.value)
    assert "block list (the model itself)" in message and "through :" not in message


class ResidualConvNet(nn.Module):
    """A network of residual conv blocks (a ResNet body): no token stream anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return h


def test_a_conv_net_is_refused_at_route_with_the_reason_on_the_first_line() -> None:
    model = ResidualConvNet()
    with pytest.raises(tread_fx.TokenStreamError) as caught:
        tread_fx.route(model, [(1, 3)])  # no call needed: its blocks are convolutions
    first = str(caught.value).splitlines()[0]
    assert "no token sequence flows through ResidualConvNet" in first
    assert "route a token-based backbone" in first and "blocks=" not in first
    assert not tread_fx.is_routed(model)


def test_a_conv_stack_beside_a_token_stack_is_not_refused_at_route() -> None:
    model = tiny_dit(depth=4)
    model.refiner = nn.ModuleList(ConvBlock() for _ in range(3))  # never called
    tread_fx.route(model, [(1, 3)])
    x, t, y = dit_inputs()
    assert model.train()(x, t, y).shape[0] == x.shape[0]


class FeatureMapBlock(nn.Module):
    """A conv block with a linear time projection: only data flow shows the feature map."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv, self.time = nn.Conv2d(channels, channels, 3, padding=1), nn.Linear(1, channels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.conv(h) + self.time(h.mean((1, 2, 3))[:, None])[:, :, None, None]


class FeatureMapBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FeatureMapBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class BothDims(nn.Module):
    """Mixes its input along dims 0 and 1: no reading keeps the samples apart."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + h.mean(dim=(0, 1), keepdim=True)


def _refusals() -> list:
    """Refusals a user can trigger cheaply, each as a zero-argument callable."""
    x, t, y = dit_inputs()
    cnn = nn.Sequential(*(ConvBlock() for _ in range(4)))
    routed = tread_fx.route(tiny_dit(depth=4), [(1, 3)])
    return [
        pytest.param(lambda: tread_fx.route(tiny_dit(depth=4), [(3, 1)]), id="start>=end"),
        pytest.param(lambda: tread_fx.route(tiny_dit(depth=4), [(1, 9)]), id="out-of-range"),
        pytest.param(lambda: tread_fx.route(tiny_dit(depth=4), [(0, 3), (2, 4)]), id="overlap"),
        pytest.param(lambda: tread_fx.route(tiny_dit(depth=4), [(1, 3)], 1.5), id="rate"),
        pytest.param(
            lambda: tread_fx.route(tiny_dit(depth=4), [(1, 3)], blocks="nope"), id="blocks"
        ),
        pytest.param(lambda: tread_fx.route(tiny_dit(), [(1, 3)], selection="x"), id="selection"),
        pytest.param(lambda: tread_fx.route(nn.Linear(2, 2), [(0, 1)]), id="no-stack"),
        pytest.param(lambda: tread_fx.route(TablesNet(), [(0, 1)]), id="no-input-stack"),
        pytest.param(lambda: tread_fx.route(routed, [(1, 3)]), id="routed-twice"),
        pytest.param(lambda: tread_fx.unroute(nn.Linear(2, 2)), id="not-routed"),
        pytest.param(
            lambda: tread_fx.route(cnn, [(1, 3)], example_inputs=(torch.randn(2, 4, 8, 8),)),
            id="feature-map-stream",
        ),
        pytest.param(lambda: tread_fx.route(ResidualConvNet(), [(1, 3)]), id="conv-net"),
        pytest.param(
            lambda: tread_fx.route(
                FeatureMapBlocks(), [(1, 3)], example_inputs=(torch.randn(2, 4, 8, 8),)
            ),
            id="feature-map-blocks-with-linear",
        ),
        pytest.param(
            lambda: tread_fx.route(
                nn.Sequential(*(BothDims() for _ in range(4))),
                [(1, 3)],
                example_inputs=(torch.randn(4, 6, 8),),
            ),
            id="batch-dim-untold",
        ),
        pytest.param(
            lambda: tread_fx.route(
                tiny_dit(depth=4), [(1, 3)], selection="rows", grid=(3, 5), example_inputs=(x, t, y)
            ),
            id="grid",
        ),  # fmt: skip
    ]


@pytest.mark.parametrize("trigger", _refusals())
def test_the_first_line_of_every_refusal_is_short(trigger) -> None:
    with pytest.raises(TreadFxError) as caught:
        trigger()
    first = str(caught.value).splitlines()[0]
    assert 0 < len(first) <= FIRST_LINE, f"{len(first)} characters: {first}"
    assert not first.rstrip().endswith((":", ",")), f"the reason is not on the first line: {first}"


def test_short_first_line_keeps_every_word() -> None:
    text = "no token sequence flows through blocks: " + "the value is a feature map, " * 12
    short = short_first_line(text)
    assert len(short.splitlines()[0]) <= FIRST_LINE
    assert short.replace("\n", " ") == text
    assert short_first_line("short; fine") == "short; fine"


def test_a_closing_parenthetical_goes_below_the_problem() -> None:
    path = "runs/" + "x" * 60 + "/step_0000001/model.safetensors"
    text = f"{path}: does not match the model (size mismatch for 0.weight: " + "y " * 50 + ")"
    first, second = short_first_line(text).splitlines()
    assert first == f"{path}: does not match the model" and second.startswith("(size mismatch")
