"""What a value entering routed blocks is, decided by how the blocks use it (never its name).

Each routed block class is traced through once on the real inputs it received while the
model was traced, its int arguments tagged with their slots; each tensor input is followed
forward through the block's data flow (a size read is no data), and the uses it meets decide
what it is (first match in this order):

- ``mask``: the ``attn_mask`` of ``scaled_dot_product_attention`` or
  ``nn.MultiheadAttention``, combined elementwise with ``q @ k^T`` scores or the attention
  probabilities (``+``, ``baddbmm``, ``maximum``, ``where`` ...), the condition or mask of a
  selecting op (``where``, ``masked_fill``), a token-by-token map of its own (elementwise
  beside the stream's tokens and broadcast over them, ``exp(-w * |i - j|)``; or a ``[T, T]``
  matrix the stream's tokens are multiplied by): cut on every token dim. A mask of an
  attention whose keys are not computed from the stream (cross-attention to a context) indexes
  the context's keys, whatever their count: it is a ``table`` when its query dim is the
  stream's, else no use (passed).
- ``ids``: indexes an embedding or a table (``embedding``, ``index_select``, ``gather``,
  advanced indexing): gathered.
- ``table``: elementwise with the stream (or q/k) on a non-last dim of a token count
  (RoPE cos/sin after a head split, gates, per-token modulation), or concatenated with the
  stream beside its tokens: gathered on the token dim.
- ``context``: a matmul/attention operand against the stream (cross-attention keys and
  values, a weight of ``F.linear``), or concatenated to the stream along the tokens: passed.
- ``unknown``: it meets the stream only in an op tread_fx cannot see into (a leaf module):
  the rules decide by its shape against the stream and say so (:func:`shape_warning`).
- ``none``: none of these (per-sample, global, unused): passed.

Each int argument is tagged with its slot (:class:`TaggedInt`) and is a count only if it
sizes, slices or splits a token dim of a stream tensor (``view``/``reshape``/``unflatten``,
``x[:, -n:]``, ``split``, ``narrow``: :func:`count_slots`), never by its value alone (a head
dim may equal the token count). A block that cannot be traced through has no uses (``None``).
Other module calls (:func:`call_uses`) and the tables a block builds (:func:`built_table_uses`)
are decided the same way. Names play no part here (nor anywhere a side value is decided).
Which ops are elementwise and which inputs select is read from torch's op metadata
(:mod:`tread_fx.passes.plan.op_kinds`); ``softmax`` and the dtype conversions stay on the
score path by name (no tag says a normalisation keeps a token-by-token map).

Example:
    >>> Use.MASK.value
    'mask'
    >>> (TaggedInt(16, ("arg", 2)) - 4).slot
    ('arg', 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch.fx as fx
from torch import nn

from tread_fx.adapters.values import SideValue
from tread_fx.passes.locate.dataflow import tensor_shape
from tread_fx.passes.plan.int_slots import (
    TaggedInt,
    _name,
    count_slots,
    op_name,
    tagged_example,
    unseen_count_slots,
)
from tread_fx.passes.plan.op_kinds import (
    is_elementwise,
    keeps_values,
    mixes_tokens,
    pairs_tokens,
    projects_tokens,
    selector_args,
)
from tread_fx.passes.trace.block import example_of, is_tensorish, trace_through

__all__ = [
    "Use",
    "BlockUses",
    "TaggedInt",
    "count_slots",
    "op_name",
    "unseen_count_slots",
    "tagged_example",
    "built_table_uses",
    "sized_by_count",
    "call_uses",
    "strongest",
    "how_used",
    "partial_warning",
    "shape_warning",
]


class Use(str, Enum):
    """What a block does with a value (see the module docstring)."""

    MASK = "mask"
    TABLE = "table"
    IDS = "ids"
    CONTEXT = "context"
    UNKNOWN = "unknown"
    NONE = "none"


_ORDER = (Use.MASK, Use.IDS, Use.TABLE, Use.CONTEXT, Use.UNKNOWN, Use.NONE)


_SDPA = "scaled_dot_product_attention"
_MATMUL = {"matmul", "bmm", "baddbmm", "einsum", "__matmul__", "linear"}
_SCORE_PATH = {"mul", "div", "truediv", "__mul__", "__truediv__", "float", "to", "type_as",
               "contiguous", "add", "__add__", "iadd", "add_", "mul_", "div_",
               "softmax", "log_softmax"}  # fmt: skip
_INDEX = {"embedding", "index_select", "take_along_dim", "gather"}
_CAT = {"cat", "concat", "concatenate", "stack"}


@dataclass
class BlockUses:
    """The uses found in one traced-through block or module call (see :func:`call_uses`).

    Attributes:
        tensors: ``(node, path)`` of each tensor input of the block call -> its use.
        counts: Int argument slots of the call that size a token dim.
        ops: ``(node, path)`` -> names of the ops in the block that read it first (for
            refusals: what an unclassified value reaches).
        unseen: Int argument slots handed, with a value computed from the stream, to a call
            tread_fx does not see into (a library function such as einops' ``rearrange``, a
            leaf module) -> that call's name: they may size a token dim
            (:func:`unseen_count_slots`).
        stopped: ``None``, or what stopped the trace of a block traced only in part: its uses
            are those of the code before that line (an input it shows no use of there is
            ``None``, not :attr:`Use.NONE`), and its int arguments count as unseen.
    """

    tensors: dict[tuple, Use | None]
    counts: set[tuple]
    ops: dict[tuple, frozenset[str]]
    unseen: dict[tuple, str] = field(default_factory=dict)
    stopped: str | None = None


def _forward(start: fx.Node, within: set[fx.Node] | None = None) -> set[fx.Node]:
    """``start`` and the tensors computed from its data (a size read from it is no data),
    only among the nodes ``within`` if given."""
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(
                u
                for u in node.users
                if (within is None or u in within) and is_tensorish(u.meta.get("tread_meta"))
            )
    return seen


def _is_scores(node: fx.Node, stream: set[fx.Node], tokens: set[int], depth: int = 4) -> bool:
    """``node`` is (a scaling or softmax of) a product of two stream-derived values with
    tokens on both its last dims (q @ k^T): attention scores or probabilities, a
    token-by-token map. The attention's output (``probs @ v``: a product with scores, even
    where the head dim equals the token count) is none."""
    name = _name(node)
    if name in _MATMUL:
        shape, operands = tensor_shape(node), [a for a in node.all_input_nodes if a in stream]
        square = shape is None or (len(shape) >= 2 and {shape[-2], shape[-1]} <= tokens)
        if not square or len(operands) < 2:
            return False
        return not any(_is_scores(a, stream, tokens) for a in operands)
    on_path = name in _SCORE_PATH or is_elementwise(node) or keeps_values(node)
    if depth == 0 or not (on_path or _elementwise_module(node)):
        return False
    inputs = (a for a in node.all_input_nodes if a in stream)
    return any(_is_scores(a, stream, tokens, depth - 1) for a in inputs)


def _elementwise_module(node: fx.Node) -> bool:
    """A call of torch's dropout or identity module (attention probabilities pass through)."""
    gm = node.graph.owning_module
    if node.op != "call_module" or gm is None:
        return False
    return isinstance(gm.get_submodule(node.target), (nn.Dropout, nn.Identity))


def _aligned(mine, theirs, tokens: set[int], skip: Any = None) -> bool:
    """Right-aligned, a dim other than the last (features) and ``skip`` (a concatenation's)
    where both have the same token count."""
    if mine is None or theirs is None:
        return False
    if isinstance(skip, int):
        skip = skip - len(theirs) if skip >= 0 else skip
    pairs = list(zip(range(-1, -len(theirs) - 1, -1), reversed(mine), reversed(theirs)))[1:]
    return any(a == b and a in tokens and d != skip for d, a, b in pairs)


def _sides(node: fx.Node, reach: set[fx.Node], stream: set[fx.Node]) -> tuple[list, list]:
    """The inputs of ``node`` computed from the value (``reach``) and not the stream, and
    those computed from the stream and not the value."""
    inputs = node.all_input_nodes
    mine = [a for a in inputs if a in reach and a not in stream]
    return mine, [a for a in inputs if a in stream and a not in reach]


def _tensor_use(node: fx.Node, reach: set[fx.Node], stream: set[fx.Node], ctx) -> Use | None:
    """The use ``node`` (reached by the value, ``reach``) makes of it, if any."""
    name, tokens, root = _name(node), ctx[0], ctx[1]
    mine, theirs = _sides(node, reach, stream)
    if name == "module":
        return _module_use(root.get_submodule(node.target), node, reach, (theirs, stream, tokens))
    if name == _SDPA:
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if mask in reach:
            query, key = (_arg(node, i, k) for i, k in ((0, "query"), (1, "key")))
            return _score_mask(mask, query, key, stream, tokens)
        return Use.CONTEXT if mine and theirs else None
    if any(s in reach for s in selector_args(node)):  # the condition of where, masked_fill
        return Use.MASK if theirs else None
    if name in _INDEX or name == "getitem":
        table = node.args[1] if name == "embedding" else node.args[0]
        index = [a for a in node.all_input_nodes if a is not table]
        return Use.IDS if table not in reach and any(a in reach for a in index) else None
    if name in _MATMUL and mine and theirs:
        added = name == "baddbmm" and node.args[0] in mine  # baddbmm(bias, q, k^T)
        mixed = mixes_tokens(node, mine, theirs, tokens)  # [T, T] @ stream
        if added and _is_scores(node, stream, tokens) or mixed:
            return Use.MASK
        return _projection_use(node, mine, stream, tokens)
    if is_elementwise(node) and mine and theirs:
        if any(_is_scores(t, stream, tokens) for t in theirs):
            return Use.MASK
        if any(
            pairs_tokens(tensor_shape(a), tensor_shape(t), tokens) for a in mine for t in theirs
        ):
            return Use.MASK  # a token-by-token map of its own
        if any(_aligned(tensor_shape(a), tensor_shape(t), tokens) for a in mine for t in theirs):
            return Use.TABLE
    if name in _CAT and mine and theirs:  # joined along the tokens: other tokens (text)
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if any(
            _aligned(tensor_shape(a), tensor_shape(t), tokens, dim) for a in mine for t in theirs
        ):
            return Use.TABLE
        return Use.CONTEXT
    if mine and theirs and not is_elementwise(node):
        return Use.UNKNOWN  # an op tread_fx cannot see into meets it and the stream
    return None


def _projection_use(node: fx.Node, mine: list, stream: set[fx.Node], tokens: set[int]) -> Use:
    """A product with the stream: a table built from the token count that contracts the
    tokens (Linformer's ``k^T @ E[:n]``) is cut on its token rows (``table``); one holding them
    on its last dim cannot be told from features (``unknown``); anything else is ``context``."""
    for table in mine:
        side = projects_tokens(node, table, tokens)
        if side is not None and sized_by_count(table, stream, tokens):
            return Use.TABLE if side == "right" else Use.UNKNOWN
    return Use.CONTEXT


def sized_by_count(node: fx.Node, stream: set[fx.Node], tokens: set[int]) -> bool:
    """Whether ``node`` is built (outside the stream) from a token count read off the stream,
    such as a slice ``E[:n]`` of a longer table or ``arange(n)``.

    Example:
        >>> import torch
        >>> g = fx.Graph()
        >>> n = g.placeholder("n")
        >>> n.meta["tread_meta"] = 16
        >>> sized_by_count(g.call_function(torch.arange, (n,)), set(), {16})
        True
    """
    seen, todo = {node}, [node]
    while todo:
        for arg in todo.pop().all_input_nodes:
            meta = arg.meta.get("tread_meta")
            if type(meta) is int and meta in tokens:
                return True
            if arg not in seen and arg not in stream:
                seen.add(arg)
                todo.append(arg)
    return False


def _arg(node: fx.Node, index: int, name: str) -> Any:
    """Argument ``index`` of a call, given positionally or as ``name``."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _score_mask(mask: fx.Node, query: Any, key: Any, stream: set, tokens: set) -> Use | None:
    """The use of an attention's ``mask`` (``[..., queries, keys]``). Keys computed from the
    stream (self or joint attention): a mask, cut on every token dim. Keys of another
    sequence (cross-attention to a context): its key dim indexes that sequence, even when as
    long as the stream; it is per token only along the queries (a table when its query dim is
    the stream's, else per sample or global: passed)."""
    if key in stream or not isinstance(query, fx.Node) or not isinstance(key, fx.Node):
        return Use.MASK
    q_shape, k_shape = tensor_shape(query), tensor_shape(key)
    if q_shape is None or k_shape is None or len(k_shape) < 2:
        return Use.MASK
    scores = (*q_shape[:-1], k_shape[-2])
    return Use.TABLE if _aligned(tensor_shape(mask), scores, tokens) else None


def _module_use(module: nn.Module, node: fx.Node, reach: set, seen: tuple) -> Use | None:
    """Uses through torch.nn leaf modules: embeddings and multi-head attention; ``seen`` is
    (the stream-derived inputs of ``node``, the stream, the token counts). A mask over the
    keys of another sequence (cross-attention) is no key mask of the stream: a key-padding
    mask is passed, an ``attn_mask`` is per token only along its query rows (a table)."""
    theirs, stream, tokens = seen
    if isinstance(module, nn.Embedding):
        return Use.IDS if node.args and node.args[0] in reach else None
    if isinstance(module, nn.MultiheadAttention):
        masks = {k: node.kwargs.get(k) for k in ("attn_mask", "key_padding_mask")}
        if not any(m in reach for m in masks.values() if m is not None):
            return Use.CONTEXT if theirs else None
        key = _arg(node, 1, "key")
        if key in stream or not isinstance(key, fx.Node):
            return Use.MASK
        shape = tensor_shape(masks["attn_mask"]) if masks["attn_mask"] in reach else None
        return Use.TABLE if shape and len(shape) >= 2 and shape[-2] in tokens else None
    return Use.UNKNOWN if theirs else None


def _classify_tensor(start: fx.Node, stream: set[fx.Node], ctx, whole: bool = True) -> Use | None:
    """The strongest use of ``start`` in the block's graph; none found is :attr:`Use.NONE` in a
    ``whole`` trace, ``None`` (unseen) in a partial one."""
    reach = _forward(start)
    found = {u for n in reach if (u := _tensor_use(n, reach, stream, ctx)) is not None}
    return strongest(found) or (Use.NONE if whole else None)


def _joined_lengths(graph: fx.Graph, stream: set[fx.Node], tokens: set[int]) -> set[int]:
    """Token counts plus the lengths of stream-derived concatenations along a token dim
    (text tokens joined in front of the image tokens inside a joint block)."""
    tokens = set(tokens)
    for node in graph.nodes:
        if node in stream and _name(node) in ("cat", "concat", "concatenate") and node.args:
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
            sizes = [
                tensor_shape(a) for a in node.args[0] if isinstance(a, fx.Node) and a in stream
            ]
            out = tensor_shape(node)
            if out and isinstance(dim, int) and any(z and z[dim] in tokens for z in sizes):
                tokens.add(out[dim])
    return tokens


def _stream_context(gm: fx.GraphModule, stream_at: Any, tokens: set[int]) -> tuple:
    """(nodes computed from the placeholders at ``stream_at``, the classifier's context)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    stream = set().union(*(_forward(placeholders[i]) for i in stream_at))
    return stream, (_joined_lengths(gm.graph, stream, tokens), gm)


def built_table_uses(
    gm: fx.GraphModule, tables: list[fx.Node], stream_at: list[int], tokens: set[int]
) -> dict[fx.Node, Use]:
    """How a traced-through block uses tensors it builds itself (a bias from an index
    buffer, a RoPE table from ``arange(N)``): the same rules as for its inputs.

    Args:
        gm: The block traced through (``block_trace.trace_through``).
        tables: Nodes of ``gm`` computed without the block's inputs.
        stream_at: Positions of the placeholders that carry the token stream.
        tokens: Token counts of the routed stream.

    Returns:
        Each table's use (``mask``/``table``: cut on its token dims; ``context``/``none``:
        not per token, a weight or a buffer used on the features).

    Example:
        >>> # see tread_fx.passes.plan.inline_tables.find_token_tables
    """
    stream, ctx = _stream_context(gm, stream_at, tokens)
    return {t: _classify_tensor(t, stream, ctx) for t in tables}


def _class_uses(gm, node: fx.Node, stream_at, example: Any, leaves, tokens, token_dim):
    """(use per flat tensor position, count slots, first ops) of one module class called at
    ``node``, whose flat tensor inputs at ``stream_at`` carry the stream, or ``None``."""
    module = gm.get_submodule(node.target)
    traced = trace_through(module, tagged_example(example, node), inlined=False, partial=True)
    if traced is None:
        return None
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    if not stream_at or len(placeholders) != len(leaves):
        return None
    for i in stream_at:  # the call's own stream length counts too
        own = tensor_shape(placeholders[i])
        tokens = tokens | ({own[token_dim]} if own and token_dim < len(own) else set())
    stream, ctx = _stream_context(traced.gm, stream_at, tokens)
    tokens = ctx[0]
    whole = traced.stopped is None
    uses = [
        Use.TABLE if i in stream_at else _classify_tensor(ph, stream, ctx, whole)
        for i, ph in enumerate(placeholders)
    ]
    counts = set().union(*(count_slots(n, tokens) for n in stream if n.op != "placeholder"))
    unseen = {k: v for n in stream for k, v in unseen_count_slots(n).items() if k not in counts}
    ops = [frozenset(op_name(u) for u in ph.users) for ph in placeholders]
    return uses, counts, ops, unseen, traced.stopped


def call_uses(
    gm: fx.GraphModule, node: fx.Node, stream: set[fx.Node], tokens: set[int], token_dim: int
) -> BlockUses | None:
    """The uses one module call makes of its inputs, the inputs in ``stream`` carrying the
    token stream: the call's class traced through once per signature (cached on the graph).

    Args:
        gm: The model's traced graph (module calls still single nodes with example inputs).
        node: A ``call_module`` node.
        stream: Nodes holding the token stream (or values computed from it) at this call.
        tokens: Token counts of the routed stream.
        token_dim: The stream's token dim.

    Returns:
        The call's :class:`BlockUses`, or ``None`` when it cannot be traced through or no
        input carries the stream.

    Example:
        >>> # see tread_fx.passes.plan.region_uses.route_uses
    """
    by_class = gm.graph.__dict__.setdefault("_tread_uses", {})
    kept = example_of(gm, node)
    if kept is None:
        return None
    example, leaves = kept
    stream_at = frozenset(i for i, (n, _) in enumerate(leaves) if n in stream)
    module = type(gm.get_submodule(node.target))
    key = (module, id(example), frozenset(tokens), token_dim, stream_at)
    if key not in by_class:
        by_class[key] = _class_uses(gm, node, stream_at, example, leaves, tokens, token_dim)
    if by_class[key] is None:
        return None
    uses, counts, ops, unseen, stopped = by_class[key]
    return BlockUses(dict(zip(leaves, uses)), counts, dict(zip(leaves, ops)), unseen, stopped)


def strongest(uses: set[Use | None]) -> Use | None:
    """The first of ``uses`` in the order mask, ids, table, context, unknown, none.

    Example:
        >>> strongest({Use.CONTEXT, Use.TABLE})
        <Use.TABLE: 'table'>
    """
    return next((use for use in _ORDER if use in uses), None)


def shape_warning(side: SideValue, rule: str) -> str:
    """The warning for a value whose use the blocks do not show, decided by its shape.

    Example:
        >>> # see tests/test_side_uses.py (a key mask handed to a leaf module)
    """
    shape = getattr(side.meta, "shape", side.meta)
    return (
        f"value '{side.node.name}' with shape {shape} (received as {sorted(side.arg_names)}) "
        f"was taken for per-token values by its shape (rule '{rule}'): its token rows are "
        f"cut to the kept tokens.{how_used(side)} If it is not per token (another sequence "
        "of the same length, a per-sample value), register a tread_fx.adapters.Adapter for "
        "it (action 'pass')."
    )


def partial_warning(side: SideValue, rule: str) -> str:
    """The warning for a value whose use was read from blocks traced only in part.

    Example:
        >>> # see tests/test_partial_block_trace.py (a numpy round trip after the table's use)
    """
    return (
        f"value '{side.node.name}' (received as {sorted(side.arg_names)}) was taken for "
        f"{side.use} values (rule '{rule}') from the part of "
        f"{', '.join(sorted(side.stopped))} traced before that line; a use after it is not "
        "seen. If it is used otherwise there, register a tread_fx.adapters.Adapter for it, or "
        "make that code a leaf (tread_fx.register_leaf_function or register_leaf_module)."
    )


def how_used(side: SideValue) -> str:
    """What the blocks do with an unclassified value, for refusal messages.

    Example:
        >>> # see tests/test_adapters.py (a table handed to a leaf module)
    """
    ops = ", ".join(sorted(side.reaches))
    if side.use in (None, Use.UNKNOWN.value):
        if not side.reaches:
            return " No block receiving it could be traced through to see how it is used."
        return f" It meets the stream in {ops}, which tread_fx cannot see into."
    return (
        f" The blocks use it in {ops or 'nothing'}, none of which says which dims are tokens (no "
        "attention mask, elementwise table, ids or attended context)."
    )
