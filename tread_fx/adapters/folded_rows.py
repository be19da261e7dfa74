"""Side values whose dim 0 folds the batch with the tokens: ``[B * N, ...]``.

Factorised video blocks alternate spatial blocks, run on ``[B * F, N, C]`` (frames folded
into the batch), with temporal blocks, run on ``[B * N, F, C]`` (token positions folded into
the batch). A route over the spatial stack also runs the temporal blocks between its routed
blocks, on ``[B * k, F, C]``; what those blocks receive beside the stream is laid out per
token position: Latte's per-sample timestep modulation repeated over the ``N`` positions
(``timestep.repeat_interleave(N, dim=0)``, ``[B * N, 6 C]``). Such a value must keep the
rows of the kept positions: it is viewed as ``[B, N, m, ...]`` (sample-major, then token,
then ``m`` rows per token: ``m = 1`` for one row per position, ``m = F`` for one per
position and frame), the kept token ids of each sample are gathered on the token dim, and
the result folds back to ``[B * k * m, ...]`` — the row order the kept stream gets from
``reshape(B, F, k, C).transpose(1, 2)``. A route over the temporal stack is the mirror
image: its stream ``[B * N, F, C]`` routes frames, and the spatial blocks' per-frame values
``[B * F, ...]`` fold the batch with *its* tokens (the frames); but Latte's per-frame text
(``[B * F, T, C]``) is attention context, passed by an earlier rule, so a route over its
temporal stack fails on its first call.

Example:
    >>> import torch
    >>> from tread_fx.adapters.folded_rows import gather_folded_rows
    >>> value = torch.arange(8.0).view(8, 1)           # B = 2 samples x N = 4 positions
    >>> idx = torch.tensor([[0, 2], [1, 3]])            # kept positions per sample
    >>> gather_folded_rows(value, idx, samples=2, num_tokens=4)[:, 0].tolist()
    [0.0, 2.0, 5.0, 7.0]
"""

from __future__ import annotations

from typing import Any

import torch

from tread_fx.adapters.token_tables import map_tensors, tensor_metas
from tread_fx.adapters.values import SideValue
from tread_fx.runtime.ops import gather_tokens

__all__ = ["rows_per_token", "gather_folded_rows", "why_not_folded"]


def _rows(side: SideValue) -> int | None:
    """Dim 0 of a tensor (or a tuple of same-shape tensors), ``None`` for anything else."""
    metas = tensor_metas(side.meta)
    if metas is None or not metas[0].shape:
        return None
    return metas[0].shape[0]


def rows_per_token(side: SideValue) -> int | None:
    """``m`` when ``side``'s dim 0 folds the samples, the stream's tokens and ``m`` rows per
    token, else ``None``: ``[B * N, ...]`` (``m = 1``) or, for a stream folding ``F``
    sequences per sample, ``[B * N * F, ...]`` (one row per token and frame, ``m = F``).

    Only values computed from a model input count (a constant table, a buffer or a table
    built from shapes alone cannot hold the batch in its rows). Values aligned with the
    stream and values whose dim 0 is the stream's own batch rows (``F == N``: per row or per
    token? See :func:`why_not_folded`) are never matched.
    """
    layout = side.stream
    rows = _rows(side)
    fold = layout.samples * layout.num_tokens
    if rows is None or not side.from_inputs or side.token_aligned or layout.num_tokens < 2:
        return None
    if rows not in (fold, fold * layout.folded) or rows == layout.batch_size:  # ambiguous
        return None
    return rows // fold


def why_not_folded(side: SideValue) -> str | None:
    """Why a ``[B * N, ...]`` value that the routed blocks do not receive is not gathered."""
    layout = side.stream
    rows = _rows(side)
    if rows is None or side.arg_names or side.token_aligned or not side.from_inputs:
        return None
    # ambiguous: samples x tokens is also the stream's own batch rows
    if layout.folded < 2 or not (rows == layout.samples * layout.num_tokens == layout.batch_size):
        return None
    return (
        f"its dim 0 ({rows}) is both the stream's batch rows ({layout.samples} samples x "
        f"{layout.folded} folded sequences) and samples x tokens ({layout.samples} x "
        f"{layout.num_tokens}), so it may be per row (pass) or per token (gather); give the "
        "model a different number of frames than tokens per frame, or register an adapter"
    )


def gather_folded_rows(
    value: Any, idx: torch.Tensor, *, samples: int, num_tokens: int, **layout: Any
) -> Any:
    """Keep the rows of the kept tokens of a ``[B * N * m, ...]`` value.

    Args:
        value: A tensor, or a tuple/list of tensors, whose dim 0 folds ``samples``, then
            ``num_tokens`` tokens, then ``m`` rows per token.
        idx: The route's kept token ids, ``[B, k]``, or ``[B * F, k]`` for a stream whose
            dim 0 folds ``F`` sequences per sample (the first row of each sample is used:
            the selection is shared by its rows).
        samples: The model's batch size ``B``.
        num_tokens: The stream's token count ``N`` (prefix included).
        **layout: The rest of the stream layout (unused; passed to every adapter action).

    Returns:
        ``[B * k * m, ...]`` (same structure); ``value`` itself when every token is kept,
        so rate 0 computes bitwise as the unrouted model.
    """
    if idx.shape[-1] == num_tokens:
        return value
    per_sample = idx.reshape(samples, -1, idx.shape[-1])[:, 0]

    def one(x: torch.Tensor) -> torch.Tensor:
        folded = x.reshape(samples, num_tokens, -1, *x.shape[1:])  # [B, N, m, ...]
        return gather_tokens(folded, per_sample, 1).reshape(-1, *x.shape[1:])

    return map_tensors(value, one)
