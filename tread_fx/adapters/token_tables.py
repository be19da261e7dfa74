"""Token tables: side values with one row per token, and how to cut them to the kept tokens.

RoPE tables and attention masks enter the blocks beside the token stream; their token rows
must follow the stream's selection. *Per-sample* tables carry the batch dim (``[B, N, d]``
cos/sin, ``[B, N]`` key-padding masks, ``[B, 1, N, N]`` attention masks): their rows are
gathered per sample with the stream's kept ids. *Batch-shared* tables have no batch dim
(or a broadcast dim of size 1: ``[N, d]``, Flux's ``[T + N, d]`` text-then-image table,
``[N, N]`` masks) and their consumer broadcasts them over the batch in ways tread_fx cannot
see (``cos[None, :, None, :]``): the route's selection is then shared across the batch
(one fresh random subset per step) and the table's rows are indexed with it, keeping its
shape except for the row count.

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

import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from tread_fx.adapters.values import SideValue, TensorMeta
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
    """

    dims: tuple[int, ...]
    lead: int = 0
    skip: int = 0
    trail: int = 0

    def options(self, batch: int | None) -> dict[str, Any]:
        """Keyword arguments of :func:`take_rows` for this map."""
        return {"dims": self.dims, "lead": self.lead, "skip": self.skip, "trail": self.trail,
                "batch": batch}  # fmt: skip


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
    n, prefix = side.stream.num_tokens, side.stream.prefix
    sizes = {n - prefix: prefix, n: 0}  # row counts that map to stream tokens: their skip
    direct = [d for d in dims if shape[d] in sizes]
    if direct and (all_dims or len(direct) == 1):
        if len({shape[d] for d in direct}) != 1:
            return None
        return RowMap(tuple(direct), skip=sizes[shape[direct[0]]])
    if direct:
        return None
    return _rows_with_extra(side, shape, dims)


def _rows_with_extra(side: SideValue, shape: tuple, dims: list[int]) -> RowMap | None:
    """Find token rows among extra rows by the concatenation or the sum that built them.

    A table of ``T + N`` rows (Flux: text ids then image ids) is tied to the stream only if
    the graph concatenates it (or the ids it is computed from) from parts of which exactly
    one has ``N`` rows; the rows before that part are ``lead``, the rows after it ``trail``.
    Failing that, a table allocated for ``N + T`` rows (``torch.ones(B, image_len +
    text_len)``, a joint key mask) is tied to the stream by the traced sum of the two
    lengths: its operand order is the row order. Several parts of ``N`` rows (``T == N``)
    are told apart by :func:`_tie`.
    """
    n = side.stream.num_tokens
    for dim in dims:
        if shape[dim] <= n:
            continue
        parts = _split_parts(side, shape[dim], n)
        if parts is not None:
            lead, trail = parts
            return RowMap((dim,), lead=lead, trail=trail)
    return None


def _split_parts(side: SideValue, rows: int, n: int) -> tuple[int, int] | None:
    """(lead, trail) by the first ancestor cat of ``rows`` rows with one part of ``n`` rows,
    else by the first traced sum of lengths ``rows`` with one of ``n``."""
    primary = side.primary
    cat = lambda c: c.target in _CAT and _split_of_cat(c, rows, n, primary)  # noqa: E731
    add = lambda c: c.target is operator.add and _split_of_sum(c, rows, n, primary)  # noqa: E731
    return _first_split(side.node, cat) or _first_split(side.node, add)


def _first_split(node: fx.Node, split) -> tuple[int, int] | None:
    """The first ``split(ancestor)`` result (breadth first) for a call_function ancestor."""
    seen, todo = {node}, [node]
    while todo and len(seen) < _SEARCH_LIMIT:
        current = todo.pop(0)
        found = split(current) if current.op == "call_function" else None
        if found:
            return found
        for arg in current.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return None


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
    mine = [i for i in candidates if isinstance(parts[i], fx.Node) and _from(parts[i], primary)]
    if len(mine) == 1:
        return mine
    warnings.warn(
        f"a table joins {len(candidates)} parts of {n} rows (as many as the routed tokens), "
        f"none of them computed from the main input alone; the last of them (part "
        f"{candidates[-1]}) is taken for the token rows. If the token rows are another "
        "part, register a tread_fx.adapters.Adapter for the table.",
        stacklevel=2,
    )
    return candidates[-1:]


def _from(part: fx.Node, primary: Any) -> bool:
    """Whether ``part`` is computed from ``primary`` (within the search limit)."""
    seen, todo = set(), [part]
    while todo and len(seen) < _SEARCH_LIMIT:
        node = todo.pop()
        if node is primary:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return False


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


def _row_ids(idx: torch.Tensor, rows: int, lead: int, skip: int, trail: int) -> torch.Tensor:
    """Table rows [B, r] kept for the kept stream tokens ``idx`` [B, k]."""
    ids = with_prefix(idx[:, skip:] - skip, lead)
    return with_suffix(ids, rows - trail, trail) if trail else ids


def _take_per_sample(x: torch.Tensor, ids: torch.Tensor, batch: int, dim: int) -> torch.Tensor:
    view = [1] * x.dim()
    view[batch], view[dim] = ids.shape
    ordered = ids if batch < dim else ids.transpose(0, 1)
    target = list(x.shape)
    target[dim] = ids.shape[1]
    return x.gather(dim, ordered.reshape(view).expand(target))


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` of a tensor, or of each tensor of a tuple/list; anything else is kept."""
    one = lambda x: fn(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return type(value)(map(one, value)) if isinstance(value, (tuple, list)) else one(value)


def _take_one(x: torch.Tensor, idx: torch.Tensor, dims, lead, skip, trail, batch, broadcast):
    if broadcast is not None and batch is not None:  # [1, N, d] -> [B, N, d], then per sample
        x = x.expand(*x.shape[:broadcast], idx.shape[0], *x.shape[broadcast + 1 :])
    for dim in dims:
        ids = _row_ids(idx, x.shape[dim], lead, skip, trail)
        shared = batch is None
        x = x.index_select(dim, ids[0]) if shared else _take_per_sample(x, ids, batch, dim)
    return x


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
    **layout: Any,
) -> Any:
    """Keep the table rows of the kept tokens ``idx`` [B, k] (prefix ids first).

    Args:
        value: A tensor, or a tuple/list of tensors (e.g. ``(cos, sin)``).
        idx: The route's kept token ids.
        dims, lead, skip, trail: Where the token rows are (see :class:`RowMap`).
        batch: The table's batch dim for a per-sample gather; ``None`` for a batch-shared
            table, indexed with the first sample's ids (the selection is shared).
        broadcast: A dim of size 1 the value is broadcast along over the batch: with
            ``batch`` given, the value is expanded to the batch there and taken per sample.
        **layout: The stream layout (unused; passed to every adapter action).

    Returns:
        The value with only the kept rows, same structure and rank.
    """
    return map_tensors(
        value, lambda x: _take_one(x, idx, dims, lead, skip, trail, batch, broadcast)
    )


def per_sample_rope_table(
    value: Any, idx: torch.Tensor, *, lead: int, skip: int, trail: int, **layout: Any
) -> Any:
    """Turn a batch-shared ``[..., R, d]`` table into a per-sample ``[B, H, r, d]`` one.

    A 2-D ``[R, d]`` table becomes ``[B, 1, r, d]``, a 3-D ``[H, R, d]`` one ``[B, H, r, d]``:
    the layout timm's own patch dropout hands its EVA-family blocks.
    """

    def one(x: torch.Tensor) -> torch.Tensor:
        table = x if x.dim() == 3 else x.unsqueeze(0)
        batched = table.unsqueeze(0).expand(idx.shape[0], *table.shape)
        ids = _row_ids(idx, x.shape[-2], lead, skip, trail)
        return _take_per_sample(batched, ids, 0, 2)

    return map_tensors(value, one)


def share_across_batch(idx: torch.Tensor) -> torch.Tensor:
    """Give every sample the first sample's kept ids (a batch-shared selection)."""
    return idx[:1].expand_as(idx)
