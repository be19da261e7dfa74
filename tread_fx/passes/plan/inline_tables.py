"""Token tables built inside routed blocks: trace those blocks through and cut the tables.

A routed block is a single call in the traced graph, so what it computes from its own token
count stays hidden (a bias indexed by an ``[N, N]`` buffer, a RoPE table from ``arange(N)``):
on the kept tokens it fails with a shape error, or (worse) builds positions ``0..k-1``.

Each routed block is traced through on the real inputs its class received while tracing the
model (:mod:`tread_fx.passes.trace.block`) and split into *data* (computed from its inputs)
and *tables* (computed without them). A table meeting the data is classified by use
(:func:`tread_fx.passes.plan.uses.built_table_uses`): a token-sized ``mask`` is cut on every
token dim (its last one only beside another, as in ``[N, N]``), a ``table`` on its token dims
but the last (which meets the features); a ``context`` or ``none`` one is no token table; one
built from buffers, factories or sizes whose use says nothing of its dims (``unknown``,
``ids``) is refused. A block with a token table is inlined into the routed graph: its tables
are built for all ``N`` tokens (at the traced sizes, so positions stay the original ones) and
cut to the kept tokens where they meet the data. Tables have no batch dim, so the route's
selection is shared across the batch. This holds for every table built from the token count
(``arange(T)`` distances, ``eye(T)``, ``ones(T, T).tril()``, a constant the trace folded
because ``T`` was an int): it is never rebuilt for the kept count, so a distance between
kept tokens stays their original one (docs/design.md, issue 44).

Example:
    >>> # driven by tread_fx.pipeline.build: find_token_tables, then inline_token_tables.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.adapters.token_tables import take_rows
from tread_fx.adapters.values import StreamLayout, TensorMeta
from tread_fx.errors import SideInputError, warn_at_caller
from tread_fx.passes.locate.dataflow import input_slots, tensor_shape
from tread_fx.passes.locate.stream import BlockCall
from tread_fx.passes.plan.dim_flow import feature_dims
from tread_fx.passes.plan.op_kinds import is_elementwise
from tread_fx.passes.plan.uses import Use, _forward, built_table_uses, sized_by_count
from tread_fx.passes.trace.block import (
    example_of,
    is_module_leaf,
    is_node_leaf,
    is_tensorish,
    node_tree,
    trace_through,
)
from tread_fx.passes.trace.tracer import ARG_MODULE_PREFIX, MODEL_PREFIX, TracedCall, fetch_attr

__all__ = ["InlineBlock", "find_token_tables", "inline_token_tables", "pack"]

_CONST_PREFIX = "tread_inline_const_"
_CUT = (Use.MASK, Use.TABLE)  # the uses that make a token-sized table a token table


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


def _built_from_tables(node: fx.Node, data: set[fx.Node], root: nn.Module) -> bool:
    """Whether a table depends on more than parameters: a buffer, a factory with constant
    sizes (``arange``, ``ones``) or a size read from the data (``arange(N)``)."""
    seen, todo = {node}, [node]
    while todo:
        current = todo.pop()
        inputs = current.all_input_nodes
        parameter = current.op == "get_attr" and isinstance(
            fetch_attr(root, current.target), nn.Parameter
        )
        if current in data or not (inputs or parameter):
            return True
        todo.extend(a for a in inputs if a not in seen)
        seen.update(inputs)
    return False


def _token_dims(
    shape: tuple[int, ...], layout: StreamLayout, use: Use = Use.MASK
) -> list[tuple[tuple, int]]:
    """``(dims, skip)`` groups of a table's token-sized dims (see the module docstring):
    the last dim counts only beside another token dim, and never for a ``table`` (it meets
    the stream's features there)."""
    sizes = {layout.num_tokens: 0}
    if layout.prefix:
        sizes.setdefault(layout.num_tokens - layout.prefix, layout.prefix)
    dims = [d for d, s in enumerate(shape) if s in sizes]
    last = len(shape) - 1
    if len(shape) < 2 or use is Use.TABLE or (last in dims and last - 1 not in dims):
        dims = [d for d in dims if d != last] if len(shape) >= 2 else []
    groups: dict[int, list[int]] = {}
    for d in dims:
        groups.setdefault(sizes[shape[d]], []).append(d)
    return [(tuple(ds), skip) for skip, ds in groups.items()]


def _tables(block: BlockCall, leaves: list, traced: TracedCall, layout: StreamLayout):
    """(data nodes, token tables with their dims) of a block traced through; refuses a
    table built from buffers or sizes whose use says nothing about its token dims."""
    data = set().union(*map(_forward, traced.gm.graph.find_nodes(op="placeholder")))
    stream = input_slots(block.node)[block.in_slot]
    stream_at = [i for i, (node, _) in enumerate(leaves) if node is stream]
    candidates = [  # tensors computed without the inputs that meet them, of token-sized dims
        node
        for node in traced.gm.graph.nodes
        if node not in data
        and isinstance(meta := node.meta.get("tread_meta"), TensorMeta)
        and any(u in data for u in node.users)
        and (_token_dims(meta.shape, layout) or _counted(node, meta, data, layout))
    ]
    uses = built_table_uses(traced.gm, candidates, stream_at, layout.token_counts)
    for node, use in uses.items():
        if use in (Use.IDS, Use.UNKNOWN) and _built_from_tables(node, data, traced.gm):
            raise SideInputError(_unresolved(block, node, use))
    features = feature_dims(traced.gm.graph, data) if uses else {}  # walks the graph per linear
    cut = {n: _token_dims(n.meta["tread_meta"].shape, layout, u) for n, u in uses.items()}
    cut = {n: _off(groups, _met_feature_dims(n, features)) for n, groups in cut.items()}
    cut = {n: groups for n, groups in cut.items() if groups and uses[n] in _CUT}
    padded = _padded_by_computed_amounts(data)
    unclear = [n for n in cut if any(u in padded for u in n.users)]
    if unclear:
        warn_at_caller(_padded_table(block, unclear[0]))
    return data, {n: groups for n, groups in cut.items() if n not in unclear}


def _counted(node: fx.Node, meta: TensorMeta, data: set[fx.Node], layout: StreamLayout) -> bool:
    """A table built from the token count with its tokens on its last dim only (``E[:n].T``):
    a candidate too, so that its use decides (it is refused where that cannot place it)."""
    tokens = layout.token_counts
    return any(s in tokens for s in meta.shape) and sized_by_count(node, data, tokens)


def _met_feature_dims(table: fx.Node, features: dict[fx.Node, int]) -> set[int]:
    """Dims of ``table`` that an elementwise op meets with the features of a linear layer's
    output (Vision-RWKV's ``[N, N, C]`` decay table at ``C == N``: its last dim meets the
    keys' width). They hold no tokens: cut, they would no longer match."""
    met = set()
    shape = table.meta["tread_meta"].shape
    for user in (u for u in table.users if is_elementwise(u)):
        for other in (a for a in user.all_input_nodes if features.get(a, -1) >= 0):
            width_at = features[other] - len(tensor_shape(other)) + len(shape)
            if width_at >= 0 and tensor_shape(other)[features[other]] > 1:
                met.add(width_at)
    return met


def _off(groups: list[tuple[tuple, int]], dims: set[int]) -> list[tuple[tuple, int]]:
    """``groups`` without ``dims``."""
    kept = [(tuple(d for d in ds if d not in dims), skip) for ds, skip in groups]
    return [(ds, skip) for ds, skip in kept if ds]


def _padded_by_computed_amounts(data: set[fx.Node]) -> set[fx.Node]:
    """The data computed from a ``pad`` whose amounts the block computes (Mamba-2's SSD pads
    its tokens to a multiple of its chunk length): a dim sized like the tokens there may be
    the chunk's, which routing does not change, so a table sized by it is no token table."""
    pads = [
        n
        for n in data
        if n.op == "call_function"
        and n.target in _PADS
        and any(isinstance(a, fx.Node) for a in pytree.tree_leaves(n.args[1:]))
    ]
    return set().union(*map(_forward, pads))


#: ``F.pad`` and the C function it calls
_PADS = (F.pad, torch._C._nn.pad)


def _padded_table(block: BlockCall, table: fx.Node) -> str:
    shape = tuple(table.meta["tread_meta"].shape)
    return (
        f"block {block.index} ({block.path}) builds the table {table.name} of shape {shape}, "
        "sized like its tokens, but it meets values the block padded by an amount it computes "
        "(to a multiple of a chunk length), so it is not taken for a token table: the block "
        "runs on the kept tokens as one call and builds it for them. If its positions must "
        "stay the original ones, route blocks without it (blocks= or other routes)."
    )


def _unresolved(block: BlockCall, table: fx.Node, use: Use) -> str:
    ops = sorted({str(getattr(u.target, "__name__", u.target)) for u in table.users})
    how = "indexes its tokens" if use is Use.IDS else "meets its tokens"
    return (
        f"block {block.index} ({block.path}) builds the table {table.name} of shape "
        f"{tuple(table.meta['tread_meta'].shape)} from its own token count, and it {how} in "
        f"{', '.join(ops)}, which does not say which of its dims are tokens, so it cannot be "
        "cut to the kept tokens; route blocks without it (pass blocks= or other routes)."
    )


def find_token_tables(
    gm: fx.GraphModule, blocks: list[BlockCall], layout: StreamLayout
) -> tuple[list[InlineBlock], frozenset[int]]:
    """The routed blocks that build token tables, each traced through.

    One block of each class (and call signature) is traced first; the other blocks of it
    are traced only if that one holds a token table.

    Args:
        gm: The traced graph (block calls still single nodes with their example inputs).
        blocks: The blocks of one route.
        layout: The stream layout at the route's start.

    Returns:
        One :class:`InlineBlock` per block with a token table, and the indices of the
        blocks whose tables are known (traced through, with or without token tables).

    Raises:
        SideInputError: A block builds a table over its tokens whose use does not say
            which dims are tokens.

    Example:
        >>> # driven by tread_fx.pipeline.build (see tests/test_inblock_token_tables.py)
    """
    verdict: dict[tuple, bool | None] = {}  # per class: has tables, or None: not traced
    found, known = [], set()
    for block in blocks:
        kept = example_of(gm, block.node)
        if kept is None:
            continue
        key = (type(gm.get_submodule(block.node.target)), id(kept[0]))
        if key in verdict and not verdict[key]:  # no token table (False), or not traced
            if verdict[key] is False:
                known.add(block.index)
            continue
        traced = trace_through(gm.get_submodule(block.node.target), kept[0], inlined=True)
        placeholders = [] if traced is None else traced.gm.graph.find_nodes(op="placeholder")
        if traced is None or len(placeholders) != len(kept[1]):
            verdict[key] = None
            continue
        data, tables = _tables(block, kept[1], traced, layout)
        verdict.setdefault(key, bool(tables))
        known.add(block.index)
        if tables:
            found.append(InlineBlock(block, traced, data, tables))
    return found, frozenset(known)


# -- splicing ---------------------------------------------------------------------------------


def _input_nodes(graph: fx.Graph, node: fx.Node) -> list[fx.Node]:
    """Graph values for the block's tensor inputs (container items taken out by getitem)."""
    leaves = pytree.tree_flatten(node_tree(node), is_leaf=is_node_leaf)[0]
    values = []
    with graph.inserting_before(node):
        for leaf in leaves:
            if not is_node_leaf(leaf) or is_module_leaf(leaf):
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
    value = fetch_attr(sub.gm, target)
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
    placeholders = sub.gm.graph.find_nodes(op="placeholder")
    env: dict[fx.Node, Any] = dict(zip(placeholders, _input_nodes(graph, node)))
    cut: dict[fx.Node, fx.Node] = {}
    result: Any = None
    for sub_node in sub.gm.graph.nodes:
        if sub_node.op == "placeholder":
            continue
        if sub_node.op == "output":
            result = fx.node.map_arg(sub_node.args[0], lambda a: cut.get(a, env[a]))
            continue
        is_data = sub_node in found.data
        is_table = not is_data and is_tensorish(sub_node.meta.get("tread_meta"))

        def arg(a: fx.Node, is_data=is_data, is_table=is_table) -> Any:
            value = a.meta.get("tread_meta")
            if is_table and isinstance(value, (int, float, bool)):
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
