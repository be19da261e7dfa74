"""Two models whose routed stream a choice by shape alone got wrong (see
``tests/test_stream_by_data_flow.py``); also the coverage verdict's wrong-stream fixture."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["B", "N", "T", "D", "JointInputs", "TwoOutputs", "joint_inputs", "two_inputs"]

B, N, T, D = 2, 16, 5, 32


class SelfBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return h + self.mlp(h)


class JointInputs(nn.Module):
    """``[image | text]`` through the blocks; the prediction reads the image positions.

    The context has as many tokens as the image and as many channels as the prediction, so
    the prediction has the context's shape (and not the image input's: 6 channels in).
    """

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.x_in, self.c_in = nn.Linear(6, D), nn.Linear(4, D)
        self.blocks = nn.ModuleList(SelfBlock() for _ in range(depth))
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.x_in(x), self.c_in(context)], dim=1)
        for block in self.blocks:
            h = block(h)
        return self.out(h[:, : x.shape[1]])


class TwoStreamBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.text_mlp, self.image_mlp = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        both = torch.cat([text, image], dim=1)
        mixed = self.attn(both, both, both, need_weights=False)[0]
        n = text.shape[1]
        return text + self.text_mlp(mixed[:, :n]), image + self.image_mlp(mixed[:, n:])


class TwoOutputs(nn.Module):
    """Separate text and image streams; returns ``(text_out, image_out)``."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.x_in, self.c_in = nn.Linear(4, D), nn.Linear(8, D)
        self.blocks = nn.ModuleList(TwoStreamBlock() for _ in range(depth))
        self.text_out, self.image_out = nn.Linear(D, 8), nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, ...]:
        image, text = self.x_in(x), self.c_in(context)
        for block in self.blocks:
            text, image = block(text, image)
        return self.text_out(text), self.image_out(image)


def joint_inputs():
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(B, N, 6, generator=gen), torch.randn(B, N, 4, generator=gen)), {}


def two_inputs():
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(B, N, 4, generator=gen), torch.randn(B, T, 8, generator=gen)), {}
