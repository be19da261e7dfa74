"""Token tables built inside routed blocks: trace those blocks through and cut the tables.

A routed block is a single call in the traced graph, so whatever it computes from its own
token count stays hidden: a relative-position bias indexed by an ``[N, N]`` buffer, a bias
computed from the patch grid on every call, a RoPE table built from ``arange(N)``. On the
kept tokens such a block fails with a shape error, or (worse) builds positions ``0..k-1``.

This pass traces each routed block through on the real inputs its class received while
tracing the model, and splits the block's graph into *data* (everything computed from its
inputs) and *tables* (tensors computed from buffers, constants and sizes only). A table
that meets the data and has token-sized dims (``N`` or ``N - prefix`` rows; the last dim
counts only beside another token dim, as in ``[N, N]``) is a token table. If a block has
one, it is inlined into the routed graph: its tables are built for all ``N`` tokens (sizes
they read are the traced constants, so positions stay the original ones), and each token
table is cut to the kept tokens on every token dim (rows and columns of an ``[N, N]`` bias)
where it meets the data. The data part reads its sizes from the routed values, so its
reshapes follow the kept count. Tables have no batch dim, so the route's selection is
shared across the batch.

Example:
    >>> # driven by tread_fx.pipeline.build: find_token_tables, then inline_token_tables.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.adapters.token_tables import take_rows
from tread_fx.adapters.values import StreamLayout, TensorMeta
from tread_fx.passes.locate import BlockCall
from tread_fx.passes.trace import ARG_MODULE_PREFIX, MODEL_PREFIX, TracedCall, trace_call
from tread_fx.passes.trace_support import has_call_hooks
from tread_fx.runtime.guards import check_traced_value

__all__ = [
    "InlineBlock",
    "EXAMPLE_KEY",
    "find_token_tables",
    "inline_token_tables",
    "pack",
    "trace_through",
]

EXAMPLE_KEY = "tread_example_inputs"
_CONST_PREFIX = "tread_inline_const_"


@dataclass
class InlineBlock:
    """A routed block to trace through, and the token tables found in it.

    Attributes:
        block: The block call in the model's graph.
        traced: The block traced through on its class's example inputs.
        data: Nodes of ``traced`` computed from the block's inputs.
        tables: Token tables (nodes of ``traced``) with ``(dims, skip)`` groups to cut.
    """

    block: BlockCall
    traced: TracedCall
    data: set[fx.Node]
    tables: dict[fx.Node, list[tuple[tuple[int, ...], int]]] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for ``explain``: which tables are cut, on which dims."""
        parts = [
            f"{n.name} {tuple(n.meta['tread_meta'].shape)} on dims "
            f"{tuple(d for dims, _ in groups for d in dims)}"
            for n, groups in self.tables.items()
        ]
        return f"block {self.block.index} ({self.block.path}) inlined; cut " + ", ".join(parts)


def pack(value: Any) -> Any:
    """Return ``value`` (a tuple/list of graph values rebuilt as the block's return value)."""
    return value


def _plain(tree: Any) -> Any:
    """fx's immutable containers as plain lists/dicts (so pytree specs compare)."""
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = [_plain(v) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _is_tensorish(meta: Any) -> bool:
    if isinstance(meta, TensorMeta):
        return True
    return isinstance(meta, (tuple, list)) and any(_is_tensorish(m) for m in meta)


def _node_tree(node: fx.Node) -> Any:
    """The block call's (args, kwargs) with each container-valued node as a container of
    ``(node, index path)`` leaves, and scalar nodes as their traced value."""

    def expand(value: Any, meta: Any, path: tuple) -> Any:
        if isinstance(meta, TensorMeta):
            return (value, path)
        if isinstance(meta, (tuple, list)) and _is_tensorish(meta):
            return type(meta)(expand(value, m, path + (i,)) for i, m in enumerate(meta))
        return meta

    def leaf(a: Any) -> Any:
        if isinstance(a, fx.Node) and _is_module((a, ())):
            return (a, ())  # a module handed to the block
        return expand(a, a.meta.get("tread_meta"), ()) if isinstance(a, fx.Node) else a

    mapped = fx.node.map_aggregate((node.args, node.kwargs), leaf)
    return _plain(mapped)


def _flat_inputs(node: fx.Node, example: Any) -> list[tuple[fx.Node, tuple]] | None:
    """The block call's tensor inputs in the example's flat order, or ``None`` when the call
    does not match the example (other structure, shapes, dtypes or constants)."""
    ex_leaves, ex_spec = pytree.tree_flatten(_plain(example))
    tree = _node_tree(node)
    leaves, spec = pytree.tree_flatten(tree, is_leaf=lambda x: _is_node_leaf(x))
    if spec != ex_spec:
        return None
    out = []
    for mine, theirs in zip(leaves, ex_leaves):
        if isinstance(theirs, torch.Tensor):
            if not _is_node_leaf(mine):
                return None
            meta = _meta_at(*mine)
            if meta.shape != tuple(theirs.shape) or meta.dtype != theirs.dtype:
                return None
            out.append(mine)
        elif isinstance(theirs, nn.Module) and _is_module(mine, theirs):
            continue  # a module handed to the block (a rotary module), traced through with it
        elif _is_node_leaf(mine) or mine != theirs:
            return None
    return out


def _is_module(leaf: Any, module: nn.Module | None = None) -> bool:
    """Whether a node leaf is a ``get_attr`` of a module (``module`` itself when given)."""
    if not _is_node_leaf(leaf) or leaf[0].op != "get_attr" or leaf[1]:
        return False
    value = _fetch(leaf[0].graph.owning_module, leaf[0].target)
    return isinstance(value, nn.Module) and (module is None or value is module)


def _is_node_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], fx.Node)


def _meta_at(node: fx.Node, path: tuple) -> TensorMeta:
    meta = node.meta["tread_meta"]
    for i in path:
        meta = meta[i]
    return meta


def _example_of(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, list] | None:
    """(example inputs, flat tensor inputs of ``node``) of the first kept call of the block's
    class that ``node``'s call matches, or ``None``."""
    cls = type(gm.get_submodule(node.target))
    for other in gm.graph.nodes:
        if EXAMPLE_KEY in other.meta and type(gm.get_submodule(other.target)) is cls:
            leaves = _flat_inputs(node, other.meta[EXAMPLE_KEY])
            if leaves is not None:
                return other.meta[EXAMPLE_KEY], leaves
    return None


def _data_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from the block's inputs; sizes read from them are not data."""
    data: set[fx.Node] = set()
    for node in graph.nodes:
        if (
            node.op == "placeholder"
            or _is_tensorish(node.meta.get("tread_meta"))
            and any(a in data for a in node.all_input_nodes)
        ):
            data.add(node)
    return data


def _built_from_tables(node: fx.Node, data: set[fx.Node], root: nn.Module) -> bool:
    """Whether a table depends on more than parameters: a buffer, a factory or a size."""
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in data:
            return True  # a size read from the data (arange(N))
        inputs = current.all_input_nodes
        if current.op == "get_attr":
            if not isinstance(_fetch(root, current.target), nn.Parameter):
                return True
        elif not inputs:
            return True  # a factory with constant sizes (arange, ones)
        todo.extend(inputs)
    return False


def _token_dims(shape: tuple[int, ...], layout: StreamLayout) -> list[tuple[tuple, int]]:
    """``(dims, skip)`` groups of a table's token-sized dims (see the module docstring)."""
    sizes = {layout.num_tokens: 0}
    if layout.prefix:
        sizes.setdefault(layout.num_tokens - layout.prefix, layout.prefix)
    dims = [d for d, s in enumerate(shape) if s in sizes]
    last = len(shape) - 1
    if len(shape) < 2 or (last in dims and last - 1 not in dims and len(dims) > 0):
        dims = [d for d in dims if d != last] if len(shape) >= 2 else []
    groups: dict[int, list[int]] = {}
    for d in dims:
        groups.setdefault(sizes[shape[d]], []).append(d)
    return [(tuple(ds), skip) for skip, ds in groups.items()]


def _tables(traced: TracedCall, data: set[fx.Node], layout: StreamLayout) -> dict:
    tables = {}
    root = traced.gm
    for node in traced.gm.graph.nodes:
        meta = node.meta.get("tread_meta")
        if node in data or not isinstance(meta, TensorMeta):
            continue
        if node.op == "get_attr" and isinstance(_fetch(root, node.target), nn.Parameter):
            continue  # a weight used as it is (x @ W) is never assumed to be a token table
        if not any(u in data for u in node.users):
            continue
        groups = _token_dims(meta.shape, layout)
        if groups and _built_from_tables(node, data, root):
            tables[node] = groups
    return tables


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def trace_through(module: nn.Module, example: Any, *, inlined: bool) -> TracedCall | None:
    """``module`` (a routed block) traced through on its example inputs, or ``None``.

    A block to be ``inlined`` has no hooks, nor any of its parts (inlining would skip them),
    and reads no tensor data (its guards would check another block's data). For its graph
    only (``inlined=False``: :mod:`tread_fx.passes.uses`), hooks and data guards are fine:
    parts with hooks are traced through from inside a real call of each (their hooks run on
    the values: FSDP2 units gather their parameters, checkpoint wrappers are seen through),
    and a block whose forward cannot run outside its own call is traced from inside one.
    Those hooks then run once more, without gradients, while the model is traced.
    """
    if inlined and any(has_call_hooks(m) for m in module.modules()):
        return None
    traced = _trace_forward(module, example, through_hooks=not inlined)
    if traced is None and not inlined and has_call_hooks(module):
        traced = _trace_inside_call(module, example)
    guarded = traced is not None and any(
        n.target is check_traced_value for n in traced.gm.graph.nodes
    )
    return None if inlined and guarded else traced


def _trace_forward(module: nn.Module, example: Any, through_hooks: bool) -> TracedCall | None:
    """``module``'s forward traced on ``example`` (its own hooks not run), or ``None``."""
    args, kwargs = example
    try:
        return trace_call(module, tuple(args), dict(kwargs), set(), through_hooks)
    except Exception:  # noqa: BLE001 - a block that cannot be traced through stays one call
        return None


def _trace_inside_call(module: nn.Module, example: Any) -> TracedCall | None:
    """``module``'s forward traced from inside one real call of it, after its pre-hooks ran.

    A block's own hooks may set the state its forward needs (FSDP2's ``fully_shard`` gathers
    the parameters in a pre-hook, and its forward cannot run without that). A last pre-hook
    traces the forward on the arguments the hooks hand on; the call then runs to its end, so
    the block's hooks leave it as they found it. Its hooks run one extra time, without
    gradients, while the model is traced.
    """
    found: list[TracedCall | None] = []

    def trace_here(hooked: nn.Module, args: tuple, kwargs: dict) -> None:
        found.append(_trace_forward(hooked, (args, kwargs), through_hooks=True))

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


def find_token_tables(
    gm: fx.GraphModule, blocks: list[BlockCall], layout: StreamLayout
) -> list[InlineBlock]:
    """The routed blocks that build token tables, each traced through.

    One block of each class (and call signature) is traced first; the other blocks of it
    are traced only if that one holds a token table.

    Args:
        gm: The traced graph (block calls still single nodes with their example inputs).
        blocks: The blocks of one route.
        layout: The stream layout at the route's start.

    Returns:
        One :class:`InlineBlock` per block with a token table.
    """
    verdict: dict[tuple, bool] = {}
    found = []
    for block in blocks:
        kept = _example_of(gm, block.node)
        key = (type(gm.get_submodule(block.node.target)), id(kept[0]) if kept else None)
        if kept is None or verdict.get(key) is False:
            continue
        traced = trace_through(gm.get_submodule(block.node.target), kept[0], inlined=True)
        if traced is None:
            verdict[key] = False
            continue
        data = _data_nodes(traced.gm.graph)
        tables = _tables(traced, data, layout)
        verdict.setdefault(key, bool(tables))
        if tables:
            found.append(InlineBlock(block, traced, data, tables))
    return found


def drop_examples(gm: fx.GraphModule) -> None:
    """Forget the example inputs the trace kept (they hold real activations)."""
    for node in gm.graph.nodes:
        node.meta.pop(EXAMPLE_KEY, None)


# -- splicing ---------------------------------------------------------------------------------


def _input_nodes(graph: fx.Graph, node: fx.Node) -> list[fx.Node]:
    """Graph values for the block's tensor inputs (container items taken out by getitem)."""
    tree = _node_tree(node)
    leaves = pytree.tree_flatten(tree, is_leaf=_is_node_leaf)[0]
    values = []
    with graph.inserting_before(node):
        for leaf in leaves:
            if not _is_node_leaf(leaf) or _is_module(leaf):
                continue
            value, path = leaf
            for i in path:
                value = graph.call_function(operator.getitem, (value, i))
            values.append(value)
    return values


def _retarget(gm: fx.GraphModule, wrapper: nn.Module, block: BlockCall, sub, target: str):
    """The target of a block attribute in the model's graph (constants get a new name)."""
    if target.startswith(MODEL_PREFIX):
        return f"{block.node.target}.{target[len(MODEL_PREFIX) :]}"
    if target.startswith(ARG_MODULE_PREFIX):  # an attribute of a module handed to the block
        name, _, rest = target.partition(".")
        handed = getattr(sub.wrapper, name)
        path = next(p for p, m in gm.named_modules() if m is handed)
        return f"{path}.{rest}" if rest else path
    value = _fetch(sub.gm, target)
    i = 0
    while hasattr(wrapper, f"{_CONST_PREFIX}{i}") or hasattr(gm, f"{_CONST_PREFIX}{i}"):
        i += 1
    name = f"{_CONST_PREFIX}{i}"
    for owner in (gm, wrapper):  # the routed graph runs with the wrapper as ``self``
        setattr(owner, name, value)
    return name


def _cut(graph: fx.Graph, table: fx.Node, groups, idx: fx.Node, route: int) -> fx.Node:
    value = table
    meta = table.meta.get("tread_meta")
    with graph.inserting_after(table):
        for dims, skip in groups:
            options = {"dims": dims, "lead": 0, "skip": skip, "trail": 0, "batch": None}
            value = graph.call_function(take_rows, (value, idx), options)
            value.meta.update(tread_meta=meta, tread_role="gather", tread_route=route)
    return value


def inline_token_tables(
    gm: fx.GraphModule, wrapper: nn.Module, found: InlineBlock, idx: fx.Node, route: int
) -> None:
    """Replace one routed block call by its traced-through graph, cutting its token tables.

    Args:
        gm: The routed graph (rewritten: the block's inputs are the kept tokens).
        wrapper: The ``FlatCall`` the routed graph runs with (constants are set on it).
        found: The block and its tables from :func:`find_token_tables`.
        idx: The route's kept ids (shared across the batch).
        route: The route's index.
    """
    graph, node, sub = gm.graph, found.block.node, found.traced
    inputs = _input_nodes(graph, node)
    placeholders = [n for n in sub.gm.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, Any] = dict(zip(placeholders, inputs))
    cut: dict[fx.Node, fx.Node] = {}
    result: Any = None
    for sub_node in sub.gm.graph.nodes:
        if sub_node.op == "placeholder":
            continue
        if sub_node.op == "output":
            result = fx.node.map_arg(sub_node.args[0], lambda a: cut.get(a, env[a]))
            continue
        is_data = sub_node in found.data
        is_table = not is_data and _is_tensorish(sub_node.meta.get("tread_meta"))

        def arg(a: fx.Node, is_data=is_data, is_table=is_table) -> Any:
            if is_table and not _is_tensorish(a.meta.get("tread_meta")):
                value = a.meta.get("tread_meta")
                if isinstance(value, (int, float, bool)):
                    return value  # a size read by a table: the traced (full) count
            if is_data and a in cut:
                return cut[a]
            return env[a]

        with graph.inserting_before(node):
            new = graph.node_copy(sub_node, arg)
        if new.op in ("get_attr", "call_module"):
            new.target = _retarget(gm, wrapper, found.block, sub, sub_node.target)
        new.meta["tread_inlined"] = found.block.path
        env[sub_node] = new
        if sub_node in found.tables:
            cut[sub_node] = _cut(graph, new, found.tables[sub_node], idx, route)
    outputs = pytree.tree_unflatten(list(result), sub.out_spec)
    if isinstance(outputs, fx.Node):
        node.replace_all_uses_with(outputs)
    else:
        with graph.inserting_before(node):
            packed = graph.call_function(pack, (outputs,))
        packed.meta.update(node.meta)
        node.replace_all_uses_with(packed)
    graph.erase_node(node)
