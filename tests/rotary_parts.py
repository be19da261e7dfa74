"""A rotary module defined in its own Python module, apart from the blocks that receive it as
an argument (as research code keeps ``pos_embed.py`` beside ``models.py``): its forward calls
einops, which rejects fx proxies. ``tests/test_argument_module_code.py`` uses it. Also an
attention function kept here, apart from the blocks that call it (Flux keeps ``attention`` and
``apply_rope`` in ``math.py`` beside ``layers.py``): ``tests/test_helper_module_code.py``."""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

__all__ = ["EinopsRotary", "ItemReadingScale", "rotary_attention"]


class EinopsRotary(nn.Module):
    """Rotates channel pairs by ``[N, d / 2]`` angles; the pairs are split with einops."""

    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        angles = torch.arange(tokens)[:, None] * torch.exp(-torch.arange(dim // 2) / 4)[None]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = rearrange(x, "... (d r) -> ... d r", r=2)
        a, b = pairs.unbind(dim=-1)
        turned = torch.stack((a * self.cos - b * self.sin, a * self.sin + b * self.cos), -1)
        return rearrange(turned, "... d r -> ... (d r)")


class ItemReadingScale(nn.Module):
    """Scales by a Python number read from its input's data (``float(x.abs().max())``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (1.0 + float(x.abs().max()))


def rotary_attention(q, k, v, table: torch.Tensor, mask: torch.Tensor | None = None):
    """Rotates ``q, k`` (``[B, H, L, d]``) by a per-sample ``[B, 1, L, d / 2, 2]`` (cos, sin)
    table, attends (under ``mask``, if any), and joins the heads with einops (``[B, L, H * d]``)."""

    def turn(x: torch.Tensor) -> torch.Tensor:
        a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = table.unbind(-1)
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)

    out = torch.nn.functional.scaled_dot_product_attention(turn(q), turn(k), v, attn_mask=mask)
    return rearrange(out, "b h l d -> b l (h d)")
