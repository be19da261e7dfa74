"""An MMDiT as community code writes it: ``forward(text, image)``, joint blocks over both
streams, the text concatenated in front of the image for the single blocks, split off at the
end. The routed stream is the image (the noisy input), and the paper's ``(2, depth - 4)``-style
route crosses the joint -> single boundary."""

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

B, T, N, D = 2, 5, 16, 32


def _attend(q: torch.Tensor, kv: torch.Tensor, attn: nn.MultiheadAttention) -> torch.Tensor:
    return attn(q, kv, kv, need_weights=False)[0]


class JointBlock(nn.Module):
    """Text and image attend over both; each stream keeps its own weights."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.text_mlp, self.image_mlp = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        both = torch.cat([text, image], dim=1)
        mixed = _attend(both, both, self.attn)
        text, image = text + mixed[:, : text.shape[1]], image + mixed[:, text.shape[1] :]
        return text + self.text_mlp(text), image + self.image_mlp(image)


class SingleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _attend(x, x, self.attn)
        return x + self.mlp(x)


class TextFirstMMDiT(nn.Module):
    """Takes ``(text, image)``: the text comes first, but the image is what is predicted."""

    def __init__(self, joint: int = 3, single: int = 3) -> None:
        super().__init__()
        self.text_in, self.image_in = nn.Linear(8, D), nn.Linear(4, D)
        self.joint_blocks = nn.ModuleList(JointBlock() for _ in range(joint))
        self.single_blocks = nn.ModuleList(SingleBlock() for _ in range(single))
        self.out = nn.Linear(D, 4)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        text, image = self.text_in(text), self.image_in(image)
        for block in self.joint_blocks:
            text, image = block(text, image)
        x = torch.cat([text, image], dim=1)
        for block in self.single_blocks:
            x = block(x)
        return self.out(x[:, text.shape[1] :])


def _inputs():
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(B, T, 8, generator=gen), torch.randn(B, N, 4, generator=gen)), {}


CROSSING = Case("crossing", TextFirstMMDiT, _inputs, routes=[(1, 5)])  # joint 1..2, single 3..4
INSIDE = Case("joint-only", TextFirstMMDiT, _inputs, routes=[(0, 2)])


def test_the_routed_stream_is_the_image_not_the_text():
    model = INSIDE.route(INSIDE.model())
    model.train()(*_inputs()[0])
    (info,) = tread_fx.route_info(model)
    assert info.num_tokens == N and info.kept.shape[1] == N // 2


def test_a_route_crosses_the_joint_to_single_concatenation():
    model = CROSSING.route(CROSSING.model())
    out = model.train()(*_inputs()[0])
    assert out.shape == (B, N, 4)
    (info,) = tread_fx.route_info(model)
    assert info.num_tokens == N and info.kept.shape[1] == N // 2
    exp = tread_fx.explain(CROSSING.model(), CROSSING.routes, 0.5, _inputs())
    routed = [b.tokens_routed for b in exp.blocks]
    assert routed == [N, N // 2, N // 2, T + N // 2, T + N // 2, T + N]
    assert exp.flops.speedup > 1.1


def test_routes_are_checked_against_the_chained_depth_of_unequal_lists():
    """2 joint + 4 single blocks chain into 6: a route ending at 5 is valid, one at 7 is not."""
    model = tread_fx.route(TextFirstMMDiT(joint=2, single=4), [(1, 5)], 0.5, seed=0)
    assert model.train()(*_inputs()[0]).shape == (B, N, 4)
    (info,) = tread_fx.route_info(model)
    assert info.kept.shape[1] == N // 2
    too_far = tread_fx.route(TextFirstMMDiT(joint=2, single=4), [(1, 7)], 0.5)
    with pytest.raises(tread_fx.InvalidRouteError, match="6 blocks"):
        too_far.train()(*_inputs()[0])


@pytest.mark.parametrize("case", [CROSSING, INSIDE], ids=lambda c: c.name)
def test_invariants(case):
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    check_routed_shape_count_and_change(case)
    check_gradients(case)
