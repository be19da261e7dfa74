"""Tracing one routed block through, on the real inputs its class received.

A routed block is a single call in the model graph. To see what it does with its inputs
(:mod:`tread_fx.passes.plan.uses`) or to splice it in with its token tables cut
(:mod:`tread_fx.passes.plan.inline_tables`), it is traced through on the example inputs the
model trace kept for its class and call signature (:func:`example_of` finds them).

Example:
    >>> is_tensorish((None, TensorMeta((2, 3), torch.float32, "cpu")))
    True
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.adapters.values import TensorMeta
from tread_fx.passes.trace import dataclass_args
from tread_fx.passes.trace.support import failure_reason, has_call_hooks
from tread_fx.passes.trace.tracer import TracedCall, fetch_attr, trace_call
from tread_fx.passes.trace.value_tracer import EXAMPLE_KEY
from tread_fx.runtime.guards import check_traced_value

__all__ = [
    "untraced_reason",
    "EXAMPLE_KEY",
    "drop_examples",
    "example_of",
    "is_module_leaf",
    "is_node_leaf",
    "is_tensorish",
    "node_tree",
    "trace_through",
]


@dataclasses.dataclass(frozen=True)
class _Instance:
    """A dataclass instance handed to a block, matched by its class only: the block's trace
    holds its fields as constants (Chroma's ``ModulationOut`` per block)."""

    cls: type


def _plain(tree: Any) -> Any:
    """fx's immutable containers as plain lists/dicts (so pytree specs compare)."""
    if dataclass_args.is_instance(tree) and not isinstance(tree, _Instance):
        return _Instance(type(tree))
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = [_plain(v) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def is_tensorish(meta: Any) -> bool:
    if isinstance(meta, TensorMeta):
        return True
    return isinstance(meta, (tuple, list)) and any(is_tensorish(m) for m in meta)


def node_tree(node: fx.Node) -> Any:
    """The block call's (args, kwargs) with each container-valued node as a container of
    ``(node, index path)`` leaves, and scalar nodes as their traced value."""

    def expand(value: Any, meta: Any, path: tuple) -> Any:
        if isinstance(meta, TensorMeta):
            return (value, path)
        if isinstance(meta, (tuple, list)) and is_tensorish(meta):
            return type(meta)(expand(value, m, path + (i,)) for i, m in enumerate(meta))
        return meta

    def leaf(a: Any) -> Any:
        if isinstance(a, fx.Node) and is_module_leaf((a, ())):
            return (a, ())  # a module handed to the block
        if (cls := dataclass_args.built_class(a)) is not None:
            return _Instance(cls)
        return expand(a, a.meta.get("tread_meta"), ()) if isinstance(a, fx.Node) else a

    return _plain(fx.node.map_aggregate((node.args, node.kwargs), leaf))


def _flat_inputs(node: fx.Node, example: Any) -> list[tuple[fx.Node, tuple]] | None:
    """The block call's tensor inputs in the example's flat order, or ``None`` when the call
    does not match the example (other structure, shapes, dtypes or constants)."""
    ex_leaves, ex_spec = pytree.tree_flatten(_plain(example))
    leaves, spec = pytree.tree_flatten(node_tree(node), is_leaf=is_node_leaf)
    if spec != ex_spec:
        return None
    out = []
    for mine, theirs in zip(leaves, ex_leaves):
        if isinstance(theirs, torch.Tensor):
            if not is_node_leaf(mine):
                return None
            meta = functools.reduce(operator.getitem, mine[1], mine[0].meta["tread_meta"])
            if meta.shape != tuple(theirs.shape) or meta.dtype != theirs.dtype:
                return None
            out.append(mine)
        elif isinstance(theirs, nn.Module) and is_module_leaf(mine, theirs):
            continue  # a module handed to the block (a rotary module), traced through with it
        elif is_node_leaf(mine) or mine != theirs:
            return None
    return out


def is_module_leaf(leaf: Any, module: nn.Module | None = None) -> bool:
    """Whether a node leaf is a ``get_attr`` of a module (``module`` itself when given)."""
    if not is_node_leaf(leaf) or leaf[0].op != "get_attr" or leaf[1]:
        return False
    value = fetch_attr(leaf[0].graph.owning_module, leaf[0].target)
    return isinstance(value, nn.Module) and (module is None or value is module)


def is_node_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], fx.Node)


def example_of(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, list] | None:
    """(example inputs, flat tensor inputs of ``node``) of the first kept call of the block's
    class that ``node``'s call matches, or ``None``."""
    cls = type(gm.get_submodule(node.target))
    for other in gm.graph.nodes:
        if EXAMPLE_KEY in other.meta and type(gm.get_submodule(other.target)) is cls:
            leaves = _flat_inputs(node, other.meta[EXAMPLE_KEY])
            if leaves is not None:
                return other.meta[EXAMPLE_KEY], leaves
    return None


def trace_through(
    module: nn.Module, example: Any, *, inlined: bool, partial: bool = False
) -> TracedCall | None:
    """``module`` (a routed block) traced through on its example inputs, or ``None``.

    A block to be ``inlined`` has no hooks in any part (inlining would skip them) and reads no
    tensor data (its guards would check another block's data). For its graph only
    (``inlined=False``), hooks and data guards are fine: parts with hooks are traced from
    inside a real call of each, and so is a block whose forward cannot run outside its own call
    (the hooks run once more, without gradients). With ``partial``, a block whose own code
    stops the trace at a line no leaf can get past gives the part traced before that line
    (``stopped`` says why): read for uses only.
    """
    if inlined and any(has_call_hooks(m) for m in module.modules()):
        return None
    traced, part = _trace_forward(module, example, not inlined)
    if traced is None and not inlined and has_call_hooks(module):
        traced = _trace_inside_call(module, example)
    if traced is None and partial and not inlined:
        traced = part  # the part traced before the line that stopped it (``stopped``)
    guarded = traced is not None and any(
        n.target is check_traced_value for n in traced.gm.graph.nodes
    )
    return None if inlined and guarded else traced


def _trace_forward(module: nn.Module, example: Any, through_hooks: bool) -> tuple:
    """``(trace, None)`` of ``module``'s forward on ``example`` (its own hooks not run), or
    ``(None, the part traced before the line that stopped it, or None)``."""
    args, kwargs = example
    try:
        traced = trace_call(module, tuple(args), dict(kwargs), set(), through_hooks)
    except Exception as err:  # noqa: BLE001 - a block that cannot be traced through stays one call
        _UNTRACED[module] = failure_reason(err)
        return None, getattr(err, "partial", None)
    _UNTRACED.pop(module, None)
    return traced, None


#: module -> what its last failed trace-through raised (:func:`untraced_reason`)
_UNTRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def untraced_reason(module: nn.Module) -> str | None:
    """What tracing ``module`` through raised the last time it failed, or ``None``.

    Example:
        >>> untraced_reason(nn.Linear(2, 2)) is None
        True
    """
    return _UNTRACED.get(module)


def _trace_inside_call(module: nn.Module, example: Any) -> TracedCall | None:
    """``module``'s forward traced by a last pre-hook of one real call of it, on the arguments
    its hooks hand on (FSDP2's ``fully_shard`` gathers the parameters in a pre-hook); the call
    then runs to its end, so the hooks leave the block as they found it."""
    found: list[TracedCall | None] = []

    def trace_here(hooked: nn.Module, args: tuple, kwargs: dict) -> None:
        found.append(_trace_forward(hooked, (args, kwargs), through_hooks=True)[0])

    args, kwargs = example
    handle = module.register_forward_pre_hook(trace_here, with_kwargs=True)
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a block whose own call fails here stays one call
        return None
    finally:
        handle.remove()
    return found[0] if found else None


def drop_examples(gm: fx.GraphModule) -> None:
    """Forget the example inputs the trace kept (they hold real activations)."""
    for node in gm.graph.nodes:
        node.meta.pop(EXAMPLE_KEY, None)
