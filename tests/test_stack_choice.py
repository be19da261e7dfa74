"""Which block list is the stack, when several lists of blocks run in one forward.

The stack is the one the noisy input flows through, handing the stream from block to block:
a text refiner (blocks handing on the text, even when they also read the image) never heads
it, and a perceiver list whose
outputs are added to the stream as a side branch never competes with it.
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

B, N, T, D = 2, 16, 5, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        kv = h if context is None else context
        x = x + self.attn(h, kv, kv, need_weights=False)[0]
        return x + self.mlp(x)


class TextRefinerModel(nn.Module):
    """Text refined by its own block list, then the image blocks attend to it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.refiner = nn.ModuleList(Block() for _ in range(4))
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        for block in self.refiner:
            text = block(text)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, text)
        return self.head(h)


class ImageAwareTextRefinerModel(TextRefinerModel):
    """The text refiner also reads a summary of the image: what it hands from block to block
    is still the text, so it does not head the stack."""

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        summary = h.mean(dim=1, keepdim=True)  # [B, 1, D], computed from the noisy input
        for block in self.refiner:
            text = block(text, summary)
        for block in self.blocks:
            h = block(h, text)
        return self.head(h)


class PerceiverBranchModel(nn.Module):
    """A second list of blocks whose outputs are added to the stream (a side branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.perceivers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block, perceiver in zip(self.blocks, self.perceivers):
            h = block(h)
            h = h + 0.5 * perceiver(reference, h).mean(dim=1, keepdim=True)
        return self.head(h)


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(B, N, 4, generator=gen), torch.randn(B, T, D, generator=gen)), {}


CASES = [
    Case(cls.__name__, cls, _inputs, routes=[(1, 3)])
    for cls in (TextRefinerModel, ImageAwareTextRefinerModel)
]
CASES += [Case(PerceiverBranchModel.__name__, PerceiverBranchModel, _inputs, routes=[(1, 3)])]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_stack_is_the_one_the_noisy_input_flows_through(case):
    model = case.model()
    exp = tread_fx.explain(model, case.routes, 0.5, case.inputs(), flops=False)
    assert [s["path"] for s in exp.stacks] == ["blocks"]
    assert exp.routes[0].num_tokens == N and exp.routes[0].kept_tokens == N // 2


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case):
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    check_routed_shape_count_and_change(case)
    check_gradients(case)
