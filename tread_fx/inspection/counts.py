"""FLOP formulas and the containers for op and FLOP counts (used by :mod:`.flops`).

Example:
    >>> import torch
    >>> from tread_fx.inspection.counts import flop_counter
    >>> with flop_counter() as counter:
    ...     _ = torch.randn(2, 3) @ torch.randn(3, 4)
    >>> counter.get_total_flops()  # 2 * 2 * 3 * 4
    48
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import (
    FlopCounterMode,
    conv_flop_count,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

__all__ = [
    "FLOP_FORMULAS",
    "flop_counter",
    "OpCounts",
    "Cost",
    "BlockCost",
    "GraphProfile",
    "add_op",
    "count_graph",
]

aten = torch.ops.aten


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation,
                        transposed, _output_padding, _groups, output_mask, out_shape=None,
                        **kwargs) -> int:  # fmt: skip
    flops = 0
    if output_mask[0]:  # grad_input: a transposed conv of grad_out with the same weight
        flops += conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[1]:  # grad_weight: one multiply-add per (output position, weight) pair
        flops += conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return flops


FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
    aten.convolution_backward: _conv_backward_flop,
}
"""FLOP formulas added to or corrected in ``torch.utils.flop_counter``.

The CPU flash-attention kernel has no formula there, and its convolution backward counts the
weight gradient of a grouped convolution ``groups`` times (a depthwise conv over ``C``
channels as if it were dense: Mamba's causal conv). Pass them to
``FlopCounterMode(custom_mapping=FLOP_FORMULAS)`` (or use :func:`flop_counter`) to count like
this module.
"""


def flop_counter(display: bool = False) -> FlopCounterMode:
    """The project's FLOP counter: ``FlopCounterMode`` with :data:`FLOP_FORMULAS` added.

    Count every FLOP figure with this one (benchmarks, tests, coverage): torch's stock counter
    has no formula for the CPU attention kernel, so it counts 0 FLOPs for
    ``F.scaled_dot_product_attention`` on CPU, and over-counts a grouped convolution's
    backward.

    Args:
        display: Print torch's per-module table when the counter exits.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> q = torch.randn(1, 2, 8, 4)  # [B, heads, tokens, head_dim]
        >>> with flop_counter() as counter:
        ...     _ = F.scaled_dot_product_attention(q, q, q)
        >>> counter.get_total_flops()  # 2 matmuls of 2 * 1 * 2 * 8 * 8 * 4 FLOPs
        2048
    """
    return FlopCounterMode(display=display, custom_mapping=FLOP_FORMULAS)


_FORMULAS = {**flop_registry, **{k: shape_wrapper(v) for k, v in FLOP_FORMULAS.items()}}


@dataclass
class OpCounts:
    """ATen ops (by name, e.g. ``aten.addmm.default``) and the FLOPs they do."""

    ops: Counter = field(default_factory=Counter)
    flops: int = 0

    def __add__(self, other: OpCounts) -> OpCounts:
        return OpCounts(self.ops + other.ops, self.flops + other.flops)

    def __sub__(self, other: OpCounts) -> OpCounts:
        return OpCounts(self.ops - other.ops, self.flops - other.flops)

    @property
    def num_ops(self) -> int:
        """Total number of ATen op calls."""
        return sum(self.ops.values())


@dataclass
class Cost:
    """Forward and backward counts of one piece of a graph."""

    forward: OpCounts
    backward: OpCounts

    @property
    def flops(self) -> int:
        """Forward + backward FLOPs (one training step)."""
        return self.forward.flops + self.backward.flops

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.forward + other.forward, self.backward + other.backward)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.forward - other.forward, self.backward - other.backward)


@dataclass
class BlockCost(Cost):
    """The cost of one block call, with its arguments' shapes and its forward ATen graph."""

    path: str = ""
    arg_shapes: tuple = ()
    aten_forward: fx.GraphModule | None = field(default=None, repr=False)


@dataclass
class GraphProfile:
    """Counts for a whole graph: total, per block call (in graph order), and the rest.

    Attributes:
        total: The whole graph.
        blocks: One entry per block call, in the order of ``block_paths``.
        outside: Everything but the blocks (embedding, head, routing ops).
        shapes: Shape of every tensor value by node name (tuples of shapes for tuples).
    """

    total: Cost
    blocks: list[BlockCost]
    outside: Cost
    shapes: dict[str, Any]


def add_op(counts: OpCounts, op: Any, args: Any, kwargs: dict, out: Any) -> None:
    """Add one ATen call ``op(*args, **kwargs) -> out`` (and its FLOPs) to ``counts``."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace == "prim":
        return
    counts.ops[str(op)] += 1
    formula = _FORMULAS.get(op.overloadpacket)
    if formula is not None:
        counts.flops += int(formula(*args, **kwargs, out_val=out))


def count_graph(graph: fx.Graph) -> OpCounts:
    """The ATen ops and FLOPs of an ATen graph whose nodes carry ``meta['val']``."""
    counts = OpCounts()
    for node in graph.nodes:
        if node.op == "call_function":
            args, kwargs = pytree.tree_map_only(
                fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)
            )
            add_op(counts, node.target, args, kwargs, node.meta.get("val"))
    return counts
