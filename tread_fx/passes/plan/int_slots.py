"""Ints handed to a block, tagged by the argument slot they came from, and what they size.

A block class is traced through on its example inputs with each int argument a
:class:`TaggedInt` (ints inside tuple and list arguments too, :func:`tagged_example`); an int
computed from one keeps its slot through ``+``, ``-``, ``*``, ``//``. :func:`count_slots` reads
which slots size, slice or split a token dim in the traced block; :func:`unseen_count_slots`
which ones reach a call tread_fx does not see into (einops' ``rearrange(..., n=count)``).
:func:`op_name` names an op for messages, with why the trace kept a call whole.

Example:
    >>> n = TaggedInt(16, ("arg", 1))
    >>> (n // 2).slot, n * 2
    (('arg', 1), 32)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from tread_fx.passes.locate.dataflow import argument_items, tensor_shape
from tread_fx.passes.plan.op_kinds import is_torch_op
from tread_fx.passes.trace.tracer import LEAF_REASON_KEY, MODEL_PREFIX
from tread_fx.stages import own_file

__all__ = [
    "TaggedInt",
    "count_slots",
    "op_name",
    "tagged_example",
    "unseen_count_slots",
]

_RESHAPE = {"view", "reshape", "unflatten"}
_SPLIT = {"split", "split_with_sizes", "narrow", "tensor_split"}


def _name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_module":
        return "module"
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def op_name(node: fx.Node) -> str:
    """The op's name, a leaf module's path for messages (with why the trace kept it one call)."""
    name = _name(node)
    if node.op == "call_module":
        name = str(node.target).removeprefix(MODEL_PREFIX)
    reason = node.meta.get(LEAF_REASON_KEY)
    return name if reason is None else f"{name} (kept as one call: tracing it raised {reason})"


def _tagged(op: Callable[[int, Any], Any]) -> Callable[[TaggedInt, Any], Any]:
    """A :class:`TaggedInt` method: ``op`` on its value, an int result keeping its slot."""

    def method(self: TaggedInt, other: Any) -> Any:
        return self._keep(op(int(self), other))

    return method


class TaggedInt(int):
    """An int that remembers which argument slot it came from, through +, -, *, //."""

    slot: tuple

    def __new__(cls, value: int, slot: tuple) -> TaggedInt:
        tagged = super().__new__(cls, value)
        tagged.slot = slot
        return tagged

    def _keep(self, value: Any) -> Any:
        return TaggedInt(value, self.slot) if type(value) is int else value

    __add__ = _tagged(operator.add)
    __radd__ = _tagged(lambda value, other: other + value)
    __sub__ = _tagged(operator.sub)
    __rsub__ = _tagged(lambda value, other: other - value)
    __mul__ = _tagged(operator.mul)
    __rmul__ = _tagged(lambda value, other: other * value)
    __floordiv__ = _tagged(operator.floordiv)

    def __neg__(self):  # noqa: D105
        return TaggedInt(-int(self), self.slot)

    def __reduce__(self):  # noqa: D105
        return int, (int(self),)


def _tags(value: Any) -> set[tuple]:
    if isinstance(value, TaggedInt):
        return {value.slot}
    if isinstance(value, slice):
        return _tags(value.start) | _tags(value.stop)
    if isinstance(value, (tuple, list)):
        return set().union(*(_tags(v) for v in value))
    return set()


def count_slots(node: fx.Node, tokens: set[int]) -> set[tuple]:
    """Slots of tagged ints that size, slice or split a token dim at ``node`` (a node of a
    block traced through on :func:`tagged_example` inputs)."""
    name, shape = _name(node), tensor_shape(node.args[0]) if node.args else None
    if shape is None:
        return set()
    if name in _RESHAPE:
        return _reshaped(node, shape, tokens)
    if name == "getitem":
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if Ellipsis in index or None in index:
            return set()
        sliced = [item for d, item in enumerate(index) if d < len(shape) and shape[d] in tokens]
        return _tags(sliced)
    if name in _SPLIT:
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        dim = node.args[1] if name == "narrow" else dim
        if isinstance(dim, int) and -len(shape) <= dim < len(shape) and shape[dim] in tokens:
            return _tags(list(node.args[1:]) + list(node.kwargs.values()))
    return set()


def unseen_count_slots(node: fx.Node) -> dict[tuple, str]:
    """Slots of tagged ints handed to ``node`` when it is a call tread_fx does not see into
    (neither one of torch's ops nor tread_fx's own: a library function kept as one call, a
    leaf module), with the op's name; ``node`` is taken to receive a value computed from the
    stream. Such an int may size a token dim there (``einops.rearrange(a, ..., n=count)``).

    Example:
        >>> graph = fx.Graph()
        >>> x = graph.placeholder("x")
        >>> unseen_count_slots(graph.call_function(print, (x, TaggedInt(8, ("arg", 1)))))
        {('arg', 1): 'print'}
    """
    if node.op == "call_function" and (is_torch_op(node) or _own_function(node.target)):
        return {}
    if node.op not in ("call_function", "call_module"):
        return {}
    found = _tags(list(node.args) + list(node.kwargs.values()))
    return dict.fromkeys(sorted(found), op_name(node))


def _own_function(target: Any) -> bool:
    """Whether ``target`` is tread_fx's own (a helper the trace records, ``functional_setitem``)."""
    code = getattr(target, "__code__", None)
    return code is not None and own_file(code.co_filename)


def _reshaped(node: fx.Node, shape: tuple[int, ...], tokens: set[int]) -> set[tuple]:
    """Tagged sizes of a view/reshape that fall inside an input token dim's extent."""
    sizes = node.args[1:]
    if _name(node) == "unflatten":
        dim = node.args[1]
        if not isinstance(dim, int) or shape[dim % len(shape)] not in tokens:
            return set()
        return _tags(node.args[2:])
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = sizes[0]
    out = tensor_shape(node)
    if out is None or len(out) != len(sizes):
        return set()
    bounds = [math.prod(shape[:d]) for d in range(len(shape) + 1)]
    token_spans = [(bounds[d], bounds[d + 1]) for d, s in enumerate(shape) if s in tokens]
    found: set[tuple] = set()
    for d, size in enumerate(sizes):
        low, high = math.prod(out[:d]), math.prod(out[: d + 1])
        if any(lo <= low and high <= hi for lo, hi in token_spans) and _tags(size):
            found |= _tags(size)
    return found


def _tag(value: Any, slot: tuple) -> Any:
    """``value`` with each int tagged by its slot, into plain tuples and lists
    (``patch_resolution=(H, W)``: ``(*slot, j)`` for item ``j``, as ``input_slots`` names it)."""
    if type(value) is int:
        return TaggedInt(value, slot)
    if type(value) in (tuple, list):
        return type(value)(_tag(v, (*slot, j)) for j, v in enumerate(value))
    return value


def tagged_example(example: Any, node: fx.Node) -> Any:
    """The block call's example ``(args, kwargs)`` with each int argument tagged by its slot
    (ints inside tuple and list arguments too)."""
    args, kwargs = list(example[0]), dict(example[1])
    for slot, _ in argument_items(node):
        kind, key = slot
        holder = args if kind == "arg" else kwargs
        if key < len(holder) if kind == "arg" else key in holder:
            holder[key] = _tag(holder[key], slot)
    return tuple(args), kwargs
