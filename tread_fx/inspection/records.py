"""The records an explanation is made of, and the JSON Schema of its dict form.

Op and FLOP counts (:class:`Cost`, filled by :mod:`tread_fx.inspection.flops`) and the records
:class:`tread_fx.inspection.report.Explanation` holds (routes, blocks, boundary values, FLOP
totals); :data:`SCHEMA` describes what its ``to_dict()`` returns.

Example:
    >>> from tread_fx.inspection.records import SideInput
    >>> SideInput("x", "in", (2, 16, 32), "x", ["x"], "gathered", "the stream").treatment
    'gathered'
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

__all__ = [
    "OpCounts",
    "Cost",
    "BlockCost",
    "GraphProfile",
    "RouteReport",
    "BlockReport",
    "SideInput",
    "InsertedNode",
    "FlopReport",
    "SCHEMA",
    "SCHEMA_VERSION",
]

SCHEMA_VERSION = "tread_fx.explain/1"
STATUSES = ("added", "removed", "rewired", "resized", "unchanged")  # of a node in the graph diff


@dataclass
class OpCounts:
    """ATen ops (by name, e.g. ``aten.addmm.default``) and the FLOPs they do."""

    ops: Counter = field(default_factory=Counter)
    flops: int = 0

    def __add__(self, other: OpCounts) -> OpCounts:
        return OpCounts(self.ops + other.ops, self.flops + other.flops)

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


@dataclass
class BlockCost(Cost):
    """The cost of one block call, with its forward ATen graph."""

    path: str = ""
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
    suffix: int  # trailing tokens never routed (text behind the image tokens)
    units: int
    keep_units: int
    inserted: list[InsertedNode]
    side_inputs: list[SideInput]
    region: list[str] = field(default_factory=list)


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


def _obj(required: dict[str, Any], nullable: bool = False) -> dict[str, Any]:
    return {
        "type": ["object", "null"] if nullable else "object",
        "required": list(required),
        "properties": required,
    }


def _arr(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


_NUM = {"type": "integer"}
_FLOAT = {"type": "number"}
_STR = {"type": "string"}
_SHAPE = {"type": ["array", "null"]}
_COST = _obj({"forward": _NUM, "backward": _NUM, "total": _NUM})
_TYPES = {"int": _NUM, "float": _FLOAT, "str": _STR, "Any": _SHAPE, "list[str]": _arr(_STR)}


def _record(cls: type, **special: Any) -> dict[str, Any]:
    """A record's dict form: its fields by their types, ``special`` ones as given (``None``:
    left out)."""
    types = {f.name: special.get(f.name, _TYPES.get(f.type)) for f in dataclasses.fields(cls)}
    return _obj({name: kind for name, kind in types.items() if kind is not None})


SCHEMA: dict[str, Any] = _obj(
    {
        "schema": {"const": SCHEMA_VERSION},
        "model": _STR,
        "stacks": _arr(_obj({"path": _STR, "class": _STR, "count": _NUM})),
        "candidates": _arr(_STR),
        "stream": _obj(
            {
                "shape": _arr(_NUM),
                "dtype": _STR,
                **dict.fromkeys(("batch_dim", "token_dim", "num_tokens", "prefix", "suffix"), _NUM),
                "grid": _SHAPE,
                "selection": _STR,
                "enters_at": _STR,
            }
        ),
        "routes": _arr(
            _record(
                RouteReport,
                inserted=_arr(
                    _record(InsertedNode, role={"enum": ["noise", "select", "gather", "scatter"]})
                ),
                side_inputs=_arr(_record(SideInput, direction={"enum": ["in", "out"]})),
                region=None,
            )
        ),
        "blocks": _arr(
            _obj(
                {
                    "index": _NUM,
                    "path": _STR,
                    "class": _STR,
                    "route": {"type": ["integer", "null"]},
                    "tokens": _obj({"original": _NUM, "routed": _NUM}),
                    "flops": _obj({"original": _COST, "routed": _COST}, nullable=True),
                    "aten_ops": _obj({"original": _NUM, "routed": _NUM}, nullable=True),
                }
            )
        ),
        "flops": _obj(
            {
                "original": _COST,
                "routed": _COST,
                "outside": _obj({"original": _COST, "routed": _COST}),
                "speedup": _FLOAT,
                "forward_speedup": _FLOAT,
                "aten_ops": _obj({"original": {"type": "object"}, "routed": {"type": "object"}}),
                "aten_delta": {"type": "object"},
            },
            nullable=True,
        ),
        "guards": _arr(_obj({"kind": _STR, "what": _STR, "value": _STR, "note": _STR})),
        "auto_leaves": {"type": "object"},
        "diff": _obj(
            {
                "counts": _obj(dict.fromkeys(STATUSES, _NUM)),
                "added": _arr({"type": "object"}),
                "removed": _arr(_STR),
                "rewired": _arr({"type": "object"}),
                "resized": _arr({"type": "object"}),
                "unchanged": _NUM,
            }
        ),
        "refusal": {"type": ["string", "null"]},
    }
)
"""JSON Schema of :meth:`Explanation.to_dict` (``tread_fx.explain/1``)."""
