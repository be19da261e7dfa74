"""Data flow and call slots for stream finding: which inputs of a node feed its *values*.

An op that reads only the dtype, device or shape of a tensor (``mask.type_as(x)``,
``mask.to(x)``, ``x.new_zeros(...)``, ``torch.zeros_like(x)``, ``x.shape``, ``x.size(1)``)
does not carry that tensor's values. The locator follows values only, so an attention mask
cast with ``type_as(hidden_states)`` does not count as "fed by the main input". The slots of
a block call (where an argument sits, where its result is unpacked) are named here too.

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

import inspect
import operator
from collections import deque
from typing import Any

import torch
import torch.fx as fx

from tread_fx.adapters.values import TensorMeta

__all__ = [
    "data_inputs",
    "data_ancestors",
    "fed_by",
    "nodes_in",
    "tensor_meta",
    "tensor_shape",
    "int_value",
    "argument_items",
    "argument_name",
    "input_slots",
    "output_slots",
    "forward_path",
]

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


def nodes_in(value: object) -> list[fx.Node]:
    """The nodes in a (nested) tuple, list or dict of arguments, in order."""
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (tuple, list)):
        return [n for v in value for n in nodes_in(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in nodes_in(v)]
    return []


def tensor_meta(node: object) -> TensorMeta | None:
    """The recorded ``TensorMeta`` of a node's value (``None``: not a node, not a tensor)."""
    meta = node.meta.get("tread_meta") if isinstance(node, fx.Node) else None
    return meta if isinstance(meta, TensorMeta) else None


def tensor_shape(node: object) -> tuple | None:
    """The recorded shape of a node's tensor value (``None``: not a node, not a tensor)."""
    meta = tensor_meta(node)
    return meta.shape if meta is not None else None


def int_value(value: object) -> int | None:
    """An int, literal or computed from shapes in the graph (``H // p``); else ``None``."""
    if isinstance(value, fx.Node):
        value = value.meta.get("tread_meta")
    return value if type(value) is int else None


def data_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes whose values (not only dtype, device or shape) reach ``node``."""
    op, target = node.op, node.target
    if op == "call_method" and target in _RECEIVER_ONLY:
        return nodes_in(node.args[0])
    if op == "call_method" and target in _METADATA_METHODS:
        return nodes_in((node.args[1:], node.kwargs)) if target == "new_full" else []
    if op == "call_function" and target in _LIKE_FUNCTIONS:
        return nodes_in((node.args[1:], node.kwargs)) if target is torch.full_like else []
    if op == "call_function" and target is getattr and node.args[1] in _METADATA_ATTRS:
        return []
    return list(node.all_input_nodes)


def _like_source(node: fx.Node) -> list[fx.Node]:
    """The tensor a ``*_like`` function or ``new_*`` method builds its result like."""
    like = node.op == "call_function" and node.target in _LIKE_FUNCTIONS
    new = node.op == "call_method" and str(node.target).startswith("new_")
    return nodes_in(node.args[:1]) if like or new else []


def data_ancestors(node: fx.Node, stop: set[fx.Node], like: bool = False) -> set[fx.Node]:
    """Every node whose values reach ``node``, not walking past the nodes in ``stop``; with
    ``like``, also the tensors a value is built like (``zeros_like(x)``: a residual stream
    started empty holds ``x``'s positions), never a size read alone (``c[:x.shape[0]]``)."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        for parent in data_inputs(current) + (_like_source(current) if like else []):
            if parent not in seen:
                seen.add(parent)
                if parent not in stop:
                    todo.append(parent)
    return seen


def fed_by(
    node: object, source: fx.Node, stop: set[fx.Node] = frozenset(), like: bool = False
) -> bool:
    """Whether ``node`` is ``source`` or computed from its values (not past ``stop``; with
    ``like``, or built like it: see :func:`data_ancestors`)."""
    if not isinstance(node, fx.Node):
        return False
    return node is source or source in data_ancestors(node, stop, like)


def argument_items(node: fx.Node) -> list[tuple[tuple, Any]]:
    """``(("arg", i), value)`` and ``(("kwarg", name), value)`` for each argument of a call."""
    items = [(("arg", i), a) for i, a in enumerate(node.args)]
    return items + [(("kwarg", k), a) for k, a in node.kwargs.items()]


def argument_name(block: Any, key: tuple) -> str:
    """The parameter name of ``block.forward`` that a slot fills (``"arg{i}"`` if unknown).

    Blocks called positionally (diffusers' gradient checkpointing passes everything by
    position) are described by the same names as when called by keyword.
    """
    if key[0] == "kwarg":
        return key[1]
    try:
        params = list(inspect.signature(block.forward).parameters.values())
    except (TypeError, ValueError):
        return f"arg{key[1]}"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[key[1]].name if key[1] < len(positional) else f"arg{key[1]}"


def input_slots(node: fx.Node) -> dict[tuple, fx.Node]:
    """Map each argument position of ``node`` that holds a node to that node: ``("arg", i)``
    or ``("kwarg", name)``, then ``(..., j, ...)`` into nested tuples
    (``image_rotary_emb=((cos, sin), None)``)."""
    slots: dict[tuple, fx.Node] = {}
    items = argument_items(node)
    while items:
        key, arg = items.pop(0)
        if isinstance(arg, fx.Node):
            slots[key] = arg
        elif isinstance(arg, (tuple, list)):
            items += [((*key, j), a) for j, a in enumerate(arg)]
    return slots


def output_slots(node: fx.Node) -> dict[tuple, fx.Node]:
    """Map ``("item", k)`` / ``("attr", name)`` to the users that unpack ``node``'s result."""
    slots = {}
    for user in node.users:
        is_item = user.op == "call_function" and user.target is operator.getitem
        if is_item and isinstance(user.args[1], (int, str)):  # not a tensor's x[:, :n] slice
            slots[("item", user.args[1])] = user
        elif user.op == "call_function" and user.target is getattr:
            slots[("attr", user.args[1])] = user
    return slots


def forward_path(source: fx.Node, target: fx.Node) -> list[fx.Node]:
    """Nodes after ``source`` on the shortest user-path to ``target`` (empty if same)."""
    parents: dict[fx.Node, fx.Node | None] = {source: None}
    queue = deque([source])
    while queue and target not in parents:
        node = queue.popleft()
        for user in node.users:
            if user not in parents:
                parents[user] = node
                queue.append(user)
    path = []
    node = target if target in parents else source
    while node is not source:
        path.append(node)
        node = parents[node]
    return path[::-1]
