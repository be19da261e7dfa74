"""Which token positions of a stream reach the model's output: a forward walk over the graph.

The stream choice (:mod:`tread_fx.passes.locate.choice`) asks, for a candidate stream, whether
the positions a route would select there are the ones the prediction is read from. Starting at
the stream entering the stack's first block with a span ``[lo, hi)`` of its token dim, the walk
follows values forward: a block passes the span from the argument that carries the stream to
the output that carries it on (attention mixing other positions in is not positional flow);
slices, ``narrow`` and ``split``/``chunk`` along the token dim cut it; a concatenation along
the token dim shifts it; any op that keeps the token dim keeps it. Where the walk cannot follow
positions (a reshape folding the tokens away) the value counts as carrying the span, so the
answer errs towards "reaches".

Example:
    >>> # used by tread_fx.passes.locate.choice; reaches_output(info, lo, hi) -> bool
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import torch
import torch.fx as fx

from tread_fx.passes.locate.dataflow import data_inputs
from tread_fx.passes.trace.tracer import TensorMeta

__all__ = ["ALL", "Span", "reaches_output"]

_SPLITS = frozenset({"split", "chunk", "tensor_split", "unbind"})
_CATS = (torch.cat, torch.concat, torch.concatenate)
ALL = _ALL = "all"  # the value depends on the span, positions no longer followed


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


def _shape(node: object) -> tuple | None:
    meta = node.meta.get("tread_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if isinstance(meta, TensorMeta) else None


def _int(value: object) -> int | None:
    if isinstance(value, fx.Node):
        value = value.meta.get("tread_meta")
    return value if type(value) is int else None


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
    if any(not isinstance(i, plain) and _int(i) is None for i in items):
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
        at = _int(item)
        return _ALL if span.lo <= at % span.size < span.hi else None
    bounds = (item.start, item.stop, item.step)
    values = tuple(None if b is None else _int(b) for b in bounds)
    if any(v is None and b is not None for v, b in zip(values, bounds)):
        return _ALL
    lo, hi, step = slice(*values).indices(span.size)
    if step != 1:
        return _ALL
    new = Span(max(span.lo, lo) - lo, min(span.hi, hi) - lo, new_dim, max(hi - lo, 0))
    return None if new.empty else new


def _cat_span(node: fx.Node, source: fx.Node, span: Span) -> Span | str | None:
    parts = node.args[0] if node.args else node.kwargs.get("tensors", ())
    dim = _int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
    out = _shape(node)
    if out is None or dim is None or not isinstance(parts, (tuple, list)):
        return _ALL
    if dim % len(out) != span.dim:
        return _keep(span, out)
    offset = 0
    for part in parts:
        if part is source:
            return Span(span.lo + offset, span.hi + offset, span.dim, out[span.dim])
        size = _shape(part)
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
    target = node.target if isinstance(node.target, str) else node.target.__name__
    dim = _int(_arg(node, 2, "dim", 0))
    if dim is None:
        return _ALL
    if dim % (len(pieces[0]) + (target == "unbind")) != span.dim:
        return {("item", i): _keep(span, p) for i, p in enumerate(pieces)}
    if target == "unbind":
        return {("item", i): (_ALL if span.lo <= i < span.hi else None) for i in range(len(pieces))}
    spans, offset = {}, 0
    for i, piece in enumerate(pieces):
        size = piece[span.dim]
        new = Span(
            max(span.lo, offset) - offset, min(span.hi, offset + size) - offset, span.dim, size
        )
        spans[("item", i)] = None if new.empty else new
        offset += size
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
        rank = len(_shape(node) or ())
        return _slice_span(span, index, rank) if user.args[0] is node else _ALL
    if isinstance(span, dict):
        return None  # a tuple used whole (rare): its items are followed through getitem
    if user in blocks:
        return blocks[user](node, span)
    if node not in data_inputs(user):
        return None  # only the dtype, device or shape of the stream is read
    if span == _ALL:
        return _ALL
    name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
    if user.op == "call_function" and user.target in _CATS:
        return _cat_span(user, node, span)
    if name in _SPLITS and user.op in ("call_function", "call_method"):
        return _split_spans(user, span)
    if name == "narrow" and user.op in ("call_function", "call_method"):
        dim, start, length = (
            _int(_arg(user, i, k)) for i, k in ((1, "dim"), (2, "start"), (3, "length"))
        )
        if None in (dim, start, length) or dim % (len(_shape(user) or ())) != span.dim:
            return _keep(span, _shape(user))
        new = Span(
            max(span.lo, start) - start, min(span.hi, start + length) - start, span.dim, length
        )
        return None if new.empty else new
    return _keep(span, _shape(user))


def reaches_output(start: fx.Node, span: Span, blocks: dict) -> bool:
    """Whether positions ``span`` of ``start`` reach the graph's output.

    Args:
        start: The stream entering the stack's first block.
        span: The positions in question (the ones a route would select).
        blocks: ``{block call node: fn(input node, span) -> span of its output}`` for the
            stack's blocks (a block hands positions on only from its stream argument).

    Returns:
        ``True`` if some of those positions (or a value computed from them whose positions
        the walk lost) reach the output.
    """
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
