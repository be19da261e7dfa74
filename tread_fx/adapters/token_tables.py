"""Token tables: side values with one row per token, and how to cut them to the kept tokens.

RoPE tables and attention masks enter the blocks beside the stream; their token rows must
follow its selection. *Per-sample* tables (``[B, N, d]`` cos/sin, ``[B, N]`` or ``[B, 1, N,
N]`` masks) are gathered per sample with the kept ids. *Batch-shared* tables (``[N, d]``,
Flux's ``[T + N, d]`` text-then-image table, ``[N, N]`` masks) are broadcast over the batch
in ways tread_fx cannot see: the route's selection is then shared across the batch and the
table's rows are indexed with it, keeping its shape except for the row count.

*Folded* values fold the batch with the tokens in dim 0: factorised video blocks run
temporal blocks on ``[B * N, F, C]`` between the routed spatial blocks on ``[B * F, N, C]``,
so what they receive per token position (Latte's ``timestep.repeat_interleave(N, dim=0)``,
``[B * N, 6 C]``) keeps the kept positions' rows: viewed as ``[B, N, m, ...]`` (``m`` rows
per token: 1, or ``F`` for one per position and frame), gathered on the token dim and folded
back to ``[B * k * m, ...]``, the kept stream's row order. A route over the temporal stack is
the mirror image, but Latte's per-frame text (``[B * F, T, C]``) is attention context,
passed by an earlier rule, so such a route fails on its first call.

Example:
    >>> import torch
    >>> from tread_fx.adapters.token_tables import take_rows
    >>> table = torch.arange(6.0).view(6, 1)          # 2 text rows, then 4 image rows
    >>> idx = torch.tensor([[0, 3], [1, 2]])          # kept image tokens (per sample)
    >>> take_rows(table, idx[:1].expand(2, 2), dims=(0,), lead=2, skip=0, trail=0,
    ...           batch=None)[:, 0].tolist()
    [0.0, 1.0, 2.0, 5.0]
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from tread_fx.adapters.values import SideValue, TensorMeta
from tread_fx.errors import warn_at_caller
from tread_fx.runtime.ops import gather_tokens, token_index
from tread_fx.runtime.selection import with_prefix, with_suffix

__all__ = [
    "RowMap",
    "find_rows",
    "explain_rows",
    "take_rows",
    "per_sample_rope_table",
    "share_across_batch",
    "tensor_metas",
    "batch_dim_of",
    "map_tensors",
    "rows_per_token",
    "gather_folded_rows",
    "why_not_folded",
]

_CAT = (torch.cat, torch.concat, torch.concatenate)
_SEARCH_LIMIT = 400


@dataclass(frozen=True)
class RowMap:
    """Where a table's token rows are and how they map to stream tokens.

    Attributes:
        dims: Dims of the table that hold token rows (one for RoPE tables, two for a
            query x key mask).
        lead: Rows before the token rows that are not stream tokens (Flux's text rows;
            always kept).
        skip: Leading stream tokens that have no row (timm EVA's tables leave out the
            cls/register tokens).
        trail: Rows after the token rows (always kept).
        drop: Trailing stream tokens that have no row (text behind the image tokens, where the
            table holds the image tokens' rows only).
    """

    dims: tuple[int, ...]
    lead: int = 0
    skip: int = 0
    trail: int = 0
    drop: int = 0

    def options(self, batch: int | None) -> dict[str, Any]:
        """Keyword arguments of :func:`take_rows` for this map."""
        return {**vars(self), "batch": batch}


def tensor_metas(meta: Any) -> list[TensorMeta] | None:
    """The ``TensorMeta`` of a value, or of each element of a flat tuple/list of tensors.

    Returns ``None`` when the value holds anything else, or tensors of differing shapes.
    """
    metas = list(meta) if isinstance(meta, (tuple, list)) else [meta]
    if not metas or not all(isinstance(m, TensorMeta) for m in metas):
        return None
    return metas if len({m.shape for m in metas}) == 1 else None


def batch_dim_of(meta: TensorMeta, side: SideValue) -> int | None:
    """The dim of ``meta`` that holds the batch (size B > 1), or ``None`` if it has none."""
    stream = side.stream
    if stream.batch_size == 1:
        return None
    for dim in (stream.batch_dim, 0):
        if dim < len(meta.shape) and meta.shape[dim] == stream.batch_size:
            return dim
    return None


def find_rows(
    side: SideValue, *, batch: int | None, features_last: bool, all_dims: bool
) -> RowMap | None:
    """Find the token rows of a table entering a routed region.

    Args:
        side: The side value (a tensor or a tuple of same-shape tensors).
        batch: The table's batch dim (excluded from the search), or ``None``.
        features_last: The last dim holds features, never tokens (RoPE tables).
        all_dims: Every dim of the token size is a token dim (a query x key mask);
            otherwise exactly one dim must qualify.

    Returns:
        The :class:`RowMap`, or ``None`` when the table's rows cannot be tied to the stream's
        tokens unambiguously.
    """
    metas = tensor_metas(side.meta)
    if metas is None:
        return None
    shape = metas[0].shape
    dims = [d for d in range(len(shape) - int(features_last)) if d != batch]
    n, prefix, suffix = side.stream.num_tokens, side.stream.prefix, side.stream.suffix
    # row counts that map to stream tokens: (skip, drop), the routable tokens' first
    sizes = {n: (0, 0), n - prefix: (prefix, 0), n - prefix - suffix: (prefix, suffix)}
    direct = [d for d in dims if shape[d] in sizes]
    if direct:
        if not (all_dims or len(direct) == 1) or len({shape[d] for d in direct}) != 1:
            return None
        skip, drop = sizes[shape[direct[0]]]
        return RowMap(tuple(direct), skip=skip, drop=drop)
    for dim in dims:  # more rows than tokens: tied to the stream by what built them
        parts = _split_parts(side, shape[dim], n) if shape[dim] > n else None
        if parts is not None:  # a mask's query and key dims both, when it has them
            same = tuple(d for d in dims if shape[d] == shape[dim]) if all_dims else (dim,)
            return RowMap(same, lead=parts[0], trail=parts[1])
    return None


def _split_parts(side: SideValue, rows: int, n: int) -> tuple[int, int] | None:
    """(lead, trail) of a table of ``rows`` rows around its ``n`` token rows.

    A ``T + N`` table (Flux: text ids then image ids) is tied to the stream by the first
    ancestor concatenation of ``rows`` rows with exactly one part of ``n`` rows; failing
    that, a table allocated for ``N + T`` rows (``torch.ones(B, image_len + text_len)``) by
    the first traced sum of lengths with one of ``n`` (operand order is row order). Several
    parts of ``n`` rows (``T == N``) are told apart by :func:`_tie`.
    """
    calls = [c for c in _ancestors(side.node) if c.op == "call_function"]
    cats = (_split_of_cat(c, rows, n, side.primary) for c in calls if c.target in _CAT)
    sums = (_split_of_sum(c, rows, n, side.primary) for c in calls if c.target is operator.add)
    return next(filter(None, itertools.chain(cats, sums)), None)


def _ancestors(node: fx.Node) -> Iterator[fx.Node]:
    """``node`` and the nodes it is computed from, breadth first, within the search limit."""
    seen, todo = {node}, [node]
    while todo and len(seen) < _SEARCH_LIMIT:
        current = todo.pop(0)
        yield current
        for arg in current.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)


def _split_of_cat(cat: fx.Node, rows: int, n: int, primary: Any) -> tuple[int, int] | None:
    """(lead, trail) of a cat of ``rows`` rows around its one part of ``n`` rows."""
    parts = cat.args[0] if cat.args else cat.kwargs.get("tensors", ())
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    out = cat.meta.get("tread_meta")
    if not isinstance(out, TensorMeta) or not isinstance(dim, int):
        return None
    dim %= len(out.shape)
    if out.shape[dim] != rows:
        return None
    sizes = [_size(p, dim) for p in parts]
    return None if None in sizes else _around(parts, sizes, n, primary)


def _split_of_sum(add: fx.Node, rows: int, n: int, primary: Any) -> tuple[int, int] | None:
    """(lead, trail) of a traced ``a + b == rows`` of lengths around the one of ``n``."""
    values = [a.meta.get("tread_meta") if isinstance(a, fx.Node) else a for a in add.args[:2]]
    if len(values) != 2 or not all(type(v) is int for v in values) or sum(values) != rows:
        return None
    return _around(add.args, values, n, primary)


def _around(parts: Any, sizes: list[int], n: int, primary: Any) -> tuple[int, int] | None:
    """The sizes before and after the one part of ``n`` rows (several: :func:`_tie`)."""
    candidates = [i for i, size in enumerate(sizes) if size == n]
    if len(candidates) > 1:  # T == N
        candidates = _tie(parts, candidates, n, primary)
    if len(candidates) != 1:
        return None
    at = candidates[0]
    return sum(sizes[:at]), sum(sizes[at + 1 :])


def _tie(parts: Any, candidates: list[int], n: int, primary: Any) -> list[int]:
    """Of several parts of ``n`` rows, the one computed from the model's main input (the
    stream's; a length read from it). Failing that, the last one (joint models put other
    tokens first), reported with a warning naming the choice and the override."""
    nodes = [i for i in candidates if isinstance(parts[i], fx.Node)]
    mine = [i for i in nodes if primary in _ancestors(parts[i])]
    if len(mine) == 1:
        return mine
    warn_at_caller(
        f"a table joins {len(candidates)} parts of {n} rows (as many as the routed tokens), "
        f"none of them computed from the main input alone; the last of them (part "
        f"{candidates[-1]}) is taken for the token rows. If the token rows are another "
        "part, register a tread_fx.adapters.Adapter for the table."
    )
    return candidates[-1:]


def explain_rows(side: SideValue, features_last: bool) -> str:
    """Why :func:`find_rows` found no token rows in ``side`` (for refusal messages)."""
    metas = tensor_metas(side.meta)
    if metas is None:
        return "it is not a tensor or a tuple of same-shape tensors"
    n, prefix = side.stream.num_tokens, side.stream.prefix
    sizes = f"{n}" + (f" or {n - prefix}" if prefix else "")
    what = "no non-feature dim" if features_last else "no dim"
    return (
        f"{what} of shape {metas[0].shape} has {sizes} rows, or more rows built by a "
        f"concatenation with exactly one part of {n} rows (or one computed from the main "
        "input), so its token rows cannot be told apart from other rows"
    )


def _size(part: Any, dim: int) -> int | None:
    meta = part.meta.get("tread_meta") if isinstance(part, fx.Node) else None
    return meta.shape[dim] if isinstance(meta, TensorMeta) and dim < len(meta.shape) else None


# -- runtime ops (inserted into routed graphs) -----------------------------------------------


def _row_ids(
    idx: torch.Tensor, rows: int, lead: int, skip: int, trail: int, drop: int = 0
) -> torch.Tensor:
    """Table rows [B, r] kept for the kept stream tokens ``idx`` [B, k]."""
    ids = with_prefix(idx[:, skip : idx.shape[1] - drop] - skip, lead)
    return with_suffix(ids, rows - trail, trail) if trail else ids


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` of a tensor, or of each tensor of a tuple/list; anything else is kept."""
    one = lambda x: fn(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return type(value)(map(one, value)) if isinstance(value, (tuple, list)) else one(value)


def take_rows(
    value: Any,
    idx: torch.Tensor,
    *,
    dims: tuple[int, ...],
    lead: int,
    skip: int,
    trail: int,
    batch: int | None,
    broadcast: int | None = None,
    drop: int = 0,
    **layout: Any,
) -> Any:
    """Keep the table rows of the kept tokens ``idx`` [B, k] (prefix ids first).

    Args:
        value: A tensor, or a tuple/list of tensors (e.g. ``(cos, sin)``).
        idx: The route's kept token ids.
        dims, lead, skip, trail, drop: Where the token rows are (see :class:`RowMap`).
        batch: The table's batch dim for a per-sample gather; ``None`` for a batch-shared
            table, indexed with the first sample's ids (the selection is shared).
        broadcast: A dim of size 1 the value is broadcast along over the batch: with
            ``batch`` given, the value is expanded to the batch there and taken per sample.
        **layout: The stream layout (unused; passed to every adapter action).

    Returns:
        The value with only the kept rows, same structure and rank.
    """

    def one(x: torch.Tensor) -> torch.Tensor:
        if broadcast is not None and batch is not None:  # [1, N, d] -> [B, N, d], per sample
            x = x.expand(*x.shape[:broadcast], idx.shape[0], *x.shape[broadcast + 1 :])
        for dim in dims:
            ids = _row_ids(idx, x.shape[dim], lead, skip, trail, drop)
            if batch is None:
                x = x.index_select(dim, ids[0])
            else:
                x = x.gather(dim, token_index(ids, x, dim, batch))
        return x

    return map_tensors(value, one)


def per_sample_rope_table(
    value: Any,
    idx: torch.Tensor,
    *,
    lead: int,
    skip: int,
    trail: int,
    drop: int = 0,
    **layout: Any,
) -> Any:
    """Turn a batch-shared ``[..., R, d]`` table into a per-sample ``[B, H, r, d]`` one.

    A 2-D ``[R, d]`` table becomes ``[B, 1, r, d]``, a 3-D ``[H, R, d]`` one ``[B, H, r, d]``:
    the layout timm's own patch dropout hands its EVA-family blocks.
    """

    def one(x: torch.Tensor) -> torch.Tensor:
        table = x if x.dim() == 3 else x.unsqueeze(0)
        batched = table.unsqueeze(0).expand(idx.shape[0], *table.shape)
        ids = _row_ids(idx, x.shape[-2], lead, skip, trail, drop)
        return batched.gather(2, token_index(ids, batched, 2, 0))

    return map_tensors(value, one)


def share_across_batch(idx: torch.Tensor) -> torch.Tensor:
    """Give every sample the first sample's kept ids (a batch-shared selection)."""
    return idx[:1].expand_as(idx)


# -- values whose dim 0 folds the batch with the tokens: [B * N, ...] ------------------------


def _rows(side: SideValue) -> int | None:
    """Dim 0 of a tensor (or a tuple of same-shape tensors), ``None`` for anything else."""
    metas = tensor_metas(side.meta)
    return metas[0].shape[0] if metas and metas[0].shape else None


def rows_per_token(side: SideValue) -> int | None:
    """``m`` when ``side``'s dim 0 folds the samples, the stream's tokens and ``m`` rows per
    token (``[B * N, ...]``: 1; ``[B * N * F, ...]`` for a stream folding ``F`` sequences per
    sample: ``F``), else ``None``. Only values computed from a model input count (a constant
    or shape-built table cannot hold the batch in its rows); values aligned with the stream
    or whose dim 0 is the stream's own batch rows (``F == N``: :func:`why_not_folded`) never
    do.
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

    Example:
        >>> value = torch.arange(8.0).view(8, 1)           # B = 2 samples x N = 4 positions
        >>> idx = torch.tensor([[0, 2], [1, 3]])            # kept positions per sample
        >>> gather_folded_rows(value, idx, samples=2, num_tokens=4)[:, 0].tolist()
        [0.0, 2.0, 5.0, 7.0]
    """
    if idx.shape[-1] == num_tokens:
        return value
    per_sample = idx.reshape(samples, -1, idx.shape[-1])[:, 0]

    def one(x: torch.Tensor) -> torch.Tensor:
        folded = x.reshape(samples, num_tokens, -1, *x.shape[1:])  # [B, N, m, ...]
        return gather_tokens(folded, per_sample, 1).reshape(-1, *x.shape[1:])

    return map_tensors(value, one)
