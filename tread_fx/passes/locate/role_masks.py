"""Streams whose token roles are given by data: a per-token mask decides which positions hold
the noisy input's tokens.

Some models pack text and image into one sequence of fixed length and tell each position's
role by data: the noisy input is multiplied by a mask (``indicator == IMAGE``), another
input by its complement, and the two are added; or the noisy input's tokens are written in
at positions an index input gives (``index_copy(1, video_indices, video)``). Which positions
are image tokens is then a property of the data, not of the graph: a route would select
text positions as well. Such a stream is refused (never routed by a
guess) until a selection restricted to the mask's positions exists.

Example:
    >>> # used by tread_fx.passes.locate.choice.choose_stream: role_mask(info) -> str | None
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tread_fx.passes.locate.dataflow import data_ancestors
from tread_fx.passes.locate.stream import StreamInfo
from tread_fx.passes.trace.tracer import TensorMeta

__all__ = ["role_mask"]

_MULS = {operator.mul, operator.imul, torch.mul, "mul", "mul_"}
_ADDS = {operator.add, operator.iadd, torch.add, "add", "add_"}
_COMPARE = {operator.eq, operator.ne, torch.eq, torch.ne, "eq", "ne", "__eq__", "__ne__"}
# writes of a source along a dim at positions given by an index tensor: (dim, index, source)
_INDEX_WRITES = {"index_copy", "index_copy_", "index_add", "index_add_", "scatter", "scatter_"}


def _fed(node: object, source: fx.Node) -> bool:
    return isinstance(node, fx.Node) and (node is source or source in data_ancestors(node, set()))


def _inputs_of(node: fx.Node) -> set[fx.Node]:
    return {n for n in data_ancestors(node, set()) | {node} if n.op == "placeholder"}


def _named(node: fx.Node) -> str:
    """The model inputs a value is computed from, by argument name (a hint for the reader)."""
    names = sorted(n.meta.get("tread_input_name", n.name) for n in _inputs_of(node))
    return f"from input(s) {', '.join(names)}" if names else node.name


def _per_token(node: object, info: StreamInfo) -> bool:
    meta = node.meta.get("tread_meta") if isinstance(node, fx.Node) else None
    if not isinstance(meta, TensorMeta) or len(meta.shape) <= info.token_dim:
        return False
    return meta.shape[info.token_dim] == info.num_tokens


def _is_role_mask(node: object, info: StreamInfo) -> bool:
    """A per-token value, not fed by the main input, computed by comparing data to a value."""
    if not _per_token(node, info) or _fed(node, info.primary):
        return False
    meta = node.meta["tread_meta"]
    if any(s != 1 for s in meta.shape[info.token_dim + 1 :]):
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
    """The index input of ``x.index_copy(dim, index, source)`` (or ``index_add``, ``scatter``)
    when ``source`` holds the main input's tokens and ``index`` is computed from an input."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.op not in ("call_function", "call_method") or name not in _INDEX_WRITES:
        return None
    args = list(node.args[1:]) + [node.kwargs.get(k) for k in ("dim", "index", "source", "src")]
    sources = [a for a in args if _fed(a, info.primary)]
    indices = [
        a
        for a in args
        if isinstance(a, fx.Node)
        and not _fed(a, info.primary)
        and any(n.op == "placeholder" for n in data_ancestors(a, set()) | {a})
    ]
    return indices[0] if sources and indices else None


def role_mask(info: StreamInfo) -> str | None:
    """Why the stream's image positions are data-dependent, if they are (else ``None``).

    Either the main input's tokens are written into the stream at positions an input gives
    (``stream.index_copy(1, video_indices, video)``), or the stream is a sum of a part fed by
    the main input and a part fed by another input only, each gated per token by a mask
    computed from data (a padding mask on the image plus an ungated per-token table is not).
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
        mine = [p for p in parts if _fed(p, info.primary)]
        other = [p for p in parts if not _fed(p, info.primary) and _inputs_of(p) - {info.primary}]
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
