"""Pass 3 — plan: for one route, what enters, leaves and passes through the routed region.

The region of route ``(s, e)`` is every node that depends on block ``s`` and feeds block ``e``
(or the last block's outputs when ``e == depth``), found with networkx over the graph.
Values entering the region are gathered (token stream, token-aligned side values) or passed
through (conditioning, text streams); values leaving it are scattered back into their
counterpart at the route start. Anything that looks token-aligned but matches no rule is
refused in strict mode, naming it.

Example:
    >>> # plan_route is driven by tread_fx.pipeline.build; see tread_fx.explain for its output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from tread_fx.adapters import StreamLayout
from tread_fx.adapters.values import NO_BATCH_DIM
from tread_fx.errors import (
    InvalidRateError,
    SelectionError,
    TokenStreamError,
    UntraceableModelError,
)
from tread_fx.passes.locate.dataflow import argument_name, fed_by, output_slots
from tread_fx.passes.locate.dims import check_packed_strategy, segment_boundaries
from tread_fx.passes.locate.layout import (
    check_no_token_tables_inside,
    check_one_stream_length,
    crossing_prefix,
    ends_where_stream_changes,
    family_slots,
    grid_arguments,
    member_prologue,
    non_token_carried,
    stream_entering,
    stream_prefix,
)
from tread_fx.passes.locate.stream import BlockCall, StreamInfo
from tread_fx.passes.plan.crossings import (
    Crossing,
    entering_values,
    in_order,
    leaving_values,
    module_of,
)
from tread_fx.passes.plan.forms import FormChange
from tread_fx.passes.plan.grid_uses import grid_uses, height_slots
from tread_fx.passes.plan.handoff import (
    check_empty_start,
    check_handed_layouts,
)
from tread_fx.passes.plan.region_uses import (
    count_arguments,
    route_uses,
    sizes_tokens,
)
from tread_fx.passes.plan.uses import op_name
from tread_fx.passes.trace.tracer import LEAF_REASON_KEY, TensorMeta
from tread_fx.routes import Route
from tread_fx.runtime.selection import Strategy, kept_units

__all__ = ["RoutePlan", "plan_route", "graph_to_networkx"]


@dataclass
class RoutePlan:
    """Everything the rewrite pass needs for one route."""

    route: Route
    index: int
    start_block: BlockCall
    end_block: BlockCall | None
    stream_start: fx.Node
    stream_end: fx.Node
    region: set[fx.Node]
    entering: list[Crossing]
    leaving: list[Crossing]
    layout: StreamLayout
    units: int
    keep_units: int
    kept_tokens: int
    shared_selection: bool = False
    height_args: list[tuple] = field(default_factory=list)
    count_args: list[tuple] = field(default_factory=list)  # (block, slot, kept count)
    change: Any = None  # later piece of a split route: the FormChange at its start
    pieces: list[RoutePlan] = field(default_factory=list)  # first piece: the later ones
    segments: tuple[fx.Node, str] | None = None  # packed stream: (boundaries, their kind)


def graph_to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """Data-flow graph of an fx graph: an edge from each input node to its user."""
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        g.add_edges_from((a, node) for a in node.all_input_nodes)
    return g


def _region(g: nx.DiGraph, info: StreamInfo, route: Route) -> tuple[set, fx.Node, fx.Node]:
    start = info.blocks[route.start]
    stream_start = stream_entering(start)
    if route.end < info.depth and not ends_where_stream_changes(info, route):
        end = info.blocks[route.end]
        stream_end = stream_entering(end)
        # a member's own code before its first call runs after the scatter, on all tokens
        upstream = nx.ancestors(g, end.node) - member_prologue(g, end)
    else:
        last = info.blocks[route.end - 1]
        after = info.stream_after if route.end == info.depth else None
        stream_end = after or last.stream_out
        tensor = isinstance(last.node.meta.get("tread_meta"), TensorMeta)  # x[i] is no unpacking
        outs = {last.node} if tensor else set(output_slots(last.node).values()) or {last.node}
        outs |= {stream_end}
        upstream = set().union(*(nx.ancestors(g, o) | {o} for o in outs))
    entry = member_prologue(g, start) | {start.node}  # the member's code before its call
    region = set().union(*(nx.descendants(g, n) | {n} for n in entry)) & upstream
    if stream_end not in region:
        raise TokenStreamError(
            f"the token stream entering block {route.end} does not come from block "
            f"{route.start}; route ({route.start}, {route.end}) does not span a chain of blocks."
        )
    return region, stream_start, stream_end


def refuse_opaque_calls_on_stream(region: set, info: StreamInfo, route: Route, stream) -> None:
    """Refuse a call between the route's blocks that the trace kept as one call (a helper
    function running numpy or C code, a submodule fx cannot follow, a custom autograd Function)
    and that reads the routed stream: whether it works on the kept tokens alone cannot be seen.
    A block kept whole is no such call (blocks run on the kept tokens by design); a function
    registered with ``tread_fx.register_leaf_function`` is the user's word that it does."""
    blocks = {b.node for b in info.blocks}
    for node in in_order(region):
        reason = node.meta.get(LEAF_REASON_KEY)
        if reason is None or node in blocks or not fed_by(node, stream):
            continue
        raise UntraceableModelError(
            f"{op_name(node)} runs between the blocks of route ({route.start}, {route.end}) on "
            "the routed tokens, and tread_fx cannot see whether it works on a subset of them. "
            "Pass routes that do not span it, or, if it treats each token on its own, register "
            "it with tread_fx.register_leaf_function (a function) or "
            "tread_fx.register_leaf_module (a module class)."
        )


def _height_arguments(gm, info, route, layout: StreamLayout, strategy: Strategy, uses) -> list:
    """Blocks told the patch grid's height: ints equal to the grid that the block uses to
    reshape its tokens (in a block that cannot be traced through, by value alone), and the
    arguments that the blocks' grid reshapes read the height from, by data flow."""
    by_flow = []
    if layout.grid is not None:  # the arguments the blocks' grid reshapes read, by data flow
        found = grid_uses(gm, info, info.blocks[route.start : route.end], decided=True)
        by_flow = height_slots(found, layout.grid)
    seen = {node for node, _ in by_flow}  # by value (the ints spelling the grid) elsewhere
    heights = by_flow + [
        (node, slot)
        for node, slot in grid_arguments(info, route, layout.grid)
        if node not in seen and sizes_tokens(uses, node, slot)
    ]
    if heights and not strategy.needs_grid:
        node, _ = heights[0]
        *frames, h, w = layout.grid
        told = f"frames={frames[0]}, height={h}" if frames else f"height={h}"
        raise SelectionError(
            f"block {node.target[len('model.') :]} receives the patch grid {told} and "
            f"width={w} as numbers and reshapes its {math.prod(layout.grid)} tokens to that "
            "grid, so it cannot run on a random subset; use selection='rows', which keeps "
            "whole rows (of every frame) and tells the blocks the kept row count."
        )
    return heights


def plan_route(
    gm: fx.GraphModule,
    info: StreamInfo,
    route: Route,
    index: int,
    strategy: Strategy,
    grid: tuple[int, int] | None,
    strict: bool = True,
    follows: RoutePlan | None = None,
    change: Any = None,
) -> RoutePlan:
    """Plan one (resolved) route on the current graph.

    Args:
        gm: The traced (possibly already partly rewritten) GraphModule.
        info: The located stream.
        route: A resolved route (non-negative, ``start < end <= depth``).
        index: The route's position among the model's routes.
        strategy: The selection strategy.
        grid: Patch grid (H, W) of the routable tokens, when known.
        strict: Refuse token-aligned-looking values that no rule covers.
        follows: For a later piece of a route split where the stream changes form
            (:mod:`tread_fx.passes.plan.forms`): the route's first piece, whose selection it uses.
        change: For a later piece: the ``FormChange`` at its start.

    Returns:
        The :class:`RoutePlan`.
    """
    g = graph_to_networkx(gm.graph)
    if follows is not None:
        return _plan_piece(gm, g, info, route, follows, change, strict)
    shift = crossing_prefix(g, info, route)
    common, uses = _boundary(gm, g, info, route, strict, grid)
    layout, entering = common["layout"], common["entering"]
    for crossing in common["leaving"]:
        if crossing.node is common["stream_end"]:
            crossing.prefix_shift = shift
    units, keep = _units(route, strategy, layout, grid)
    heights = _height_arguments(gm, info, route, layout, strategy, uses)
    segments = segment_boundaries(entering) if layout.batch_size == 1 else None
    if layout.batch_dim == NO_BATCH_DIM or segments is not None:
        check_packed_strategy(strategy.name, strategy.needs_grid)
    kept_tokens = layout.prefix + keep * (layout.routable // units) + layout.suffix
    passed = {c.node for c in entering if c.action == "pass"}
    name = lambda block, slot: argument_name(module_of(block.node), slot)  # noqa: E731
    counts = count_arguments(info, route, layout, kept_tokens, passed, name, set(heights), uses)
    shared = any(c.shares_selection for c in entering)
    return RoutePlan(
        **common,
        index=index,
        units=units,
        keep_units=keep,
        kept_tokens=kept_tokens,
        shared_selection=shared,
        height_args=heights,
        count_args=counts,
        segments=segments,
    )


def _boundary(gm, g, info: StreamInfo, route: Route, strict: bool, grid=None, piece=None):
    """The :class:`RoutePlan` fields of what crosses the route's region, and the uses of what
    enters it. A later piece of a split route (``piece``: the form change at its start) has
    no grid, and its prefix and suffix are the other tokens around the image tokens where
    these stay one run (:func:`_around_image`)."""
    region, stream_start, stream_end = _region(g, info, route)
    refuse_opaque_calls_on_stream(region, info, route, stream_start)
    start = info.blocks[route.start]
    shape, first = stream_start.meta["tread_meta"].shape, info.layout
    tokens = shape[first.token_dim]
    # a packed stream has no batch dim (batch size 1)
    batch = first.batch_size if first.batch_dim == NO_BATCH_DIM else shape[first.batch_dim]
    if piece is not None:
        (prefix, suffix), grid = _around_image(piece, tokens), None
    else:  # a longer later stream keeps the image part (and its suffix) last
        prefix, suffix = stream_prefix(g, info, start), first.suffix
        grid = grid if tokens == first.num_tokens else None
    layout = replace(
        first, batch_size=batch, num_tokens=tokens, prefix=prefix, grid=grid, suffix=suffix
    )
    uses = route_uses(gm, info, route, region, layout)
    entering = entering_values(g, (start, stream_start, uses), region, info, layout, strict)
    check_handed_layouts(g, info, route)
    carried = non_token_carried(g, info, route), family_slots(g, info, start)
    stream = (stream_start, stream_end)
    leaving = leaving_values(region, info, route, stream, entering, layout, carried)
    for crossing in leaving:  # a carried token slot the start block was handed nothing in
        if crossing.options.get("empty"):
            like = crossing.node.meta["tread_meta"]
            check_empty_start(gm, route, start, crossing.options["slot"], like)
    common = {
        "route": route,
        "start_block": start,
        "end_block": info.blocks[route.end] if route.end < info.depth else None,
        "stream_start": stream_start,
        "stream_end": stream_end,
        "region": region,
        "entering": entering,
        "leaving": leaving,
        "layout": layout,
    }
    return common, uses


def _units(route: Route, strategy: Strategy, layout: StreamLayout, grid) -> tuple[int, int]:
    """(selectable units, kept units) of the route; refuses a rate that keeps none or all."""
    units = strategy.units(layout.routable, grid)
    keep = kept_units(units, route.rate)
    if keep < 1 or units < 1:
        raise InvalidRateError(
            f"route ({route.start}, {route.end}) at rate {route.rate} keeps {keep} of {units} "
            f"selectable units ({strategy.name}); lower the rate so at least one is kept."
        )
    if route.rate > 0 and units == 1:
        raise TokenStreamError(
            f"route ({route.start}, {route.end}) has only 1 routable token, so it can save "
            "nothing; route a stack whose blocks see more image tokens, or drop the route.\n"
            f"The stream has {layout.num_tokens} tokens, {layout.prefix} leading and "
            f"{layout.suffix} trailing ones never routed (not computed from the main input: "
            f"text, registers, condition tokens), leaving 1 selectable unit ({strategy.name}). "
            "Pass keep_prefix= if the prefix was detected wrongly."
        )
    if route.rate > 0 and keep >= units:
        raise InvalidRateError(
            f"route ({route.start}, {route.end}) at rate {route.rate} keeps all {units} "
            f"selectable units ({strategy.name}; floor({units} * {route.rate}) = 0 routed "
            "around): the routed blocks would see no fewer tokens and the route would save "
            f"nothing. Raise the rate to at least {1 / units:.3g}, or drop the route."
        )
    return units, keep


def _plan_piece(gm, g, info, route: Route, follows: RoutePlan, change, strict) -> RoutePlan:
    """A later piece of a split route: the longer stream after a form change, gathered at the
    places of the first piece's kept tokens and at every other token (never routed)."""
    check_one_stream_length(info, route)
    check_no_token_tables_inside(gm, info, route)
    common, _ = _boundary(gm, g, info, route, strict, piece=change)
    return RoutePlan(
        **common,
        index=follows.index,
        units=follows.units,
        keep_units=follows.keep_units,
        kept_tokens=follows.kept_tokens + change.others.shape[1],
        shared_selection=follows.shared_selection,
        change=change,
    )


def _around_image(change: FormChange, tokens: int) -> tuple[int, int]:
    """``(prefix, suffix)`` of a later piece's stream of ``tokens``: the other tokens before
    and after the image tokens where these are one run at the same places in every sample
    (``cat((img, txt), 1)``), so a table of the image tokens' rows (a RoPE table of the first
    stream) maps to them; else ``(0, 0)`` (no such table is cut).

    Example:
        >>> pos = torch.arange(4).expand(2, 4) + 2
        >>> _around_image(FormChange(3, pos, torch.tensor([[0, 1, 6]])), 7)
        (2, 1)
    """
    positions = change.positions
    start = positions[:, :1]
    run = start + torch.arange(positions.shape[1], device=positions.device)
    if not (torch.equal(positions, run) and bool((start == start[0, 0]).all())):
        return 0, 0
    prefix = int(start[0, 0])
    return prefix, tokens - positions.shape[1] - prefix
