"""The token stream's dims: where the batch and the tokens are, and which tokens are routed.

A stream is ``[B, N, C]``, ``[N, B, C]`` or ``[B * F, N, C]`` (frames or positions folded into
the batch: one selection shared by all rows, so every folded sequence keeps the same tokens
and blocks that mix them, temporal attention across frames, see consistent ones), or:

- *token-major* 4-D with the channels last: a patch grid ``[B, H, W, C]`` or a head-split
  ``[B, N, heads, d]``, routed by whole dim-1 slices (the kept rows of a grid form a smaller
  ``r x W`` grid the blocks see natively). A feature map ``[B, C, H, W]`` is refused;
- *packed* ``[tokens, dim]`` (samples concatenated along one axis: NaViT, flash-attn varlen),
  routed as one sequence (``batch_dim == NO_BATCH_DIM``, ``token_dim == 0``, batch size 1),
  per segment when the blocks receive the boundaries (``cu_seqlens``, segment ids). A 2-D
  value is one only when its rows are not the batch or the blocks receive integer token
  data beside it: per-sample vectors ``[B, dim]`` stay refused.

Tokens concatenated to the image tokens along the token dim (cls/registers in front, as in
timm; a text stream behind, ``cat([image, text], 1)``) are a never-routed *prefix* and
*suffix*: kept by every route, written back in place at the route end.

Example:
    >>> import torch
    >>> block = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    >>> channels_last(block, (2, 4, 4, 8)), channels_last(block, (2, 8, 4, 4))
    (True, False)
    >>> packed_layout((24, 32))
    (-1, 0, 1, 1)
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from tread_fx.adapters.values import NO_BATCH_DIM, TensorMeta
from tread_fx.errors import SelectionError, TokenStreamError, shown, with_article
from tread_fx.passes.locate.batch_dim import Layout, decide_layout
from tread_fx.passes.locate.dataflow import (
    argument_name,
    data_ancestors,
    fed_by,
    input_slots,
    tensor_meta,
)
from tread_fx.passes.trace.concats import concatenation_parts
from tread_fx.passes.trace.tracer import TracedCall
from tread_fx.runtime.selection import Strategy, select_random

__all__ = [
    "GRID_ROWS",
    "stream_dims",
    "joint_parts",
    "channels_last",
    "is_token_major",
    "token_major_unit",
    "packed_layout",
    "segment_boundaries",
    "check_packed_strategy",
]

# every selection on a 4-D token-major stream keeps whole dim-1 slices (rows of a grid)
GRID_ROWS = Strategy("rows", False, lambda n, grid: n, select_random)


def stream_dims(
    traced: TracedCall,
    module: nn.Module,
    blocks: list[Any],
    primary: fx.Node,
    lists: list[str],
    batch_dim: int | None = None,
) -> tuple[tuple[int, int, int, int], str]:
    """((batch dim, token dim, batch size, rows folded per sample), why) of the stream
    entering ``blocks[0]`` (a ``BlockCall``, of ``module``); refuses one of none of the forms
    above. A main input given as a list of per-sample tensors has the list's length as batch
    size. Where the shape allows several layouts, what the blocks mix decides
    (:mod:`tread_fx.passes.locate.batch_dim`), or the user's ``batch_dim=``.
    """
    block = blocks[0]
    meta = block.stream_in.meta["tread_meta"]
    listed = _list_batch(traced, primary)
    if _is_packed(meta.shape, block.node, block.stream_in, _batch_of(primary, listed)):
        _check_one_packed_stream(block.node, module, block.path, block.stream_in, primary)
        return packed_layout(meta.shape), "a packed [tokens, dim] stream: no batch dim"
    _check_stream_rank(module, block.path, lists, meta.shape)
    layouts = _layouts(meta, primary, listed)
    layout, why = decide_layout(traced.gm, blocks, meta.shape, layouts, batch_dim)
    _check_token_count(meta, layout)
    return (layout.batch_dim, layout.token_dim, layout.batch_size, layout.folded), why


def _list_batch(traced: TracedCall, primary: fx.Node) -> int | None:
    """The length of the list of per-sample tensors that ``primary`` belongs to, if any."""
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    if primary not in placeholders or len(placeholders) != len(traced.tensor_positions):
        return None
    leaf = traced.tensor_positions[placeholders.index(primary)]
    count = traced.in_spec.num_leaves
    args, kwargs = pytree.tree_unflatten(list(range(count)), traced.in_spec)
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)) and leaf in value:
            return len(value) if all(isinstance(v, int) for v in value) else None
    return None


def _batch_of(primary: fx.Node, listed: int | None) -> int | None:
    """The batch size the main input tells: a list's length, or dim 0 of a tensor of rank 3
    or more (``None`` for a [tokens, dim] input: packed tokens or per-sample vectors)."""
    if listed is not None:
        return listed
    meta = tensor_meta(primary)
    return meta.shape[0] if meta is not None and len(meta.shape) >= 3 else None


def _input_batch_sizes(primary: fx.Node, listed: int | None) -> list[int]:
    """The sizes the model's main input may have as its batch: a list's length, else its
    dim 0 and, for a ``[B, N, C]`` / ``[T, B, C]`` input (sequence-first), its dim 1."""
    if listed is not None:
        return [listed]
    pmeta = tensor_meta(primary)
    if pmeta is None or not pmeta.shape:
        return []
    return list(dict.fromkeys(pmeta.shape[: 2 if len(pmeta.shape) == 3 else 1]))


def _layouts(meta: TensorMeta, primary: fx.Node, listed: int | None) -> list[Layout]:
    """The readings of a ``[B, N, ...]``, ``[N, B, ...]`` or ``[B * F, N, ...]`` stream that
    its shape and the main input's sizes allow, one per batch dim (dim 0 of the input first)."""
    sizes = _input_batch_sizes(primary, listed) or [meta.shape[0]]
    rows, second = meta.shape[0], meta.shape[1]
    found: dict[int, Layout] = {}
    for size in sizes:
        if rows == size:
            found.setdefault(0, Layout(0, 1, rows))
        if second == size:
            found.setdefault(1, Layout(1, 0, second))
    folds = rows > sizes[0] and rows % sizes[0] == 0  # frames or positions folded into dim 0
    if not found and folds:
        found[0] = Layout(0, 1, rows, rows // sizes[0])
    if not found:
        raise TokenStreamError(
            f"the token stream has shape {tuple(meta.shape)}, but the batch size {sizes[0]} "
            "(dim 0 of the first input) is in neither of its first two dims nor folded into "
            "dim 0; tread_fx needs [B, N, ...], [N, B, ...] or [B * F, N, ...] streams: pass "
            "blocks= naming a stack whose blocks see the batch, or route a model that keeps "
            "it (a main input given as a list of per-sample tensors has the list's length as "
            "batch size)."
        )
    return list(found.values())


def _check_token_count(meta: TensorMeta, layout: Layout) -> None:
    """Refuse sequences of one token: routing would save nothing."""
    tokens, folded = meta.shape[layout.token_dim], layout.folded
    if tokens < 2:
        raise TokenStreamError(
            f"the blocks see sequences of {tokens} token, so routing would save nothing; route "
            "a stack whose blocks see longer sequences (pass blocks=), or drop the route.\n"
            f"The token stream has shape {tuple(meta.shape)}: {tokens} token on dim "
            f"{layout.token_dim}"
            + (f"; dim 0 folds {folded} sequences per sample into the batch" if folded > 1 else "")
            + "."
        )


def _feature_sizes(block: nn.Module) -> tuple[set[int], set[int]]:
    """(sizes read as the last dim: Linear inputs, norms; channels read on dim 1: convs)."""
    last, first = set(), set()
    for module in block.modules():
        if isinstance(module, nn.Linear):
            last.add(module.in_features)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.normalized_shape:
            last.add(module.normalized_shape[-1])
        elif isinstance(module, nn.modules.conv._ConvNd):
            first.add(module.in_channels)
        elif isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):
            first.add(getattr(module, "num_features", getattr(module, "num_channels", 0)))
    return last, first


def channels_last(block: nn.Module, shape: tuple[int, ...]) -> bool:
    """Whether ``block`` reads the last dim of a 4-D input as its channels (and not dim 1)."""
    last, first = _feature_sizes(block)
    return shape[-1] in last and (shape[1] not in first or shape[1] == shape[-1])


def is_token_major(shape: tuple[int, ...]) -> bool:
    """A located stream of rank 4: tokens on dim 1, whole dim-1 slices routed."""
    return len(shape) == 4


def _check_stream_rank(block: nn.Module, block_path: str, lists: list[str], shape) -> None:
    """Refuse a stream that is neither [B, N, C] / [N, B, C] nor 4-D channels-last."""
    shape = tuple(shape)
    if len(shape) == 3 or (len(shape) == 4 and channels_last(block, shape)):
        return
    ndim = with_article(f"{len(shape)}-D")
    if len(shape) == 4:
        why = (
            "a feature map such as [B, C, H, W]: block's convolutions or norms read dim 1 "
            f"({shape[1]}) as channels, or nothing in it reads the last dim ({shape[-1]}) as "
            "channels, so its axes are not tokens"
        )
    elif len(shape) == 2:
        why = (
            "a [rows, dim] value whose rows are the batch (per-sample vectors), and nothing "
            "marks it as a packed stream (samples' tokens concatenated along one axis): a "
            "packed stream is routed when its rows are not the batch or when the blocks "
            "receive its segment boundaries beside it (cu_seqlens, segment or position ids "
            "as integer tensors)"
        )
    else:
        why = f"{ndim} value has no [batch, tokens, ...] layout tread_fx can route"
    raise TokenStreamError(
        f"no token sequence flows through {_lists_text(lists)}: its blocks take a "
        f"{_kind(shape)}, not [batch, tokens, dim]; route a token-based backbone.\n"
        f"The value entering block "
        f"{block_path} is {ndim} tensor of shape {list(shape)}, not a 3-D [batch, "
        "tokens, dim] (or [tokens, batch, dim]) tensor nor a channels-last 4-D stream "
        f"([B, H, W, C] or [B, N, heads, d]); it is {why}. tread_fx routes token sequences "
        "only; if another list of the model's blocks takes them, pass blocks= naming it."
    )


def _kind(shape: tuple) -> str:
    """A short name for a value that is no token stream."""
    return {4: "4-D feature map", 2: "[rows, dim] value"}.get(len(shape), f"{len(shape)}-D tensor")


def _lists_text(lists: list[str]) -> str:
    """The first block list, and how many more (for a first line)."""
    more = f" (and {len(lists) - 1} more lists)" if len(lists) > 1 else ""
    return f"{shown(lists[0])}{more}"


def token_major_unit(shape) -> str | None:
    """What one routed unit of a 4-D stream is, for ``explain`` (``None``: a single token)."""
    if not is_token_major(tuple(shape)):
        return None
    _, n, w, c = shape
    return (
        f"a whole dim-1 slice [{w}, {c}] of the 4-D stream (a row of a channels-last "
        f"[B, H, W, C] grid, or a token of [B, N, heads, d]): the kept rows form a smaller "
        f"r x {w} grid the blocks see natively, so every selection= keeps whole rows; a block "
        "that pads its input to a window size computes on the padded window either way"
    )


def _integer_token_data(block: fx.Node, stream: fx.Node) -> bool:
    """The block receives an integer tensor of rank 1 or 2 beside the stream."""
    for node in input_slots(block).values():
        meta = tensor_meta(node)
        if node is stream or meta is None or len(meta.shape) not in (1, 2):
            continue
        if not (meta.dtype.is_floating_point or meta.dtype.is_complex) and meta.dtype.itemsize > 1:
            return True
    return False


def _is_packed(shape: tuple, block: fx.Node, stream: fx.Node, batch: int | None) -> bool:
    """Whether a 2-D ``shape`` entering ``block`` is a packed stream: its rows are not the
    ``batch`` the main input tells, or the block receives integer token data beside it."""
    if len(shape) != 2:
        return False
    return (batch is not None and shape[0] != batch) or _integer_token_data(block, stream)


def packed_layout(shape: tuple) -> tuple[int, int, int, int]:
    """(batch dim, token dim, batch size, folded rows) of a packed stream of ``shape``."""
    if shape[0] < 2:
        raise TokenStreamError(
            f"the packed token stream has shape {list(shape)}: {shape[0]} token, so routing "
            "would save nothing. Route a stack whose blocks see longer sequences (pass "
            "blocks=), or call the model with more tokens."
        )
    return NO_BATCH_DIM, 0, 1, 1


def _check_one_packed_stream(
    block: fx.Node, module: Any, path: str, stream: fx.Node, primary: fx.Node
) -> None:
    """Refuse a first block that receives several packed streams fed by the main input (slices
    of a joint buffer the noisy tokens were written into by index: which slice holds them
    depends on the index values, which data flow cannot tell)."""
    meta = tensor_meta(stream)
    streams = [
        (key, node)
        for key, node in input_slots(block).items()
        if (m := tensor_meta(node)) is not None
        and len(m.shape) == 2
        and m.shape[-1] == meta.shape[-1]
        and m.dtype == meta.dtype
        and (node is stream or primary in data_ancestors(node, set()))
    ]
    if len(streams) < 2:
        return
    found = ", ".join(
        f"{_argument_label(module, k)} {list(tensor_meta(n).shape)}" for k, n in streams
    )
    raise TokenStreamError(
        f"block {path} receives {len(streams)} packed token streams from the noisy input, "
        "and data flow cannot tell which to route; pass blocks= naming other blocks.\n"
        f"The streams: {found}. The model writes its tokens into one joint "
        "buffer at positions held in index tensors and hands the blocks slices of it, so "
        "which slice carries the noisy tokens (and which is text or conditioning, never "
        "routed) depends on the index values, which data flow cannot tell. tread_fx routes "
        "a packed stream only when exactly one block argument carries tokens computed from "
        "the noisy input: build the other slices apart from it (e.g. concatenate the text "
        "and noisy tokens instead of writing both into one buffer by index), or pass "
        "blocks= naming a stack whose blocks see one such stream."
    )


def _argument_label(module: Any, key: tuple) -> str:
    return argument_name(module, key) + "".join(f"[{k}]" for k in key[2:])


def segment_boundaries(entering: list) -> tuple[fx.Node, str] | None:
    """(value, kind) of the segment boundaries the routed blocks receive, if any: the
    entering values whose rule said they hold them (``Crossing.segments``).

    Raises:
        TokenStreamError: The blocks receive several different boundary values.
    """
    found = {c.node: c.segments for c in entering if c.segments is not None}
    if len(found) > 1:
        names = ", ".join(f"'{n.name}' ({k})" for n, k in found.items())
        raise TokenStreamError(
            f"the routed blocks receive {len(found)} segment boundary values of the packed "
            f"stream ({names}); tread_fx selects per segment from one of them and cannot "
            "tell whether they agree. Pass the blocks one (cu_seqlens or segment ids), or "
            "register an Adapter that passes the others through."
        )
    return next(iter(found.items()), None)


def check_packed_strategy(strategy_name: str, needs_grid: bool) -> None:
    """Refuse a grid-shaped selection on a packed stream (its segments are no grid)."""
    if needs_grid:
        raise SelectionError(
            f"selection={strategy_name!r} keeps whole rows of a patch grid, but the stream is "
            "a packed [tokens, dim] sequence of segments; use selection='random' (or "
            "'auto'), which selects per segment."
        )


def joint_parts(
    model: nn.Module,
    keep_prefix: int | None,
    stream0: fx.Node,
    primary: fx.Node,
    token_dim: int,
    num_tokens: int,
) -> tuple[int, int]:
    """``(prefix, suffix)``: never-routed leading and trailing tokens of the stream ``stream0``
    entering the first block. The suffix is detected; the prefix is ``keep_prefix``, else the
    model's ``num_prefix_tokens`` where a concatenation builds the stream, else detected."""
    prefix, suffix = _parts_from_concat(stream0, primary, token_dim, num_tokens)
    declared = getattr(model, "num_prefix_tokens", None)
    if keep_prefix is not None:
        prefix = keep_prefix
        if prefix + suffix >= num_tokens:
            raise TokenStreamError(
                f"keep_prefix={keep_prefix} leaves no token to route:\nthe stream has "
                f"{num_tokens} tokens ({suffix} trailing ones never routed); pass a smaller "
                "keep_prefix, or None to detect the cls/register tokens."
            )
    elif isinstance(declared, int) and _concatenated(stream0, token_dim, num_tokens):
        prefix = declared  # the model's own count of the tokens it concatenates in front
    return prefix, suffix


def _concatenated(stream0: fx.Node, token_dim: int, num_tokens: int) -> bool:
    """Whether a concatenation along the token dim builds the stream (else a declared prefix,
    CaiT's class token added only before its later blocks, is not in this stream)."""
    upstream = data_ancestors(stream0, set()) | {stream0}
    return any(_concat_parts(n, token_dim, num_tokens) is not None for n in upstream)


def _parts_from_concat(
    stream0: fx.Node, primary: fx.Node, token_dim: int, num_tokens: int
) -> tuple[int, int]:
    """Count tokens concatenated in front of (cls, registers) and behind (text) the parts
    computed from ``primary`` (the image tokens), in the concatenation along the token dim
    nearest to the stream. A single image part that is itself such a concatenation (history
    frames added one group at a time) is searched in turn; the counts of every level add up.
    """
    upstream = data_ancestors(stream0, set()) | {stream0}
    for node in reversed([n for n in stream0.graph.nodes if n in upstream]):
        found = _concat_parts(node, token_dim, num_tokens)
        if found is None:
            continue
        parts, sizes = found
        image = [i for i, part in enumerate(parts) if fed_by(part, primary)]
        if not image:
            continue
        prefix, suffix = sum(sizes[: image[0]]), sum(sizes[image[-1] + 1 :])
        part = parts[image[0]]
        if len(image) == 1 and part is not primary and sizes[image[0]] != num_tokens:
            inner = _parts_from_concat(part, primary, token_dim, sizes[image[0]])
            prefix, suffix = prefix + inner[0], suffix + inner[1]
        return prefix, suffix
    return 0, 0


def _concat_parts(
    node: fx.Node, token_dim: int, num_tokens: int
) -> tuple[list[fx.Node], list[int]] | None:
    """Parts and token counts of a concatenation along the token dim into ``num_tokens`` (a
    ``torch.cat``, or a leaf such as ``pack``: :mod:`tread_fx.passes.trace.concats`)."""
    out = tensor_meta(node)
    if out is None or len(out.shape) <= token_dim or out.shape[token_dim] != num_tokens:
        return None
    return concatenation_parts(node, token_dim)
