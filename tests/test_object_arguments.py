"""Plain Python objects the forward hands to its blocks (a per-layer key/value cache).

fx has no argument type for an instance of a user class, so a block call that receives one
could not be recorded. The tracer now keeps such an object as a constant of the trace, like
the non-tensor model inputs it comes from; the signature key holds them by identity, so a
call with another object never runs on a stale one. Self-written model; checked against
docs/design.md#invariants.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import (
    INVARIANTS,
    Case,
    check_compiled,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class Slot:
    """One layer's cache: the blocks write what they attended over."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None

    def store(self, keys: torch.Tensor) -> None:
        self.keys = keys.detach()


class LayerCaches:
    """One :class:`Slot` per layer, handed out by index (the forward calls ``get(i)``)."""

    def __init__(self, layers: int) -> None:
        self.slots = [Slot() for _ in range(layers)]

    def get(self, index: int) -> Slot:
        return self.slots[index]


class CachingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor, cache: Slot) -> torch.Tensor:
        h = self.norm(x)
        cache.store(h)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class CachingBackbone(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList(CachingBlock() for _ in range(depth))
        self.head = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor, caches: LayerCaches) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = block(h, caches.get(i))
        return self.head(h)


def _inputs() -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, N, 8, generator=g), LayerCaches(4)), {}


CASE = Case("CachingBackbone", CachingBackbone, _inputs, routes=[(1, 3)])


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda c: c.__name__)
def test_invariants(check):
    check(CASE)


def test_half_the_tokens_are_kept():
    infos = check_routed_shape_count_and_change(CASE)
    assert infos[0].kept.shape[1] == N // 2


def test_routed_blocks_write_the_kept_tokens_into_the_object_of_this_call():
    model = tread_fx.route(CachingBackbone(), routes=[(1, 3)], seed=0).train()
    x = _inputs()[0][0]
    first, second = LayerCaches(4), LayerCaches(4)
    model(x, first)
    model(x, second)  # another object: never the first one's trace
    assert [s.keys.shape[1] for s in second.slots] == [N, N // 2, N // 2, N]
    first_keys = [s.keys for s in first.slots]
    model(x, second)  # the same object again: the cached trace, the first object untouched
    assert all(s.keys is keys for s, keys in zip(first.slots, first_keys))


@pytest.mark.slow
def test_compiled_routed_graph():
    check_compiled(CASE)
