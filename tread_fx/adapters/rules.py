"""The built-in side-input rules, as one table, in the order they are consulted.

Each rule is an :class:`~tread_fx.adapters.values.Adapter`; its ``doc`` says what it
assumes. User adapters are consulted first. No rule reads an argument name or a library:
they decide by the value's shape and use in the blocks (``SideValue.use``, from
:mod:`tread_fx.passes.plan.uses`: ``"table"``, combined elementwise with the stream or q/k
along a token dim; ``"mask"``, on attention scores; ``"ids"``, indexing a table; ``None`` or
``"unknown"``, unseen). Names (``SideValue.arg_names``) are hints for ``explain`` and users.

Example:
    >>> from tread_fx.adapters.rules import BUILTIN_ADAPTERS
    >>> [a.name for a in BUILTIN_ADAPTERS][:3]
    ['packed-offsets', 'packed-segment-ids', 'broadcast-over-tokens']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from tread_fx.adapters.token_tables import (
    RowMap,
    batch_dim_of,
    explain_rows,
    find_rows,
    gather_folded_rows,
    rows_per_token,
    take_rows,
    tensor_metas,
    why_not_folded,
)
from tread_fx.adapters.values import NO_BATCH_DIM, Adapter, SideValue, TensorMeta
from tread_fx.runtime.packed import kept_offsets

__all__ = ["BUILTIN_ADAPTERS"]

_Rows = Callable[[SideValue], RowMap | None]


def _table(side: SideValue) -> tuple[tuple[int, ...] | None, int | None]:
    """(shape, batch dim) of a tensor or a tuple of same-shape tensors, else (None, None)."""
    metas = tensor_metas(side.meta)
    if metas is None:
        return None, None
    return metas[0].shape, batch_dim_of(metas[0], side)


def _has_features(side: SideValue) -> bool:
    """A table has a feature dim last unless only its last dim has as many rows as the
    routed tokens (one value per token: [N], [B, N], [1, N])."""
    shape, batch = _table(side)
    if shape is None:
        return False
    long = [d for d, s in enumerate(shape) if d != batch and s >= side.stream.routable]
    return long != [len(shape) - 1]


def _covers_tokens(side: SideValue, features_last: bool) -> bool:
    """Some dim (not the batch, not features) has at least as many rows as routable tokens."""
    shape, batch = _table(side)
    if shape is None:
        return False
    dims = range(len(shape) - int(features_last))
    return any(shape[d] >= side.stream.routable for d in dims if d != batch)


def _rows_used_as(use: str, per_sample: bool) -> _Rows:
    """The token rows of a value the blocks use as ``use`` (``"table"``, ``"mask"``,
    ``"ids"``) that has a batch dim (``per_sample``) or none. Every dim of N rows of a mask,
    or of a table without features, is a token dim (query and key)."""

    def rows(side: SideValue) -> RowMap | None:
        shape, batch = _table(side)
        if side.use != use or shape is None or (batch is not None) != per_sample:
            return None
        features = use == "table" and _has_features(side)
        all_dims = use != "ids" and not features
        return find_rows(side, batch=batch, features_last=features, all_dims=all_dims)

    return rows


_shared_table = _rows_used_as("table", per_sample=False)


def _broadcast_rows(side: SideValue) -> RowMap | None:
    """A table whose every use is elementwise with the stream between the blocks, with a dim
    of size 1 at the stream's batch dim (``SideValue.batch_broadcast``)."""
    return None if side.batch_broadcast is None else _shared_table(side)


def _rope_of_a_shorter_stream(side: SideValue) -> bool:
    """A rotary table none of whose rows can be the routed tokens' (fewer rows than them)."""
    if side.use != "table" or _table(side)[0] is None:
        return False
    return not _covers_tokens(side, _has_features(side))


def _why_not(use: str, features_last: bool) -> Callable[[SideValue], str | None]:
    """Why a value used as ``use``, with a dim of the tokens' size, has no token rows."""

    def diagnose(side: SideValue) -> str | None:
        if side.use != use or not _covers_tokens(side, features_last):
            return None
        return explain_rows(side, features_last)

    return diagnose


def _unseen(side: SideValue) -> bool:
    """The blocks' use of it is not seen: it meets the stream only inside a leaf module, or
    no block receiving it could be traced through (``tread_fx/passes/plan/uses.py``)."""
    return side.use in (None, "unknown")


def _laid_out_like_stream(side: SideValue) -> RowMap | None:
    """Use unseen, and one value per token and sample: two dims, the batch at the stream's
    batch dim and the token rows at its token dim (``[B, N]``). A value with features
    (``[B, N, d]``) may be another sequence of the same length: not matched."""
    shape, batch = _table(side)
    if not _unseen(side) or batch != side.stream.batch_dim or len(shape) != 2:
        return None
    rows = find_rows(side, batch=batch, features_last=False, all_dims=False)
    aligned = rows is not None and rows.dims == (side.stream.token_dim,)
    return rows if aligned and not (rows.lead or rows.trail) else None


def _integers(side: SideValue, ranks: tuple[int, ...]) -> bool:
    """One integer (not bool) tensor with one of ``ranks`` dims."""
    metas = tensor_metas(side.meta)
    if metas is None or len(metas) != 1 or len(metas[0].shape) not in ranks:
        return False
    dtype = metas[0].dtype
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _token_index_rows(side: SideValue) -> RowMap | None:
    """Use unseen, and a 1-D integer tensor with one entry per token (N, or N - prefix)."""
    if not (_unseen(side) and _integers(side, (1,))):
        return None
    return find_rows(side, batch=None, features_last=False, all_dims=False)


def _packed_mask_source(side: SideValue, ranks: tuple[int, ...]) -> bool:
    """An integer tensor of ``ranks`` dims from which the blocks of a packed stream ([T, dim]
    without a batch dim, or a batch of one packed sequence) build their attention mask."""
    packed = side.stream.batch_dim == NO_BATCH_DIM or side.stream.batch_size == 1
    return packed and side.use == "mask" and _integers(side, ranks)


def _packed_offsets(side: SideValue) -> bool:
    """Cumulative segment offsets [S + 1] of a packed stream: an integer vector shorter
    than the tokens."""
    if not _packed_mask_source(side, (1,)):
        return False
    return tensor_metas(side.meta)[0].shape[0] < side.stream.routable


def _packed_segment_ids(side: SideValue) -> RowMap | None:
    """One segment id per token ([T] or [1, T] integers) of a packed stream."""
    if not _packed_mask_source(side, (1, 2)):
        return None
    return find_rows(side, batch=None, features_last=False, all_dims=False)


_SAME_VALUE = frozenset({"contiguous", "clone", "detach", "to", "float", "half", "bfloat16",
                         "type_as"})  # fmt: skip
_EXPANDS = frozenset({"expand", "expand_as", "broadcast_to", "repeat"})


def _expanded_over_tokens(side: SideValue) -> bool:
    """A token-aligned value made by expanding (or repeating) a token dim of size 1 to N, e.g.
    per-sample modulation ``t.unsqueeze(0).expand(S, -1, -1)``: all its token rows are equal."""
    if not side.token_aligned:
        return False
    node = side.node
    while node.op == "call_method" and node.target in _SAME_VALUE and node.args:
        node = node.args[0]
    expands = node.op == "call_method" and node.target in _EXPANDS
    expands = expands or (node.op == "call_function" and node.target is torch.broadcast_to)
    source = node.args[0].meta.get("tread_meta") if expands else None
    dim = side.stream.token_dim
    return isinstance(source, TensorMeta) and dim < len(source.shape) and source.shape[dim] == 1


def _folded_rows(side: SideValue) -> bool:
    """A [B * N, ...] value not received as a RoPE table or a mask (see token_tables)."""
    return side.use not in ("table", "mask") and rows_per_token(side) is not None


def _cut(
    name: str,
    rows: _Rows,
    doc: str,
    *,
    per_sample: bool = False,
    broadcast: bool = False,
    **more: Any,
) -> Adapter:
    """A rule that keeps the token rows ``rows(side)`` finds with :func:`take_rows`: per
    sample along the value's batch dim (``per_sample``), else with the first sample's ids;
    ``broadcast``: per sample from its expansion along ``SideValue.batch_broadcast``."""

    def options(side: SideValue) -> dict[str, Any]:
        found = rows(side).options(_table(side)[1] if per_sample else None)
        return {**found, "broadcast": side.batch_broadcast} if broadcast else found

    matches = lambda side: rows(side) is not None  # noqa: E731
    return Adapter(name, matches, take_rows, doc, options=options, **more)


_RULES = (
    Adapter(
        "packed-offsets",
        _packed_offsets,
        kept_offsets,
        "Packed streams only ([T, dim], or a batch of one [1, T, dim]): a 1-D integer tensor "
        "shorter than the tokens from which the blocks build their attention mask gives the "
        "samples' boundaries (cumulative segment offsets [S + 1], cu_seqlens). The route selects "
        "per segment (each keeps its share of tokens, in order) and the blocks get the kept "
        "tokens' offsets; a max_seqlen number stays as it is (an upper bound).",
        segments="offsets",
    ),
    _cut(
        "packed-segment-ids",
        _packed_segment_ids,
        "Packed streams only ([T, dim], or a batch of one [1, T, dim]): one segment (sample, "
        "document) id per token ([T] or [1, T] integers) from which the blocks build their "
        "attention mask. The route selects per segment and the kept tokens keep their ids, so "
        "masks built from them stay per segment.",
        segments="ids",
    ),
    Adapter(
        "broadcast-over-tokens",
        _expanded_over_tokens,
        "gather",
        "A token-aligned value expanded (or repeated) from a token dim of size 1 to N (per-sample "
        "adaLN modulation expanded over the tokens, whatever the blocks do with it): its rows are "
        "all equal, so gathering the kept tokens' rows is exact.",
    ),
    Adapter(
        "context",
        lambda side: side.use == "context",
        "pass",
        "A value the blocks attend to (keys/values of an attention whose queries come from the "
        "stream: cross-attention context) or join to the stream as other tokens (text "
        "concatenated along the tokens): its tokens are not the routed ones, so it is passed "
        "through even when its length equals N.",
    ),
    Adapter(
        "not-per-token",
        lambda side: side.use == "none",
        "pass",
        "A value the blocks never combine with the stream per token: per-sample or global (a "
        "timestep embedding [B, d] through a linear layer, a mean, an unused argument), whatever "
        "its sizes (d == N included): passed through unchanged.",
    ),
    _cut(
        "rope-per-sample",
        _rows_used_as("table", per_sample=True),
        "A table combined elementwise with the stream or q/k along a token dim, in or between "
        "the blocks (RoPE cos/sin, positional tables, gates, residuals, a per-token adaLN "
        "modulation [B, N, 6, d]), with the batch dim (size B) and one other non-feature dim of "
        "N (or N - prefix) rows, features last unless only the last dim has token rows ([B, N] "
        "weights): each sample's rows are gathered with its kept ids. Extra rows (T + N) are cut "
        "only where a concatenation in the graph shows where the N token rows are.",
        per_sample=True,
    ),
    _cut(
        "table-between-blocks",
        _broadcast_rows,
        "A table the code between the routed blocks adds (or multiplies) elementwise to the "
        "stream along a token dim, with size 1 at the stream's batch dim ([1, N, d]: a decoder's "
        "position table added between an encoder and a decoder stack): the graph shows it "
        "broadcast over the batch, so its kept rows are taken per sample from its expansion "
        "([B, k, d]), or keep its size 1 ([1, k, d]) under a selection shared across the batch.",
        broadcast=True,
    ),
    _cut(
        "rope-batch-shared",
        _shared_table,
        "A table combined elementwise with the stream or q/k along a token dim (RoPE) without a "
        "batch dim (or with a broadcast dim of 1): [N, d], [N], or a joint model's [T + N, d] "
        "whose text rows come first, as the graph's concatenation of txt_ids and img_ids shows. "
        "The attention broadcasts it over the batch unseen, so the route's selection is shared "
        "across the batch (a fresh subset per step) and the table keeps the kept tokens' rows "
        "plus all non-token (text) rows, in their original order.",
        shares_selection=True,
        diagnose=_why_not("table", features_last=True),
    ),
    Adapter(
        "rope-other-stream",
        _rope_of_a_shorter_stream,
        "pass",
        "A table combined elementwise along a token dim whose rows (all dims but the batch and "
        "the features) are fewer than the routed tokens, e.g. a [T, d] table of a shorter text or "
        "condition stream: it cannot hold the routed tokens' positions, so it is passed "
        "unchanged, even when its head dim d happens to equal N.",
    ),
    _cut(
        "attention-mask",
        _rows_used_as("mask", per_sample=True),
        "A value that reaches attention scores (the attn_mask of scaled_dot_product_attention or "
        "nn.MultiheadAttention, added to q @ k^T, the mask of masked_fill) with the batch dim: a "
        "[B, N] key-padding mask or a [B, 1|H, N|1, N] attention mask. Every dim of N rows is a "
        "token dim (query and key) and is gathered per sample with the kept ids; a sub-mask of a "
        "causal mask stays causal because kept ids are ascending.",
        per_sample=True,
    ),
    _cut(
        "attention-mask-shared",
        _rows_used_as("mask", per_sample=False),
        "A value that reaches attention scores without a batch dim ([N, N], [1, 1, N, N]): "
        "indexed along its token dims with a selection shared across the batch, keeping its shape "
        "apart from the token count.",
        shares_selection=True,
        diagnose=_why_not("mask", features_last=False),
    ),
    _cut(
        "ids",
        _rows_used_as("ids", per_sample=True),
        "Ids the blocks index an embedding or a table with (embedding, index_select, advanced "
        "indexing), [B, N]: each sample's kept tokens keep their original ids (gathered per "
        "sample).",
        per_sample=True,
    ),
    _cut(
        "ids-shared",
        _rows_used_as("ids", per_sample=False),
        "Ids the blocks index an embedding or a table with, without a batch dim ([N], or [1, N] "
        "broadcast over the batch, as language-model code builds position ids): indexed with a "
        "selection shared across the batch.",
        shares_selection=True,
    ),
    _cut(
        "token-index-shared",
        _token_index_rows,
        "Only where no block receiving it could be traced through (its use is unknown): a 1-D "
        "integer tensor of N (or N - prefix) entries holds one index per token (a modulation "
        "index, a segment or modality id, a position): the kept tokens keep their entries, "
        "indexed with a selection shared across the batch. Floating-point [N] vectors are not "
        "assumed per token. Reported with a warning (an Adapter with action 'pass' overrides it).",
        shares_selection=True,
        by_shape_only=True,
    ),
    Adapter(
        "tokens-folded-into-batch",
        _folded_rows,
        gather_folded_rows,
        "A value computed from a model input whose dim 0 folds the batch with the stream's "
        "tokens, sample-major ([B * N, ...], or [B * N * F, ...]: a row per token and folded "
        "frame), as factorised video blocks between the routed ones receive it: viewed as [B, N, "
        "m, ...], each sample's kept tokens are gathered and folded back to [B * k * m, ...]. Not "
        "matched: a value whose dim 0 is also the stream's own batch rows (ambiguous), or a table "
        "or mask (a joint model's [T + N, d] RoPE table has B * N rows when T == N and B == 2).",
        options=lambda side: {
            "samples": side.stream.samples,
            "rows_per_token": rows_per_token(side),
        },
        diagnose=why_not_folded,
    ),
    Adapter(
        "stream-derived",
        lambda side: side.token_aligned and side.from_stream,
        "gather",
        "A token-aligned value computed from the model's first input is a version of the token "
        "stream (a U-ViT skip, a second residual stream): gathered with the same ids.",
    ),
    Adapter(
        "residual",
        lambda side: side.token_aligned and side.combined_with_stream,
        "gather",
        "A token-aligned value added/multiplied elementwise into region values (e.g. ControlNet "
        "residuals added between blocks) is gathered with the same ids.",
    ),
    _cut(
        "per-token-by-shape",
        _laid_out_like_stream,
        "Only where the blocks' use of it is not seen (it meets the stream only inside a leaf "
        "module, or no block receiving it could be traced through): [B, N], the batch and the N "
        "(or N - prefix) token rows at the stream's batch and token dims (a key mask, per-token "
        "ids), is taken for per-token values and gathered per sample, with a warning naming the "
        "value (an Adapter with action 'pass' overrides it: a mask of another sequence of the "
        "same length). Values with features ([B, N, d]), several token-sized dims ([B, N, N]) or "
        "no batch dim are refused in strict mode.",
        per_sample=True,
        by_shape_only=True,
    ),
)

BUILTIN_ADAPTERS: tuple[Adapter, ...] = tuple(replace(rule, builtin=True) for rule in _RULES)
