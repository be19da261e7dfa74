"""Concatenations along a dim: ``torch.cat`` nodes, and leaf functions whose values show one.

A concatenation of tokens inside a leaf function (``pack([x, registers], "b * d")``) is
invisible to the passes that look for ``torch.cat`` (:mod:`tread_fx.passes.locate.dims`).
While tracing, the leaf's real output is compared with its tensor inputs laid out one after
another along each dim; where the values are equal, the node records that dim and the part
sizes (the data decide, never the function's name). :func:`concatenation_parts` answers for
both kinds of node.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from tread_fx.adapters.values import TensorMeta

__all__ = ["concatenation_parts", "concatenation_sizes", "record_leaf_concatenation"]

_KEY = "tread_leaf_concat"
_CAT = (torch.cat, torch.concat, torch.concatenate)


def concatenation_sizes(
    out: torch.Tensor, parts: list[torch.Tensor]
) -> list[tuple[int, list[int]]]:
    """The dims along which ``out`` is ``parts`` laid out one after another, with part sizes.

    A part may have any shape whose elements, in order, fill its block of ``out``
    (``[B, H, W, D]`` fills ``[B, H * W, D]``, as einops ``pack`` flattens it).

    Args:
        out: The output tensor.
        parts: The input tensors, in argument order (at least two).

    Returns:
        ``(dim, sizes)`` for every dim of ``out`` along which the values match exactly.

    Example:
        >>> a, b = torch.randn(2, 4, 3), torch.randn(2, 1, 3)
        >>> concatenation_sizes(torch.cat([b, a], 1), [b, a])
        [(1, [1, 4])]
    """
    found: list[tuple[int, list[int]]] = []
    if len(parts) < 2 or out.dim() == 0 or out.numel() == 0:
        return found
    for dim in range(out.dim()):
        sizes = _sizes_along(out, parts, dim)
        if sizes is not None and _equal_blocks(out, parts, dim, sizes):
            found.append((dim, sizes))
    return found


def _sizes_along(out: torch.Tensor, parts: list[torch.Tensor], dim: int) -> list[int] | None:
    other = out.numel() // out.shape[dim]
    if any(p.numel() % other for p in parts):
        return None
    sizes = [p.numel() // other for p in parts]
    return sizes if sum(sizes) == out.shape[dim] else None


def _equal_blocks(out: torch.Tensor, parts: list[torch.Tensor], dim: int, sizes: list[int]) -> bool:
    shape = list(out.shape)
    try:
        blocks = [p.reshape([*shape[:dim], s, *shape[dim + 1 :]]) for p, s in zip(parts, sizes)]
        if any(b.dtype != out.dtype for b in blocks):
            return False
        return torch.equal(torch.cat(blocks, dim), out)
    except (RuntimeError, NotImplementedError):  # meta/fake tensors, odd layouts: no evidence
        return False


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in argument order (repeats kept: ``pack([x, x])``)."""
    found: list[fx.Node] = []

    def keep(n: fx.Node) -> fx.Node:
        if isinstance(n.meta.get("tread_meta"), TensorMeta):
            found.append(n)
        return n

    fx.node.map_arg((node.args, node.kwargs), keep)
    return found


def record_leaf_concatenation(node: fx.Node, value: Any, values: dict[fx.Node, Any]) -> None:
    """Record on a leaf function's node which of its tensor outputs concatenate its inputs.

    Args:
        node: The leaf function's ``call_function`` node (its inputs already traced).
        value: Its real output: a tensor, or a tuple/list holding tensors.
        values: The real values of the traced nodes.
    """
    parts = [values[n] for n in _tensor_inputs(node)]
    outputs = {None: value} if isinstance(value, torch.Tensor) else {}
    if isinstance(value, (tuple, list)):
        outputs = {i: v for i, v in enumerate(value) if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        found = {key: concatenation_sizes(out, parts) for key, out in outputs.items()}
    if any(found.values()):
        node.meta[_KEY] = {key: matches for key, matches in found.items() if matches}


def concatenation_parts(node: fx.Node, dim: int) -> tuple[list[fx.Node], list[int]] | None:
    """``(parts, sizes)`` when ``node`` concatenates tensors along ``dim``: a ``torch.cat``, or
    a leaf call (or an item of its result) whose values showed one; else ``None``.

    Args:
        node: Any graph node.
        dim: The dim (negative counts from the end).

    Example:
        >>> from tread_fx.passes.trace.tracer import trace_call
        >>> class Join(torch.nn.Module):
        ...     def forward(self, a, b):
        ...         return torch.cat([a, b], 1)
        >>> gm = trace_call(Join(), (torch.randn(2, 3, 4), torch.randn(2, 1, 4)), {}, set()).gm
        >>> cat = next(n for n in gm.graph.nodes if n.target is torch.cat)
        >>> concatenation_parts(cat, 1)[1]
        [3, 1]
    """
    out = node.meta.get("tread_meta")
    if node.op != "call_function" or not isinstance(out, TensorMeta) or not out.shape:
        return None
    dim %= len(out.shape)
    if node.target not in _CAT:
        return _leaf_parts(node, dim)
    cat_dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(cat_dim, int) or cat_dim % len(out.shape) != dim:
        return None
    parts = list(node.args[0])
    metas = [p.meta.get("tread_meta") if isinstance(p, fx.Node) else None for p in parts]
    if not all(isinstance(m, TensorMeta) and len(m.shape) > dim for m in metas):
        return None
    return parts, [m.shape[dim] for m in metas]


def _leaf_parts(node: fx.Node, dim: int) -> tuple[list[fx.Node], list[int]] | None:
    key, source = None, node
    if node.target is operator.getitem:
        source, key = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or _KEY not in source.meta:
        return None
    for found_dim, sizes in source.meta[_KEY].get(key, ()):
        if found_dim == dim:
            return _tensor_inputs(source), sizes
    return None
