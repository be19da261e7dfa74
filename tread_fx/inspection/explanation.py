"""What :func:`tread_fx.explain` returns: the explanation's records, and its report methods.

:class:`Explanation` holds the routes, blocks, boundary values, FLOP counts, guards and both
graphs; ``str()`` and :meth:`Explanation.to_json` render it through
:mod:`tread_fx.inspection.report`, which reads these records and never builds them.

Example:
    >>> from tread_fx.inspection.explanation import SideInput
    >>> SideInput("x", "in", (2, 16, 32), "x", ["x"], "gathered", "the stream").treatment
    'gathered'
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from tread_fx.config import RoutingConfig
from tread_fx.inspection.flops import Cost, GraphProfile
from tread_fx.inspection.graphdiff import GraphDiff
from tread_fx.inspection.guards import Guard
from tread_fx.inspection.report import format_report, to_dict

__all__ = [
    "Explanation",
    "RouteReport",
    "BlockReport",
    "SideInput",
    "InsertedNode",
    "FlopReport",
    "SCHEMA_VERSION",
]

SCHEMA_VERSION = "tread_fx.explain/1"


@dataclass
class SideInput:
    """A value crossing a route's boundary and how the rewrite treats it."""

    name: str
    direction: str  # "in" or "out"
    shape: Any
    source: str
    received_as: list[str]
    treatment: str  # gathered | scattered back | passed through | refused | adapted (fn)
    reason: str


@dataclass
class InsertedNode:
    """A node the rewrite added for a route."""

    name: str
    role: str
    target: str
    shape: Any
    inputs: list[str]


@dataclass
class RouteReport:
    """One route: its blocks, token counts, inserted nodes and boundary values."""

    index: int
    start: int
    end: int
    rate: float
    num_tokens: int
    kept_tokens: int
    prefix: int
    units: int
    keep_units: int
    inserted: list[InsertedNode]
    side_inputs: list[SideInput]
    region: list[str] = field(default_factory=list)
    suffix: int = 0  # trailing tokens never routed (text behind the image tokens)


@dataclass
class BlockReport:
    """One block call: token counts and costs in both graphs."""

    index: int
    path: str
    cls: str
    route: int | None
    tokens_original: int
    tokens_routed: int
    original: Cost | None = None
    routed: Cost | None = None
    node_original: str = ""
    node_routed: str = ""


@dataclass
class FlopReport:
    """Whole-graph costs, the part outside the blocks, and the predicted speed-up."""

    original: Cost
    routed: Cost
    outside_original: Cost
    outside_routed: Cost

    @property
    def speedup(self) -> float:
        """Original / routed FLOPs of one training step (forward + backward)."""
        return self.original.flops / max(self.routed.flops, 1)

    @property
    def forward_speedup(self) -> float:
        """Original / routed forward FLOPs."""
        return self.original.forward.flops / max(self.routed.forward.flops, 1)

    def aten_delta(self) -> dict[str, int]:
        """Forward ATen op counts routed minus original (inserted ops are positive)."""
        a, b = self.original.forward.ops, self.routed.forward.ops
        delta = {op: b.get(op, 0) - a.get(op, 0) for op in set(a) | set(b)}
        return {op: d for op, d in sorted(delta.items()) if d}


@dataclass
class Explanation:
    """The structured result of :func:`explain`; ``str()`` is the readable report."""

    model: str
    stacks: list[dict[str, Any]]
    candidates: list[str]
    stream: dict[str, Any]
    routes: list[RouteReport]
    blocks: list[BlockReport]
    flops: FlopReport | None
    guards: list[Guard]
    auto_leaves: dict[str, str]
    diff: GraphDiff
    refusal: str | None = None
    input_names: dict[str, str] = field(default_factory=dict)
    original_graph: fx.GraphModule | None = field(default=None, repr=False)
    routed_graph: fx.GraphModule | None = field(default=None, repr=False)
    profiles: tuple[GraphProfile, GraphProfile] | None = field(default=None, repr=False)
    config: RoutingConfig | None = field(default=None, repr=False)

    def report(self, color: bool = False) -> str:
        """The text report (ANSI-coloured when ``color``)."""
        return format_report(self, color=color)

    def __str__(self) -> str:
        return self.report(color=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (schema ``tread_fx.explain/1``, see ``report.SCHEMA``)."""
        return to_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The :meth:`to_dict` result as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)
