"""Hand-off slots besides the stream: what else the blocks hand on, and how a route treats it.

Blocks in the ``mamba_ssm`` style hand on a pair, ``hidden, residual = block(hidden,
residual)``: the residual is ``None`` into the first block and laid out like the stream
afterwards. Every carried slot laid out like the stream (``layout.family_slots``) is
gathered at a route's start and scattered at its end with the stream's selection. This
module adds what the planner needs around that:

- :func:`carried_counterparts`: the value each carried slot leaving the route's end is
  scattered into (the slot at the start block), or ``None`` where the start block is handed
  no tensor there (a route starting at the first block sees no residual yet);
- :func:`check_empty_start`: zeros stand for such an empty slot only where the start block
  computes the same with zeros there as with nothing (decided by calling it on its traced
  inputs both ways); otherwise the route is refused;
- :func:`check_handed_layouts`: a carried slot computed from the stream, with the stream's
  token count on a dim but not laid out like the stream, is refused (no selection of the
  stream's fits it).

Example:
    >>> # used by tread_fx.passes.plan.route_plan.plan_route
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from tread_fx.adapters.values import NO_BATCH_DIM, TensorMeta
from tread_fx.errors import TokenStreamError
from tread_fx.module_state import random_state_kept, seed_every_generator
from tread_fx.passes.locate.dataflow import fed_by, input_slots, output_slots, tensor_meta
from tread_fx.passes.locate.layout import family_outputs, family_slots, fed_only_by
from tread_fx.passes.locate.stream import BlockCall, StreamInfo, handed_values, same_block_class
from tread_fx.passes.trace.block import example_of
from tread_fx.routes import Route

__all__ = ["carried_counterparts", "check_empty_start", "check_handed_layouts"]


def carried_counterparts(
    info: StreamInfo, route: Route
) -> dict[fx.Node, tuple[tuple, fx.Node | None]]:
    """Values that re-enter a carried slot at the route end: ``(the start block's slot, its
    value there)``; the value is ``None`` where the start block is handed no tensor in that
    slot (the first block of a ``(hidden, residual)`` pair stack), the slot ``None`` where
    the slot at the end continues none of the start list's. A slot of a later list is
    followed back to the start list through the outputs of each list's last block that its
    first block is handed (a U-ViT's out blocks continue the in blocks' pair)."""
    start = info.blocks[route.start]
    start_slots = input_slots(start.node)
    if route.end < info.depth:
        end = info.blocks[route.end]
        path, same = end.list_path, end.list_path == start.list_path
        carried = set(info.carried.get(path, {}).values())
        ends = {
            n: k
            for k, n in input_slots(end.node).items()
            if k in carried or (same and k in start_slots)
        }
    else:
        path = info.blocks[-1].list_path
        carried = info.carried.get(path, {})
        ends = {
            n: carried[k] for k, n in output_slots(info.blocks[-1].node).items() if k in carried
        }
    found = {}
    for node, key in ends.items():
        key = _slot_in_list(info, path, start.list_path, key)
        if key != start.in_slot:
            found[node] = (key, start_slots.get(key))
    return found


def _slot_in_list(info: StreamInfo, path: str, target: str, key: tuple) -> tuple | None:
    """The slot of list ``target`` that slot ``key`` of list ``path`` continues: the one the
    list before hands on into it, or, where code between the lists (a mid block traced
    through) computes it from that list's outputs, the same argument of a list of the same
    block class (``None``: neither)."""
    while path != target:
        n = info.list_paths.index(path)
        if n == 0:
            return None
        first = next(b for b in info.blocks if b.list_path == path)
        value = handed_values(info, path).get(key)
        path = info.list_paths[n - 1]
        last = [b for b in info.blocks if b.list_path == path][-1]
        items = {node: k for k, node in output_slots(last.node).items()}
        if value in items:
            key = info.carried.get(path, {}).get(items[value])
        elif not _same_slot_between(info, (last, first), key, value):
            key = None
        if key is None:
            return None
    return key


def _same_slot_between(info: StreamInfo, blocks: tuple, key: tuple, value) -> bool:
    """Whether ``value``, handed in ``key`` to the first block of a list (``blocks[1]``) and
    computed by code from the outputs of the last block of the list before (``blocks[0]``),
    continues that list's slot ``key``: both blocks of one class, which carries ``key``."""
    last, first = blocks
    carried = {*info.carried.get(last.list_path, {}).values(), last.in_slot}
    stop = {b.node for b in info.blocks} - {last.node}
    computed = isinstance(value, fx.Node) and fed_by(value, last.node, stop)
    return computed and key in carried and same_block_class(last, first)


def check_empty_start(gm: fx.GraphModule, route: Route, start: BlockCall, slot, like) -> None:
    """Refuse a route whose start block is handed no tensor in a carried token slot, unless
    that block computes the same with zeros there (``like``'s shape) as with nothing.

    The routed-around tokens re-enter at the route end with their value at the start; a
    slot that held nothing there is written back as zeros, which is right only if zeros mean
    what nothing meant (``residual = hidden if residual is None else residual + hidden``).
    """
    found = example_of(gm, start.node)
    verdict = "its traced inputs were not kept" if found is None else None
    if found is not None:
        verdict = _zeros_differ(gm.get_submodule(start.node.target), found[0], slot, like)
    if verdict is None:
        return
    name = f"argument {slot[1]}" if slot[0] == "arg" else f"{slot[1]}="
    raise TokenStreamError(
        f"route ({route.start}, {route.end}) starts at block {start.path}, which is handed "
        f"no tensor in {name} but hands one on there ({list(like.shape)}, laid out like the "
        "token stream) to the blocks after it. The routed-around tokens re-enter at the route "
        "end with their value at the start, and that slot had none: zeros would stand for it "
        f"only if the block computed the same with zeros there, but {verdict}. Start the "
        f"route at block {route.start + 1} or later."
    )


def _zeros_differ(module: torch.nn.Module, example: Any, slot: tuple, like: TensorMeta):
    """``None`` when ``module`` returns the same on ``example`` with zeros put in ``slot``;
    else why not (the outputs differ, the slot cannot be filled, the call fails)."""
    zeros = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    filled = _filled(example, slot, zeros)
    if filled is None:
        return "the slot cannot be filled in the block's call"
    try:
        with torch.no_grad(), random_state_kept():
            seed_every_generator(0)
            empty = module(*_cloned(example[0]), **_cloned(dict(example[1])))
            seed_every_generator(0)
            zeroed = module(*filled[0], **filled[1])
    except Exception as err:  # noqa: BLE001 - the block's own failure decides the refusal
        return f"calling it with zeros there failed ({type(err).__name__}: {err})"
    ours, spec = pytree.tree_flatten(empty)
    theirs, other = pytree.tree_flatten(zeroed)
    same = spec == other and all(_same(a, b) for a, b in zip(ours, theirs))
    return None if same else "it returns other values with zeros there"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)
    return type(a) is type(b) and (isinstance(a, torch.Tensor) or a == b)


def _cloned(tree: Any) -> Any:
    """The example's tensors copied (a block that writes into its inputs runs twice)."""
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, tree)


def _filled(example: Any, slot: tuple, value: torch.Tensor) -> tuple[list, dict] | None:
    """``(args, kwargs)`` of ``example`` with ``value`` at ``slot`` (a top-level argument
    that holds ``None`` or is left out), or ``None`` where it cannot go."""
    args, kwargs = list(_cloned(tuple(example[0]))), _cloned(dict(example[1]))
    if len(slot) != 2:
        return None
    if slot[0] == "kwarg" and kwargs.get(slot[1]) is None:
        return args, {**kwargs, slot[1]: value}
    if slot[0] == "arg" and slot[1] < len(args) and args[slot[1]] is None:
        args[slot[1]] = value
        return args, kwargs
    if slot[0] == "arg" and slot[1] == len(args):
        return [*args, value], kwargs
    return None


def check_handed_layouts(g: nx.DiGraph, info: StreamInfo, route: Route) -> None:
    """Refuse a route over blocks that hand on, besides the stream, a value computed from it
    with token counts on its dims but not laid out like the stream (the tokens on another
    dim, another count on the token dim, a second token dim as in ``[B, N, N]`` attention
    scores): the stream's selection, taken on the token dim, does not fit it."""
    lists = dict.fromkeys(b.list_path for b in info.blocks[route.start : route.end])
    for path in lists:
        first = next(b for b in info.blocks if b.list_path == path)
        family = family_slots(g, info, first)
        for slot, value in handed_values(info, path).items():
            dims = _token_dims(tensor_meta(value), info, first)
            if _misfit(dims, slot in family, info, first, value) and _from_stream(
                g, info, path, value
            ):
                _refuse_layout(route, first, slot, value, (dims, info.layout.token_dim))


def _token_dims(meta: TensorMeta | None, info: StreamInfo, first: BlockCall) -> list[int]:
    """The dims of ``meta`` (not its batch dim) with a token count of ``first``'s stream."""
    if meta is None:
        return []
    layout = info.layout
    tokens = first.stream_in.meta["tread_meta"].shape[layout.token_dim]
    counts = {tokens, tokens - layout.prefix, layout.routable}
    batch = layout.batch_dim if layout.batch_dim != NO_BATCH_DIM else None
    return [d for d, s in enumerate(meta.shape) if d != batch and s in counts]


def _misfit(dims: list[int], aligned: bool, info: StreamInfo, first: BlockCall, value) -> bool:
    """Token dims the stream's selection does not cover: a token count on another dim where
    the stream has none (a dim as wide as the stream's own there reads like it: features);
    for a slot not laid out like the stream, also its token dim ([B, N, N] scores)."""
    if not dims:
        return False
    stream, shape = first.stream_in.meta["tread_meta"].shape, value.meta["tread_meta"].shape
    token_dim = info.layout.token_dim
    others = [d for d in dims if d != token_dim]
    wider = any(d >= len(stream) or stream[d] != shape[d] for d in others)
    return wider or (not aligned and token_dim in dims)


def _from_stream(g: nx.DiGraph, info: StreamInfo, path: str, value: fx.Node) -> bool:
    """Whether the handed value is computed from the routed stream: from the model's main
    input in the first list, from the previous list's token outputs alone in a later one (a
    joint text stream handed on beside the image is not)."""
    n = info.list_paths.index(path)
    if n == 0:
        return fed_by(value, info.primary, like=True)  # a size read (`x[:b]`) is no data
    before = info.list_paths[n - 1]
    last = next(b for b in info.blocks if b.list_path == before)
    feeders = family_outputs(info, before, family_slots(g, info, last))
    return fed_only_by(value, feeders, info)


def _refuse_layout(route: Route, first: BlockCall, slot: tuple, value: fx.Node, where) -> None:
    dims, token_dim = where
    shape = list(value.meta["tread_meta"].shape)
    stream = list(first.stream_in.meta["tread_meta"].shape)
    name = f"argument {slot[1]}" if slot[0] == "arg" else f"{slot[1]}="
    raise TokenStreamError(
        f"route ({route.start}, {route.end}): the blocks of {first.list_path!r} hand on, "
        f"besides the token stream {stream}, a value computed from it in {name} with shape "
        f"{shape}: it has token counts on dim(s) {dims} but is not laid out like the stream "
        f"(its tokens on dim {token_dim} only), so the stream's selection does not fit it and "
        "the routed blocks would meet it with tokens they do not have. Have the blocks hand "
        "it on in the stream's layout, route blocks that hand on nothing else (blocks=), or "
        "end the route before them."
    )
