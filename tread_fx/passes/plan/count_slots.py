"""Which int arguments of a block are token counts: the ints that size its tokens.

A block traced through (:mod:`tread_fx.passes.plan.uses`) gets each int argument as a
:class:`TaggedInt` that remembers its argument slot through ``+ - * //``. An int argument is a
count only if it sizes, slices or splits a token dim of a tensor computed from the stream
(``view``/``reshape``/``unflatten`` of its token dim, ``x[:, -n:]``, ``split``,
``narrow``); any other int (a head dim equal to the token count by coincidence) is never
rewritten.

Example:
    >>> n = TaggedInt(16, ("arg", 2))
    >>> (n - 4).slot
    ('arg', 2)
"""

from __future__ import annotations

import math
from typing import Any

import torch.fx as fx

from tread_fx.adapters.values import TensorMeta
from tread_fx.passes.locate.stacks import argument_items

__all__ = ["TaggedInt", "count_slots", "tagged_example"]

_RESHAPE = {"view", "reshape", "unflatten"}
_SPLIT = {"split", "split_with_sizes", "narrow", "tensor_split"}


def _name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_module":
        return "module"
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _shape(value: Any) -> tuple[int, ...] | None:
    meta = value.meta.get("tread_meta") if isinstance(value, fx.Node) else None
    return meta.shape if isinstance(meta, TensorMeta) else None


class TaggedInt(int):
    """An int that remembers which argument slot it came from, through +, -, *, //."""

    slot: tuple

    def __new__(cls, value: int, slot: tuple) -> TaggedInt:
        tagged = super().__new__(cls, value)
        tagged.slot = slot
        return tagged

    def _keep(self, value: Any) -> Any:
        return TaggedInt(value, self.slot) if type(value) is int else value

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
        return TaggedInt(-int(self), self.slot)

    def __reduce__(self):  # noqa: D105
        return int, (int(self),)


def _tags(value: Any) -> set[tuple]:
    if isinstance(value, TaggedInt):
        return {value.slot}
    if isinstance(value, slice):
        return _tags(value.start) | _tags(value.stop)
    if isinstance(value, (tuple, list)):
        return set().union(*(_tags(v) for v in value)) if value else set()
    return set()


def _token_dims(shape: tuple[int, ...], tokens: set[int]) -> set[int]:
    return {d for d, s in enumerate(shape) if s in tokens}


def count_slots(node: fx.Node, tokens: set[int]) -> set[tuple]:
    """Slots of tagged ints that size, slice or split a token dim at ``node`` (a node of a
    block traced through on :func:`tagged_example` inputs)."""
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


def tagged_example(example: Any, node: fx.Node) -> Any:
    """The block call's example ``(args, kwargs)`` with each int argument tagged by its slot."""
    args, kwargs = example
    args, kwargs = list(args), dict(kwargs)
    for slot, _ in argument_items(node):
        kind, key = slot
        holder = args if kind == "arg" else kwargs
        if (key < len(holder) if kind == "arg" else key in holder) and type(holder[key]) is int:
            holder[key] = TaggedInt(holder[key], slot)
    return tuple(args), kwargs
