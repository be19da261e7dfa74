"""What a value entering a routed region is, when the code *between* the routed blocks uses it.

:mod:`tread_fx.passes.plan.uses` decides values the blocks receive by tracing the blocks through.
A value may also be used by the model's own code between two routed blocks, which the
traced graph shows directly: a position table added to the stream between an encoder stack
and a decoder stack (``x = x + self.decoder_pos_embed``, a ``[1, N, D]`` parameter), a long
skip concatenated beside the features before a projection. The same op rules decide it
(elementwise with the stream along a token dim: a table; concatenated beside its tokens: a
table; an index: ids; attention scores: a mask; ...), followed forward over the region's
nodes that are not block calls (those are decided by the blocks' own uses).

Where every use is such an elementwise op with the stream and the value has a dim of size 1
at the stream's batch dim, the graph shows it broadcast over the batch
(:func:`batch_broadcast`): its kept rows can then be taken per sample from its expansion,
so the route's selection need not be shared.

Example:
    >>> # used by tread_fx.passes.plan.route_plan (see tests/test_between_block_tables.py)
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from tread_fx.passes.plan.uses import (
    _ELEMENTWISE,
    _ORDER,
    Use,
    _forward,
    _name,
    _tensor_use,
    value_uses,
)
from tread_fx.passes.trace.block import is_tensorish
from tread_fx.passes.trace.tracer import TensorMeta

__all__ = ["side_use", "between_use", "strongest", "batch_broadcast"]


def side_use(
    node: fx.Node, receiving: dict, region: set[fx.Node], ends: tuple, layout: Any
) -> Use | None:
    """What decides ``node``: the uses of the blocks receiving it (``receiving``: block node
    -> its :class:`~tread_fx.passes.plan.uses.BlockUses`) together with the code's between them,
    the strongest; ``None`` (unseen) when a receiving block shows no use of it.

    Args:
        node: A value entering the region.
        receiving: The routed blocks receiving it directly, with their uses.
        region: The route's region.
        ends: ``(stream_start, block_nodes)``: the stream entering the route and all block
            call nodes.
        layout: The stream layout (its token counts).
    """
    in_blocks = value_uses(node, receiving) if receiving else None
    if receiving and in_blocks is None:
        return None
    stream_start, block_nodes = ends
    tokens = layout.token_counts
    gm = node.graph.owning_module
    batch = (layout.batch_dim, layout.batch_size)
    between = between_use(node, region, stream_start, block_nodes, tokens, gm, batch)
    return strongest({in_blocks, between})


def between_use(
    node: fx.Node,
    region: set[fx.Node],
    stream_start: fx.Node,
    block_nodes: Any,
    tokens: set[int],
    gm: fx.GraphModule,
    batch: tuple[int, int] | None = None,
) -> Use | None:
    """How the region's code between the blocks uses ``node`` (``None``: it does not, or
    the op rules cannot tell).

    Only tensors are decided here (an int is a count only by how it sizes the stream:
    :mod:`tread_fx.passes.plan.token_counts`). "Never per token" (:attr:`Use.NONE`) is a verdict
    only where every stream value the code combines it with keeps the stream's batch at its
    batch dim: code that folds the tokens into the batch (``[B * N, F, C]``, to run the
    blocks of another stack between the routed ones) uses it per row, and a row there is a
    token; the op rules, which read tokens at a token dim, cannot tell, so it stays unseen
    (``None``) and the data-flow rules (``tokens-folded-into-batch``) decide it as they do a
    value no routed block receives.

    Args:
        node: A value entering the region.
        region: The route's region.
        stream_start: The stream entering the route.
        block_nodes: The block call nodes (their uses are the blocks' own).
        tokens: Token counts of the routed stream.
        gm: The traced GraphModule (for leaf modules between the blocks).
        batch: ``(batch_dim, batch_size)`` of the routed stream; ``None``: not checked.

    Returns:
        The strongest use found, :attr:`Use.NONE` when the code uses it but never with the
        stream per token, or ``None`` when no code between the blocks reads it (or it reads
        it only beside a stream whose batch holds tokens).
    """
    if not is_tensorish(node.meta.get("tread_meta")):
        return None
    if not any(u in region and u not in block_nodes for u in node.users):
        return None
    stream = _forward(stream_start, region)
    reach = _forward(node, region)
    ctx = (tokens, gm)
    code = [n for n in reach if n is not node and n not in block_nodes]
    found = {use for n in code if (use := _tensor_use(n, reach, stream, ctx)) is not None}
    if found:
        return strongest(found)
    if any(_meets_unseen(n, reach, stream) for n in code):
        return Use.UNKNOWN
    if batch is not None and any(_meets_refolded(n, reach, stream, batch) for n in code):
        return None
    return Use.NONE


def _meets_unseen(node: fx.Node, reach: set[fx.Node], stream: set[fx.Node]) -> bool:
    """``node`` reads the value and a stream value in an op whose use no rule reads (not an
    elementwise op, which is per token only along an aligned token dim)."""
    inputs = node.all_input_nodes
    mine = any(a in reach and a not in stream for a in inputs)
    theirs = any(a in stream and a not in reach for a in inputs)
    return mine and theirs and _name(node) not in _ELEMENTWISE


def _meets_refolded(
    node: fx.Node, reach: set[fx.Node], stream: set[fx.Node], batch: tuple[int, int]
) -> bool:
    """``node`` combines the value with a stream value whose batch dim no longer holds the
    stream's batch (the code has folded tokens into it, or moved the batch)."""
    dim, size = batch
    mine = any(a in reach and a not in stream for a in node.all_input_nodes)
    theirs = [a for a in node.all_input_nodes if a in stream and a not in reach]
    return mine and any(_batch(a, dim) not in (size, None) for a in theirs)


def strongest(uses: set[Use | None]) -> Use | None:
    """The first of ``uses`` in the order mask, ids, table, context, unknown, none."""
    for use in (*_ORDER, Use.NONE):
        if use in uses:
            return use
    return None


def batch_broadcast(
    node: fx.Node, region: set[fx.Node], stream_start: fx.Node, layout: Any
) -> int | None:
    """The stream's batch dim, if ``node`` has size 1 there, the stream's rank, and every
    use of it is an elementwise op (inside the region) with a stream value of the full batch;
    else ``None``."""
    meta = node.meta.get("tread_meta")
    shape = meta.shape if isinstance(meta, TensorMeta) else None
    rank = len(stream_start.meta["tread_meta"].shape)
    dim = layout.batch_dim
    if shape is None or len(shape) != rank or dim >= rank or shape[dim] != 1:
        return None
    if layout.batch_size == 1:
        return None
    stream = _forward(stream_start, region)
    for user in (u for u in node.users if u in region):
        others = [a for a in user.all_input_nodes if a is not node]
        if _name(user) not in _ELEMENTWISE or not others:
            return None
        if not all(a in stream and _batch(a, dim) == layout.batch_size for a in others):
            return None
    return dim


def _batch(node: fx.Node, dim: int) -> int | None:
    meta = node.meta.get("tread_meta")
    return meta.shape[dim] if isinstance(meta, TensorMeta) and dim < len(meta.shape) else None
