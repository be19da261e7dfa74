"""A hand-written TREAD forward for the reference models, kept purely for comparison.

This is what a user would write by editing the model's forward: draw sorted random token ids,
gather the stream(s) before block ``start``, run blocks ``start .. end-1`` on the kept tokens
and scatter the result into a copy of the stream as it was at ``start`` before block ``end``.
It calls the models' own submodules and shares nothing with ``tread_fx`` (on purpose: the
benchmark compares the generic pass against this), except that the ids it consumes can be
handed in, so that tests can check that both give the same output for the same ids.

Example:
    >>> import torch, tread_fx
    >>> from benchmarks.handwritten import dit_forward, random_token_ids
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    >>> ids = random_token_ids(2, 16, keep=8)
    >>> dit_forward(model.train(), x, t, y, ids, start=1, end=3).shape
    torch.Size([2, 2, 8, 8])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = [
    "random_token_ids",
    "random_row_ids",
    "gather_stream",
    "scatter_stream",
    "dit_forward",
    "mamba_forward",
    "rwkv_forward",
    "forward_for",
]


def random_token_ids(
    batch: int,
    num_tokens: int,
    keep: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Per sample, ``keep`` uniformly random token ids out of ``num_tokens``, ascending.

    Args:
        batch: Batch size B.
        num_tokens: Tokens per sample N.
        keep: Tokens kept per sample k.
        generator: Optional generator for reproducible draws.
        device: Device of the ids.

    Returns:
        Int64 ids ``[B, k]``, sorted within each row.
    """
    noise = torch.rand(batch, num_tokens, generator=generator, device=device)
    return noise.argsort(dim=1)[:, :keep].sort(dim=1).values


def random_row_ids(
    batch: int,
    grid: tuple[int, int],
    keep_rows: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Per sample, the token ids of ``keep_rows`` random whole rows of an (H, W) grid, ascending.

    Returns:
        Int64 ids ``[B, keep_rows * W]``; the kept tokens form a ``keep_rows x W`` grid.
    """
    rows = random_token_ids(batch, grid[0], keep_rows, generator, device)
    cols = torch.arange(grid[1], device=rows.device)
    return (rows[:, :, None] * grid[1] + cols).flatten(1)


def _expanded(ids: Tensor, width: int) -> Tensor:
    return ids.unsqueeze(-1).expand(-1, -1, width)


def gather_stream(stream: Tensor, ids: Tensor) -> Tensor:
    """Tokens ``ids`` [B, k] of ``stream`` [B, N, D] -> [B, k, D]."""
    return torch.gather(stream, 1, _expanded(ids, stream.shape[-1]))


def scatter_stream(saved: Tensor, processed: Tensor, ids: Tensor) -> Tensor:
    """Copy of ``saved`` [B, N, D] with tokens ``ids`` replaced by ``processed`` [B, k, D]."""
    return saved.scatter(1, _expanded(ids, saved.shape[-1]), processed.to(saved.dtype))


def dit_forward(
    model: nn.Module, x: Tensor, t: Tensor, y: Tensor, ids: Tensor, start: int, end: int
) -> Tensor:
    """The reference DiT's training forward with blocks ``start .. end-1`` on tokens ``ids``."""
    h = model.pos_embed + model.x_embedder(x)  # as DiT.forward: a contiguous token stream
    c = model.t_embedder(t) + model.y_embedder(y)
    saved = h
    for i, block in enumerate(model.blocks):
        if i == start:
            saved, h = h, gather_stream(h, ids)
        h = block(h, c)
        if i == end - 1:
            h = scatter_stream(saved, h, ids)
    return model.unpatchify(model.final_layer(h, c))


def mamba_forward(
    model: nn.Module, x: Tensor, t: Tensor, y: Tensor, ids: Tensor, start: int, end: int
) -> Tensor:
    """The reference diffusion Mamba's forward; both streams (hidden, residual) are routed.

    Raises:
        NotImplementedError: For models with U-ViT long skips (not benchmarked).
    """
    if any(src is not None for src in model.skip_sources):
        raise NotImplementedError("the hand-written Mamba forward covers skip=False only")
    hidden = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    residual = torch.zeros_like(hidden)
    saved = (hidden, residual)
    for i, block in enumerate(model.blocks):
        if i == start:
            saved = (hidden, residual)
            hidden, residual = gather_stream(hidden, ids), gather_stream(residual, ids)
        hidden, residual = block(hidden, residual, c)
        if i == end - 1:
            hidden = scatter_stream(saved[0], hidden, ids)
            residual = scatter_stream(saved[1], residual, ids)
    return model.unpatchify(model.final_layer(residual + hidden, c))


def rwkv_forward(
    model: nn.Module, x: Tensor, t: Tensor, y: Tensor, ids: Tensor, start: int, end: int
) -> Tensor:
    """The reference Diffusion-RWKV's forward; ``ids`` must be whole grid rows, ascending.

    Raises:
        NotImplementedError: For models with U-ViT long skips (not benchmarked).
    """
    if model.skip_pairs:
        raise NotImplementedError("the hand-written RWKV forward covers skip=False only")
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    saved = h
    for i, block in enumerate(model.blocks):
        if i == start:
            saved, h = h, gather_stream(h, ids)
        h = block(h, c)
        if i == end - 1:
            h = scatter_stream(saved, h, ids)
    return model.unpatchify(model.final_layer(h, c))


def forward_for(model: nn.Module) -> Callable[..., Tensor]:
    """The hand-written forward matching ``model``'s class.

    Raises:
        TypeError: For a model that has no hand-written forward here.
    """
    names = {"DiT": dit_forward, "DiffusionMamba": mamba_forward, "DiffusionRWKV": rwkv_forward}
    for cls in type(model).__mro__:
        if cls.__name__ in names:
            return names[cls.__name__]
    raise TypeError(f"no hand-written TREAD forward for {type(model).__name__}")
