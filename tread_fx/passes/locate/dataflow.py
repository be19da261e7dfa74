"""Data flow for stream finding: which inputs of a node feed its *values*.

An op that reads only the dtype, device or shape of a tensor (``mask.type_as(x)``,
``mask.to(x)``, ``x.new_zeros(...)``, ``torch.zeros_like(x)``, ``x.shape``, ``x.size(1)``)
does not carry that tensor's values. The locator follows values only, so an attention mask
cast with ``type_as(hidden_states)`` does not count as "fed by the main input".

Example:
    >>> import torch, torch.fx as fx
    >>> class M(torch.nn.Module):
    ...     def forward(self, x, mask):
    ...         return mask.type_as(x)
    >>> g = fx.symbolic_trace(M()).graph
    >>> cast = [n for n in g.nodes if n.op == "call_method"][0]
    >>> [n.name for n in data_inputs(cast)]
    ['mask']
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["data_inputs", "data_ancestors"]

# methods whose receiver's values reach the result, but not those of their other arguments
_RECEIVER_ONLY = frozenset({"type_as", "to", "view_as", "reshape_as", "expand_as"})
# methods and functions whose result holds none of the receiver's / first argument's values
_METADATA_METHODS = frozenset(
    {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "size", "dim", "numel"}
)
_LIKE_FUNCTIONS = frozenset(
    {
        torch.zeros_like,
        torch.ones_like,
        torch.empty_like,
        torch.full_like,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
    }
)
_METADATA_ATTRS = frozenset({"dtype", "device", "shape", "ndim", "is_cuda", "layout"})


def _nodes_in(value: object) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (tuple, list)):
        return [n for v in value for n in _nodes_in(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _nodes_in(v)]
    return []


def data_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes whose values (not only dtype, device or shape) reach ``node``."""
    op, target = node.op, node.target
    if op == "call_method" and target in _RECEIVER_ONLY:
        return _nodes_in(node.args[0])
    if op == "call_method" and target in _METADATA_METHODS:
        return _nodes_in((node.args[1:], node.kwargs)) if target == "new_full" else []
    if op == "call_function" and target in _LIKE_FUNCTIONS:
        return _nodes_in((node.args[1:], node.kwargs)) if target is torch.full_like else []
    if op == "call_function" and target is getattr and node.args[1] in _METADATA_ATTRS:
        return []
    return list(node.all_input_nodes)


def data_ancestors(node: fx.Node, stop: set[fx.Node]) -> set[fx.Node]:
    """Every node whose values reach ``node``, not walking past the nodes in ``stop``."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        for parent in data_inputs(current):
            if parent not in seen:
                seen.add(parent)
                if parent not in stop:
                    todo.append(parent)
    return seen
