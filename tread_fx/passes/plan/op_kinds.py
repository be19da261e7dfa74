"""What an op of a traced graph is, read from torch's own op metadata (never a list of names).

The classifier of uses (:mod:`tread_fx.passes.plan.uses`) asks of an op whether it is
elementwise and which of its inputs select (a condition or a mask). A node's target — a
``Tensor`` method, a torch function (``torch.where``, ``F.softmax``), a Python operator
(``a * b``), an aten overload — is resolved to the aten overloads it dispatches to: it is run
once on meta tensors of its inputs' shapes and dtypes under a dispatch mode that records them
(cached per target and input signature). Only torch's own callables are run: ``Tensor``
methods, functions ``torch.overrides`` lists as overridable, aten overloads and the
``operator`` module. From the overloads reached:

- :func:`is_pointwise`: every one is tagged ``torch.Tag.pointwise`` (an in-place overload
  reads its out-of-place sibling's tags: ``masked_fill_`` is ``masked_fill``'s in-place form),
  or it reaches none (``x.float()`` of a float tensor returns ``x``).
- :func:`keeps_values`: every one is a view (its schema returns an alias) or a copy
  (``_to_copy``, ``clone``): dtype, device and layout changes, values kept.
- :func:`selector_args`: the inputs bound to a schema parameter named ``condition`` or
  ``mask`` of a pointwise overload (``where``, ``masked_fill``).

An op that cannot be resolved (a leaf function, an input without a recorded shape) is none of
these; :func:`is_elementwise` then falls back to the former name list. Two shape rules say
what an op makes of the token dims: :func:`pairs_tokens` (an elementwise operand that makes a
token-by-token map of the stream) and :func:`mixes_tokens` (a ``[T, T]`` matrix the stream's
tokens are multiplied by).

Example:
    >>> g = fx.Graph()
    >>> a = g.placeholder("a")
    >>> a.meta["tread_meta"] = TensorMeta((2, 3), torch.float32, "cpu")
    >>> is_pointwise(g.call_method("clamp", (a,), {"max": 1.0}))
    True
    >>> is_pointwise(g.call_function(torch.softmax, (a, -1)))
    False
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from tread_fx.adapters.values import TensorMeta
from tread_fx.passes.locate.dataflow import tensor_shape

__all__ = [
    "aten_overloads",
    "is_elementwise",
    "is_pointwise",
    "is_torch_op",
    "keeps_values",
    "mixes_tokens",
    "projects_tokens",
    "pairs_tokens",
    "selector_args",
]

_SELECTORS = ("condition", "mask")  # schema parameter names of a selecting input
_COPIES = ("aten::_to_copy", "aten::clone", "aten::detach", "aten::alias")
# The former name list, kept: the tags leave out rsub.Tensor, and a node without recorded
# input shapes cannot be resolved.
_NAMED_ELEMENTWISE = {"add", "sub", "mul", "div", "truediv", "iadd", "isub", "imul", "add_",
                      "sub_", "mul_", "div_", "addcmul", "__add__", "__sub__", "__mul__",
                      "__truediv__", "__radd__", "__rmul__", "__rsub__", "lerp"}  # fmt: skip


class _Record(TorchDispatchMode):
    """Records the aten overloads a call dispatches to."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@functools.cache
def _overridable() -> frozenset:
    found = torch.overrides.get_overridable_functions().values()
    return frozenset(f for functions in found for f in functions)


def _runnable(node: fx.Node) -> bool:
    """Whether ``node``'s target is torch's own (safe to run on meta tensors)."""
    target = node.target
    if node.op == "call_method":
        return isinstance(target, str) and callable(getattr(torch.Tensor, target, None))
    if node.op != "call_function":
        return False
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return target is not operator.setitem
    try:
        return target in _overridable()
    except TypeError:  # an unhashable target
        return False


def is_torch_op(node: fx.Node) -> bool:
    """Whether ``node`` calls one of torch's own ops (a tensor method, an aten op, an
    ``operator`` function, an overridable torch function), whose effect tread_fx reads from
    torch's metadata; a library or model function kept as one call is not one.

    Example:
        >>> import torch
        >>> graph = fx.Graph()
        >>> x = graph.placeholder("x")
        >>> is_torch_op(graph.call_function(torch.relu, (x,)))
        True
        >>> is_torch_op(graph.call_function(print, (x,)))
        False
    """
    return _runnable(node)


def _key(value: Any) -> Any:
    """A hashable stand-in for one argument: a tensor's rank and dtype, a scalar's type."""
    if isinstance(value, fx.Node):
        meta = value.meta.get("tread_meta")
        if isinstance(meta, TensorMeta):
            return ("tensor", len(meta.shape), meta.dtype)
        return ("scalar", meta) if isinstance(meta, (bool, int, float)) else ("?", None)
    if isinstance(value, (tuple, list)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _key(v)) for k, v in value.items())
    return ("const", value) if isinstance(value, (bool, int, float, str, type(None))) else None


def _meta_value(value: Any) -> Any:
    if isinstance(value, fx.Node):
        meta = value.meta.get("tread_meta")
        if isinstance(meta, TensorMeta):
            return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
        if isinstance(meta, (bool, int, float)):
            return meta
        raise _Unresolved
    return value


class _Unresolved(Exception):
    """An input without a recorded tensor or scalar value."""


def aten_overloads(node: fx.Node) -> tuple[torch._ops.OpOverload, ...] | None:
    """The aten overloads ``node``'s op dispatches to on inputs of its shapes and dtypes,
    or ``None`` when it cannot be resolved (see the module docstring).

    Example:
        >>> g = fx.Graph()
        >>> a = g.placeholder("a")
        >>> a.meta["tread_meta"] = TensorMeta((4,), torch.float32, "cpu")
        >>> [str(op) for op in aten_overloads(g.call_function(operator.mul, (a, a)))]
        ['aten.mul.Tensor']
    """
    if not _runnable(node):
        return None
    try:
        key = (node.op, node.target, _key(node.args), _key(node.kwargs))
        hash(key)
    except TypeError:
        return None
    return _resolve(key, node)


_CACHE: dict[tuple, tuple | None] = {}


def _resolve(key: tuple, node: fx.Node) -> tuple | None:
    if key not in _CACHE:
        _CACHE[key] = _dispatch(node)
    return _CACHE[key]


def _dispatch(node: fx.Node) -> tuple | None:
    try:
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), _meta_value)
    except _Unresolved:
        return None
    record = _Record()
    try:
        with record:
            if node.op == "call_method":
                getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not runnable on meta tensors: unresolved
        return None
    return tuple(record.ops)


def _pointwise(op: torch._ops.OpOverload) -> bool:
    if torch.Tag.pointwise in op.tags:
        return True
    name = op._schema.name.removeprefix("aten::")
    if torch.Tag.inplace not in op.tags or not name.endswith("_"):
        return False
    packet = getattr(torch.ops.aten, name[:-1], None)
    sibling = getattr(packet, op._overloadname, None) if packet is not None else None
    return sibling is not None and torch.Tag.pointwise in sibling.tags


def is_pointwise(node: fx.Node) -> bool:
    """Whether ``node``'s op is elementwise (with broadcasting) by torch's op tags."""
    ops = aten_overloads(node)
    return ops is not None and all(_pointwise(op) or _copies(op) for op in ops)


def _copies(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    views = bool(returns) and returns[0].alias_info is not None
    return views or op._schema.name in _COPIES


def is_elementwise(node: fx.Node) -> bool:
    """Whether ``node`` is elementwise: by torch's op tags (:func:`is_pointwise`), or one of
    the ops the former name list held that the tags leave out or that cannot be resolved.

    Example:
        >>> g = fx.Graph()
        >>> a = g.placeholder("a")
        >>> is_elementwise(g.call_function(operator.mul, (a, 2)))  # no shape: by its name
        True
    """
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in _NAMED_ELEMENTWISE or is_pointwise(node)


def keeps_values(node: fx.Node) -> bool:
    """Whether ``node``'s op only views or copies its input (``to``, ``float``, ``contiguous``,
    ``type_as``), by the schemas of the overloads it reaches."""
    ops = aten_overloads(node)
    return ops is not None and all(_copies(op) for op in ops)


def selector_args(node: fx.Node) -> list[Any]:
    """The inputs of ``node`` bound to a ``condition``/``mask`` parameter of the pointwise
    overload it dispatches to (``where(condition, a, b)``, ``x.masked_fill(mask, v)``)."""
    ops = aten_overloads(node) or ()
    found = []
    for op in ops:
        if not _pointwise(op):
            continue
        for i, argument in enumerate(op._schema.arguments):
            if argument.name not in _SELECTORS:
                continue
            if argument.name in node.kwargs:
                found.append(node.kwargs[argument.name])
            elif i < len(node.args):
                found.append(node.args[i])
    return found


# -- what an op makes of token dims -----------------------------------------------------------


def _right(shape: tuple[int, ...], d: int) -> int | None:
    return shape[d] if -len(shape) <= d else None


def pairs_tokens(mine: tuple | None, theirs: tuple | None, tokens: set[int]) -> bool:
    """Whether a value of shape ``mine``, broadcast elementwise against a stream value of shape
    ``theirs``, supplies two token dims of the result: one beside the stream's tokens and one
    where the stream has size 1 (``exp(-w * |i - j|)[..., None] * k[:, None]``: a token-by-token
    map, like attention scores). The stream's last dim holds features unless it is 1.

    Example:
        >>> pairs_tokens((16, 16, 1), (2, 1, 16, 32), {16}), pairs_tokens((16, 8), (2, 16, 8), {16})
        (True, False)
    """
    if mine is None or theirs is None:
        return False
    beside = broadcast = False
    for d in range(-1, -len(mine) - 1, -1):
        size, other = mine[d], _right(theirs, d)
        if size not in tokens or (d == -1 and other not in (1, None)):
            continue
        beside |= other == size
        broadcast |= other in (1, None)
    return beside and broadcast


def mixes_tokens(node: fx.Node, mine: list, theirs: list, tokens: set[int]) -> bool:
    """Whether ``node`` is ``a @ b`` with ``a`` among ``mine`` a token-mixing matrix of the
    stream value ``b`` among ``theirs``: ``a``'s last dim contracts ``b``'s token dim and its
    rows are tokens (a ``[T, T]`` decay or mixing matrix, as attention probabilities are).

    Example:
        >>> g = fx.Graph()
        >>> a, b = g.placeholder("a"), g.placeholder("b")
        >>> a.meta["tread_meta"] = TensorMeta((16, 16), torch.float32, "cpu")
        >>> b.meta["tread_meta"] = TensorMeta((2, 16, 32), torch.float32, "cpu")
        >>> mixes_tokens(g.call_function(operator.matmul, (a, b)), [a], [b], {16})
        True
    """
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name not in ("matmul", "bmm", "__matmul__") or len(node.args) < 2:
        return False
    left, right = tensor_shape(node.args[0]), tensor_shape(node.args[1])
    if node.args[0] not in mine or node.args[1] not in theirs or not left or not right:
        return False
    if len(left) < 2 or len(right) < 2:
        return False
    return left[-1] == right[-2] and left[-1] in tokens and left[-2] in tokens


def projects_tokens(node: fx.Node, table: fx.Node, tokens: set[int]) -> str | None:
    """Which side of ``a @ b`` a ``table`` built from the token count sits on when it
    contracts the other side's token dim (Linformer's ``k^T @ E[:n]`` projecting the tokens):
    ``"right"`` (its dim -2 holds the tokens), ``"left"`` (its last dim does), else ``None``.

    Example:
        >>> g = fx.Graph()
        >>> k, e = g.placeholder("k"), g.placeholder("e")
        >>> k.meta["tread_meta"] = TensorMeta((2, 8, 16), torch.float32, "cpu")
        >>> e.meta["tread_meta"] = TensorMeta((16, 4), torch.float32, "cpu")
        >>> projects_tokens(g.call_function(operator.matmul, (k, e)), e, {16})
        'right'
    """
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name not in ("matmul", "bmm", "__matmul__") or len(node.args) < 2:
        return None
    left, right = tensor_shape(node.args[0]), tensor_shape(node.args[1])
    if not left or not right or len(right) < 2 or left[-1] != right[-2] or left[-1] not in tokens:
        return None
    return {0: "left", 1: "right"}.get(next((i for i in (1, 0) if node.args[i] is table), -1))
