"""Packed ``[tokens, dim]`` streams: samples concatenated along one token axis, no batch dim.

NaViT-style training, flash-attn varlen and many LLM-like backbones pack a batch into one
sequence; the blocks learn where each sample (segment) starts from cumulative offsets
(``cu_seqlens`` [S + 1]) or one segment id per token ([T]). Such a stream is routed as one
sequence of T tokens (``batch_dim == NO_BATCH_DIM``, ``token_dim == 0``, batch size 1)
with a per-segment selection when the blocks receive the boundaries (the adapter rules
``packed-offsets`` and ``packed-segment-ids``), so every segment keeps its own share of
tokens and no token moves to another segment; without boundaries the stream is one segment.

A 2-D value is taken for a packed stream only when something says it is one: its rows are
not the batch (the first input's dim 0, or the length of a list of per-sample inputs), or
the blocks receive integer token data beside it (offsets, segment or position ids). A
stack of per-sample vectors ``[B, dim]`` stays refused: its rows are samples, not tokens.

Example:
    >>> packed_layout((24, 32))
    (-1, 0, 1, 1)
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from tread_fx.adapters.values import NO_BATCH_DIM, TensorMeta
from tread_fx.errors import SelectionError, TokenStreamError
from tread_fx.passes.locate.stacks import ancestors, argument_name, input_slots

__all__ = [
    "is_packed",
    "packed_layout",
    "check_one_packed_stream",
    "segment_boundaries",
    "check_packed_strategy",
]


def _meta(node: object) -> TensorMeta | None:
    meta = node.meta.get("tread_meta") if isinstance(node, fx.Node) else None
    return meta if isinstance(meta, TensorMeta) else None


def _integer_token_data(block: fx.Node, stream: fx.Node) -> bool:
    """The block receives an integer tensor of rank 1 or 2 beside the stream."""
    for node in input_slots(block).values():
        meta = _meta(node)
        if node is stream or meta is None or len(meta.shape) not in (1, 2):
            continue
        if not (meta.dtype.is_floating_point or meta.dtype.is_complex) and meta.dtype.itemsize > 1:
            return True
    return False


def is_packed(shape: tuple, block: fx.Node, stream: fx.Node, batch: int | None) -> bool:
    """Whether a 2-D ``shape`` entering ``block`` is a packed stream (see the module doc).

    Args:
        shape: The stream's shape.
        block: The first block's call node.
        stream: The value entering it in the stream slot.
        batch: The batch size the main input tells (``None``: it has no batch dim).
    """
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


def check_one_packed_stream(
    block: fx.Node, module: Any, path: str, stream: fx.Node, primary: fx.Node
) -> None:
    """Refuse a first block that receives several packed streams fed by the main input.

    A model that writes its noisy tokens into a joint buffer at positions held in index
    tensors (``buf[idx] = tokens``) and hands the blocks slices of it (an understanding
    and a generation pathway) feeds every slice from the noisy input: which slice holds
    the noisy tokens depends on the index values, which data flow cannot tell.
    """
    meta = _meta(stream)
    streams = [
        (key, node)
        for key, node in input_slots(block).items()
        if (m := _meta(node)) is not None
        and len(m.shape) == 2
        and m.shape[-1] == meta.shape[-1]
        and m.dtype == meta.dtype
        and (node is stream or primary in ancestors(node, set()))
    ]
    if len(streams) < 2:
        return
    found = ", ".join(f"{_slot_name(module, k)} {list(_meta(n).shape)}" for k, n in streams)
    raise TokenStreamError(
        f"block {path} receives {len(streams)} packed [tokens, dim] streams that all "
        f"come from the noisy input ({found}): the model writes its tokens into one joint "
        "buffer at positions held in index tensors and hands the blocks slices of it, so "
        "which slice carries the noisy tokens (and which is text or conditioning, never "
        "routed) depends on the index values, which data flow cannot tell. tread_fx routes "
        "a packed stream only when exactly one block argument carries tokens computed from "
        "the noisy input: build the other slices apart from it (e.g. concatenate the text "
        "and noisy tokens instead of writing both into one buffer by index), or pass "
        "blocks= naming a stack whose blocks see one such stream."
    )


def _slot_name(module: Any, key: tuple) -> str:
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
