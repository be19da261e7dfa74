"""What crosses a routed region's boundary, and what the rewrite does with each value.

Every value computed outside the region and read inside it *enters*: the token stream is
gathered, a side value is decided by the first adapter rule that takes it (its use in the
blocks, then its shape), and one that looks token-aligned but matches no rule is refused in
strict mode, naming it. Every value computed inside the region and read after it *leaves*:
the stream (and a carried token slot) is scattered back into its counterpart at the route
start; a value laid out like the stream with no counterpart is refused.

Example:
    >>> Crossing(node=None, action="pass", reason="not token-aligned").action
    'pass'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from tread_fx.adapters import SideValue, adapters
from tread_fx.errors import SideInputError, TokenStreamError, warn_at_caller
from tread_fx.passes.locate.dataflow import input_slots
from tread_fx.passes.locate.layout import family_slots
from tread_fx.passes.locate.stream import StreamInfo
from tread_fx.passes.plan.handoff import carried_counterparts
from tread_fx.passes.plan.region_uses import in_stream_layout, side_value
from tread_fx.passes.plan.uses import how_used, partial_warning, shape_warning
from tread_fx.passes.trace.tracer import TensorMeta
from tread_fx.routes import Route

__all__ = [
    "Crossing",
    "classify_entering",
    "entering_values",
    "leaving_values",
    "module_of",
    "in_order",
]


@dataclass
class Crossing:
    """A value crossing the region boundary and what the rewrite does with it.

    Attributes:
        node: The value.
        action: ``"gather"``, ``"pass"``, ``"scatter"`` or an adapter function.
        reason: The rule that decided (shown by ``explain``).
        users: For entering values, the region nodes using it; for leaving values, the
            nodes after the region using it.
        counterpart: For scattered values, the full-size value at the route start.
        options: Extra keyword arguments of an adapter function (decided at plan time).
        shares_selection: The adapter needs the route's selection shared across the batch.
        prefix_shift: For the scattered token stream of a route that crosses a concatenation
            of other tokens in front of it: their count (they leave processed, never routed).
        segments: The value holds a packed stream's segment boundaries (``"offsets"`` or
            ``"ids"``), as the rule that decided says.
    """

    node: fx.Node
    action: Any
    reason: str
    users: list[fx.Node] = field(default_factory=list)
    counterpart: fx.Node | None = None
    options: dict[str, Any] = field(default_factory=dict)
    shares_selection: bool = False
    segments: str | None = None
    prefix_shift: int = 0  # scattered stream: tokens concatenated in front inside the route


def _looks_token_aligned(side: SideValue) -> bool:
    """Any dim (but a batch dim of size B) has N, N - prefix or the routable count of
    entries, e.g. a [N, d] table."""
    layout = side.stream
    return any(
        s in layout.token_counts and not (d == layout.batch_dim and s == layout.batch_size)
        for m in _items(side.meta)
        if isinstance(m, TensorMeta)
        for d, s in enumerate(m.shape)
    )


def classify_entering(side: SideValue, users, carried_slot, family, strict: bool) -> Crossing:
    node = side.node
    if carried_slot is not None:
        if carried_slot in family:
            return Crossing(node, "gather", f"carried token stream {carried_slot}", users)
        return Crossing(node, "pass", f"carried non-token stream {carried_slot}", users)
    for adapter in adapters():
        if adapter.matches(side):
            options = adapter.options(side) if adapter.options is not None else {}
            reason = f"adapter '{adapter.name}'"
            if adapter.builtin and adapter.by_shape_only:
                reason += " (by its shape: its use is not seen)"
                warn_at_caller(shape_warning(side, adapter.name))
            elif side.stopped and side.use is not None:
                reason += " (its use read from blocks traced in part)"
                warn_at_caller(partial_warning(side, adapter.name))
            shares, segments = adapter.shares_selection, adapter.segments
            return Crossing(node, adapter.action, reason, users, None, options, shares, segments)
    notes = [f"{a.name}: {n}" for a in adapters() if a.diagnose and (n := a.diagnose(side))]
    if side.token_aligned or _looks_token_aligned(side) or notes:
        shape = getattr(side.meta, "shape", side.meta)
        message = (
            f"value '{node.name}' with shape {shape} enters the routed blocks "
            f"{sorted(side.arg_names) or '(used inside the region)'} and looks token-aligned "
            f"({side.stream.num_tokens} tokens), but no rule says how to fit it to the kept "
            "tokens. Register a tread_fx.adapters.Adapter for it (action 'gather' or 'pass'), "
            "or pass strict=False to gather token-aligned values and pass the rest."
        ) + how_used(side)
        if notes:
            message += " Rules meant for it declined: " + "; ".join(notes) + "."
        if strict:
            raise SideInputError(message)
        warn_at_caller(message)
        action = "gather" if side.token_aligned else "pass"
        return Crossing(node, action, "non-strict guess", users)
    return Crossing(node, "pass", "not token-aligned", users)


def entering_values(g, plan_args, region, info, layout, strict) -> list[Crossing]:
    start, stream_start, uses = plan_args
    # the block calls, and the module calls inside the routed blocks (they receive values too)
    block_nodes = {n: module_of(n) for n in (*(b.node for b in info.blocks), *uses)}
    start_slots = {n: k for k, n in input_slots(start.node).items()}
    family = family_slots(g, info, start)
    carried = set(info.carried.get(start.list_path, {}).values())
    crossings, seen = [], {}
    for node in in_order(region):
        for arg in node.all_input_nodes:
            if arg not in region:
                seen.setdefault(arg, []).append(node)
    for value, users in seen.items():
        if value is stream_start:
            crossings.append(Crossing(value, "gather", "token stream", users))
            continue
        slot = start_slots.get(value)
        side = side_value(g, value, users, region, (info, layout, stream_start, block_nodes, uses))
        carried_slot = slot if slot in carried and start.node in users else None
        crossings.append(classify_entering(side, users, carried_slot, family, strict))
    return crossings


def leaving_values(
    region, info, route, stream, entering, layout, carried=(frozenset(), set())
) -> list:
    """What leaves the region; ``carried``: (values handed on at the end that are no token
    stream, the start list's carried token slots)."""
    (stream_start, stream_end), (non_token, family) = stream, carried
    gathered = {c.node for c in entering if c.action != "pass"}
    counterparts = carried_counterparts(info, route)
    crossings = []
    for node in in_order(region):
        outside = [u for u in node.users if u not in region and (u.users or u.op == "output")]
        if not outside:  # dead unpacking (RWKV's unused `attentions` item) is not a use
            continue
        meta = node.meta.get("tread_meta")
        if node is stream_end:
            action, reason, counterpart = "scatter", "token stream", stream_start
        elif node in counterparts and (
            counterparts[node][1] in gathered
            or (counterparts[node][1] is None and counterparts[node][0] in family)
        ):  # a carried token slot: into its value at the start (none there: zeros)
            slot, counterpart = counterparts[node]
            reason = "carried token stream" + (
                ", zeros at the start" if counterpart is None else ""
            )
            options = {"slot": slot, "empty": counterpart is None}
            crossings.append(Crossing(node, "scatter", reason, outside, counterpart, options))
            continue
        elif node in non_token:
            action, reason, counterpart = "pass", "carried non-token stream", None
        elif (
            node in counterparts
            and counterparts[node][0] is None
            and in_stream_layout(meta, layout)
        ):
            raise _no_counterpart(node, route, info)
        elif in_stream_layout(meta, layout) and meta == stream_start.meta.get("tread_meta"):
            action, reason, counterpart = "scatter", "stream-shaped value", stream_start
        elif any(in_stream_layout(m, layout) for m in _items(meta)):
            users = ", ".join(u.name for u in outside)
            raise SideInputError(
                f"route ({route.start}, {route.end}) splits value '{node.name}', made on the "
                "kept tokens inside it and used after it; end the route before or after it.\n"
                f"The value has shape {_shape_text(meta)} and is used after the route by "
                f"{users}, but it has no counterpart at the route start to scatter into. Choose "
                "a route that does not split it (end the route before it is produced or after "
                "it is consumed), or pass blocks= to exclude that code."
            )
        else:
            action, reason, counterpart = "pass", "not token-aligned", None
        crossings.append(Crossing(node, action, reason, outside, counterpart))
    return crossings


def _no_counterpart(node: fx.Node, route: Route, info: StreamInfo) -> TokenStreamError:
    """The route ends where the blocks are handed, besides the stream, a token-aligned value
    that continues none of the start block's slots (code between the lists computes it from
    several of them)."""
    start, end = info.blocks[route.start], info.blocks[min(route.end, info.depth - 1)]
    return TokenStreamError(
        f"route ({route.start}, {route.end}) ends where the blocks of {end.list_path!r} are "
        f"handed '{node.name}' besides the token stream, laid out like it, but it is not "
        f"handed on from a slot of block {start.path} (code between the lists computes it), "
        "so the routed-around tokens have no value of it at the route start to re-enter "
        f"with. End the route in {start.list_path!r}, or start it in {end.list_path!r}."
    )


def _shape_text(meta: Any) -> Any:
    """A value's shape for messages; a tuple's item shapes (``((2, 65, 32), (2, 17, 64))``)."""
    if isinstance(meta, (tuple, list)):
        return tuple(getattr(m, "shape", m) for m in meta)
    return getattr(meta, "shape", meta)


def _items(meta: Any) -> tuple:
    """A value's metadata, or its items' for a tuple of values."""
    return tuple(meta) if isinstance(meta, (tuple, list)) else (meta,)


def module_of(node: fx.Node) -> Any:
    gm = node.graph.owning_module
    return gm.get_submodule(node.target) if gm is not None else None


def in_order(region: set[fx.Node]) -> list[fx.Node]:
    """The region's nodes in graph order."""
    return [n for n in next(iter(region)).graph.nodes if n in region]
