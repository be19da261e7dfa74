"""What a value entering a routed region is, decided by its uses there (never its name).

The op rules of :mod:`tread_fx.passes.plan.uses` are applied to a route's region, and the
verdict, the strongest use found, is handed to the adapters as a
:class:`~tread_fx.adapters.SideValue` (:func:`side_value`). The uses are those of:

- the routed blocks receiving it, each block class traced through (:func:`route_uses`);
- other module calls in the region: a stack member may be a list of sub-blocks called in
  turn (``ModuleList([norm, attention, residual])``, its first call standing for the block),
  and a value handed to a later one (a rotary table given to the attention) enters there.
  Such a call is traced through like a block if it sees the stream in its own layout
  (:func:`in_stream_layout`); one that gets a folded form of it (temporal blocks on
  ``[B * N, F, C]`` between spatial blocks on ``[B * F, N, C]``) holds other units on its
  token dim, so the data-flow rules alone decide there (``tokens-folded-into-batch``);
- the model's own code between the routed blocks, as the graph shows it: a position table
  added between an encoder and a decoder stack (``x = x + self.decoder_pos_embed``), a long
  skip concatenated beside the features before a projection.

Where every use is elementwise with the stream and the value has size 1 at the stream's batch
dim, the graph shows it broadcast over the batch (:func:`batch_broadcast`): its kept rows can
be taken per sample from its expansion, so the route's selection need not be shared.

Example:
    >>> # used by tread_fx.passes.plan.route_plan (tests/test_between_block_tables.py,
    >>> # tests/test_rotary_tuple.py)
"""

from __future__ import annotations

import operator
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from tread_fx.adapters.values import NO_BATCH_DIM, SideValue, StreamLayout, TensorMeta
from tread_fx.passes.locate.dataflow import (
    argument_items,
    argument_name,
    data_ancestors,
    input_slots,
)
from tread_fx.passes.locate.stream import StreamInfo
from tread_fx.passes.plan.uses import (
    _ELEMENTWISE,
    BlockUses,
    Use,
    _forward,
    _name,
    _sides,
    _tensor_use,
    call_uses,
    strongest,
)
from tread_fx.passes.trace.block import is_tensorish
from tread_fx.routes import Route

__all__ = ["route_uses", "side_value", "in_stream_layout", "batch_broadcast"]

_COMBINED = {operator.add, operator.iadd, operator.mul, operator.imul, operator.sub,
             operator.isub, torch.add, torch.mul, torch.sub, "add", "mul", "sub", "add_",
             "mul_", "sub_"}  # fmt: skip


def route_uses(
    gm: fx.GraphModule, info: StreamInfo, route: Route, region: set[fx.Node], layout: StreamLayout
) -> dict[fx.Node, BlockUses | None]:
    """The uses the route's blocks make of their inputs, and those of the other module calls
    in the region that receive a value from outside it (``None``: not traced through).

    Args:
        gm: The model's traced graph (module calls still single nodes with example inputs).
        info: The located stream.
        route: The route.
        region: The route's region.
        layout: The stream layout (its token counts).

    Returns:
        Per block or module call node, its :class:`~tread_fx.passes.plan.uses.BlockUses`.

    Example:
        >>> # driven by tread_fx.passes.plan.route_plan.plan_route (tests/test_rotary_tuple.py)
    """
    tokens, token_dim = layout.token_counts, info.token_dim
    found = {
        b.node: call_uses(gm, b.node, {input_slots(b.node)[b.in_slot]}, tokens, token_dim)
        for b in info.blocks[route.start : route.end]
    }
    blocks = {b.node for b in info.blocks}
    for node in region:
        if node.op != "call_module" or node in blocks:
            continue
        inputs = node.all_input_nodes
        if all(a in region for a in inputs):
            continue  # nothing enters the region here
        metas = {a: a.meta.get("tread_meta") for a in inputs if a in region}
        stream = {a for a, meta in metas.items() if in_stream_layout(meta, layout, tokens)}
        if stream:  # else a folded form of the stream (or no tensor of it): data-flow rules
            found[node] = call_uses(gm, node, stream, tokens, token_dim)
    return found


def in_stream_layout(meta: Any, layout: StreamLayout, tokens: set[int] | None = None) -> bool:
    """Whether ``meta`` is a tensor laid out like the stream: a token count (``tokens``, by
    default the stream's own) on the token dim, the stream's batch rows on the batch dim.

    Example:
        >>> layout = StreamLayout(0, 1, 2, 16, 0, None)
        >>> in_stream_layout(TensorMeta((2, 16, 8), None, None), layout)
        True
    """
    shape = meta.shape if isinstance(meta, TensorMeta) else ()
    if len(shape) <= max(layout.batch_dim, layout.token_dim):
        return False
    batched = layout.batch_dim == NO_BATCH_DIM or shape[layout.batch_dim] == layout.batch_size
    return batched and shape[layout.token_dim] in (tokens or {layout.num_tokens})


def side_value(
    g: nx.DiGraph, node: fx.Node, users: list[fx.Node], region: set[fx.Node], ctx: tuple
) -> SideValue:
    """A value entering the region as the adapters see it, with its use.

    Args:
        g: The graph's data flow (networkx).
        node: The value.
        users: The region nodes using it.
        region: The route's region.
        ctx: ``(info, layout, stream_start, block_nodes, uses)``: the located stream, its
            layout, the stream entering the route, block (and inner) call node -> module,
            and their :func:`route_uses`.

    Example:
        >>> # driven by tread_fx.passes.plan.route_plan.plan_route (tests/test_side_uses.py)
    """
    info, layout, stream_start, block_nodes, uses = ctx
    receiving = {u: uses.get(u) for u in users if u in block_nodes}
    in_blocks, reaches = _in_blocks(node, receiving)
    use = None  # unseen: a receiving block shows no use of it
    if not receiving or in_blocks is not None:
        use = strongest({in_blocks, _between_use(node, region, stream_start, block_nodes, layout)})
    names, classes = set(), set()
    for user in users:
        if user in block_nodes:
            for key, arg in input_slots(user).items():
                if arg is node:
                    names.add(argument_name(block_nodes[user], key))
            names |= _dict_keys_holding(block_nodes[user], user, node)
            classes.add(type(block_nodes[user]))
    combined = any(
        u.op in ("call_function", "call_method")
        and u.target in _COMBINED
        and any(a in region for a in u.all_input_nodes)
        for u in users
    )
    meta = node.meta.get("tread_meta")
    return SideValue(
        node=node,
        meta=meta,
        arg_names=frozenset(names),
        block_classes=frozenset(classes),
        stream=layout,
        token_aligned=in_stream_layout(meta, layout),
        from_stream=node is info.primary or nx.has_path(g, info.primary, node),
        combined_with_stream=combined,
        from_inputs=node.op == "placeholder"
        or any(a.op == "placeholder" for a in data_ancestors(node, set())),
        use=use.value if use is not None else None,
        reaches=reaches,
        batch_broadcast=batch_broadcast(node, region, stream_start, layout),
        primary=info.primary,
    )


def _in_blocks(node: fx.Node, receiving: dict) -> tuple[Use | None, frozenset[str]]:
    """How the blocks receiving ``node`` use it (any of its tensors): the strongest use, or
    ``None`` when none shows one or one could not be traced through; and the names of the
    block ops that read it first (for refusal messages)."""
    uses, ops = set(), set()
    for found in receiving.values():
        if found is not None:
            uses |= {u for (n, _), u in found.tensors.items() if n is node}
            ops |= {op for (n, _), names in found.ops.items() if n is node for op in names}
    if any(u is None for u in receiving.values()):
        uses.discard(Use.NONE)  # a block that could not be traced through may use it
    return strongest(uses), frozenset(ops)


def _dict_keys_holding(block: Any, user: fx.Node, node: fx.Node) -> set[str]:
    """``argument.key`` for each dict argument through which a block receives ``node``:
    ``attention_kwargs.attention_mask``, ``rotary_emb.query`` (hints for messages and user
    adapters; no built-in rule reads them)."""
    return {
        f"{argument_name(block, slot)}.{k}"
        for slot, a in argument_items(user)
        if isinstance(a, dict)
        for k, v in a.items()
        if v is node
    }


def _between_use(
    node: fx.Node, region: set[fx.Node], stream_start: fx.Node, block_nodes: Any, layout: Any
) -> Use | None:
    """How the region's code between the blocks (``block_nodes``, decided by their own uses)
    uses the tensor ``node``: the strongest use found, :attr:`Use.NONE` when the code uses it
    but never with the stream per token, or ``None`` when no code between the blocks reads it.

    "Never per token" is a verdict only where every stream value the code combines it with
    keeps the stream's batch at its batch dim: code that folds the tokens into the batch
    (``[B * N, F, C]``, to run the blocks of another stack between the routed ones) uses it
    per row, and a row there is a token, which the op rules cannot tell; so it stays unseen
    (``None``) and the data-flow rules (``tokens-folded-into-batch``) decide it.
    """
    if not is_tensorish(node.meta.get("tread_meta")):
        return None  # an int is a count only by how it sizes the stream (token_counts)
    if not any(u in region and u not in block_nodes for u in node.users):
        return None
    stream = _forward(stream_start, region)
    reach = _forward(node, region)
    ctx = (layout.token_counts, node.graph.owning_module)
    code = [n for n in reach if n is not node and n not in block_nodes]
    found = {use for n in code if (use := _tensor_use(n, reach, stream, ctx)) is not None}
    if found:
        return strongest(found)
    sides = [(n, *_sides(n, reach, stream)) for n in code]
    if any(mine and theirs and _name(n) not in _ELEMENTWISE for n, mine, theirs in sides):
        return Use.UNKNOWN  # it meets the stream in an op whose use no rule reads
    dim, size = layout.batch_dim, layout.batch_size
    if any(
        mine and any(_batch(a, dim) not in (size, None) for a in theirs)
        for _, mine, theirs in sides
    ):
        return None  # beside a stream whose batch dim no longer holds the stream's batch
    return Use.NONE


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
    if layout.batch_size == 1:  # nothing to broadcast over
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
