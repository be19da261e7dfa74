"""Thin routes reported: a default stack that holds under half the blocks the stream flows through.

A stack split over several lists (U-ViT's ``in_blocks`` / ``out_blocks`` with long skips)
may be taken only in part: where the stream's way into a later list is unclear, the stack
ends before it. Routes then span few of the blocks that carry the stream and save little,
without error. Counted here by data flow: a block list carries the stream if its blocks are
called once each, in order, and hand on a value fed by the main input; a module of the same
class as their blocks outside every list (U-ViT's mid block) counts as one block more.

Example:
    >>> # used by tread_fx.pipeline.build: note = thin_stack(traced, model, info, paths, None)
"""

from __future__ import annotations

from torch import nn

from tread_fx.errors import TreadFxError
from tread_fx.passes.locate.stacks import _stream_fed_by, _valid_sequence, block_calls
from tread_fx.passes.locate.stream import StreamInfo, locate
from tread_fx.passes.trace.tracer import TracedCall

__all__ = ["thin_stack"]


def thin_stack(
    traced: TracedCall,
    model: nn.Module,
    info: StreamInfo,
    list_paths: list[str],
    keep_prefix: int | None,
) -> str | None:
    """A warning when the located stack holds under half the blocks that carry the stream.

    Args:
        traced: The traced call.
        model: The model.
        info: The located stack and stream (chosen without ``blocks=``).
        list_paths: Every candidate block list.
        keep_prefix: The user's ``keep_prefix`` (to check the suggested ``blocks=``).

    Returns:
        The message (with the count and a ``blocks=`` that covers more), or ``None``.
    """
    calls = block_calls(traced, list_paths)
    carrying = [
        p
        for p, nodes in calls.items()
        if nodes and _valid_sequence(model, p, nodes) and _stream_fed_by(nodes, info.primary)
    ]
    loose = _loose_blocks(model, carrying, list_paths)
    total = sum(len(calls[p]) for p in carrying) + len(loose)
    if info.depth * 2 >= total:
        return None
    order = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
    carrying.sort(key=lambda p: order[calls[p][0]])
    try:
        wider = locate(traced, model, carrying, True, keep_prefix, info.primary)
        hint = f"pass blocks={carrying} to route() to span {wider.depth} blocks"
    except TreadFxError:
        others = [p for p in carrying if p not in info.list_paths]
        largest = max(others, key=lambda p: len(calls[p]), default=None)
        if largest is not None and len(calls[largest]) > info.depth:
            hint = (
                f"they do not form one stack that data flow can follow; pass "
                f"blocks={largest!r} ({len(calls[largest])} blocks) to route() to route those"
            )
        else:
            hint = (
                "no other blocks= spans more of them as one stack here (the data flow does "
                "not show how the stream passes from one list to the next)"
            )
    counts = ", ".join([*(f"{p}: {len(calls[p])}" for p in carrying), *(f"{p}: 1" for p in loose)])
    return (
        f"the routes span the block stack {' + '.join(info.list_paths)}, {info.depth} of the "
        f"{total} blocks the token stream flows through ({counts}), so they save less than "
        f"they could; {hint}."
    )


def _loose_blocks(model: nn.Module, carrying: list[str], list_paths: list[str]) -> list[str]:
    """Modules of a carrying list's block class that sit outside every block list (U-ViT's
    mid block): they carry the stream too, though no list holds them."""
    classes = {type(m) for p in carrying for m in model.get_submodule(p).children()}
    inside = tuple(f"{p}." for p in list_paths)
    return [
        path
        for path, module in model.named_modules()
        if path and type(module) in classes and not path.startswith(inside)
    ]
