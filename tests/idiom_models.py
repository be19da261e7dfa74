"""A small token model for tests of the Python a model's own code writes, and TREAD written by
hand over it.

A test overrides :meth:`IdiomModel.embed` (the model's own code before the blocks) or
:meth:`IdiomModel.step` (how the forward calls a block), or passes its own block class;
:func:`routed_by_hand` runs the same code with the route's kept tokens gathered and scattered.
"""

from __future__ import annotations

import torch
from torch import nn

B, N, D = 2, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x))


class IdiomModel(nn.Module):
    """``[B, N, 8]`` in and out, four blocks of width ``D`` between."""

    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, D), nn.Linear(D, 8)
        self.blocks = nn.ModuleList(block() for _ in range(4))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x)

    def step(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return block(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = self.step(block, h)
        return self.out(h)


def routed_by_hand(model: IdiomModel, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Route (1, 3) of ``model`` written out, on the kept tokens ``idx`` ([B, k])."""
    h = model.step(model.blocks[0], model.embed(x))
    rows = idx[..., None].expand(-1, -1, h.shape[-1])
    kept = h.gather(1, rows)
    for block in model.blocks[1:3]:
        kept = model.step(block, kept)
    return model.out(model.step(model.blocks[3], h.scatter(1, rows, kept)))


def twins(make: type[IdiomModel], *args) -> tuple[IdiomModel, IdiomModel]:
    """Two models with the same weights (one to route, one to run by hand)."""
    torch.manual_seed(0)
    model, reference = make(*args), make(*args)
    reference.load_state_dict(model.state_dict())
    return model, reference
