"""A small layered layout for data-flow DAGs, so the HTML view needs no Graphviz.

Nodes go on layers by longest path from the inputs (inputs and constants are pulled down next
to their first user); within a layer they are ordered by a few barycenter sweeps and placed as
close to their first input (the ``inputs`` node attribute, else the mean of all inputs) as
overlaps allow, so the token stream runs straight down. Good enough for model graphs, which
are a long chain (the token stream) with short side branches.

Example:
    >>> import networkx as nx
    >>> from tread_fx.inspection.layout import layered_layout
    >>> pos = layered_layout(nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c")]))
    >>> pos["a"][1] < pos["b"][1] < pos["c"][1]
    True
"""

from __future__ import annotations

import networkx as nx

__all__ = ["layered_layout", "spine_of", "NODE_W", "NODE_H", "GAP_X", "GAP_Y"]

NODE_W, NODE_H, GAP_X, GAP_Y = 190, 40, 40, 34


def _layers(g: nx.DiGraph) -> dict[str, int]:
    """Longest path from the inputs, then every node pulled down next to its first user."""
    layer: dict[str, int] = {}
    order = list(nx.topological_sort(g))
    for n in order:
        layer[n] = max((layer[p] + 1 for p in g.predecessors(n)), default=0)
    for n in reversed(order):
        if g.out_degree(n) > 0:
            layer[n] = min(layer[s] for s in g.successors(n)) - 1
    low = min(layer.values())
    return {n: v - low for n, v in layer.items()}


def _order(g: nx.DiGraph, rows: list[list[str]], sweeps: int = 4) -> None:
    index = {n: i for row in rows for i, n in enumerate(row)}

    def center(n: str, down: bool) -> float:
        near = list(g.predecessors(n) if down else g.successors(n))
        return sum(index[m] for m in near) / len(near) if near else index[n]

    for sweep in range(sweeps):
        down = sweep % 2 == 0
        for row in rows if down else reversed(rows):
            row.sort(key=lambda n, down=down: center(n, down))
            index.update({n: i for i, n in enumerate(row)})


def _keep_groups_apart(rows: list[list[str]], x: dict, layer: dict, groups: list[set]) -> None:
    """Shift non-members right of each group's box (innermost group first)."""
    step = NODE_W + GAP_X
    for members in groups:
        inside = [n for n in members if n in x]
        if not inside:
            continue
        right = max(x[n] for n in inside) + step
        top, bottom = min(layer[n] for n in inside), max(layer[n] for n in inside)
        for row in rows[top : bottom + 1]:
            placed = None
            for n in row:
                if n not in members:
                    x[n] = max(x[n], right, -1e9 if placed is None else placed + step)
                placed = x[n]


def spine_of(g: nx.DiGraph, source: str, target: str) -> list[str]:
    """The longest path from ``source`` to ``target`` (the main data flow), or ``[]``."""
    if source not in g or target not in g or not nx.has_path(g, source, target):
        return []
    between = (nx.descendants(g, source) | {source}) & (nx.ancestors(g, target) | {target})
    return nx.dag_longest_path(g.subgraph(between))


def layered_layout(
    g: nx.DiGraph,
    order_key: dict[str, int] | None = None,
    groups: list[set] | None = None,
    spine: list[str] | None = None,
) -> dict[str, tuple]:
    """Positions ``{node: (x, y)}`` (top-left corners, pixels) for a DAG.

    Args:
        g: The graph (acyclic).
        order_key: Initial order within layers (e.g. the fx node index); default: name.
        groups: Node sets drawn as boxes, innermost first (nested or disjoint); their members
            go left in each layer and other nodes are kept out of their boxes.
        spine: Nodes drawn as one straight column on the left (see :func:`spine_of`).

    Returns:
        Top-left corner of each node's ``NODE_W x NODE_H`` box.
    """
    if g.number_of_nodes() == 0:
        return {}
    groups = groups or []
    layer = _layers(g)
    depth = max(layer.values()) + 1
    rows: list[list[str]] = [[] for _ in range(depth)]
    key = order_key or {}
    for n in sorted(g, key=lambda n: (key.get(n, 0), n)):
        rows[layer[n]].append(n)
    _order(g, rows)
    on_spine = set(spine or ())
    rank = {n: next((i for i, grp in enumerate(groups) if n in grp), len(groups)) for n in g}
    rank.update({n: -1 for n in on_spine})
    for row in rows:
        row.sort(key=lambda n: rank[n])
    step = NODE_W + GAP_X
    x: dict[str, float] = {}
    for row in rows:
        placed = -step
        for n in row:
            first = [p for p in g.nodes[n].get("inputs", ()) if p in x]
            preds = [x[first[0]]] if first else [x[p] for p in g.predecessors(n) if p in x]
            want = sum(preds) / len(preds) if preds else placed + step
            x[n] = 0.0 if n in on_spine else max(want, placed + step, step if on_spine else 0)
            placed = x[n]
    _keep_groups_apart(rows, x, layer, groups)
    shift = min(x.values())
    return {n: (x[n] - shift, layer[n] * (NODE_H + GAP_Y)) for n in g}
