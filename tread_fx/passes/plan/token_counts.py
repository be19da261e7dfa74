"""Blocks told a token count of their stream as a plain number, and what it becomes.

Some blocks take the length of a part of their stream as an int argument and split or
slice the stream with it: a video model with history frames in front of the noisy frames
tells every block how many noisy tokens there are (``x[:, -n:]``, ``split(x, [L - n, n])``).
After routing, the stream is shorter; such a number must follow the kept tokens:

- the routed part's length (the stream less its never-routed prefix and suffix) becomes the
  kept count;
- the whole stream's length becomes the routed stream's length;
- the never-routed prefix's and suffix's lengths stay as they are.

Which ints are counts is decided by use: a block traced through
(:mod:`tread_fx.passes.plan.uses`) gets each int argument as a :class:`TaggedInt` that
remembers its argument slot through ``+ - * //``, and an int is a count only if it sizes,
slices or splits a token dim of a tensor computed from the stream
(``view``/``reshape``/``unflatten`` of its token dim, ``x[:, -n:]``, ``split``, ``narrow``);
any other int (a head dim equal to the token count by coincidence) is never rewritten.

A number that equals two of these counts, or one of them and the length of another token
sequence the block receives (a text stream), cannot be told apart: the route is refused,
naming the argument. A number that differs from block to block of a list (a block index)
is not a count.

Example:
    >>> n = TaggedInt(16, ("arg", 2))
    >>> (n - 4).slot
    ('arg', 2)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from tread_fx.adapters.values import StreamLayout, TensorMeta
from tread_fx.errors import SideInputError
from tread_fx.passes.locate.dataflow import argument_items, input_slots
from tread_fx.passes.locate.layout import int_arguments, stream_tokens
from tread_fx.passes.locate.stream import BlockCall, StreamInfo
from tread_fx.routes import Route

__all__ = ["TaggedInt", "count_slots", "tagged_example", "count_arguments", "sizes_tokens"]

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
        return set().union(*(_tags(v) for v in value))
    return set()


def count_slots(node: fx.Node, tokens: set[int]) -> set[tuple]:
    """Slots of tagged ints that size, slice or split a token dim at ``node`` (a node of a
    block traced through on :func:`tagged_example` inputs)."""
    name, shape = _name(node), _shape(node.args[0]) if node.args else None
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
    token_spans = [(bounds[d], bounds[d + 1]) for d, s in enumerate(shape) if s in tokens]
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


# (what the number counts, its value when traced, its value after routing)
_Count = tuple[str, int, int]


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
        kept_tokens: Tokens of the routed stream at the route start (prefix and suffix
            included).
        passed: Values entering the route unchanged (their lengths are other counts).
        name: The parameter name a block's argument slot fills (for messages).
        skip: ``(node, slot)`` pairs already rewritten (the patch grid's height).
        uses: Per block node, its :class:`~tread_fx.passes.plan.uses.BlockUses`
            (:func:`sizes_tokens`); in a block that cannot be traced through, an int equal
            to a count is taken for one, with a warning.

    Returns:
        ``(block node, slot, number after routing)`` for each argument whose number changes.

    Raises:
        SideInputError: A number matches counts that routing changes differently.
    """
    prefix, suffix = layout.prefix, layout.suffix
    tokens = stream_tokens(info.blocks[route.start], info)
    others = _other_sequences(info.blocks[route.start], info, passed, name)
    found = []
    constant_by_list: dict[str, set[tuple]] = {}
    for block in info.blocks[route.start : route.end]:
        shift = stream_tokens(block, info) - tokens  # tokens concatenated in front (crossing)
        kept = kept_tokens - prefix - suffix
        counts = [
            ("the routed part of the stream (less its never-routed prefix and suffix)",
             tokens - prefix - suffix, kept),
            ("the whole stream", tokens + shift, kept_tokens + shift),
            ("the never-routed prefix of the stream", prefix + shift, prefix + shift),
        ]  # fmt: skip
        if suffix:
            counts.append(("the never-routed suffix of the stream", suffix, suffix))
        traced = uses.get(block.node) is not None
        counts += [] if traced else others  # traced: a count sizes the stream's own tokens
        if block.list_path not in constant_by_list:
            constant_by_list[block.list_path] = _constant_slots(info, block)
        constant = constant_by_list[block.list_path]
        for slot, number in int_arguments(block.node):
            if (block.node, slot) in skip or slot not in constant:
                continue
            if not sizes_tokens(uses, block.node, slot):
                continue
            matches = [(what, new) for what, value, new in counts if value == number]
            if len({new for _, new in matches}) > 1:
                raise SideInputError(_ambiguous(block, name(block, slot), number, matches))
            if matches and matches[0][1] != number:
                found.append((block.node, slot, matches[0][1]))
                if not traced:
                    warnings.warn(_guessed(block, name(block, slot), number), stacklevel=2)
    return found


def sizes_tokens(uses: dict, node: fx.Node, slot: tuple) -> bool:
    """Whether the block call ``node`` uses the int in ``slot`` as a token count (it sizes,
    slices or splits a token dim); in a block that cannot be traced through, any int may.

    Example:
        >>> sizes_tokens({}, None, ("arg", 2))
        True
    """
    return uses.get(node) is None or slot in uses[node].counts


def _guessed(block: BlockCall, name: str, number: int) -> str:
    return (
        f"block {block.index} ({block.path}) receives the number {number} as '{name}', equal "
        "to a token count, and cannot be traced through to see whether it sizes the tokens; "
        "it is told the kept count. If it is not a count, route blocks that do not take it "
        "(blocks=)."
    )


def _other_sequences(
    block: BlockCall, info: StreamInfo, passed: set[fx.Node], name: Callable
) -> list[_Count]:
    """Lengths of other token sequences ([B, T, ...] tensors) the block receives unchanged."""
    counts = []
    for key, value in input_slots(block.node).items():
        meta = value.meta.get("tread_meta")
        if value in passed and isinstance(meta, TensorMeta) and len(meta.shape) >= 3:
            length = meta.shape[info.token_dim]
            what = f"the length of the sequence '{name(block, key)}' the block also receives"
            counts.append((what, length, length))
    return counts


def _constant_slots(info: StreamInfo, block: BlockCall) -> set[tuple]:
    """Int slots holding the same number in every block of ``block``'s list."""
    members = [b for b in info.blocks if b.list_path == block.list_path]
    values = [dict(int_arguments(b.node)) for b in members]
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
