"""Pass 4 — rewrite: insert select -> gather before a route and scatter after it.

For each route the graph gets a new input ``tread_noise_<i>`` (uniform noise drawn outside
the graph), a ``select`` node computing the kept token ids, a gather for every value the plan
marks as entering, and a scatter (or blend) for every value leaving into its counterpart at
the route start. The kept ids of every route become extra graph outputs (the route info).

Example:
    >>> # driven by tread_fx.pipeline.build; see tread_fx.explain for the resulting graph.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from tread_fx.adapters.token_tables import share_across_batch
from tread_fx.passes.plan.crossings import Crossing
from tread_fx.passes.plan.route_plan import RoutePlan
from tread_fx.passes.trace.tracer import TensorMeta
from tread_fx.runtime.ops import (
    blend_tokens,
    call_in_fp32,
    gather_tokens,
    kept_positions,
    scatter_after_prefix,
    scatter_tokens,
)
from tread_fx.runtime.packed import select_segments
from tread_fx.runtime.selection import Strategy, with_suffix

__all__ = ["rewrite_route", "append_route_outputs", "NOISE_PREFIX", "Reinsert"]

NOISE_PREFIX = "tread_noise_"


@dataclasses.dataclass(frozen=True)
class Reinsert:
    """How routed-around tokens re-enter the stream at a route's end.

    Attributes:
        mode: ``"scatter"`` (their value at the route start, the default) or ``"blend"``
            (``base_weight * start_value + embedded_weight * embedded_input``).
        base_weight: Weight of the route-start value in blend mode.
        embedded_weight: Weight of the embedded input (the stream entering block 0).
    """

    mode: str = "scatter"
    base_weight: float = 1.0
    embedded_weight: float = 0.0


def _mark(node: fx.Node, meta: Any, role: str, route: int) -> fx.Node:
    node.meta.update(tread_meta=meta, tread_role=role, tread_route=route)
    return node


def _with_tokens(meta: Any, token_dim: int, count: int) -> Any:
    if not isinstance(meta, TensorMeta) or token_dim >= len(meta.shape):
        return meta
    shape = list(meta.shape)
    shape[token_dim] = count
    return dataclasses.replace(meta, shape=tuple(shape))


def _gathered_meta(meta: Any, crossing: Crossing, plan: RoutePlan) -> Any:
    """The shape metadata of a gathered side value: the stream's token dim, the token
    row dims an adapter named (tables keep ``lead``/``trail`` rows and drop ``skip``), or
    dim 0 of a value that folds samples x tokens x ``rows_per_token`` rows."""
    options = crossing.options or {}
    if "rows_per_token" in options:  # [B * N * m, ...] -> [B * k * m, ...]
        rows = options["samples"] * plan.kept_tokens * options["rows_per_token"]
        return _with_tokens(meta, 0, rows)
    if crossing.action == "gather" or "dims" not in options:
        return _with_tokens(meta, plan.layout.token_dim, plan.kept_tokens)
    rows = plan.kept_tokens - options["skip"] + options["lead"] + options["trail"]
    if options.get("broadcast") is not None and not plan.shared_selection:  # per sample
        meta = _with_tokens(meta, options["broadcast"], plan.layout.batch_size)
    for dim in options["dims"]:
        meta = _with_tokens(meta, dim, rows)
    return meta


def _add_noise_input(graph: fx.Graph, plan: RoutePlan) -> fx.Node:
    with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
        noise = graph.placeholder(f"{NOISE_PREFIX}{plan.index}")
    return _mark(noise, None, "noise", plan.index)


def _settled(options: dict, plan: RoutePlan) -> dict:
    """An adapter's options for this route: a table broadcast over the batch (``broadcast``,
    its dim of size 1) is taken per sample from its expansion unless the route's selection
    is shared across the batch (then indexed once, keeping its size 1)."""
    if options.get("broadcast") is None:
        return options
    return {**options, "batch": None if plan.shared_selection else options["broadcast"]}


def _gather(graph: fx.Graph, crossing: Crossing, idx: fx.Node, plan: RoutePlan) -> None:
    layout = plan.layout
    with graph.inserting_before(_first(graph, crossing.users)):
        if crossing.action == "gather":
            new = graph.call_function(gather_tokens, (crossing.node, idx, layout.token_dim))
        else:
            fields = {**dataclasses.asdict(layout), **_settled(crossing.options, plan)}
            new = graph.call_function(crossing.action, (crossing.node, idx), fields)
    meta = _gathered_meta(crossing.node.meta.get("tread_meta"), crossing, plan)
    _mark(new, meta, "gather", plan.index)
    for user in crossing.users:
        user.replace_input_with(crossing.node, new)


def _scatter(
    graph: fx.Graph,
    crossing: Crossing,
    idx: fx.Node,
    plan: RoutePlan,
    reinsert: Reinsert,
    embedded: fx.Node | None,
) -> None:
    token_dim = plan.layout.token_dim
    with graph.inserting_after(crossing.node):
        base = _base(graph, crossing, plan, reinsert)
    made = base is not crossing.counterpart  # zeros or a weighted counterpart, just made
    with graph.inserting_after(base if made else crossing.node):
        if reinsert.mode == "blend" and crossing.node is plan.stream_end:
            args = (base, crossing.node, idx, embedded)
            weights = (reinsert.base_weight, reinsert.embedded_weight, token_dim)
            new = graph.call_function(blend_tokens, args + weights)
        elif crossing.prefix_shift:  # [other tokens | kept image tokens] -> full stream
            args = (base, crossing.node, idx, crossing.prefix_shift, token_dim)
            new = graph.call_function(scatter_after_prefix, args)
        else:
            new = graph.call_function(scatter_tokens, (base, crossing.node, idx, token_dim))
    source = crossing.node if crossing.prefix_shift or made else base
    _mark(new, source.meta.get("tread_meta"), "scatter", plan.index)
    for user in crossing.users:
        user.replace_input_with(crossing.node, new)


def _base(graph: fx.Graph, crossing: Crossing, plan: RoutePlan, reinsert: Reinsert) -> fx.Node:
    """What the routed-around tokens of a leaving value re-enter as: its counterpart at the
    route start; zeros shaped like the value where the start block was handed nothing in its
    slot (``options["empty"]``); for a carried slot other than the stream in blend mode, the
    counterpart times ``base_weight`` (the embedded input is added to the stream alone: blocks
    that sum their hand-off slots, a ``(hidden, residual)`` pair, see it once)."""
    if crossing.options.get("empty"):
        shape = crossing.node.meta["tread_meta"].shape  # the unrouted value's, all tokens
        return graph.call_method("new_zeros", (crossing.node, shape))
    blended = reinsert.mode == "blend" and crossing.node is not plan.stream_end
    if blended and "slot" in crossing.options and reinsert.base_weight != 1.0:
        return graph.call_function(operator.mul, (crossing.counterpart, reinsert.base_weight))
    return crossing.counterpart


def _selection_anchor(graph: fx.Graph, plan: RoutePlan) -> fx.Node:
    """Where the selection goes: before the route's first block call, or before the code of
    its member that runs before that call on the gathered stream (a long skip concatenated
    and projected: ``tread_fx/passes/locate/layout.py`` ``member_prologue``)."""
    users = [u for c in plan.entering if c.node is plan.stream_start for u in c.users]
    return _first(graph, {plan.start_block.node, *users})


def _first(graph: fx.Graph, nodes: Any) -> fx.Node:
    """The first of ``nodes`` in graph order."""
    return next(n for n in graph.nodes if n in nodes)


def rewrite_route(
    gm: fx.GraphModule,
    plan: RoutePlan,
    strategy: Strategy,
    reinsert: Reinsert = Reinsert(),
    embedded: fx.Node | None = None,
    kept: fx.Node | None = None,
    owner: Any = None,
) -> fx.Node:
    """Insert the nodes of one route into ``gm.graph`` in place.

    Args:
        gm: The GraphModule being rewritten.
        plan: The route's plan (made on the current graph).
        strategy: The selection strategy whose ``select`` computes the kept ids.
        reinsert: How routed-around tokens re-enter.
        embedded: The embedded input (stream entering block 0), needed for blend mode.
        kept: For a later piece of a split route (``plan.change``): the kept ids of the
            route's first piece, mapped to their places after the form change.
        owner: The module the graph runs on (``self`` of its code), which holds the
            tables of a later piece (default: ``gm``).

    Returns:
        The node holding the kept token ids [B, k] of this route.
    """
    graph = gm.graph
    if plan.change is not None:
        idx = _moved_selection(gm, plan, kept, owner if owner is not None else gm)
    else:
        noise = _add_noise_input(graph, plan)
        with graph.inserting_before(_selection_anchor(graph, plan)):
            kwargs = {"keep": plan.keep_units, "prefix": plan.layout.prefix}
            if plan.segments is not None:  # a packed stream: select within each segment
                boundaries, kind = plan.segments
                kwargs |= {"boundaries": boundaries, "kind": kind}
                idx = graph.call_function(select_segments, (noise,), kwargs)
            else:
                kwargs["grid"] = plan.layout.grid
                idx = graph.call_function(strategy.select, (noise,), kwargs)
            if plan.layout.suffix:  # trailing tokens (text behind the image) are always kept
                tail = (plan.layout.num_tokens - plan.layout.suffix, plan.layout.suffix)
                idx = graph.call_function(with_suffix, (idx, *tail))
            if plan.shared_selection:  # a batch-shared table enters: one subset for all samples
                idx = graph.call_function(share_across_batch, (idx,))
    _mark(idx, None, "select", plan.index)
    for crossing in plan.entering:
        if crossing.action != "pass":
            _gather(graph, crossing, idx, plan)
    for crossing in plan.leaving:
        if crossing.action == "scatter":
            _scatter(graph, crossing, idx, plan, reinsert, embedded)
    for node, key in plan.height_args:  # blocks told the grid: they now see keep_units rows
        _set_argument(node, key, plan.keep_units)
    for node, key, count in plan.count_args:  # blocks told a token count: the kept one
        _set_argument(node, key, count)
    return idx


def _moved_selection(gm: fx.GraphModule, plan: RoutePlan, kept: fx.Node, owner) -> fx.Node:
    """The places of the first piece's kept tokens and of all other tokens after a form
    change (constant tables of the traced call: where each image token landed)."""
    device = plan.stream_start.meta["tread_meta"].device
    names = []
    for part in ("positions", "others"):
        name = f"tread_form_{plan.index}_{plan.route.start}_{part}"
        table = getattr(plan.change, part).to(device)
        for module in {id(gm): gm, id(owner): owner}.values():  # the graph runs on ``owner``
            module.register_buffer(name, table, persistent=False)
        names.append(name)
    with gm.graph.inserting_before(_selection_anchor(gm.graph, plan)):
        tables = [gm.graph.get_attr(name) for name in names]
        return gm.graph.call_function(kept_positions, (kept, *tables))


def _set_argument(node: fx.Node, key: tuple, value: Any) -> None:
    """Put ``value`` into the argument slot ``key`` (see ``input_slots``), nested or not."""

    def replaced(container: Any, path: tuple) -> Any:
        if not path:
            return value
        items = list(container)
        items[path[0]] = replaced(items[path[0]], path[1:])
        return type(container)(items)

    if key[0] == "arg":
        node.args = replaced(node.args, key[1:])
    else:
        node.kwargs = {**node.kwargs, key[1]: replaced(node.kwargs[key[1]], key[2:])}


def _wrap_marked_blocks(graph: fx.Graph) -> None:
    """Re-apply what a block call needs beyond a plain call.

    Blocks the model ran through activation checkpointing (``meta["tread_checkpoint"]``) are
    checkpointed again (non-reentrant); the first block after a route with
    ``fp32_reentry=True`` (``meta["tread_fp32"]``) runs outside autocast in float32.
    """
    for node in list(graph.nodes):
        checkpointed, fp32 = node.meta.get("tread_checkpoint"), node.meta.get("tread_fp32")
        if node.op != "call_module" or not (checkpointed or fp32):
            continue
        with graph.inserting_before(node):
            args = (graph.get_attr(node.target), *node.args)
            if fp32 and not checkpointed:
                call = graph.call_function(call_in_fp32, args, dict(node.kwargs))
            else:
                args = (call_in_fp32, *args) if fp32 else args
                kwargs = {**node.kwargs, "use_reentrant": False}
                call = graph.call_function(checkpoint, args, kwargs)
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)


def append_route_outputs(gm: fx.GraphModule, idx_nodes: list[fx.Node]) -> int:
    """Append the routes' kept ids to the graph outputs; return the model's output count.

    Also wraps marked block calls (checkpointing, fp32 re-entry), then lints and recompiles
    the graph.
    """
    _wrap_marked_blocks(gm.graph)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    model_outputs = tuple(output.args[0])
    output.args = (model_outputs + tuple(idx_nodes),)
    gm.graph.lint()
    gm.recompile()
    return len(model_outputs)
