"""A forward that draws with numpy's global generator (efficientvit's UViT training step draws
its timesteps with ``np.random.choice``). A number drawn while tracing would be baked into the
graph: every routed step would reuse the traced timesteps. Before, that happened silently (and
tracing moved numpy's state, so only the first routed call could match the plain forward).
Now a draw in the model's own forward is refused, naming numpy; a draw inside a submodule
makes that submodule a leaf, run at every call, drawing anew; and building a route leaves
torch's, numpy's and Python's generators as they were."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import tread_fx
from tread_fx.errors import UntraceableModelError
from tread_fx.module_state import random_state_kept

B, N, D, STEPS = 2, 16, 32, 50


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(D), nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class TimestepSampler(nn.Module):
    def forward(self, x0):
        return torch.as_tensor(np.random.choice(list(range(STEPS)), (len(x0),)))


class DrawsWithNumpy(nn.Module):
    """One training step's prediction: timesteps drawn with numpy, noise with torch; the draw
    in the model's own forward, or in a submodule (``sampler``)."""

    def __init__(self, sampler: bool = False) -> None:
        super().__init__()
        self.sampler = TimestepSampler() if sampler else None
        self.register_buffer("levels", torch.linspace(0.1, 1.0, STEPS))
        self.embed, self.time = nn.Linear(4, D), nn.Embedding(STEPS, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x0):
        if self.sampler is not None:
            n = self.sampler(x0)
        else:
            n = torch.as_tensor(np.random.choice(list(range(STEPS)), (len(x0),)))
        xn = x0 + self.levels[n][:, None, None] * torch.randn_like(x0)
        h = self.embed(xn) + self.time(n)[:, None]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def test_a_draw_in_the_models_own_forward_is_refused_naming_numpy():
    model = tread_fx.route(DrawsWithNumpy(), routes=[(1, 3)], rate=0.5)
    with pytest.raises(UntraceableModelError, match=r"numpy randomness .*test_random_state\.py"):
        model.train()(torch.randn(B, N, 4))


def test_a_draw_in_a_submodule_is_drawn_anew_at_every_routed_call():
    torch.manual_seed(0)
    model, x = DrawsWithNumpy(sampler=True).train(), torch.randn(B, N, 4)
    plain = []
    for seed in (7, 8):
        _seeded(seed)
        with torch.no_grad():
            plain.append(model(x))
    routed = tread_fx.route(model, routes=[(1, 3)], rate=0.0, seed=0)  # its own generator
    for seed, expected in zip((7, 8), plain):
        _seeded(seed)
        with torch.no_grad():
            assert torch.equal(routed(x), expected)  # the first call traces, plans and checks
    assert not torch.equal(*plain)  # other timesteps: nothing baked in


def test_every_generator_is_put_back():
    _seeded(3)
    random.seed(3)
    with random_state_kept([]):
        np.random.rand(), random.random(), torch.rand(1)
    assert (np.random.rand(), random.random()) == (
        np.random.RandomState(3).rand(),
        random.Random(3).random(),
    )
