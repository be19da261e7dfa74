"""A checkpoint function a module holds (as diffusers' models do) is seen through by value.

The model keeps ``functools.partial(torch.utils.checkpoint.checkpoint, ...)`` as an attribute
under a name of its own and calls its blocks through it in training. The trace recognises the
function by what it is, not by the attribute's name: the blocks are traced as plain calls,
marked, and checkpointed again in the routed graph, which computes what the unrouted model
computes at rate 0.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tread_fx

B, N, D = 2, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x, table):
        return x + self.mlp(self.norm(x + table))


class HeldCheckpointModel(nn.Module):
    def __init__(self, held) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, D), nn.Linear(D, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.table = nn.Parameter(torch.randn(1, N, D) * 0.1)
        self.zq = held

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = self.zq(block, x, self.table) if self.training else block(x, self.table)
        return self.head(x)


HELD = {
    "partial": functools.partial(checkpoint, use_reentrant=False),
    "function": checkpoint,
}


@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint")
@pytest.mark.parametrize("held", HELD, ids=str)
def test_blocks_called_through_a_held_checkpoint_function_are_seen_and_checkpointed(held):
    torch.manual_seed(0)
    model = HeldCheckpointModel(HELD[held]).train()
    x = torch.randn(B, N, 4)
    reference = model(x)
    tread_fx.route(model, routes=[(1, 3)], rate=0.0, seed=0)
    torch.testing.assert_close(model(x), reference, rtol=0, atol=0)
    gm = tread_fx.routed_graphs(model)[0].gm
    assert sum(bool(n.meta.get("tread_checkpoint")) for n in gm.graph.nodes) == 4
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0, reroute=True)
    model(x).square().mean().backward()
    assert tread_fx.route_info(model)[0].kept.shape[-1] == N // 2


class HeldInBlock(nn.Module):
    """A block that checkpoints its inner part through a partial it holds, passing keyword
    arguments (as torch's ``checkpoint_wrapper`` does): run for real while the model is
    traced, it must checkpoint with the partial's own options."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()
        self.zq = functools.partial(checkpoint, use_reentrant=False)

    def forward(self, x, table):
        return self.zq(self.inner, x, table=table) if self.training else self.inner(x, table)


def test_a_partial_held_by_a_block_keeps_its_options_when_run_for_real():
    torch.manual_seed(0)
    model = HeldCheckpointModel(lambda block, *args: block(*args)).train()
    model.blocks = nn.ModuleList(HeldInBlock() for _ in range(4))
    x = torch.randn(B, N, 4)
    reference = model(x)
    tread_fx.route(model, routes=[(1, 3)], rate=0.0, seed=0)
    torch.testing.assert_close(model(x), reference, rtol=0, atol=0)
