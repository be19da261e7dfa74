"""What a value entering routed blocks is, decided by how the blocks use it (never its name).

Each routed block class is traced through once on the real inputs it received while the
model was traced (the machinery of :mod:`tread_fx.passes.inline_tables`), with every int
argument replaced by a tagged int that remembers where it came from. Each tensor input is
then followed forward through the block's tensor data flow (a size read is no data), and
the uses it meets decide what it is (first match in this order):

- ``mask``: the ``attn_mask`` of ``scaled_dot_product_attention`` or
  ``nn.MultiheadAttention``, added to ``q @ k^T`` scores, the mask of ``masked_fill`` or
  ``where``: cut on every token dim.
- ``ids``: indexes an embedding or a table (``embedding``, ``index_select``, ``gather``,
  advanced indexing): gathered.
- ``table``: elementwise with the stream (or q/k) on a non-last dim of a token count
  (RoPE cos/sin after a head split, gates, per-token modulation), or concatenated with the
  stream beside its tokens: gathered on the token dim.
- ``context``: a matmul/attention operand against the stream (cross-attention keys and
  values), or concatenated to the stream along the tokens: passed.
- ``unknown``: it meets the stream only in an op tread_fx cannot see into (a leaf module):
  the rules decide by its shape against the stream and say so (:func:`shape_warning`).
- ``none``: none of these (per-sample, global, unused): passed.

An int argument is a count only if it sizes, slices or splits a token dim of a tensor
computed from the stream (``view``/``reshape``/``unflatten`` of its token dim,
``x[:, -n:]``, ``split``, ``narrow``); any other int (a head dim equal to the token count
by coincidence) is never rewritten. A block that cannot be traced through has no uses
(``None``).

Names play no part here (nor anywhere a side value is decided); the plan shows them as hints.

Example:
    >>> Use.MASK.value
    'mask'
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import torch.fx as fx
from torch import nn

from tread_fx.adapters.values import SideValue, TensorMeta
from tread_fx.passes.inline_tables import _example_of, _is_tensorish, trace_through
from tread_fx.passes.locate import BlockCall, input_slots
from tread_fx.passes.stacks import argument_items

__all__ = [
    "Use",
    "BlockUses",
    "block_uses",
    "route_uses",
    "reached_ops",
    "value_uses",
    "how_used",
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


_ORDER = (Use.MASK, Use.IDS, Use.TABLE, Use.CONTEXT, Use.UNKNOWN)


class _Tagged(int):
    """An int that remembers which argument slot it came from, through +, -, *, //."""

    slot: tuple

    def __new__(cls, value: int, slot: tuple) -> _Tagged:
        tagged = super().__new__(cls, value)
        tagged.slot = slot
        return tagged

    def _keep(self, value: Any) -> Any:
        return _Tagged(value, self.slot) if type(value) is int else value

    def __add__(self, o):  # noqa: D105
        return self._keep(int(self) + o)

    def __radd__(self, o):  # noqa: D105
        return self._keep(o + int(self))

    def __sub__(self, o):  # noqa: D105
        return self._keep(int(self) - o)

    def __rsub__(self, o):  # noqa: D105
        return self._keep(o - int(self))

    def __mul__(self, o):  # noqa: D105
        return self._keep(int(self) * o)

    def __rmul__(self, o):  # noqa: D105
        return self._keep(o * int(self))

    def __floordiv__(self, o):  # noqa: D105
        return self._keep(int(self) // o)

    def __neg__(self):  # noqa: D105
        return _Tagged(-int(self), self.slot)

    def __reduce__(self):  # noqa: D105
        return int, (int(self),)


_SDPA = "scaled_dot_product_attention"
_MATMUL = {"matmul", "bmm", "baddbmm", "einsum", "__matmul__"}
_SCORE_PATH = {"mul", "div", "truediv", "__mul__", "__truediv__", "float", "to", "type_as",
               "contiguous", "add", "__add__", "iadd", "add_", "mul_", "div_"}  # fmt: skip
_MASK_FILL = {"masked_fill", "masked_fill_", "where"}
_ELEMENTWISE = {"add", "sub", "mul", "div", "truediv", "iadd", "isub", "imul", "add_", "sub_",
                "mul_", "div_", "addcmul", "__add__", "__sub__", "__mul__", "__truediv__",
                "__radd__", "__rmul__", "__rsub__", "lerp"}  # fmt: skip
_INDEX = {"embedding", "index_select", "take_along_dim", "gather"}
_CAT = {"cat", "concat", "concatenate", "stack"}
_RESHAPE = {"view", "reshape", "unflatten"}
_SPLIT = {"split", "split_with_sizes", "narrow", "tensor_split"}


def _name(node: fx.Node) -> str:
    return "module" if node.op == "call_module" else _op_name(node)


def _op_name(node: fx.Node) -> str:
    """The op's name, a leaf module's path for messages."""
    target = node.target
    if node.op == "call_module":
        return str(target).removeprefix("model.")
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _meta(value: Any) -> Any:
    return value.meta.get("tread_meta") if isinstance(value, fx.Node) else None


def _shape(value: Any) -> tuple[int, ...] | None:
    meta = _meta(value)
    return meta.shape if isinstance(meta, TensorMeta) else None


class BlockUses:
    """The uses found in one traced-through block (see :func:`block_uses`).

    Attributes:
        tensors: ``(node, path)`` of each tensor input of the block call -> its use.
        counts: Int argument slots of the call that size a token dim.
        ops: ``(node, path)`` -> names of the ops in the block that read it first (for
            refusals: what an unclassified value reaches).
    """

    def __init__(self, tensors: dict[tuple, Use], counts: set[tuple], ops: dict) -> None:
        self.tensors = tensors
        self.counts = counts
        self.ops = ops


def _forward(start: fx.Node) -> set[fx.Node]:
    """``start`` and the tensors computed from its data (a size read from it is no data)."""
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(u for u in node.users if _is_tensorish(u.meta.get("tread_meta")))
    return seen


def _is_scores(node: fx.Node, stream: set[fx.Node], depth: int = 4) -> bool:
    """``node`` is (a scaling of) a product of two stream-derived values (q @ k^T)."""
    name = _name(node)
    if name in _MATMUL:
        return sum(a in stream for a in node.all_input_nodes) >= 2
    if depth == 0 or name not in _SCORE_PATH:
        return False
    return any(_is_scores(a, stream, depth - 1) for a in node.all_input_nodes if a in stream)


def _aligned(mine, theirs, tokens: set[int], skip: Any = None) -> bool:
    """Right-aligned, a dim other than the last (features) and ``skip`` (a concatenation's)
    where both have the same token count."""
    if mine is None or theirs is None:
        return False
    if isinstance(skip, int):
        skip = skip - len(theirs) if skip >= 0 else skip
    pairs = list(zip(range(-1, -len(theirs) - 1, -1), reversed(mine), reversed(theirs)))[1:]
    return any(a == b and a in tokens and d != skip for d, a, b in pairs)


def _tensor_use(node: fx.Node, reach: set[fx.Node], stream: set[fx.Node], ctx) -> Use | None:
    """The use ``node`` (reached by the value, ``reach``) makes of it, if any."""
    name, tokens, root = _name(node), ctx[0], ctx[1]
    inputs = node.all_input_nodes
    mine = [a for a in inputs if a in reach and a not in stream]
    theirs = [a for a in inputs if a in stream and a not in reach]
    if name == "module":
        return _module_use(root.get_submodule(node.target), node, reach, theirs)
    if name == _SDPA:
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if mask in reach:
            return Use.MASK
        return Use.CONTEXT if mine and theirs else None
    if name in _MASK_FILL and len(node.args) > 1:
        cond = node.args[0] if name == "where" else node.args[1]
        return Use.MASK if cond in reach and theirs else None
    if name in _INDEX or name == "getitem":
        table = node.args[1] if name == "embedding" else node.args[0]
        index = [a for a in inputs if a is not table]
        return Use.IDS if table not in reach and any(a in reach for a in index) else None
    if name in _MATMUL and mine and theirs:
        return Use.CONTEXT
    if name in _ELEMENTWISE and mine and theirs:
        if any(_is_scores(t, stream) for t in theirs):
            return Use.MASK
        if any(_aligned(_shape(a), _shape(t), tokens) for a in mine for t in theirs):
            return Use.TABLE
    if name in _CAT and mine and theirs:  # joined along the tokens: other tokens (text)
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if any(_aligned(_shape(a), _shape(t), tokens, dim) for a in mine for t in theirs):
            return Use.TABLE
        return Use.CONTEXT
    if mine and theirs and name not in _ELEMENTWISE:
        return Use.UNKNOWN  # an op tread_fx cannot see into meets it and the stream
    return None


def _module_use(module: nn.Module, node: fx.Node, reach: set, theirs: list) -> Use | None:
    """Uses through torch.nn leaf modules: embeddings and multi-head attention."""
    if isinstance(module, nn.Embedding):
        return Use.IDS if node.args and node.args[0] in reach else None
    if isinstance(module, nn.MultiheadAttention):
        masks = [node.kwargs.get(k) for k in ("attn_mask", "key_padding_mask")]
        if any(m in reach for m in masks if m is not None):
            return Use.MASK
        return Use.CONTEXT if theirs else None
    return Use.UNKNOWN if theirs else None


def _classify_tensor(start: fx.Node, stream: set[fx.Node], ctx) -> Use:
    reach = _forward(start)
    found = {u for n in reach if (u := _tensor_use(n, reach, stream, ctx)) is not None}
    for use in _ORDER:
        if use in found:
            return use
    return Use.NONE


def _joined_lengths(graph: fx.Graph, stream: set[fx.Node], tokens: set[int]) -> set[int]:
    """Token counts plus the lengths of stream-derived concatenations along a token dim
    (text tokens joined in front of the image tokens inside a joint block)."""
    tokens = set(tokens)
    for node in graph.nodes:
        if node in stream and _name(node) in ("cat", "concat", "concatenate") and node.args:
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
            parts = [a for a in node.args[0] if isinstance(a, fx.Node) and a in stream]
            out = _shape(node)
            sizes = [_shape(p) for p in parts]
            if out and isinstance(dim, int) and any(z and z[dim] in tokens for z in sizes):
                tokens.add(out[dim])
    return tokens


def _tags(value: Any) -> set[tuple]:
    if isinstance(value, _Tagged):
        return {value.slot}
    if isinstance(value, slice):
        return _tags(value.start) | _tags(value.stop)
    if isinstance(value, (tuple, list)):
        return set().union(*(_tags(v) for v in value)) if value else set()
    return set()


def _token_dims(shape: tuple[int, ...], tokens: set[int]) -> set[int]:
    return {d for d, s in enumerate(shape) if s in tokens}


def _count_slots(node: fx.Node, tokens: set[int]) -> set[tuple]:
    """Slots of tagged ints that size, slice or split a token dim at ``node``."""
    name, shape = _name(node), _shape(node.args[0]) if node.args else None
    if shape is None:
        return set()
    found: set[tuple] = set()
    if name in _RESHAPE:
        found |= _reshaped(node, shape, tokens)
    elif name == "getitem":
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if Ellipsis not in index and None not in index:
            for d, item in enumerate(index):
                if d < len(shape) and shape[d] in tokens:
                    found |= _tags(item)
    elif name in _SPLIT:
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        dim = node.args[1] if name == "narrow" else dim
        if isinstance(dim, int) and -len(shape) <= dim < len(shape) and shape[dim] in tokens:
            found |= _tags(list(node.args[1:]) + list(node.kwargs.values()))
    return found


def _reshaped(node: fx.Node, shape: tuple[int, ...], tokens: set[int]) -> set[tuple]:
    """Tagged sizes of a view/reshape that fall inside an input token dim's extent."""
    sizes = node.args[1:]
    if _name(node) == "unflatten":
        dim = node.args[1]
        dim = dim % len(shape) if isinstance(dim, int) else None
        if dim is None or shape[dim] not in tokens:
            return set()
        return _tags(node.args[2:])
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = sizes[0]
    out = _shape(node)
    if out is None or len(out) != len(sizes):
        return set()
    bounds = [math.prod(shape[:d]) for d in range(len(shape) + 1)]
    token_spans = [(bounds[d], bounds[d + 1]) for d in _token_dims(shape, tokens)]
    found: set[tuple] = set()
    for d, size in enumerate(sizes):
        low, high = math.prod(out[:d]), math.prod(out[: d + 1])
        if any(lo <= low and high <= hi for lo, hi in token_spans) and _tags(size):
            found |= _tags(size)
    return found


def _tagged_example(example: Any, node: fx.Node) -> Any:
    args, kwargs = example
    args, kwargs = list(args), dict(kwargs)
    for slot, _ in argument_items(node):
        kind, key = slot
        holder = args if kind == "arg" else kwargs
        if (key < len(holder) if kind == "arg" else key in holder) and type(holder[key]) is int:
            holder[key] = _Tagged(holder[key], slot)
    return tuple(args), kwargs


def _class_uses(gm, block: BlockCall, example: Any, leaves, tokens, token_dim):
    """(use per flat tensor position, count slots) of one block class, or ``None``."""
    module = gm.get_submodule(block.node.target)
    traced = trace_through(module, _tagged_example(example, block.node), inlined=False)
    if traced is None:
        return None
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    stream_at = next((i for i, (n, _) in enumerate(leaves) if n is _stream_of(block)), None)
    if stream_at is None or len(placeholders) != len(leaves):
        return None
    stream = _forward(placeholders[stream_at])
    own = _shape(placeholders[stream_at])
    tokens = tokens | ({own[token_dim]} if own and token_dim < len(own) else set())
    tokens = _joined_lengths(traced.gm.graph, stream, tokens)
    ctx = (tokens, traced.gm)
    uses = [
        Use.TABLE if i == stream_at else _classify_tensor(ph, stream, ctx)
        for i, ph in enumerate(placeholders)
    ]
    counts = set().union(*(_count_slots(n, tokens) for n in stream if n.op != "placeholder"))
    ops = [frozenset(_op_name(u) for u in ph.users) for ph in placeholders]
    return uses, counts, ops


def block_uses(
    gm: fx.GraphModule, blocks: list[BlockCall], tokens: set[int], token_dim: int
) -> dict[fx.Node, BlockUses | None]:
    """Trace each block class through once on its example inputs and classify the inputs.

    Args:
        gm: The model's traced graph (block calls still single nodes with example inputs).
        blocks: The routed blocks.
        tokens: Token counts of the routed stream (N, N - prefix, the routable count).
        token_dim: The stream's token dim (the block's own stream length counts too).

    Returns:
        Per block call node, its :class:`BlockUses`, or ``None`` when the block cannot be
        traced through (on the first call of its class with this call's signature).

    Example:
        >>> # see tests/test_side_uses.py
    """
    by_class = gm.graph.__dict__.setdefault("_tread_uses", {})
    found: dict[fx.Node, BlockUses | None] = {}
    for block in blocks:
        kept = _example_of(gm, block.node)
        if kept is None:
            found[block.node] = None
            continue
        example, leaves = kept
        key = (type(gm.get_submodule(block.node.target)), id(example), frozenset(tokens), token_dim)
        if key not in by_class:
            by_class[key] = _class_uses(gm, block, example, leaves, tokens, token_dim)
        known = by_class[key]
        if known is not None:
            uses, counts, ops = known
            found[block.node] = BlockUses(dict(zip(leaves, uses)), counts, dict(zip(leaves, ops)))
        else:
            found[block.node] = None
    return found


def _stream_of(block: BlockCall) -> fx.Node:
    return input_slots(block.node)[block.in_slot]


def reached_ops(node: fx.Node, found: dict[fx.Node, BlockUses | None]) -> set[str]:
    """Names of the block ops that read ``node`` first (for refusal messages).

    Example:
        >>> reached_ops(None, {})
        set()
    """
    return {
        op
        for uses in found.values()
        if uses is not None
        for (n, _), ops in uses.ops.items()
        if n is node
        for op in ops
    }


def value_uses(node: fx.Node, found: dict[fx.Node, BlockUses | None]) -> Use | None:
    """How the routed blocks use ``node`` (any of its tensors): the strongest use, or
    ``None`` when a block receiving it could not be traced through.

    Example:
        >>> value_uses(None, {}) is None
        True
    """
    uses = set()
    for uses_of_block in found.values():
        if uses_of_block is None:
            continue
        uses |= {u for (n, _), u in uses_of_block.tensors.items() if n is node}
    if any(u is None for u in found.values()):
        uses.discard(Use.NONE)  # a block that could not be traced through may use it
    for use in (*_ORDER, Use.NONE):
        if use in uses:
            return use
    return None


def route_uses(gm: fx.GraphModule, blocks: list[BlockCall], layout: Any, token_dim: int) -> dict:
    """:func:`block_uses` for a route's blocks, with the stream layout's token counts.

    Example:
        >>> # driven by tread_fx.passes.plan.plan_route
    """
    tokens = {layout.num_tokens, layout.num_tokens - layout.prefix, layout.routable}
    return block_uses(gm, blocks, tokens, token_dim)


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


def how_used(side: SideValue) -> str:
    """What the blocks do with an unclassified value, for refusal messages.

    Example:
        >>> # see tests/test_adapters.py (a table handed to a leaf module)
    """
    if side.use in (None, Use.UNKNOWN.value):
        if not side.reaches:
            return " No block receiving it could be traced through to see how it is used."
        ops = ", ".join(sorted(side.reaches))
        return f" It meets the stream in {ops}, which tread_fx cannot see into."
    ops = ", ".join(sorted(side.reaches)) or "nothing"
    return (
        f" The blocks use it in {ops}, none of which says which dims are tokens (no "
        "attention mask, elementwise table, ids or attended context)."
    )
