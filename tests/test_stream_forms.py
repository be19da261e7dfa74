"""Token streams that change form along the stack (DESIGN §3.2): the image stream moved into
a longer stream per sample (a padded buffer), a text suffix re-concatenated and sliced off in
every block, a joint -> single -> joint stack that splits the text off again, and a model
whose input is a list of per-sample tensors. A route crosses each such boundary: the kept
image tokens are written back before it and gathered again after it at their new places,
the other tokens (text, padding) are never routed."""

from __future__ import annotations

import pytest
import torch
from test_mmdit_streams import JointBlock, SingleBlock  # the same joint and single blocks
from third_party_checks import (
    Case,
    check_compiled,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, T, N, D, PAD = 2, 5, 16, 32, 3


class PaddedJoint(nn.Module):
    """Image refiner blocks, then text and image written per sample into a padded buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.text_in, self.image_in = nn.Linear(8, D), nn.Linear(4, D)
        self.refiner = nn.ModuleList(SingleBlock() for _ in range(3))
        self.layers = nn.ModuleList(SingleBlock() for _ in range(3))
        self.out = nn.Linear(D, 4)

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        image, text = self.image_in(image), self.text_in(text)
        for block in self.refiner:
            image = block(image)
        n, t = image.shape[1], text.shape[1]
        joint = image.new_zeros(image.shape[0], t + n + PAD, image.shape[2])
        for i in range(image.shape[0]):
            joint[i, :t] = text[i]
            joint[i, t : t + n] = image[i]
        for block in self.layers:
            joint = block(joint)
        return self.out(torch.stack([joint[i, t : t + n] for i in range(joint.shape[0])]))


class SuffixSingles(nn.Module):
    """Joint blocks, then the text as a suffix; every single block gets fresh text appended,
    which is sliced off after it."""

    def __init__(self) -> None:
        super().__init__()
        self.text_in, self.image_in = nn.Linear(8, D), nn.Linear(4, D)
        self.extra_in = nn.Linear(8, D)
        self.joint_blocks = nn.ModuleList(JointBlock() for _ in range(3))
        self.single_blocks = nn.ModuleList(SingleBlock() for _ in range(3))
        self.out = nn.Linear(D, 4)

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        image, extra, text = self.image_in(image), self.extra_in(text), self.text_in(text)
        for block in self.joint_blocks:
            text, image = block(text, image)
        n = image.shape[1]
        x = torch.cat([image, text], dim=1)
        length = x.shape[1]
        for block in self.single_blocks:
            x = torch.cat([x, extra[:, :2]], dim=1)
            x = block(x)
            x = x[:, :length]
        return self.out(x[:, :n])


class SplitBack(nn.Module):
    """Joint blocks, single blocks over [text | image], then joint blocks again on the split."""

    def __init__(self) -> None:
        super().__init__()
        self.text_in, self.image_in = nn.Linear(8, D), nn.Linear(4, D)
        self.joint_blocks = nn.ModuleList(JointBlock() for _ in range(2))
        self.single_blocks = nn.ModuleList(SingleBlock() for _ in range(2))
        self.final_blocks = nn.ModuleList(JointBlock() for _ in range(2))
        self.out = nn.Linear(D, 4)

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        image, text = self.image_in(image), self.text_in(text)
        for block in self.joint_blocks:
            text, image = block(text, image)
        t = text.shape[1]
        x = torch.cat([text, image], dim=1)
        for block in self.single_blocks:
            x = block(x)
        text, image = x[:, :t], x[:, t:]
        for block in self.final_blocks:
            text, image = block(text, image)
        return self.out(image)


class ListInput(nn.Module):
    """Takes a list of per-sample [N, 4] tensors: the batch is the list's length."""

    def __init__(self) -> None:
        super().__init__()
        self.image_in = nn.Linear(4, D)
        self.blocks = nn.ModuleList(SingleBlock() for _ in range(4))
        self.out = nn.Linear(D, 4)

    def forward(self, images: list[torch.Tensor], text: torch.Tensor) -> torch.Tensor:
        x = torch.stack([self.image_in(image) for image in images])
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _inputs():
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(B, N, 4, generator=gen), torch.randn(B, T, 8, generator=gen)), {}


def _list_inputs():
    gen = torch.Generator().manual_seed(5)
    images = [torch.randn(N, 4, generator=gen) for _ in range(3)]
    return (images, torch.randn(3, T, 8, generator=gen)), {}


PADDED = Case("padded", PaddedJoint, _inputs, routes=[(1, 5)])  # refiner 1..2, layers 3..4
SUFFIX = Case("suffix", SuffixSingles, _inputs, routes=[(1, 5)])  # joint 1..2, single 3..4
SPLIT = Case("split-back", SplitBack, _inputs, routes=[(1, 6)])  # joint 1, single, joint 4..5
LISTED = Case("list-input", ListInput, _list_inputs, routes=[(1, 4)])
CASES = [PADDED, SUFFIX, SPLIT, LISTED]

# tokens each block sees in the routed graph (half the image tokens kept)
EXPECTED = {
    "padded": [N, N // 2, N // 2, T + N // 2 + PAD, T + N // 2 + PAD, T + N + PAD],
    "suffix": [N, N // 2, N // 2, N // 2 + T + 2, N // 2 + T + 2, N + T + 2],
    "split-back": [N, N // 2, T + N // 2, T + N // 2, N // 2, N // 2],
    "list-input": [N, N // 2, N // 2, N // 2],
}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_routed_stream_is_the_image_and_flops_drop(case):
    args, kwargs = case.inputs()
    model = case.route(case.model())
    model.train()(*args, **kwargs)
    (info,) = tread_fx.route_info(model)
    assert info.num_tokens == N and info.kept.shape[1] == N // 2
    exp = tread_fx.explain(case.model(), case.routes, 0.5, (args, kwargs))
    assert [b.tokens_routed for b in exp.blocks] == EXPECTED[case.name]
    assert exp.flops.speedup > 1.05


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case):
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    check_routed_shape_count_and_change(case)
    check_gradients(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [PADDED, SUFFIX], ids=lambda c: c.name)
def test_compiled_split_route(case):
    check_compiled(case)


class MixingHandOff(PaddedJoint):
    """Writes a running sum over the image tokens into the buffer: not a move of tokens."""

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        image, text = self.image_in(image), self.text_in(text)
        for block in self.refiner:
            image = block(image)
        n, t = image.shape[1], text.shape[1]
        joint = image.new_zeros(image.shape[0], t + n, image.shape[2])
        for i in range(image.shape[0]):
            joint[i, :t] = text[i]
            joint[i, t:] = image[i].cumsum(0)
        for block in self.layers:
            joint = block(joint)
        return self.out(joint[:, t:])


def test_a_hand_off_that_mixes_tokens_is_refused_with_the_reason():
    case = Case("mixing", MixingHandOff, _inputs, routes=[(1, 5)])
    model = case.route(case.model())
    with pytest.raises(tread_fx.TokenStreamError, match="computed from several tokens"):
        model.train()(*_inputs()[0])


def test_a_route_starting_on_the_longer_stream_that_drops_tokens_is_refused():
    case = Case("inside", SuffixSingles, _inputs, routes=[(3, 6)])
    model = case.route(case.model())
    with pytest.raises(tread_fx.TokenStreamError, match="start the route where the stream"):
        model.train()(*_inputs()[0])
