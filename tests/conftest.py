"""Shared fixtures: tiny models and inputs (depth 4-6, width 32-64, 16-64 tokens)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import tread_fx
from benchmarks.coverage_checks import randomize_zero_init  # noqa: F401 - re-exported to tests

# one thread per xdist worker (`-n 2` on 2 cores: 2 threads each oversubscribed the CPU and
# took ~10% longer), two in a single process
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(autouse=True)
def _fresh_dynamo_counters():
    """Each test counts its own graph breaks (dynamo's counters are process-wide)."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].utils.counters.clear()


def tiny_dit(depth: int = 6, input_size: int = 8, patch: int = 2, seed: int = 0, **kwargs):
    """A DiT small enough for the 2-core CI (16 tokens at 8x8, patch 2)."""
    torch.manual_seed(seed)
    defaults = dict(in_channels=1, num_classes=10, hidden_size=32, num_heads=2)
    model = tread_fx.models.DiT(
        input_size=input_size, patch_size=patch, depth=depth, **{**defaults, **kwargs}
    )
    randomize_zero_init(model)
    return model


def dit_inputs(batch: int = 3, input_size: int = 8, channels: int = 1, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, input_size, input_size, generator=gen)
    t = torch.rand(batch, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return x, t, y


@pytest.fixture
def dit():
    return tiny_dit()


@pytest.fixture
def inputs():
    return dit_inputs()
