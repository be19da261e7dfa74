"""A kernel bound at import time outside the model's own files, as a research builder binds
a plain-PyTorch stand-in for a CUDA op (tests/test_research_classes.py): a closure the
model's module reaches by a global name, calling a library (einops) that rejects traced
values."""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange

__all__ = ["make_head_scale"]


def make_head_scale(heads: int, factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A closure scaling ``x [B, N, H * D]`` per head (through einops)."""
    weights = torch.linspace(1.0, factor, heads)

    def head_scale(x: torch.Tensor) -> torch.Tensor:
        split = rearrange(x, "b n (h d) -> b n h d", h=heads)
        return rearrange(split * weights[:, None], "b n h d -> b n (h d)")

    return head_scale
