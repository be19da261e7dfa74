"""Which token positions of a candidate stream are the noisy input's: a forward walk over the
graph, and the per-token masks computed from data that decide them instead.

The stream choice (:mod:`tread_fx.passes.locate.choice`) asks, for a candidate stream, whether
the positions a route would select there are the ones the prediction is read from
(:func:`reaches_output`). Starting at the stream entering the stack's first block with a span
``[lo, hi)`` of its token dim, the walk follows values forward: a block passes the span from
the argument that carries the stream to the output that carries it on (attention mixing other
positions in is not positional flow); slices, ``narrow`` and ``split``/``chunk`` along the
token dim cut it; a concatenation along the token dim shifts it; any op that keeps the token
dim keeps it. Where the walk cannot follow positions (a reshape folding the tokens away) the
value counts as carrying the span, so the answer errs towards "reaches".

Some models pack text and image into one sequence of fixed length and tell each position's
role by data (:func:`role_mask`): the noisy input is multiplied by a mask (``indicator ==
IMAGE``), another input by its complement, and the two are added; or the noisy input's tokens
are written in at positions an index input gives (``index_copy(1, video_indices, video)``).
Which positions are image tokens is then a property of the data, not of the graph: a route
would select text positions as well. Such a stream is refused (never routed by a guess).

Example:
    >>> # used by tread_fx.passes.locate.choice; reaches_output(info, lo, hi) -> bool
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import torch
import torch.fx as fx

from tread_fx.passes.locate.dataflow import (
    data_ancestors,
    data_inputs,
    fed_by,
    int_value,
    tensor_meta,
    tensor_shape,
)
from tread_fx.passes.locate.stream import StreamInfo
from tread_fx.passes.trace.tracer import TensorMeta

__all__ = ["ALL", "Span", "reaches_output", "role_mask"]

_SPLITS = frozenset({"split", "chunk", "tensor_split", "unbind"})
_CATS = (torch.cat, torch.concat, torch.concatenate)
ALL = _ALL = "all"  # the value depends on the span, positions no longer followed
_MULS = {operator.mul, operator.imul, torch.mul, "mul", "mul_"}
_ADDS = {operator.add, operator.iadd, torch.add, "add", "add_"}
_COMPARE = {operator.eq, operator.ne, torch.eq, torch.ne, "eq", "ne", "__eq__", "__ne__"}
# writes of a source along a dim at positions given by an index tensor: (dim, index, source)
_INDEX_WRITES = {"index_copy", "index_copy_", "index_add", "index_add_", "scatter", "scatter_"}


@dataclass(frozen=True)
class Span:
    """Positions ``[lo, hi)`` of dim ``dim`` (of size ``size``) of a tensor value."""

    lo: int
    hi: int
    dim: int
    size: int

    @property
    def empty(self) -> bool:
        return self.lo >= self.hi


def _window(span: Span, start: int, length: int, dim: int) -> Span | None:
    """The part of ``span`` in ``[start, start + length)``, re-based to it (``None``: none)."""
    new = Span(max(span.lo, start) - start, min(span.hi, start + length) - start, dim, length)
    return None if new.empty else new


def _op_name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _arg(node: fx.Node, i: int, name: str, default: object = None) -> object:
    """Argument ``i`` (0: the tensor) of a function or method call, by position or name."""
    args = node.args[1:]
    return args[i - 1] if len(args) >= i else node.kwargs.get(name, default)


def _keep(span: Span, out: tuple | None) -> Span | str | None:
    """The span after an op that may keep the token dim (same rank, same size there)."""
    if out is None:
        return None  # not a tensor (a size, a bool): no values of the stream in it
    if len(out) > span.dim and out[span.dim] == span.size:
        return span
    return _ALL


def _slice_span(span: Span, index: object, rank: int) -> Span | str | None:
    """``x[index]`` on a rank-``rank`` tensor: the span in the result, when ``index`` is made
    of slices, ints, ``None`` and ``Ellipsis`` (a tensor index loses the positions)."""
    items = list(index) if isinstance(index, tuple) else [index]
    plain = (type(None), type(Ellipsis), int, slice)
    if any(not isinstance(i, plain) and int_value(i) is None for i in items):
        return _ALL
    if any(i is Ellipsis for i in items):
        at = next(k for k, i in enumerate(items) if i is Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:at] + [slice(None)] * (rank - used) + items[at + 1 :]
    items += [slice(None)] * (rank - sum(1 for i in items if i is not None))
    dim = new_dim = 0
    for item in items:
        if item is None:
            new_dim += 1
            continue
        if dim == span.dim:
            return _cut(span, item, new_dim)
        dim += 1
        new_dim += isinstance(item, slice)
    return _ALL


def _cut(span: Span, item: object, new_dim: int) -> Span | str | None:
    """The span after indexing its dim with ``item`` (a slice or an int)."""
    if not isinstance(item, slice):
        at = int_value(item)
        return _ALL if span.lo <= at % span.size < span.hi else None
    bounds = (item.start, item.stop, item.step)
    values = tuple(None if b is None else int_value(b) for b in bounds)
    if any(v is None and b is not None for v, b in zip(values, bounds)):
        return _ALL
    lo, hi, step = slice(*values).indices(span.size)
    if step != 1:
        return _ALL
    return _window(span, lo, max(hi - lo, 0), new_dim)


def _cat_span(node: fx.Node, source: fx.Node, span: Span) -> Span | str | None:
    parts = node.args[0] if node.args else node.kwargs.get("tensors", ())
    dim = int_value(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
    out = tensor_shape(node)
    if out is None or dim is None or not isinstance(parts, (tuple, list)):
        return _ALL
    if dim % len(out) != span.dim:
        return _keep(span, out)
    offset = 0
    for part in parts:
        if part is source:
            return Span(span.lo + offset, span.hi + offset, span.dim, out[span.dim])
        size = tensor_shape(part)
        if size is None:
            return _ALL
        offset += size[span.dim]
    return _ALL


def _split_spans(node: fx.Node, span: Span) -> dict | str:
    """``split``/``chunk``/``unbind`` along the token dim: the span of each piece."""
    meta = node.meta.get("tread_meta")
    pieces = [tuple(m.shape) if isinstance(m, TensorMeta) else None for m in (meta or ())]
    if not pieces or any(p is None for p in pieces):
        return _ALL
    target = _op_name(node)
    dim = int_value(_arg(node, 2, "dim", 0))
    if dim is None:
        return _ALL
    if dim % (len(pieces[0]) + (target == "unbind")) != span.dim:
        return {("item", i): _keep(span, p) for i, p in enumerate(pieces)}
    if target == "unbind":
        return {("item", i): (_ALL if span.lo <= i < span.hi else None) for i in range(len(pieces))}
    spans, offset = {}, 0
    for i, piece in enumerate(pieces):
        spans[("item", i)] = _window(span, offset, piece[span.dim], span.dim)
        offset += piece[span.dim]
    return spans


def _step(node: fx.Node, user: fx.Node, span: object, blocks: dict) -> object:
    """The span ``user`` holds when ``node`` (holding ``span``) is one of its inputs."""
    if user.op == "output":
        return span
    is_attr = user.op == "call_function" and user.target is getattr
    if isinstance(span, dict) and is_attr:  # an attribute of a block's output object
        return span.get(("attr", user.args[1]))
    if user.op == "call_function" and user.target is operator.getitem:
        index = user.args[1]
        if isinstance(span, dict):  # an item of a tuple-valued node
            return span.get(("item", index)) if isinstance(index, (int, str)) else None
        if span == _ALL:
            return _ALL
        rank = len(tensor_shape(node) or ())
        return _slice_span(span, index, rank) if user.args[0] is node else _ALL
    if isinstance(span, dict):
        return None  # a tuple used whole (rare): its items are followed through getitem
    if user in blocks:
        return blocks[user](node, span)
    if node not in data_inputs(user):
        return None  # only the dtype, device or shape of the stream is read
    if span == _ALL:
        return _ALL
    name = _op_name(user)
    if user.op == "call_function" and user.target in _CATS:
        return _cat_span(user, node, span)
    if name in _SPLITS and user.op in ("call_function", "call_method"):
        return _split_spans(user, span)
    if name == "narrow" and user.op in ("call_function", "call_method"):
        dim, start, length = (
            int_value(_arg(user, i, k)) for i, k in ((1, "dim"), (2, "start"), (3, "length"))
        )
        if None in (dim, start, length) or dim % (len(tensor_shape(user) or ())) != span.dim:
            return _keep(span, tensor_shape(user))
        return _window(span, start, length, span.dim)
    return _keep(span, tensor_shape(user))


def reaches_output(start: fx.Node, span: Span, blocks: dict) -> bool:
    """Whether positions ``span`` of ``start`` (or a value computed from them whose positions
    the walk lost) reach the graph's output; ``blocks`` maps each block call to
    ``fn(input node, span) -> span of its output``."""
    spans: dict[fx.Node, object] = {start: span}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for user in node.users:
            new = _step(node, user, spans[node], blocks)
            if new is None or new == {} or (isinstance(new, Span) and new.empty):
                continue
            if user.op == "output":
                return True
            if user not in spans:  # the first span to arrive decides (graphs are DAGs)
                spans[user] = new
                queue.append(user)
    return False


def _inputs_of(node: fx.Node) -> set[fx.Node]:
    return {n for n in data_ancestors(node, set()) | {node} if n.op == "placeholder"}


def _named(node: fx.Node) -> str:
    """The model inputs a value is computed from, by argument name (a hint for the reader)."""
    names = sorted(n.meta.get("tread_input_name", n.name) for n in _inputs_of(node))
    return f"from input(s) {', '.join(names)}" if names else node.name


def _per_token(node: object, info: StreamInfo) -> bool:
    meta = tensor_meta(node)
    if meta is None or len(meta.shape) <= info.layout.token_dim:
        return False
    return meta.shape[info.layout.token_dim] == info.layout.num_tokens


def _is_role_mask(node: object, info: StreamInfo) -> bool:
    """A per-token value, not fed by the main input, computed by comparing data to a value."""
    if not _per_token(node, info) or fed_by(node, info.primary):
        return False
    meta = node.meta["tread_meta"]
    if any(s != 1 for s in meta.shape[info.layout.token_dim + 1 :]):
        return False  # a mask broadcast over the channels, not a per-token feature
    ups = data_ancestors(node, set()) | {node}
    return any(u.op in ("call_function", "call_method") and u.target in _COMPARE for u in ups)


def _gated(node: fx.Node, info: StreamInfo) -> fx.Node | None:
    """The role mask that gates ``node``'s values per token, if ``node`` is ``x * mask``."""
    if node.op not in ("call_function", "call_method") or node.target not in _MULS:
        return None
    args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    masks = [a for a in args if _is_role_mask(a, info)]
    return masks[0] if masks and len(args) == 2 else None


def _placed_by_data(node: fx.Node, info: StreamInfo) -> fx.Node | None:
    """The index of ``x.index_copy(dim, index, source)`` (``index_add``, ``scatter``) when
    ``source`` holds the main input's tokens and ``index`` is computed from an input."""
    name = _op_name(node)
    if node.op not in ("call_function", "call_method") or name not in _INDEX_WRITES:
        return None
    args = list(node.args[1:]) + [node.kwargs.get(k) for k in ("dim", "index", "source", "src")]
    sources = [a for a in args if fed_by(a, info.primary)]
    indices = [
        a
        for a in args
        if isinstance(a, fx.Node)
        and not fed_by(a, info.primary)
        and any(n.op == "placeholder" for n in data_ancestors(a, set()) | {a})
    ]
    return indices[0] if sources and indices else None


def role_mask(info: StreamInfo) -> str | None:
    """Why the stream's image positions are data-dependent (see the module doc), else ``None``.

    A padding mask on the image plus an ungated per-token table is no role mask.
    """
    stream0 = info.blocks[0].stream_in
    ups = [n for n in data_ancestors(stream0, set()) | {stream0} if n.op != "placeholder"]
    for node in ups:
        index = _placed_by_data(node, info)
        if index is not None:
            return (
                f"the stream entering {info.blocks[0].path} receives the main input's tokens "
                f"at positions given by the data ({node.target} with an index {_named(index)}), so "
                "which positions hold the noisy input is not known from the graph, and a route "
                "would select other tokens too"
            )
    for node in ups:
        if node.op not in ("call_function", "call_method") or node.target not in _ADDS:
            continue
        parts = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if len(parts) != 2 or not all(_per_token(p, info) for p in parts):
            continue
        mine = [p for p in parts if fed_by(p, info.primary)]
        other = [p for p in parts if not fed_by(p, info.primary) and _inputs_of(p) - {info.primary}]
        if len(mine) != 1 or len(other) != 1:
            continue
        gates = [g for n in data_ancestors(mine[0], set()) | {mine[0]} if (g := _gated(n, info))]
        theirs = [g for n in data_ancestors(other[0], set()) | {other[0]} if (g := _gated(n, info))]
        if gates and theirs:  # complementary roles; an ungated per-token table is not one
            return (
                f"the stream entering {info.blocks[0].path} adds, per position, the main input's "
                f"tokens gated by a mask computed from data ({_named(gates[0])}) and per-token "
                f"values {_named(other[0])}: which positions hold the noisy input is "
                "decided by the data, not the graph, so a route would select other tokens too"
            )
    return None
