"""Where one dim of a tensor goes: the dim of each value computed from it that holds it.

A block may read the stream's tokens after a linear layer and a transpose (``h.transpose(1, 2)
.reshape(b, -1, gh, gw)``); when the stream's width equals its token count, sizes alone cannot
say which dim of the reshaped value is the tokens'. Data flow can: :func:`follow_dim` walks
forward from the stream, and for each op maps the tracked dim to its place in the result:

- ``transpose``/``swapaxes``/``permute``/``movedim``/``.mT`` by their arguments;
- ``reshape``/``view``/``flatten``/``unflatten`` when the dims before it keep their product and
  the dim keeps its size (a dim merged or split away is lost);
- indexing with full slices, ``None`` and ``...`` (``k[:, None]``) and ``unsqueeze``, which
  insert dims before or after it;
- elementwise ops and copies (by torch's op tags and schemas: dims aligned from the right);
- ops on the last dim only (a linear layer, a norm over the features), for any other dim;
  ``a @ b``: ``a``'s dims but its last, ``b``'s last; ``cat`` along another dim; ops that
  keep every dim in place (``softmax``, ``cumsum``, ``flip``, ``tril``).

A value reached along paths that disagree, or an op none of these covers, holds no tracked dim:
the caller then knows it cannot tell (never a guess).
"""

from __future__ import annotations

import math
import operator

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from tread_fx.passes.locate.dataflow import tensor_shape
from tread_fx.passes.plan.op_kinds import is_elementwise, keeps_values

__all__ = ["feature_dims", "follow_dim"]

_TRANSPOSES = {"transpose", "swapaxes", "swapdims"}
_MOVES = {"movedim", "moveaxis"}
_RESHAPES = {"reshape", "view", "flatten", "unflatten"}
_UNKNOWN = -1


def _name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return str(target)
    return getattr(target, "__name__", "") if node.op == "call_function" else ""


def _ints(args: tuple) -> list[int] | None:
    flat = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else list(args)
    return flat if all(type(a) is int for a in flat) else None


def _transposed(node: fx.Node, dim: int, rank: int) -> int | None:
    name = _name(node)
    rest = node.args[1:]
    if name in _TRANSPOSES and len(rest) == 2 and all(type(a) is int for a in rest):
        a, b = (r % rank for r in rest)
        return b if dim == a else a if dim == b else dim
    if name == "permute":
        order = _ints(rest)
        if order is None or len(order) != rank:
            return _UNKNOWN
        return [o % rank for o in order].index(dim)
    if name in ("mT", "adjoint") or (node.target is getattr and node.args[1] in ("mT", "T")):
        return rank - 1 if dim == rank - 2 else rank - 2 if dim == rank - 1 else dim
    if name in _MOVES and len(rest) == 2 and all(type(a) is int for a in rest):
        source, dest = (r % rank for r in rest)
        order = [d for d in range(rank) if d != source]
        order.insert(dest, source)
        return order.index(dim)
    return None


def _reshaped(before: tuple, after: tuple, dim: int) -> int:
    """Where ``dim`` of ``before`` stands in ``after``: the dim at which the sizes before it
    have the same product and whose size is the same."""
    lead = math.prod(before[:dim])
    for i in range(len(after)):
        if math.prod(after[:i]) == lead and after[i] == before[dim]:
            return i
    return _UNKNOWN


_LAST_DIM_MODULES = (
    nn.Linear,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Identity,
    nn.Dropout,
    nn.GELU,
    nn.SiLU,
    nn.ReLU,
    nn.Tanh,
    nn.Sigmoid,
)
_LAST_DIM_FUNCTIONS = {F.linear, F.layer_norm, F.rms_norm, F.dropout}
# ops that keep every dim in place (values may mix along one): same shape out
_IN_PLACE = {"softmax", "log_softmax", "cumsum", "cumprod", "flip", "roll", "tril", "triu"}
_MATMULS = {"matmul", "bmm", "__matmul__"}
_CATS = {"cat", "concat", "concatenate"}


def _on_last_dim(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` acts on the last dim of ``source`` only (each other dim kept)."""
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(node.target)
        return isinstance(module, _LAST_DIM_MODULES)
    return node.op == "call_function" and node.target in _LAST_DIM_FUNCTIONS


def _through_cat(node: fx.Node, dim: int, before, after) -> int:
    """``cat`` along another dim keeps the tracked one in place; along it, it is lost."""
    along = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if not isinstance(along, int) or len(after) != len(before):
        return _UNKNOWN
    return dim if along % len(before) != dim and after[dim] == before[dim] else _UNKNOWN


def _through_matmul(node: fx.Node, source: fx.Node, dim: int, before, after) -> int:
    """``a @ b``: a dim of ``a`` but its last stays (from the right), ``b``'s last is the
    result's last; the contracted dims are lost."""
    rank = len(before)
    if len(node.args) != 2 or rank < 2:
        return _UNKNOWN
    if node.args[0] is source and dim < rank - 1:
        at = dim + len(after) - rank
    elif node.args[1] is source and dim == rank - 1:
        at = len(after) - 1
    else:
        return _UNKNOWN
    return at if 0 <= at < len(after) and after[at] == before[dim] else _UNKNOWN


def _indexed(node: fx.Node, dim: int, before: tuple, after: tuple) -> int:
    """``x[:, None]`` / ``x[..., None, :]`` / ``x.unsqueeze(d)``: where ``dim`` lands (full
    slices keep a dim, ``None`` adds one, ``...`` stands for the dims not named)."""
    if _name(node) == "unsqueeze" and len(node.args) == 2 and type(node.args[1]) is int:
        new = node.args[1] % len(after)
        return dim + (new <= dim)
    index = node.args[1] if len(node.args) == 2 else None
    items = index if isinstance(index, tuple) else (index,)
    full = slice(None, None, None)
    if not all(i is None or i is Ellipsis or i == full for i in items):
        return _UNKNOWN
    named = sum(i is not Ellipsis and i is not None for i in items)
    expanded: list = []
    for item in items:
        expanded += [full] * (len(before) - named) if item is Ellipsis else [item]
    expanded += [full] * (len(before) - sum(i is not None for i in expanded))
    kept = [at for at, item in enumerate(expanded) if item is not None]
    return kept[dim] if dim < len(kept) and len(expanded) == len(after) else _UNKNOWN


def _mapped(node: fx.Node, source: fx.Node, dim: int) -> int:
    """Where ``dim`` of ``source`` (an input of ``node``) stands in ``node``'s value."""
    before, after = tensor_shape(source), tensor_shape(node)
    if before is None or after is None:
        return _UNKNOWN
    if node.args and node.args[0] is source:
        moved = _transposed(node, dim, len(before))
        if moved is not None:
            return moved if moved == _UNKNOWN or after[moved] == before[dim] else _UNKNOWN
        if _name(node) in _RESHAPES:
            return _reshaped(before, after, dim)
        if node.target is operator.getitem or _name(node) == "unsqueeze":
            at = _indexed(node, dim, before, after)
            return at if at == _UNKNOWN or after[at] == before[dim] else _UNKNOWN
    if _name(node) in _CATS:
        return _through_cat(node, dim, before, after)
    if node.target is operator.matmul or _name(node) in _MATMULS:
        return _through_matmul(node, source, dim, before, after)
    if _name(node) in _IN_PLACE and tuple(after) == tuple(before):
        return dim
    if _on_last_dim(node, source):
        last = dim == len(before) - 1
        kept = len(after) == len(before) and after[dim] == before[dim]
        return dim if kept and not last else _UNKNOWN
    same_shape = tuple(after) == tuple(before)
    if is_elementwise(node) or (same_shape and keeps_values(node)):
        at = dim + len(after) - len(before)  # broadcasting aligns dims from the right
        return at if 0 <= at < len(after) and after[at] == before[dim] else _UNKNOWN
    return _UNKNOWN


def follow_dim(start: fx.Node, dim: int) -> dict[fx.Node, int]:
    """Each tensor value computed from ``start`` -> the dim of it that holds ``start``'s
    ``dim`` (``-1``: lost, or paths disagree).

    Example:
        >>> import torch
        >>> from tread_fx.adapters.values import TensorMeta
        >>> g = fx.Graph()
        >>> x = g.placeholder("x")
        >>> t = g.call_method("transpose", (x, 1, 2))
        >>> for node, shape in ((x, (2, 16, 64)), (t, (2, 64, 16))):
        ...     node.meta["tread_meta"] = TensorMeta(shape, torch.float32, torch.device("cpu"))
        >>> follow_dim(x, 1)[t]
        2
    """
    found: dict[fx.Node, int] = {start: dim}
    for node in _after(start):
        if tensor_shape(node) is None:
            continue
        places = {
            _mapped(node, source, found[source])
            for source in node.all_input_nodes
            if found.get(source, _UNKNOWN) != _UNKNOWN
        }
        if places:
            found[node] = places.pop() if len(places) == 1 else _UNKNOWN
    return found


def feature_dims(graph: fx.Graph, data: set[fx.Node]) -> dict[fx.Node, int]:
    """Each value of ``data`` -> its dim holding the features of a linear layer's output
    computed from ``data`` (``-1``: none, or paths disagree): the width, never the tokens."""
    found: dict[fx.Node, int] = {}
    for node in graph.nodes:
        linear = node.op == "call_module" and isinstance(
            node.graph.owning_module.get_submodule(node.target), nn.Linear
        )
        if node in data and (linear or node.target is F.linear) and tensor_shape(node):
            for value, dim in follow_dim(node, len(tensor_shape(node)) - 1).items():
                found[value] = dim if found.get(value, dim) == dim else _UNKNOWN
    return found


def _after(start: fx.Node) -> list[fx.Node]:
    """The nodes after ``start`` in graph order (a topological order)."""
    nodes, seen = [], False
    for node in start.graph.nodes:
        if seen:
            nodes.append(node)
        seen = seen or node is start
    return nodes
