"""Blocks that hand a list or tuple of streams on whole (several scales at once).

A multi-scale stack calls ``xs = block(xs)`` with ``xs`` a list of token streams: the value
handed from block to block is the container, not a tensor, so no argument slot of the next
block holds a stream. This pass rewrites each such hand-off into what a loop that unpacks
(``fine, coarse = block([fine, coarse])``) traces to: one ``getitem`` per element, passed on as
a list (or tuple) of those nodes. The stream slots are then ``("arg", i, j)`` into the block and
``("item", j)`` out of it, and the stream is chosen among the elements by data flow as for any
other candidate (:mod:`tread_fx.passes.locate.choice`). The program computes the same values.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from tread_fx.passes.trace.tracer import trace_call
    >>> class Both(nn.Module):
    ...     def forward(self, xs):
    ...         return [xs[0] + 1, xs[1] * 2]
    >>> class Model(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.blocks = nn.ModuleList(Both() for _ in range(2))
    ...     def forward(self, a, b):
    ...         xs = [a, b]
    ...         for block in self.blocks:
    ...             xs = block(xs)
    ...         return xs[0]
    >>> traced = trace_call(Model(), (torch.ones(1, 4, 2), torch.ones(1, 2, 2)), {},
    ...                     {"blocks.0", "blocks.1"})
    >>> calls = [n for n in traced.gm.graph.nodes if n.op == "call_module"]
    >>> unpack_handed_containers(traced.gm, calls)
    1
    >>> [item.args for item in calls[1].args[0]]
    [(model_blocks_0, 0), (model_blocks_0, 1)]
"""

from __future__ import annotations

import operator

import torch.fx as fx

from tread_fx.passes.trace.tracer import TensorMeta

__all__ = ["unpack_handed_containers"]


def unpack_handed_containers(gm: fx.GraphModule, calls: list[fx.Node]) -> int:
    """Pass each block's whole list/tuple result on to the next block as unpacked elements.

    Args:
        gm: The traced graph (changed in place).
        calls: The stack's block calls, in order.

    Returns:
        The number of hand-offs rewritten.
    """
    rewritten = 0
    for before, after in zip(calls, calls[1:]):
        meta = before.meta.get("tread_meta")
        is_container = isinstance(meta, (list, tuple)) and meta
        if not is_container or not all(isinstance(m, TensorMeta) for m in meta):
            continue
        if before not in after.args and before not in after.kwargs.values():
            continue
        with gm.graph.inserting_before(after):
            getitem = gm.graph.call_function
            items = [getitem(operator.getitem, (before, j)) for j in range(len(meta))]
        for item, item_meta in zip(items, meta):
            item.meta["tread_meta"] = item_meta
        unpacked = type(meta)(items)
        after.args = tuple(unpacked if a is before else a for a in after.args)
        after.kwargs = {k: unpacked if v is before else v for k, v in after.kwargs.items()}
        rewritten += 1
    return rewritten
