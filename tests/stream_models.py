"""Two models whose routed stream a choice by shape alone got wrong (see
``tests/test_stream_by_data_flow.py``); also the coverage verdict's wrong-stream fixture."""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "B", "N", "T", "D", "JointInputs", "TwoOutputs", "IdsFluxLike", "RolePacked",
    "LateClassToken", "joint_inputs", "two_inputs", "ids_inputs", "role_inputs",
]  # fmt: skip

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


class RopeBlock(nn.Module):
    """A block that adds a per-position table (computed from position ids) to its stream."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h + table)


class JointRopeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.text_mlp, self.image_mlp = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, text, image, table):
        both = torch.cat([text, image], dim=1) + table
        mixed = self.attn(both, both, both, need_weights=False)[0]
        n = text.shape[1]
        return text + self.text_mlp(mixed[:, :n]), image + self.image_mlp(mixed[:, n:])


class IdsFluxLike(nn.Module):
    """Joint blocks then single blocks over ``[text | image]``; an ids input feeds every
    block's table, so the single blocks' (longer) stream descends from it too."""

    def __init__(self) -> None:
        super().__init__()
        self.x_in, self.c_in, self.ids_in = nn.Linear(4, D), nn.Linear(8, D), nn.Linear(2, D)
        self.joint = nn.ModuleList(JointRopeBlock() for _ in range(2))
        self.single = nn.ModuleList(RopeBlock() for _ in range(3))
        self.out = nn.Linear(D, 4)

    def forward(self, x, context, ids):
        image, text, table = self.x_in(x), self.c_in(context), self.ids_in(ids)
        for block in self.joint:
            text, image = block(text, image, table)
        h = torch.cat([text, image], dim=1)
        for block in self.single:
            h = block(h, table)
        return self.out(h[:, text.shape[1] :])


def ids_inputs():
    gen = torch.Generator().manual_seed(6)
    x, context = torch.randn(B, N, 4, generator=gen), torch.randn(B, T, 8, generator=gen)
    return (x, context, torch.randn(B, 1, 2, generator=gen)), {}  # one table row per sample


class RolePacked(nn.Module):
    """Text and image packed into one sequence, each position's role given by data:
    ``by="mask"`` multiplies by ``indicator == 1`` masks, ``by="index"`` writes with
    ``index_copy`` at given positions; ``by="padding"`` zeroes padded image tokens and adds
    a per-token table from another input, ungated (the roles stay the image's)."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.by = by
        self.x_in, self.c_in = nn.Linear(4, D), nn.Linear(8, D)
        self.blocks = nn.ModuleList(SelfBlock() for _ in range(4))
        self.out = nn.Linear(D, 4)

    def forward(self, x, context, indicator):
        if self.by == "index":
            image_at, text_at = indicator[0], indicator[1]
            h = x.new_zeros(x.shape[0], N + T, D)
            h = h.index_copy(1, image_at, self.x_in(x)).index_copy(1, text_at, self.c_in(context))
        else:
            image_mask = (indicator == 1).to(x.dtype).unsqueeze(-1)
            h = self.x_in(x) * image_mask
            text = self.c_in(context)  # "padding": an ungated per-token table is added
            h = h + (text * (1 - image_mask) if self.by == "mask" else text)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def role_inputs(by: str):
    gen = torch.Generator().manual_seed(8)
    if by == "index":
        x, context = torch.randn(B, N, 4, generator=gen), torch.randn(B, T, 8, generator=gen)
        order = torch.randperm(N + T, generator=gen)
        return (x, context, [order[:N], order[N:]]), {}
    x, context = torch.randn(B, N, 4, generator=gen), torch.randn(B, N, 8, generator=gen)
    return (x, context, (torch.rand(B, N, generator=gen) < 0.7).long()), {}


class LateClassToken(nn.Module):
    """Declares ``num_prefix_tokens = 1`` (as timm's CaiT and ConViT do) but concatenates the
    class token only after its blocks, before a head block: the blocks' stream has none."""

    num_prefix_tokens = 1

    def __init__(self) -> None:
        super().__init__()
        self.x_in = nn.Linear(4, D)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.blocks = nn.ModuleList(SelfBlock() for _ in range(4))
        self.head_block, self.out = SelfBlock(), nn.Linear(D, 4)

    def forward(self, x):
        h = self.x_in(x)
        for block in self.blocks:
            h = block(h)
        h = self.head_block(torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1))
        return self.out(h[:, 0])


class AttentionBlock(nn.Module):
    """A pre-norm self-attention block over ``[B, N, dim]`` tokens (nn.MultiheadAttention)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)
