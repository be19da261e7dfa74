"""Runtime ops for packed ``[tokens, dim]`` streams: per-segment selection and offsets.

A packed stream holds several samples (segments) concatenated along one token axis, with no
batch dim; the blocks learn the boundaries from cumulative offsets (``cu_seqlens`` [S + 1])
or from one segment id per token ([T]). A route keeps a fixed total of ``keep`` tokens
(static shapes for ``torch.compile``), spread over the segments in proportion to their
lengths: each keeps ``len * (1 - rate)`` rounded to a neighbouring whole token, chosen
uniformly at random within it and in ascending order, so tokens never change segments.

Example:
    >>> import torch
    >>> cu = torch.tensor([0, 8, 32])
    >>> idx = select_segments(torch.rand(1, 32), keep=16, prefix=0, boundaries=cu, kind="offsets")
    >>> idx.shape, int((idx < 8).sum()), int((idx >= 8).sum())
    (torch.Size([1, 16]), 4, 12)
    >>> kept_offsets(cu, idx).tolist()
    [0, 4, 16]
"""

from __future__ import annotations

from typing import Any

import torch

from tread_fx.runtime.selection import with_prefix

__all__ = ["segment_ids_of", "select_segments", "kept_offsets"]


def segment_ids_of(boundaries: torch.Tensor, kind: str, tokens: int) -> torch.Tensor:
    """One segment id per token ([tokens], int64) from offsets or per-token ids.

    Tokens past the last offset (padding after the samples) form one more segment.
    """
    if kind == "offsets":
        positions = torch.arange(tokens, device=boundaries.device)
        return torch.searchsorted(boundaries[1:].to(torch.int64), positions, right=True)
    return boundaries.reshape(-1).to(torch.int64)


def _rank_in_segment(segments: torch.Tensor, noise: torch.Tensor) -> tuple:
    """(random rank of each token within its segment, its segment's length), both [T]."""
    order = torch.argsort(segments.double() * 2 + noise.double())  # by segment, then noise
    grouped = segments[order]
    first = torch.searchsorted(grouped, grouped, right=False)
    length = torch.searchsorted(grouped, grouped, right=True) - first
    positions = torch.arange(segments.shape[0], device=segments.device)
    rank = torch.empty_like(positions).scatter_(0, order, positions - first)
    size = torch.empty_like(positions).scatter_(0, order, length)
    return rank, size


def select_segments(
    noise: torch.Tensor, keep: int, prefix: int, boundaries: torch.Tensor, kind: str
) -> torch.Tensor:
    """Kept token ids [1, prefix + keep] of a packed stream, ascending, per segment.

    Args:
        noise: Uniform noise [1, routable] (drawn outside the graph): the tokens after
            the prefix and before a never-routed suffix.
        keep: Routable tokens kept in all (``T - floor(T * rate)`` of the routable ones).
        prefix: Leading tokens always kept.
        boundaries: ``cu_seqlens`` [S + 1] (``kind="offsets"``) or segment ids [T]
            (``kind="ids"``) of the whole stream.
        kind: ``"offsets"`` or ``"ids"``.

    Returns:
        The kept ids: every segment keeps ``len * keep / (T - prefix)`` of its tokens, rounded
        to a neighbouring whole token, at random positions within itself.
    """
    units = noise.shape[1]
    segments = segment_ids_of(boundaries, kind, prefix + units)[prefix : prefix + units]
    rank, size = _rank_in_segment(segments, noise[0])
    # stratified: a token's score is its rank's place within its own segment; the ``keep``
    # lowest scores give each segment its proportional share (ties broken by the noise)
    score = (rank.double() + 0.5) / size.double() + noise[0].double() * (0.25 / units**2)
    kept = score.topk(keep, largest=False).indices.sort().values
    return with_prefix(kept.unsqueeze(0), prefix)


def kept_offsets(value: torch.Tensor, idx: torch.Tensor, **layout: Any) -> torch.Tensor:
    """``cu_seqlens`` of the kept tokens ``idx`` [1, k]: each offset becomes the number of
    kept tokens before it (same dtype and device as ``value``)."""
    return torch.searchsorted(idx[0].contiguous(), value.to(idx.dtype)).to(value.dtype)
