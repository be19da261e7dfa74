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
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if x.requires_grad else 2.0  # inside a block (traced through)
        return x + self.lin(self.norm(x)) * scale


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, D), nn.Linear(D, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if h.requires_grad:  # the model's own forward: checkpoint when gradients flow
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h) * 0.5
        return self.out(h)


def _reference(model: Model, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Route (1, 3) written out on the kept tokens ``idx``, as the model's code runs."""
    step = lambda b, h: b(h) if h.requires_grad else b(h) * 0.5  # noqa: E731
    h = step(model.blocks[0], model.inp(x))
    rows = idx[..., None].expand(-1, -1, D)
    kept = h.gather(1, rows)
    for block in model.blocks[1:3]:
        kept = step(block, kept)
    return model.out(step(model.blocks[3], h.scatter(1, rows, kept)))


def _pair() -> tuple[Model, Model]:
    torch.manual_seed(0)
    model, reference = Model(), Model()
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_requires_grad_is_answered_as_in_training():
    model, reference = _pair()
    x = torch.randn(B, N, 8)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    out = model.train()(x)
    (info,) = tread_fx.route_info(model)
    expected = _reference(reference.train(), x, info.kept)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_freezing_after_the_first_call_traces_again_and_takes_the_other_branch():
    model, reference = _pair()
    x = torch.randn(B, N, 8)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    model.train()(x)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    out = model(x)
    (info,) = tread_fx.route_info(model)
    torch.testing.assert_close(out, _reference(reference.train(), x, info.kept))
    assert not out.requires_grad
