"""Structural diff of the original and the routed graph, with networkx.

Both fx graphs become ``networkx.DiGraph`` s whose nodes carry the op, the target, the module
path and the tensor shape. Nodes are matched by ``(op, target, module path)`` and their
order among nodes with the same key (the rewrite only inserts nodes, it never reorders).
Every node then gets a status:

- ``added``: only in the routed graph (the route's noise input, select, gathers, scatters);
- ``removed``: only in the original graph;
- ``rewired``: matched, but its inputs changed (e.g. block ``start`` now reads a gather);
- ``resized``: matched, same inputs, but its tensor shape changed (blocks inside a route);
- ``unchanged``: everything else.

Example:
    >>> import torch, tread_fx
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> x = (torch.randn(1, 1, 8, 8), torch.rand(1), torch.tensor([3]))
    >>> report = tread_fx.explain(model, [(1, 3)], 0.5, x, flops=False)
    >>> sorted({report.diff.status[n] for n in report.diff.added})
    ['added']
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch.fx as fx

from tread_fx.inspection.records import STATUSES
from tread_fx.passes.trace.tracer import MODEL_PREFIX, TensorMeta

__all__ = ["GraphDiff", "Rewire", "diff_graphs", "to_networkx", "node_key", "shape_of", "fmt_shape"]


@dataclass
class Rewire:
    """A matched node whose inputs changed (names in the routed graph)."""

    name: str
    before: list[str]
    after: list[str]


@dataclass
class GraphDiff:
    """The result of :func:`diff_graphs`.

    Attributes:
        original: networkx graph of the original fx graph (node = fx node name).
        routed: networkx graph of the routed fx graph.
        matches: Original node name -> routed node name.
        status: Routed node name -> status, plus ``removed`` original names.
        added: Routed nodes that the rewrite inserted (or that have no match).
        removed: Original nodes with no routed counterpart.
        rewired: Matched nodes whose inputs changed.
        resized: Matched nodes with the same inputs whose tensor shape changed.
        unchanged: Names of the remaining routed nodes.
    """

    original: nx.DiGraph
    routed: nx.DiGraph
    matches: dict[str, str]
    status: dict[str, str] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rewired: list[Rewire] = field(default_factory=list)
    resized: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Number of nodes per status."""
        return {status: len(getattr(self, status)) for status in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (node names, inputs and shapes)."""
        g = self.routed
        return {
            "counts": self.counts(),
            "added": [
                {
                    "name": n,
                    "role": g.nodes[n]["role"],
                    "target": g.nodes[n]["target"],
                    "shape": json_shape(g.nodes[n]["shape"]),
                    "inputs": list(g.nodes[n]["inputs"]),
                }
                for n in self.added
            ],
            "removed": list(self.removed),
            "rewired": [dict(vars(r)) for r in self.rewired],
            "resized": [
                {
                    "name": n,
                    "before": json_shape(self.original.nodes[o]["shape"]),
                    "after": json_shape(g.nodes[n]["shape"]),
                }
                for o, n in self.matches.items()
                if n in self.resized
            ],
            "unchanged": len(self.unchanged),
        }

    def __str__(self) -> str:
        lines = ["  ".join(f"{k} {v}" for k, v in self.counts().items())]
        g = self.routed
        for name in self.added:
            attrs = g.nodes[name]
            role = attrs["role"] or "new"
            inputs = f"  <- {', '.join(attrs['inputs'])}" if attrs["inputs"] else ""
            lines.append(f"+ {name:<24} {role:<8} {attrs['target']}{inputs}")
        for name in self.removed:
            lines.append(f"- {name:<24} {self.original.nodes[name]['target']}")
        for r in self.rewired:
            lines.append(f"~ {r.name:<24} inputs {', '.join(r.before)} -> {', '.join(r.after)}")
        back = {v: k for k, v in self.matches.items()}
        for name in self.resized:
            before = self.original.nodes[back[name]]["shape"]
            after = g.nodes[name]["shape"]
            lines.append(f"* {name:<24} {fmt_shape(before)} -> {fmt_shape(after)}")
        return "\n".join(lines)


def json_shape(shape: Any) -> Any:
    """A shape as JSON lists (tuples of shapes become lists of lists)."""
    return [json_shape(s) for s in shape] if isinstance(shape, tuple) else shape


def fmt_shape(shape: Any) -> str:
    """``[1, 256, 768]``, ``([..], [..])`` for tuples, ``-`` for Python values."""
    if isinstance(shape, tuple) and all(isinstance(s, int) for s in shape):
        return "[" + ", ".join(map(str, shape)) + "]"
    if isinstance(shape, tuple):
        return "(" + ", ".join(fmt_shape(s) for s in shape) + ")"
    return "-"


def target_name(node: fx.Node) -> str:
    """Readable target: module path, ``module.function`` or ``.method``."""
    if node.op in ("call_module", "get_attr"):
        return node.target.removeprefix(MODEL_PREFIX)
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_function":
        fn = node.target
        module = getattr(fn, "__module__", None) or ""
        if fn in vars(operator).values():
            module = "operator"
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        return f"{module}.{name}" if module and module != "builtins" else name
    return str(node.target)


def module_path(node: fx.Node) -> str:
    """The module a node belongs to (its own path for module calls, ``""`` at top level)."""
    if node.op == "call_module":
        return node.target.removeprefix(MODEL_PREFIX)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    last = list(stack)[-1] if isinstance(stack, dict) else stack[-1]
    return str(last).removeprefix(MODEL_PREFIX)


def node_key(node: fx.Node) -> tuple[str, str, str]:
    """The matching key of a node: ``(op, target, module path)``."""
    return node.op, target_name(node), module_path(node)


def shape_of(node: fx.Node, shapes: dict[str, Any] | None = None) -> Any:
    """Tensor shape of a node (a tuple, a tuple of shapes, or ``None`` for Python values)."""
    if shapes is not None and node.name in shapes:
        return shapes[node.name]
    meta = node.meta.get("tread_meta")
    if isinstance(meta, TensorMeta):
        return meta.shape
    if _holds_tensors(meta):
        return tuple(m.shape if isinstance(m, TensorMeta) else None for m in meta)
    return None


def _holds_tensors(meta: Any) -> bool:
    return isinstance(meta, (tuple, list)) and any(isinstance(m, TensorMeta) for m in meta)


def to_networkx(graph: fx.Graph, shapes: dict[str, Any] | None = None) -> nx.DiGraph:
    """Data-flow graph; node attributes ``op, cls, target, module, key, role, route, shape``.

    Edges go from each input to its user and carry the input's ``shape``.
    """
    g = nx.DiGraph()
    owner = graph.owning_module
    for index, node in enumerate(graph.nodes):
        cls = ""
        if node.op == "call_module" and owner is not None:
            cls = type(owner.get_submodule(node.target)).__name__
        g.add_node(
            node.name,
            index=index,
            op=node.op,
            cls=cls,
            target=target_name(node),
            module=module_path(node),
            key=node_key(node),
            role=node.meta.get("tread_role"),
            route=node.meta.get("tread_route"),
            shape=shape_of(node, shapes),
            python=_python_value(node),
            inputs=tuple(a.name for a in node.all_input_nodes),
        )
        for arg in node.all_input_nodes:
            g.add_edge(arg.name, node.name, shape=shape_of(arg, shapes))
    return g


def _python_value(node: fx.Node) -> bool:
    """True for nodes holding Python values (shapes, flags) rather than tensors."""
    if node.op in ("placeholder", "output") or node.meta.get("tread_role"):
        return False
    meta = node.meta.get("tread_meta")
    if isinstance(meta, TensorMeta) or _holds_tensors(meta):
        return False
    return node.op != "call_module" and not (node.op == "get_attr" and meta is None)


def _match(original: nx.DiGraph, routed: nx.DiGraph) -> dict[str, str]:
    by_key: dict[tuple, list[str]] = defaultdict(list)
    for name, attrs in sorted(routed.nodes(data=True), key=lambda item: item[1]["index"]):
        if not attrs["role"]:
            by_key[attrs["key"]].append(name)
    queues = {key: iter(names) for key, names in by_key.items()}  # matched in order, per key
    matches = {}
    for name, attrs in sorted(original.nodes(data=True), key=lambda item: item[1]["index"]):
        match = next(queues.get(attrs["key"], iter(())), None)
        if match is not None:
            matches[name] = match
    return matches


def diff_graphs(
    original: fx.Graph,
    routed: fx.Graph,
    original_shapes: dict[str, Any] | None = None,
    routed_shapes: dict[str, Any] | None = None,
) -> GraphDiff:
    """Diff two fx graphs structurally (see the module docstring).

    Args:
        original: The traced graph before the rewrite.
        routed: The rewritten graph.
        original_shapes: Shapes by node name (e.g. from a fake run); default: trace metadata.
        routed_shapes: Same for the routed graph (its metadata inside routes is pre-rewrite).
    """
    g_orig, g_routed = to_networkx(original, original_shapes), to_networkx(routed, routed_shapes)
    matches = _match(g_orig, g_routed)
    diff = GraphDiff(g_orig, g_routed, matches)
    matched = set(matches.values())
    for name in sorted(g_routed, key=lambda n: g_routed.nodes[n]["index"]):
        if name not in matched:
            diff.added.append(name)
            diff.status[name] = "added"
    for name in sorted(g_orig, key=lambda n: g_orig.nodes[n]["index"]):
        if name not in matches:
            diff.removed.append(name)
            diff.status[name] = "removed"
            continue
        new = matches[name]
        before = [matches.get(a, a) for a in g_orig.nodes[name]["inputs"]]
        after = list(g_routed.nodes[new]["inputs"])
        resized = g_orig.nodes[name]["shape"] != g_routed.nodes[new]["shape"]
        if before != after:
            diff.rewired.append(Rewire(new, before, after))
            diff.status[new] = "rewired"
        elif resized:
            diff.resized.append(new)
            diff.status[new] = "resized"
        else:
            diff.unchanged.append(new)
            diff.status[new] = "unchanged"
    for name in g_routed:
        g_routed.nodes[name]["status"] = diff.status.get(name, "unchanged")
    for name in g_orig:  # an original node shows its match's status
        g_orig.nodes[name]["status"] = diff.status.get(matches.get(name, name), "unchanged")
    return diff
