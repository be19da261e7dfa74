"""``x.requires_grad`` in traced code is answered as training sees it (issue 41).

The trace runs without gradients on detached copies, so code branching on
``x.requires_grad`` (checkpointing only when gradients flow) was refused as reading autograd
state. The answer now follows the graph (a floating value computed with grad enabled from
a parameter or input that requires grad) and is checked on every routed call: freezing the
model after the first call traces again and takes the other branch.
``tread_fx/passes/trace/autograd_flags.py``.
"""

from __future__ import annotations

import torch
from idiom_models import B, Block, IdiomModel, N, routed_by_hand, twins
from torch import nn

import tread_fx


class GradBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if x.requires_grad else 2.0  # inside a block (traced through)
        return x + self.lin(self.norm(x)) * scale


class GradModel(IdiomModel):
    def __init__(self) -> None:
        super().__init__(GradBlock)

    def step(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if h.requires_grad:  # the model's own forward: checkpoint when gradients flow
            return torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return block(h) * 0.5


def test_requires_grad_is_answered_as_in_training():
    (model, reference), x = twins(GradModel), torch.randn(B, N, 8)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    out = model.train()(x)
    (info,) = tread_fx.route_info(model)
    expected = routed_by_hand(reference.train(), x, info.kept)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_freezing_after_the_first_call_traces_again_and_takes_the_other_branch():
    (model, reference), x = twins(GradModel), torch.randn(B, N, 8)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    model.train()(x)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    out = model(x)
    (info,) = tread_fx.route_info(model)
    torch.testing.assert_close(out, routed_by_hand(reference.train(), x, info.kept))
    assert not out.requires_grad
