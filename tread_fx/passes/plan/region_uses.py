"""What a value entering a routed region is, decided by its uses there (never its name).

The op rules of :mod:`tread_fx.passes.plan.uses` are applied to a route's region, and the
strongest use found is handed to the adapters as a :class:`~tread_fx.adapters.SideValue`
(:func:`side_value`). The uses are those of:

- the routed blocks receiving it, each block class traced through (:func:`route_uses`);
- other module calls in the region (a member ``ModuleList([norm, attention, residual])``
  called in turn, a rotary table handed to its attention), traced through like a block if
  they see the stream in its own layout (:func:`in_stream_layout`); one that gets a folded
  form of it (temporal blocks on ``[B * N, F, C]`` between spatial blocks on
  ``[B * F, N, C]``) holds other units on its token dim, so the data-flow rules alone decide
  there (``tokens-folded-into-batch``);
- the model's own code between the routed blocks: a position table added between two stacks
  (``x = x + self.decoder_pos_embed``), a long skip concatenated before a projection.

A value of size 1 at the stream's batch dim whose every use is elementwise with the stream
is broadcast over the batch (:func:`batch_broadcast`): its kept rows can be taken per sample
from its expansion, so the route's selection need not be shared.

A block told a token count as a plain number (how many noisy tokens follow the history
frames: ``x[:, -n:]``) is told what it becomes (:func:`count_arguments`): the routed part's
length (less the never-routed prefix and suffix) the kept count, the whole stream's the routed
stream's; the prefix's and suffix's stay. A number equal to two of these counts, or to one and
the length of another sequence the block receives (text), is refused, naming the argument; one
that differs from block to block of a list (a block index) is no count.

Example:
    >>> # used by tread_fx.passes.plan.route_plan (tests/test_between_block_tables.py,
    >>> # tests/test_rotary_tuple.py)
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from tread_fx.adapters.values import NO_BATCH_DIM, SideValue, StreamLayout, TensorMeta
from tread_fx.errors import SideInputError, warn_at_caller
from tread_fx.passes.locate.dataflow import (
    argument_items,
    argument_name,
    data_ancestors,
    input_slots,
    tensor_shape,
)
from tread_fx.passes.locate.layout import int_arguments, stream_tokens
from tread_fx.passes.locate.stream import BlockCall, StreamInfo
from tread_fx.passes.plan.op_kinds import is_elementwise
from tread_fx.passes.plan.uses import (
    BlockUses,
    Use,
    _forward,
    _sides,
    _tensor_use,
    call_uses,
    strongest,
)
from tread_fx.passes.trace.block import is_tensorish, untraced_reason
from tread_fx.passes.trace.tracer import MODEL_PREFIX
from tread_fx.routes import Route

__all__ = [
    "route_uses",
    "side_value",
    "in_stream_layout",
    "batch_broadcast",
    "count_arguments",
    "sizes_tokens",
]

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
    tokens, token_dim = layout.token_counts, info.layout.token_dim
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
    in_blocks, reaches = _in_blocks(node, receiving, block_nodes)
    use = None  # unseen: a receiving block shows no use of it
    if not receiving or in_blocks is not None:
        use = strongest({in_blocks, _between_use(node, region, stream_start, block_nodes, layout)})
    names = set().union(*(_names_holding(block_nodes[u], u, node) for u in receiving))
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
        block_classes=frozenset(type(block_nodes[u]) for u in receiving),
        stream=layout,
        token_aligned=in_stream_layout(meta, layout),
        from_stream=node is info.primary or nx.has_path(g, info.primary, node),
        combined_with_stream=combined,
        from_inputs=node.op == "placeholder"
        or any(a.op == "placeholder" for a in data_ancestors(node, set())),
        use=use.value if use is not None else None,
        reaches=reaches,
        stopped=_stopped(receiving),
        batch_broadcast=batch_broadcast(node, region, stream_start, layout),
        primary=info.primary,
    )


def _in_blocks(node: fx.Node, receiving: dict, modules: dict) -> tuple[Use | None, frozenset]:
    """How the blocks receiving ``node`` use it (any of its tensors): the strongest use, or
    ``None`` when none shows one or one could not be traced through; and the names of the
    block ops that read it first, or of a block whose trace-through failed with what it
    raised (for refusal messages)."""
    uses, ops = set(), set()
    for call, found in receiving.items():
        if found is not None:
            uses |= {u for (n, _), u in found.tensors.items() if n is node}
            ops |= {op for (n, _), names in found.ops.items() if n is node for op in names}
        if (found is None or found.stopped) and (reason := untraced_reason(modules[call])):
            path = str(call.target).removeprefix(MODEL_PREFIX)
            how = (
                "could not be traced through"
                if found is None
                else "traced through only up to the line that stopped it"
            )
            ops.add(f"{path} ({how}: {reason})")
    if any(u is None or u.stopped for u in receiving.values()):
        uses.discard(Use.NONE)  # a block that could not be traced through may use it
    return strongest(uses), frozenset(ops)


def _stopped(receiving: dict) -> frozenset[str]:
    """``path: what stopped it`` of each receiving block traced only in part."""
    return frozenset(
        f"{str(call.target).removeprefix(MODEL_PREFIX)} ({found.stopped})"
        for call, found in receiving.items()
        if found is not None and found.stopped
    )


def _names_holding(block: Any, user: fx.Node, node: fx.Node) -> set[str]:
    """The names under which a block receives ``node``: its arguments, and ``argument.key``
    for each dict argument holding it (``attention_kwargs.attention_mask``,
    ``rotary_emb.query``): hints for messages and user adapters, no built-in rule reads them."""
    names = {argument_name(block, key) for key, arg in input_slots(user).items() if arg is node}
    return names | {
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

    "Never per token" is a verdict only beside stream values that keep the stream's batch at
    its batch dim: where the code folds the tokens into the batch (``[B * N, F, C]``, for the
    blocks of another stack) a row is a token, which the op rules cannot tell, so it stays
    unseen (``None``) for the data-flow rules (``tokens-folded-into-batch``).
    """
    if not is_tensorish(node.meta.get("tread_meta")):
        return None  # an int is a count only by how it sizes the stream (count_arguments)
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
    if any(mine and theirs and not is_elementwise(n) for n, mine, theirs in sides):
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
    shape = tensor_shape(node)
    rank = len(stream_start.meta["tread_meta"].shape)
    dim = layout.batch_dim
    if shape is None or len(shape) != rank or dim >= rank or shape[dim] != 1:
        return None
    if layout.batch_size == 1:  # nothing to broadcast over
        return None
    stream = _forward(stream_start, region)
    for user in (u for u in node.users if u in region):
        others = [a for a in user.all_input_nodes if a is not node]
        if not is_elementwise(user) or not others:
            return None
        if not all(a in stream and _batch(a, dim) == layout.batch_size for a in others):
            return None
    return dim


def _batch(node: fx.Node, dim: int) -> int | None:
    meta = node.meta.get("tread_meta")
    return meta.shape[dim] if isinstance(meta, TensorMeta) and dim < len(meta.shape) else None


def count_arguments(
    info: StreamInfo,
    route: Route,
    layout: StreamLayout,
    kept_tokens: int,
    passed: set[fx.Node],
    name: Callable[[BlockCall, tuple], str],
    skip: set[tuple],
    uses: dict,
) -> list[tuple[fx.Node, tuple, int]]:
    """Int arguments of the route's blocks that count tokens of the routed stream.

    Args:
        info: The located stream.
        route: The route.
        layout: The stream layout at the route start (its never-routed prefix and suffix).
        kept_tokens: Tokens of the routed stream at the route start (prefix, suffix included).
        passed: Values entering the route unchanged (their lengths are other counts).
        name: The parameter name a block's argument slot fills (for messages).
        skip: ``(node, slot)`` pairs already rewritten (the patch grid's height).
        uses: Per block node, its :class:`~tread_fx.passes.plan.uses.BlockUses`
            (:func:`sizes_tokens`); in a block that cannot be traced through, an int equal
            to a count is taken for one, with a warning.

    Returns:
        ``(block node, slot, number after routing)`` for each argument whose number changes.

    Raises:
        SideInputError: A number matches counts that routing changes differently, or one
            handed to a call tread_fx does not see into matches a count but is not computed
            from the stream's token dim (:func:`read_from_stream`).
    """
    prefix, suffix = layout.prefix, layout.suffix
    tokens = stream_tokens(info.blocks[route.start], info)
    entering = input_slots(info.blocks[route.start].node)[info.blocks[route.start].in_slot]
    others = _other_sequences(info.blocks[route.start], info, passed, name)
    found = []
    paths = {b.list_path for b in info.blocks[route.start : route.end]}
    constant = {path: _constant_slots(info, path) for path in paths}
    for block in info.blocks[route.start : route.end]:
        shift = stream_tokens(block, info) - tokens  # tokens concatenated in front (crossing)
        counts = [
            ("the routed part of the stream (less its never-routed prefix and suffix)",
             tokens - prefix - suffix, kept_tokens - prefix - suffix),
            ("the whole stream", tokens + shift, kept_tokens + shift),
            ("the never-routed prefix of the stream", prefix + shift, prefix + shift),
        ]  # fmt: skip
        if suffix:
            counts.append(("the never-routed suffix of the stream", suffix, suffix))
        traced = uses.get(block.node) is not None and not uses[block.node].stopped
        counts += [] if traced else others  # traced: a count sizes the stream's own tokens
        values = dict(argument_items(block.node))
        for slot, number in int_arguments(block.node):
            unchanged = (block.node, slot) in skip or slot not in constant[block.list_path]
            unseen = traced and uses[block.node].unseen.get(slot)
            if unchanged or not (unseen or sizes_tokens(uses, block.node, slot)):
                continue
            told = counts + others if unseen else counts
            matches = [(what, new) for what, value, new in told if value == number]
            if len({new for _, new in matches}) > 1:
                raise SideInputError(_ambiguous(block, name(block, slot), number, matches))
            reads = {value for _, value, _ in counts}
            if matches and unseen and not read_from_stream(values[slot], entering, reads):
                raise SideInputError(_unseen(block, name(block, slot), number, unseen, matches))
            if matches and matches[0][1] != number:
                found.append((block.node, slot, matches[0][1]))
                if not traced:
                    warn_at_caller(_guessed(block, name(block, slot), number))
    return found


def read_from_stream(value: Any, stream: fx.Node, counts: set[int]) -> bool:
    """Whether the int ``value`` (a graph node) is computed from a size read of a token dim
    (a dim of one of ``counts``) of ``stream`` or of a tensor ``stream`` is computed from:
    ``ntok = x.shape[1]`` of the stream entering the blocks is a token count by data flow.

    Example:
        >>> read_from_stream(16, None, {16})  # a literal: not read from any tensor
        False
    """
    if not isinstance(value, fx.Node):
        return False
    lineage = data_ancestors(stream, set()) | {stream}
    for tensor, dim in _size_reads(value):
        shape = tensor_shape(tensor) if tensor in lineage else None
        if shape and -len(shape) <= dim < len(shape) and shape[dim] in counts:
            return True
    return False


def _size_reads(value: fx.Node) -> list[tuple[fx.Node, int]]:
    """``(tensor, dim)`` of each size read (``t.size(d)``, ``t.shape[d]``) that the int
    ``value`` is computed from through int arithmetic."""
    reads, todo, seen = [], [value], set()
    while todo:
        node = todo.pop()
        if node in seen or not isinstance(node, fx.Node):
            continue
        seen.add(node)
        read = _size_read(node)
        if read is not None:
            reads.append(read)
        elif type(node.meta.get("tread_meta")) is int:
            todo.extend(node.all_input_nodes)
    return reads


def _size_read(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(tensor, dim)`` when ``node`` reads one size of a tensor, else ``None``."""
    if node.op == "call_method" and node.target == "size" and len(node.args) == 2:
        tensor, dim = node.args
    elif node.op == "call_function" and node.target is operator.getitem:
        shape, dim = node.args
        whole = isinstance(shape, fx.Node) and shape.op in ("call_method", "call_function")
        is_size = whole and shape.target == "size" and len(shape.args) == 1
        if not (is_size or (whole and shape.target is getattr and shape.args[1] == "shape")):
            return None
        tensor = shape.args[0]
    else:
        return None
    return (tensor, dim) if isinstance(tensor, fx.Node) and isinstance(dim, int) else None


def _unseen(block: BlockCall, name: str, number: int, call: str, matches: list) -> str:
    what, new = matches[0]
    return (
        f"block {block.index} ({block.path}) receives the number {number} as its argument "
        f"'{name}' and hands it to {call}, which tread_fx does not see into, beside values "
        f"computed from the tokens. {number} is {what} (told {new} after routing), but the "
        "number is not computed from the stream's shape, so tread_fx cannot tell whether it "
        "counts the tokens or only equals their count. Compute it from the stream entering "
        "the blocks (x.shape[1]), let the block read it from its input, or route blocks "
        "that do not take it (blocks=)."
    )


def sizes_tokens(uses: dict, node: fx.Node, slot: tuple) -> bool:
    """Whether the block call ``node`` uses the int in ``slot`` as a token count (it sizes,
    slices or splits a token dim); in a block that cannot be traced through (or only in part),
    any int may.

    Example:
        >>> sizes_tokens({}, None, ("arg", 2))
        True
    """
    found = uses.get(node)
    return found is None or bool(found.stopped) or slot in found.counts


def _guessed(block: BlockCall, name: str, number: int) -> str:
    return (
        f"block {block.index} ({block.path}) receives the number {number} as '{name}', equal "
        "to a token count, and cannot be traced through to see whether it sizes the tokens; "
        "it is told the kept count. If it is not a count, route blocks that do not take it "
        "(blocks=)."
    )


def _other_sequences(
    block: BlockCall, info: StreamInfo, passed: set[fx.Node], name: Callable
) -> list[tuple[str, int, int]]:
    """Lengths of other token sequences ([B, T, ...] tensors) the block receives unchanged:
    (what the number counts, its value when traced, its value after routing)."""
    counts = []
    for key, value in input_slots(block.node).items():
        meta = value.meta.get("tread_meta")
        if value in passed and isinstance(meta, TensorMeta) and len(meta.shape) >= 3:
            length = meta.shape[info.layout.token_dim]
            what = f"the length of the sequence '{name(block, key)}' the block also receives"
            counts.append((what, length, length))
    return counts


def _constant_slots(info: StreamInfo, list_path: str) -> set[tuple]:
    """Int slots holding the same number in every block of the list at ``list_path``."""
    values = [dict(int_arguments(b.node)) for b in info.blocks if b.list_path == list_path]
    return {k for k, v in values[0].items() if all(d.get(k) == v for d in values)}


def _ambiguous(block: BlockCall, name: str, number: int, matches: list[Any]) -> str:
    meanings = "; ".join(f"{what} (told {new} after routing)" for what, new in matches)
    return (
        f"block {block.index} ({block.path}) receives the number {number} as its argument "
        f"'{name}', and {number} is the token count of several things that routing changes "
        f"differently: {meanings}. tread_fx cannot tell which one the block counts, so it "
        "cannot tell the block the right number for the kept tokens. Make the counts differ "
        "(another input size or history/context length), pass keep_prefix= if the prefix was "
        "detected wrongly, or route blocks that do not take the number (blocks=)."
    )
