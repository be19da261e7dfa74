"""Uses of side values by module calls inside routed blocks that are no block of the stack.

A stack member may be a list of sub-blocks called in turn (``ModuleList([norm, attention,
residual])``, ``for attn, ff in self.layers``): the member's first call stands for the
block, and its other calls are separate module calls inside the routed region. A value the
model hands to one of them (a rotary table given to the attention, not to the norm) enters
the region there, so its use is decided there: each such call is traced through like a
block (:func:`tread_fx.passes.plan.uses.call_uses`), its inputs computed inside the region
carrying the stream.

Only calls that see the stream in its own layout are traced through: an input computed inside
the region holds the routed tokens on the token dim and the stream's batch rows on the batch
dim. A call that receives a folded form of the stream (the temporal blocks of a factorised
video model, run on ``[B * N, F, C]`` between routed spatial blocks on ``[B * F, N, C]``)
is left out: its inputs' token dim holds other units, so a use found there says nothing about
the routed tokens, and what enters there is decided by the data-flow rules alone
(``tokens-folded-into-batch`` for the per-position modulation ``[B * N, 3 C]``).

Example:
    >>> # used by tread_fx.passes.plan.route_plan.plan_route; see tests/test_rotary_tuple.py
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from tread_fx.adapters.values import NO_BATCH_DIM, TensorMeta
from tread_fx.passes.plan.uses import BlockUses, call_uses

__all__ = ["inner_call_uses"]


def inner_call_uses(
    gm: fx.GraphModule, region: set[fx.Node], blocks: set[fx.Node], layout: Any, token_dim: int
) -> dict[fx.Node, BlockUses | None]:
    """Per module call in ``region`` that is no block call and receives a value from outside
    the region, the uses it makes of its inputs (``None``: it cannot be traced through).

    Args:
        gm: The model's traced graph (module calls still single nodes with example inputs).
        region: The route's region.
        blocks: The block call nodes of the stack (their uses are found per block).
        layout: The stream layout (its token counts).
        token_dim: The stream's token dim.

    Returns:
        Per such call node, its :class:`~tread_fx.passes.plan.uses.BlockUses` or ``None``.
    """
    tokens = layout.token_counts
    found: dict[fx.Node, BlockUses | None] = {}
    for node in region:
        if node.op != "call_module" or node in blocks:
            continue
        inputs = node.all_input_nodes
        if all(a in region for a in inputs):
            continue  # nothing enters the region here
        stream = {a for a in inputs if a in region and _in_stream_layout(a, layout, tokens)}
        if not stream:
            continue  # a folded form of the stream (or no tensor of it): data-flow rules decide
        found[node] = call_uses(gm, node, stream, tokens, token_dim)
    return found


def _in_stream_layout(node: fx.Node, layout: Any, tokens: set[int]) -> bool:
    """Whether ``node`` is a tensor laid out like the stream: the routed tokens on the token
    dim, the stream's batch rows on the batch dim (not ``[B * N, F, C]`` for ``[B * F, N, C]``)."""
    meta = node.meta.get("tread_meta")
    if not isinstance(meta, TensorMeta):
        return False
    shape, token_dim, batch_dim = meta.shape, layout.token_dim, layout.batch_dim
    if token_dim >= len(shape) or shape[token_dim] not in tokens:
        return False
    return batch_dim == NO_BATCH_DIM or (
        batch_dim < len(shape) and shape[batch_dim] == layout.batch_size
    )
