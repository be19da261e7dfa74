"""Blocks whose forward runs only inside their own call: side values still decided by use.

FSDP2's ``fully_shard`` gathers a unit's parameters in a forward pre-hook and frees them in
a forward hook, so the unit's forward cannot run outside a call of it; accelerate wraps each
block in a checkpoint wrapper whose part is the sharded unit. Here a gate stands in for the
gathered parameters: a pre-hook opens it, a forward hook closes it, and the forward refuses
to run while it is closed. The rotary table, mask and ids the blocks get are decided by how
the blocks use them in both shapes (hooks on the block, hooks on a part of it), so the routed
model computes exactly what the same model without hooks computes under the same seed.
"""

from __future__ import annotations

import pytest
import torch
from test_side_uses import SIDE, SideBlock, SideModel, _assert_same
from third_party_checks import Case
from torch import nn

import tread_fx


class GatedBlock(SideBlock):
    """Its forward runs only between its hooks (parameters gathered, as FSDP2 does)."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered = False
        self.register_forward_pre_hook(_open)
        self.register_forward_hook(_close)

    def forward(self, x, rope, keep, tags, context, count, head_dim):
        if not self.gathered:
            raise RuntimeError("parameters not gathered: call the block, not its forward")
        return super().forward(x, rope, keep, tags, context, count, head_dim)


def _open(module: nn.Module, args: tuple) -> None:
    module.gathered = True


def _close(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    module.gathered = False


class WrappedGatedBlock(nn.Module):
    """A wrapper block without hooks around a gated part (a checkpoint wrapper's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = GatedBlock()

    def forward(self, x, rope, keep, tags, context, count, head_dim):
        return self.inner(x, rope, keep, tags, context, count, head_dim)


class GatedModel(SideModel):
    block_class = GatedBlock


class WrappedGatedModel(SideModel):
    block_class = WrappedGatedBlock


CASES = [
    Case("hooks-on-block", GatedModel, SIDE.inputs, routes=SIDE.routes),
    Case("hooks-on-part", WrappedGatedModel, SIDE.inputs, routes=SIDE.routes),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_side_values_of_gated_blocks_are_decided_by_use(case):
    _assert_same(case, SIDE)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_hooks_leave_every_gate_as_they_found_it(case):
    model = case.route(case.model()).train()
    model(*case.inputs()[0])
    gates = [m for m in model.modules() if isinstance(m, GatedBlock)]
    assert len(gates) == 4 and not any(m.gathered for m in gates)
    info = tread_fx.route_info(model)
    assert info and info[0].kept.shape[-1] < info[0].num_tokens
