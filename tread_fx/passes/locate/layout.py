"""Stream layouts of chained block lists: which carried values are token streams, how long
the stream is in each list, what a route may span, and where the stream enters a member that
is a list of sub-blocks (its own code may reshape the stream before its first call).

A chained stack (Flux, AuraFlow, Chroma) carries several values from block to block; only
some are image-token streams (a joint text stream is not, although it attends to the
image). Some models also concatenate other tokens (text) in front of the image stream
between two lists, so the later list runs on a longer stream whose leading part is a
prefix never routed.

Example:
    >>> # used by tread_fx.passes.plan.route_plan.plan_route
"""

from __future__ import annotations

import math

import networkx as nx
import torch.fx as fx

from tread_fx.errors import SideInputError, TokenStreamError
from tread_fx.passes.locate.dataflow import (
    argument_items,
    fed_by,
    input_slots,
    int_value,
    output_slots,
    tensor_shape,
)
from tread_fx.passes.locate.stream import BlockCall, StreamInfo, handed_values
from tread_fx.passes.trace.concats import concatenation_parts
from tread_fx.routes import Route

__all__ = [
    "stream_tokens",
    "ends_where_stream_changes",
    "check_last_block_keeps_length",
    "check_route_keeps_width",
    "check_one_stream_length",
    "crossing_prefix",
    "check_no_token_tables_inside",
    "stream_prefix",
    "family_slots",
    "non_token_carried",
    "grid_arguments",
    "grid_in_block_arguments",
    "int_arguments",
    "stream_entering",
    "member_prologue",
]


def stream_tokens(block: BlockCall, info: StreamInfo) -> int:
    """Token count of the stream entering ``block``."""
    return block.stream_in.meta["tread_meta"].shape[info.layout.token_dim]


def ends_where_stream_changes(info: StreamInfo, route: Route) -> bool:
    """The route ends at a list whose stream is longer (text concatenated in between)."""
    if route.end >= info.depth:
        return False
    if route.end in info.form_cuts:  # a route split at a change of the stream's form
        return True
    end, start = info.blocks[route.end], info.blocks[route.start]
    return stream_tokens(end, info) != stream_tokens(start, info)


def crossing_prefix(g: nx.DiGraph, info: StreamInfo, route: Route) -> int:
    """Tokens concatenated in front of the stream inside the route (0: none).

    A route may cross the boundary where the model concatenates other tokens (text) in front
    of the image stream (MMDiT joint -> single blocks): the kept tokens travel through the
    concatenation and the later blocks see ``T + kept`` tokens. Returns ``T``; refuses a
    route along which the stream changes in any other way.
    """
    start = info.blocks[route.start]
    last = info.blocks[route.end - 1]
    base = stream_tokens(start, info)
    check_last_block_keeps_length(info, route)
    if stream_tokens(last, info) == base:
        check_one_stream_length(info, route)
        return 0
    changed = next(
        b for b in info.blocks[route.start : route.end] if stream_tokens(b, info) != base
    )
    try:
        extra = stream_prefix(g, info, changed) - stream_prefix(g, info, start)
    except TokenStreamError:
        extra = None
    grown = stream_tokens(changed, info)
    later = info.blocks[changed.index : route.end]
    if (
        extra is None
        or extra + base != grown
        or any(stream_tokens(b, info) != grown for b in later)
    ):
        check_one_stream_length(info, route)  # raises with the reason
    return extra


def check_last_block_keeps_length(info: StreamInfo, route: Route) -> None:
    """Refuse a route whose last block hands the stream on with another token count than it
    takes (it merges or splits tokens itself): the routed-around tokens could not be written
    back beside the kept ones. Inside a route the next block's input shows the change."""
    last = info.blocks[route.end - 1]
    before, after = tensor_shape(last.stream_in), tensor_shape(last.stream_out)
    dim = info.layout.token_dim
    if before is None or after is None or len(after) != len(before) or len(after) <= dim:
        return
    if after[dim] != before[dim]:
        raise TokenStreamError(
            f"route ({route.start}, {route.end}) ends after block {last.index} ({last.path}), "
            f"which takes {before[dim]} tokens and hands on {after[dim]}\nthe block merges or "
            "splits tokens itself, so the routed-around tokens cannot be written back beside "
            f"the kept ones after it. End the route before block {last.index}, or route "
            "blocks that keep the token count."
        )
    check_route_keeps_width(info, route)


def check_route_keeps_width(info: StreamInfo, route: Route) -> None:
    """Refuse a route whose stream comes back from its last block in another width than it
    entered its first (the routed-around tokens could not be written back beside the kept)."""
    first = tensor_shape(info.blocks[route.start].stream_in)
    last = info.blocks[route.end - 1]
    after, dim = tensor_shape(last.stream_out), info.layout.token_dim
    if first is None or after is None or len(first) != len(after):
        return
    if [s for d, s in enumerate(first) if d != dim] != [s for d, s in enumerate(after) if d != dim]:
        raise TokenStreamError(
            f"route ({route.start}, {route.end}) takes the stream as {list(first)} into block "
            f"{route.start} and gets it back as {list(after)} from block {last.index} "
            f"({last.path}): its width changes inside the route, so the routed-around tokens "
            "cannot be written back beside the kept ones. Route blocks between which the "
            "stream keeps its width (end the route before the block that changes it)."
        )


def check_one_stream_length(info: StreamInfo, route: Route) -> None:
    """Refuse a route whose blocks do not all see a stream of the same length (and one whose
    last block changes it, :func:`check_last_block_keeps_length`)."""
    check_last_block_keeps_length(info, route)
    start = info.blocks[route.start]
    for block in info.blocks[route.start + 1 : route.end]:
        if stream_tokens(block, info) != stream_tokens(start, info):
            raise TokenStreamError(
                f"route ({route.start}, {route.end}) starts where blocks see "
                f"{stream_tokens(start, info)} tokens, but block {block.index} ({block.path}) sees "
                f"{stream_tokens(block, info)}: the model concatenates other tokens (e.g. text) "
                f"into the stream between {start.list_path} and {block.list_path}. Routes "
                f"must stay on one stream: end this one at block {block.index} or start it "
                "there."
            )


def check_no_token_tables_inside(
    gm: fx.GraphModule, info: StreamInfo, route: Route, known: frozenset[int] = frozenset()
) -> None:
    """Refuse blocks that hold a buffer with a dim of their token count (BEiT's relative
    position index) and were not traced through: those in ``known`` were, their token tables
    cut (``tread_fx/passes/plan/inline_tables.py``)."""
    start = info.blocks[route.start]
    tokens = stream_tokens(start, info)
    sizes = {tokens, tokens - info.layout.prefix}
    for block in info.blocks[route.start : route.end]:
        if block.index in known:
            continue
        for name, buffer in gm.get_submodule(block.node.target).named_buffers():
            if buffer.dim() >= 2 and any(s in sizes for s in buffer.shape):
                raise SideInputError(
                    f"block {block.index} ({block.path}) holds the buffer {name} of shape "
                    f"{tuple(buffer.shape)}, possibly a table over its {tokens} input tokens "
                    "(e.g. a relative position index), and the block could not be traced "
                    "through to see how it uses it, so it may not run on the kept tokens "
                    "only; route blocks without such tables, or pass blocks= to choose others."
                )


def stream_prefix(g: nx.DiGraph, info: StreamInfo, start: BlockCall) -> int:
    """Leading tokens never routed in the stream entering ``start``.

    A chained list may run on a longer stream: AuraFlow and Chroma concatenate the text
    stream in front of the image stream between their joint and single blocks. The parts
    of that concatenation before the image stream are prefix tokens of the longer stream.
    """
    tokens, layout = stream_tokens(start, info), info.layout
    if tokens == layout.num_tokens:
        return layout.prefix
    first = next(b for b in info.blocks if b.list_path == start.list_path)
    prev = info.blocks[first.index - 1] if first.index else None
    if prev is not None and stream_tokens(prev, info) == layout.num_tokens:
        between = nx.descendants(g, prev.stream_out) & (
            nx.ancestors(g, first.stream_in) | {first.stream_in}
        )
        for node in between:
            prefix = prefix_in_cat(g, node, prev.stream_out, info, tokens)
            if prefix is not None:
                return prefix + layout.prefix
    raise TokenStreamError(
        f"the stream entering {start.path} has {tokens} tokens, the stack's first block "
        f"{layout.num_tokens}, and no concatenation of other tokens in front of the image "
        "stream explains the difference; route only blocks that see the first block's stream."
    )


def prefix_in_cat(g, node: fx.Node, image: fx.Node, info: StreamInfo, tokens: int) -> int | None:
    found = concatenation_parts(node, info.layout.token_dim)  # torch.cat, or a leaf (pack)
    if found is None:
        return None
    parts, sizes = found
    for i, part in enumerate(parts):
        if part is image or nx.has_path(g, image, part):
            last = i == len(parts) - 1 and sizes[i] == info.layout.num_tokens
            return sum(sizes[:i]) if last and sum(sizes) == tokens else None
    return None


def family_slots(g: nx.DiGraph, info: StreamInfo, block: BlockCall) -> set:
    """Carried input slots of ``block``'s list that hold token streams: in the first list
    those fed by the model's first input; in a chained list those fed by the previous list's
    token-stream outputs alone (a joint text stream that attended to the image is not one).
    """
    family: set = set()
    for n, path in enumerate(info.list_paths):
        members = [b for b in info.blocks if b.list_path == path]
        slots = handed_values(info, path)  # a slot None into the first block: its next value
        carried = (set(info.carried.get(path, {}).values()) | {members[0].in_slot}) & set(slots)
        feeders = family_outputs(info, info.list_paths[n - 1], family) if n else None
        family = {k for k in carried if is_token_slot(g, info, slots[k], feeders)}
        family.add(members[0].in_slot)
        if path == block.list_path:
            return family
    return family


def is_token_slot(g: nx.DiGraph, info: StreamInfo, value: fx.Node, feeders) -> bool:
    shape, dim = getattr(value.meta.get("tread_meta"), "shape", ()), info.layout.token_dim
    if len(shape) <= dim or shape[dim] != info.layout.num_tokens:
        return False  # e.g. CogVideoX's text stream, sliced off a text+image concatenation
    if feeders is None:  # the stack's first list: by data flow from the model's first input
        return fed_by(value, info.primary, like=True)  # a size read (`x[:b]`) is no data
    return fed_only_by(value, feeders, info)


def family_outputs(info: StreamInfo, path: str, family: set) -> tuple[set, set]:
    """(token-stream outputs, all outputs) of the last block of list ``path``."""
    last = [b for b in info.blocks if b.list_path == path][-1]
    outs = output_slots(last.node)
    if not outs:
        return {last.node}, {last.node}
    carried = info.carried.get(path, {})
    tokens = {node for key, node in outs.items() if carried.get(key) in family}
    return tokens | {last.stream_out}, set(outs.values())


def fed_only_by(node: fx.Node, feeders: tuple[set, set], info: StreamInfo) -> bool:
    """Whether ``node`` depends on token-stream outputs of the previous list and no other."""
    tokens, outputs = feeders
    stop = {b.node for b in info.blocks} | outputs
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current not in outputs:
            todo.extend(a for a in current.all_input_nodes if a not in stop or a in outputs)
    reached = seen & outputs
    return bool(reached) and reached <= tokens


def non_token_carried(g: nx.DiGraph, info: StreamInfo, route: Route) -> set[fx.Node]:
    """Values carried from block to block at the route end that are not token streams (a
    joint text stream with as many tokens as the image stream would look like one)."""
    if route.end < info.depth and not ends_where_stream_changes(info, route):
        end = info.blocks[route.end]
        slots = input_slots(end.node)
        carried = set(info.carried.get(end.list_path, {}).values())
        family = family_slots(g, info, end)
        return {slots[k] for k in carried - family if k in slots}
    last = info.blocks[route.end - 1]
    outs = output_slots(last.node)
    family = family_slots(g, info, last)
    carried = info.carried.get(last.list_path, {})
    return {outs[o] for o, i in carried.items() if i not in family and o in outs}


def grid_arguments(info: StreamInfo, route: Route, grid: tuple[int, ...] | None) -> list[tuple]:
    """Blocks of the route that receive the patch grid's height and width as numbers.

    Sana's blocks take ``(..., height, width)`` (Sana-Video's ``(..., frames, height,
    width)``), a Vision-RWKV block a tuple ``patch_resolution=(H, W)``, and reshape their
    tokens to that grid. Such a route can keep whole rows
    (``selection="rows"``; in every frame for a video grid) if each block is told the kept
    row count instead of the height.

    Returns:
        ``(node, slot)`` of every height argument (the width follows it).
    """
    found = []
    for block in info.blocks[route.start : route.end] if grid is not None else ():
        runs = [int_arguments(block.node), *_tuple_ints(argument_items(block.node))]
        found += _height_in_runs(block.node, runs, tuple(grid))
    return found


def _height_in_runs(node: fx.Node, runs: list[list], grid: tuple[int, ...]) -> list[tuple]:
    """``(node, slot)`` of the height in the first run of ints that spells ``grid``."""
    for numbers in runs:
        for i in range(len(numbers) - len(grid) + 1):
            if tuple(v for _, v in numbers[i : i + len(grid)]) == grid:
                return [(node, numbers[i + len(grid) - 2][0])]
    return []


def _tuple_ints(items: list[tuple[tuple, object]]) -> list[list[tuple[tuple, int]]]:
    """``(slot, value)`` runs of the ints inside each tuple or list argument, nested slots
    ``(*slot, j)`` as ``input_slots`` names them (``patch_resolution=(H, W)``)."""
    runs = []
    for key, value in items:
        if isinstance(value, (tuple, list)):
            inner = [((*key, j), v) for j, v in enumerate(value)]
            runs.append([(k, int_value(v)) for k, v in inner if int_value(v) is not None])
            runs += _tuple_ints(inner)
    return runs


def grid_in_block_arguments(info: StreamInfo, tokens: int) -> tuple[int, ...] | None:
    """A patch grid the first block is told as consecutive numbers: ``(frames, height,
    width)`` or ``(height, width)`` whose product is ``tokens`` (the routable tokens)."""
    numbers = [v for _, v in int_arguments(info.blocks[0].node)]
    for size in (3, 2):
        for i in range(len(numbers) - size + 1):
            run = tuple(numbers[i : i + size])
            if math.prod(run) == tokens and min(run[-2:]) > 1:
                return run
    return None


def int_arguments(node: fx.Node) -> list[tuple[tuple, int]]:
    """``(slot, value)`` of each top-level int argument of a call (literal or computed)."""
    return [(k, int_value(a)) for k, a in argument_items(node) if int_value(a) is not None]


def stream_entering(block: BlockCall) -> fx.Node:
    """The stream entering ``block`` in the graph as it is now: what its call receives in the
    stream slot (a route planned and rewritten before may have replaced the located value by
    its scatter), or, for a member whose own code changes the stream's shape before its first
    call, the value that code starts from (``block.stream_in``, see ``stream.locate``).
    """
    slot = input_slots(block.node).get(block.in_slot)
    if slot is block.stream_in or tensor_shape(slot) == tensor_shape(block.stream_in):
        return slot
    return _scattered(block.stream_in)


def _scattered(node: fx.Node) -> fx.Node:
    """``node``, or the scatter a route ending here put in its place
    (``tread_fx/passes/rewrite/insert.py``
    marks it ``tread_role == "scatter"``, the routed value its second argument)."""
    for user in node.users:
        if user.meta.get("tread_role") == "scatter" and user.args[1:2] == (node,):
            return _scattered(user)
    return node


def member_prologue(g: nx.DiGraph, block: BlockCall) -> set[fx.Node]:
    """Nodes of the data-flow graph ``g`` between the stream entering ``block`` and its first
    call (the member's own code before that call); empty where the call receives the stream.
    """
    entering = stream_entering(block)
    if input_slots(block.node).get(block.in_slot) is entering:
        return set()
    return nx.descendants(g, entering) & nx.ancestors(g, block.node)
