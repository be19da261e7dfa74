"""Blocks told a token count of their stream as a plain number.

Some blocks take the length of a part of their stream as an int argument and split or
slice the stream with it: a video model with history frames in front of the noisy frames
tells every block how many noisy tokens there are (``x[:, -n:]``, ``split(x, [L - n, n])``).
After routing, the stream is shorter; such a number must follow the kept tokens:

- the routed part's length (the stream less its never-routed prefix and suffix) becomes the
  kept count;
- the whole stream's length becomes the routed stream's length;
- the never-routed prefix's and suffix's lengths stay as they are.

A number that equals two of these counts, or one of them and the length of another token
sequence the block receives (a text stream), cannot be told apart: the route is refused,
naming the argument. A number that differs from block to block of a list (a block index)
is not a count.

Example:
    >>> # used by tread_fx.passes.plan.route_plan.plan_route; see tests/test_block_token_counts.py
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from tread_fx.errors import SideInputError
from tread_fx.passes.locate.layout import int_arguments, stream_tokens
from tread_fx.passes.locate.stream import BlockCall, StreamInfo, input_slots
from tread_fx.passes.trace.tracer import TensorMeta
from tread_fx.routes import Route

__all__ = ["count_arguments"]

# (what the number counts, its value when traced, its value after routing)
_Count = tuple[str, int, int]


def count_arguments(
    info: StreamInfo,
    route: Route,
    prefix: int,
    suffix: int,
    kept_tokens: int,
    passed: set[fx.Node],
    name: Callable[[BlockCall, tuple], str],
    skip: set[tuple] = frozenset(),
    uses: dict | None = None,
) -> list[tuple[fx.Node, tuple, int]]:
    """Int arguments of the route's blocks that count tokens of the routed stream.

    Args:
        info: The located stream.
        route: The route.
        prefix: Leading tokens of the stream at the route start that are never routed.
        suffix: Trailing tokens of the stream at the route start that are never routed.
        kept_tokens: Tokens of the routed stream at the route start (prefix and suffix
            included).
        passed: Values entering the route unchanged (their lengths are other counts).
        name: The parameter name a block's argument slot fills (for messages).
        skip: ``(node, slot)`` pairs already rewritten (the patch grid's height).
        uses: Per block node, its :class:`~tread_fx.passes.plan.uses.BlockUses`: only an int
            that sizes, slices or splits a token dim in the block is a count; in a block
            that cannot be traced through, an int equal to a count is taken for one, with
            a warning.

    Returns:
        ``(block node, slot, number after routing)`` for each argument whose number changes.

    Raises:
        SideInputError: A number matches counts that routing changes differently.
    """
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
        counts += [] if _sizes_stream(uses, block) else others
        if block.list_path not in constant_by_list:
            constant_by_list[block.list_path] = _constant_slots(info, block)
        constant = constant_by_list[block.list_path]
        for slot, number in int_arguments(block.node):
            if (block.node, slot) in skip or slot not in constant:
                continue
            if not _sizes_tokens(uses, block, slot):
                continue
            matches = [(what, new) for what, value, new in counts if value == number]
            if len({new for _, new in matches}) > 1:
                raise SideInputError(_ambiguous(block, name(block, slot), number, matches))
            if matches and matches[0][1] != number:
                found.append((block.node, slot, matches[0][1]))
                if uses is not None and uses.get(block.node) is None:
                    warnings.warn(_guessed(block, name(block, slot), number), stacklevel=2)
    return found


def _sizes_stream(uses: dict | None, block: BlockCall) -> bool:
    """Whether the block's ints were traced to the stream's own shape ops (then a number
    equal to another sequence's length is still the stream's count)."""
    return uses is not None and uses.get(block.node) is not None


def _sizes_tokens(uses: dict | None, block: BlockCall, slot: tuple) -> bool:
    """Whether the block uses the int in ``slot`` as a token count (see
    tread_fx/passes/plan/uses.py); for
    a block that cannot be traced through, any int may be (the caller warns)."""
    if uses is None or uses.get(block.node) is None:
        return True
    return slot in uses[block.node].counts


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
