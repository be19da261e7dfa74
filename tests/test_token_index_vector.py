"""A per-token index vector ([N] integers) handed to every block beside the stream.

Packed multi-modal DiTs tag each token with an index (its modality, its frame's timestep)
and every block picks its adaLN modulation row per token with ``table.index_select(0,
index)``. The index vector must follow the token selection: the kept tokens keep their own
entries. It has no batch dim, so the selection is shared across the batch.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import (
    Case,
    capture_block_inputs,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, N, D, KINDS = 2, 16, 32, 3


class TaggedBlock(nn.Module):
    """Per-token shift/scale chosen by the token's tag from a per-block table."""

    def __init__(self) -> None:
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(KINDS, 2 * D) * 0.1)
        self.mix = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation.index_select(0, tags).chunk(2, dim=-1)  # [N, D] each
        return x + self.mix(x * (1 + scale) + shift)


class TaggedTokens(nn.Module):
    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(TaggedBlock() for _ in range(depth))
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        tags = torch.arange(x.shape[1]) % KINDS + step * 0  # an [N] integer vector
        for block in self.blocks:
            x = block(x, tags)
        return self.out(x)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(B, N, 4, generator=gen), torch.tensor(0)), {}


CASE = Case("token-tags", TaggedTokens, _inputs, routes=[(1, 4)])


def test_the_tags_follow_the_kept_tokens():
    model = CASE.route(CASE.model()).train()
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*_inputs()[0])
    *_, (args, _) = calls  # the first call may be the tracing one
    (info,) = tread_fx.route_info(model)
    assert torch.equal(info.kept[0], info.kept[1])  # the selection is shared
    assert torch.equal(args[1], torch.arange(N)[info.kept[0]] % KINDS)


def test_explain_names_the_rule():
    exp = str(tread_fx.explain(CASE.model(), CASE.routes, 0.5, _inputs()))
    assert "adapter 'ids-shared'" in exp


class WeightedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return x + self.mix(x) * weights.softmax(0).amax()  # not per token


class FloatVector(TaggedTokens):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(WeightedBlock() for _ in range(5))

    def forward(self, x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        weights = torch.linspace(0, 1, x.shape[1]) + step  # [N] floats, used as a whole
        for block in self.blocks:
            x = block(x, weights)
        return self.out(x)


def test_a_vector_of_n_entries_used_as_a_whole_is_passed_whole():
    """[N] floats the blocks only reduce (a global statistic) are no per-token values."""
    case = Case("float", FloatVector, _inputs, routes=[(1, 4)])
    model = case.route(case.model()).train()
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*_inputs()[0])
    *_, (args, _) = calls
    assert args[0].shape[1] == N // 2 and torch.equal(args[1], torch.linspace(0, 1, N))


@pytest.mark.parametrize(
    "check",
    [
        check_eval_is_bitwise_unrouted,
        check_rate_zero_equals_training,
        check_routed_shape_count_and_change,
        check_gradients,
    ],  # fmt: skip
)
def test_invariants(check):
    check(CASE)
