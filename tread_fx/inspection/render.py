"""Pictures of an explanation: Graphviz DOT text, SVG (through ``dot``) and one HTML page.

Both graphs are drawn side by side: the original and the routed one. The block stack is a
grouped box, each route's region a box inside it, inserted nodes (noise, select, gather,
scatter) are highlighted, rewired and resized nodes tinted, and edges carry tensor shapes.
Nodes holding Python values (shape arithmetic) are hidden unless ``full=True``.

DOT is plain text (no binary needed); SVG needs Graphviz's ``dot``; the HTML page lays the
graphs out itself (:func:`layered_layout`) and is one self-contained file.

Example:
    >>> import tread_fx
    >>> from tread_fx.inspection.render import to_dot
    >>> m = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> to_dot(tread_fx.explain(m, [(1, 3)], flops=False)).startswith("digraph")
    True
"""

from __future__ import annotations

import html
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from tread_fx.errors import GraphvizNotFoundError
from tread_fx.inspection.graphdiff import fmt_shape
from tread_fx.inspection.report import Explanation, Style, fmt_flops, side_input_cells

__all__ = ["to_dot", "to_svg", "to_html", "graph_views", "GraphView", "layered_layout", "spine_of"]

FILL = {
    "noise": "#e0e0e0",
    "select": "#ffe082",
    "gather": "#81d4fa",
    "scatter": "#e1bee7",
    "rewired": "#ffe0b2",
    "resized": "#e3f2fd",
    "removed": "#eeeeee",
    "unchanged": "#ffffff",
    "added": "#c8e6c9",
}


@dataclass
class Group:
    """A box around nodes: the block stack or one route's region."""

    id: str
    label: str
    members: set[str]
    parent: str | None = None
    kind: str = "stack"


@dataclass
class GraphView:
    """One side of the picture: visible nodes, their labels and classes, and groups."""

    name: str
    graph: nx.DiGraph
    labels: dict[str, list[str]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)


def _shape_label(shape: Any) -> str:
    return fmt_shape(shape) if shape is not None else ""


def _label(attrs: dict, name: str, inputs: dict[str, str]) -> list[str]:
    op = attrs["op"]
    if op == "placeholder":
        first = inputs.get(name, name)
    elif op == "call_module":
        first = f"{attrs['target']} ({attrs['cls']})" if attrs["cls"] else attrs["target"]
    elif op == "call_function":
        first = attrs["target"].rsplit(".", 1)[-1]
    else:
        first = attrs["target"] if op in ("call_method", "get_attr") else op
    second = _shape_label(attrs["shape"])
    return [first, f"{name}  {second}".strip() if first != name else second]


def _view(exp: Explanation, which: str, full: bool) -> GraphView:
    diff = exp.diff
    g = diff.routed if which == "routed" else diff.original
    g = g.subgraph([n for n, a in g.nodes(data=True) if full or not a["python"]]).copy()
    view = GraphView(which, g)
    for name, attrs in g.nodes(data=True):
        view.labels[name] = _label(attrs, name, exp.input_names)
        view.kinds[name] = attrs["role"] or attrs.get("status", "unchanged")
    back = {v: k for k, v in diff.matches.items()}
    as_here = (lambda n: n) if which == "routed" else (lambda n: back.get(n))
    block_names = [b.node_routed if which == "routed" else b.node_original for b in exp.blocks]
    index = nx.get_node_attributes(g, "index")
    ranks = [index[n] for n in block_names if n in index]
    stack_id = f"{which}_stack"
    members = {n for n, i in index.items() if ranks and min(ranks) <= i <= max(ranks)}
    for r in exp.routes:
        boundary = {n.name for n in r.inserted if n.role in ("gather", "scatter")}
        names = {as_here(n) for n in r.region} | boundary
        names = {n for n in names if n in g}
        if which == "routed":
            label = (
                f"route {r.index}: blocks {r.start}..{r.end - 1} on {r.kept_tokens} of "
                f"{r.num_tokens} tokens"
            )
        else:
            label = f"route {r.index} region (all {r.num_tokens} tokens here)"
        view.groups.append(Group(f"{which}_route{r.index}", label, names, stack_id, "route"))
        members |= names
    stacks = " + ".join(f"{s['path']}: {s['count']} x {s['class']}" for s in exp.stacks)
    view.groups.insert(0, Group(stack_id, stacks, members))
    return view


def graph_views(exp: Explanation, full: bool = False) -> tuple[GraphView, GraphView]:
    """The original and routed :class:`GraphView` of an explanation."""
    return _view(exp, "original", full), _view(exp, "routed", full)


# -- DOT / SVG ----------------------------------------------------------------------------------


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_node(view: GraphView, name: str) -> str:
    kind = view.kinds[name]
    style = "rounded,filled,bold" if view.graph.nodes[name]["role"] else "rounded,filled"
    if kind == "removed":
        style += ",dashed"
    label = "\n".join(line for line in view.labels[name] if line)
    attrs = {
        "label": label,
        "fillcolor": FILL.get(kind, "#ffffff"),
        "style": style,
        "tooltip": f"{name}: {kind}",
        "class": f"node-{kind}",
    }
    body = ", ".join(f"{k}={_q(v)}" for k, v in attrs.items())
    return f"{_q(view.name + ':' + name)} [{body}];"


def _dot_side(view: GraphView, lines: list[str]) -> None:
    placed: set[str] = set()

    def emit(group: Group, indent: str) -> None:
        fill = "#f5f5f5" if group.kind == "stack" else "#e8f4fd"
        style = "rounded,filled" if view.name == "routed" or group.kind == "stack" else "dashed"
        lines.append(f"{indent}subgraph {_q('cluster_' + group.id)} {{")
        lines.append(f"{indent}  label={_q(group.label)}; style={_q(style)}; fillcolor={_q(fill)};")
        for child in view.groups:
            if child.parent == group.id:
                emit(child, indent + "  ")
        for name in sorted(group.members - placed, key=lambda n: view.graph.nodes[n]["index"]):
            lines.append(f"{indent}  {_dot_node(view, name)}")
            placed.add(name)
        lines.append(f"{indent}}}")

    lines.append(f"  subgraph {_q('cluster_' + view.name)} {{")
    lines.append(f'    label={_q(view.name)}; fontsize=16; style=rounded; color="#cccccc";')
    for group in view.groups:
        if group.parent is None:
            emit(group, "    ")
    for name in sorted(view.graph, key=lambda n: view.graph.nodes[n]["index"]):
        if name not in placed:
            lines.append(f"    {_dot_node(view, name)}")
    lines.append("  }")
    for a, b, attrs in view.graph.edges(data=True):
        shape = _shape_label(attrs["shape"])
        lines.append(
            f"  {_q(view.name + ':' + a)} -> {_q(view.name + ':' + b)} [label={_q(shape)}];"
        )


def to_dot(exp: Explanation, full: bool = False) -> str:
    """Graphviz DOT text of the original and routed graphs side by side."""
    lines = [
        "digraph tread_fx {",
        '  graph [rankdir=TB, fontname="Helvetica", newrank=true, nodesep=0.25, ranksep=0.3];',
        '  node [shape=box, fontname="Helvetica", fontsize=10, margin="0.1,0.04"];',
        '  edge [fontname="Helvetica", fontsize=8, color="#777777", fontcolor="#555555"];',
    ]
    for view in graph_views(exp, full):
        _dot_side(view, lines)
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_svg(exp: Explanation, full: bool = False, dot_binary: str = "dot") -> str:
    """SVG of :func:`to_dot`, rendered by Graphviz's ``dot``.

    Raises:
        GraphvizNotFoundError: when ``dot`` is not installed.
    """
    path = shutil.which(dot_binary)
    if path is None:
        raise GraphvizNotFoundError(
            f"SVG output was asked for, but Graphviz's '{dot_binary}' program is not on PATH. "
            "Install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install "
            "graphviz), or use --format dot (text, no binary) or --format html (self-contained)."
        )
    result = subprocess.run(
        [path, "-Tsvg"],
        input=to_dot(exp, full),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise GraphvizNotFoundError(
            f"Graphviz's dot failed (exit {result.returncode}): {result.stderr.strip()[:500]}; "
            "use --format dot to inspect the text it was given."
        )
    return result.stdout


# -- HTML: a layered layout (no Graphviz), each side as SVG, one page ---------------------------

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
    """Positions ``{node: (x, y)}`` (top-left corner of a ``NODE_W x NODE_H`` box) for a DAG.

    Nodes go on layers by longest path from the inputs, are ordered by barycenter sweeps and
    placed under their first input (the ``inputs`` attribute), so the stream runs straight down.

    Args:
        g: The graph (acyclic).
        order_key: Initial order within layers (e.g. the fx node index); default: name.
        groups: Node sets drawn as boxes, innermost first (nested or disjoint); their members
            go left in each layer and other nodes are kept out of their boxes.
        spine: Nodes drawn as one straight column on the left (see :func:`spine_of`).

    Example:
        >>> pos = layered_layout(nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c")]))
        >>> pos["a"][1] < pos["b"][1] < pos["c"][1]
        True
    """
    if g.number_of_nodes() == 0:
        return {}
    groups = groups or []
    layer = _layers(g)
    rows: list[list[str]] = [[] for _ in range(max(layer.values()) + 1)]
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


def _svg_side(view: GraphView) -> str:
    g = view.graph
    inner_first = [grp.members for grp in sorted(view.groups, key=lambda grp: not grp.parent)]
    by_index = sorted(g, key=lambda n: g.nodes[n]["index"])
    sources = [n for n in by_index if g.nodes[n]["op"] == "placeholder"]
    spine = spine_of(g, sources[0], by_index[-1]) if sources else []
    pos = layered_layout(g, nx.get_node_attributes(g, "index"), inner_first, spine)
    pad, depth = 40, {grp.id: 0 for grp in view.groups}
    for grp in view.groups:
        depth[grp.id] = depth.get(grp.parent, -1) + 1 if grp.parent else 0
    width = max((x for x, _ in pos.values()), default=0) + NODE_W + 2 * pad + 40
    height = max((y for _, y in pos.values()), default=0) + NODE_H + 2 * pad + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" class="graph" id="svg-{view.name}">'
    ]
    for grp in view.groups:
        boxes = [pos[n] for n in grp.members if n in pos]
        if not boxes:
            continue
        margin = 14 - 6 * depth[grp.id]
        label_room = 16 * (1 + max(depth.values()) - depth[grp.id])
        x0 = min(x for x, _ in boxes) + pad + 20 - margin
        y0 = min(y for _, y in boxes) + pad + 20 - margin - label_room
        x1 = max(x for x, _ in boxes) + pad + 20 + NODE_W + margin
        y1 = max(y for _, y in boxes) + pad + 20 + NODE_H + margin
        out.append(
            f'<g class="group {grp.kind}" id="{view.name}-{grp.id}">'
            f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" rx="10"/>'
            f'<text x="{x0 + 8}" y="{y0 + 13}">{html.escape(grp.label)}</text></g>'
        )
    for a, b, attrs in g.edges(data=True):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        x1, y1 = xa + pad + 20 + NODE_W / 2, ya + pad + 20 + NODE_H
        x2, y2 = xb + pad + 20 + NODE_W / 2, yb + pad + 20
        mid = (y1 + y2) / 2
        shape = _shape_label(attrs["shape"])
        out.append(
            f'<g class="edge"><path d="M{x1},{y1} C{x1},{mid} {x2},{mid} {x2},{y2 - 4}" '
            f'marker-end="url(#arrow)"/><text x="{x1 + 6}" y="{y1 + 12}">'
            f"{html.escape(shape)}</text></g>"
        )
    for name in sorted(g, key=lambda n: g.nodes[n]["index"]):
        x, y = pos[name][0] + pad + 20, pos[name][1] + pad + 20
        kind, role = view.kinds[name], g.nodes[name]["role"]
        classes = f"node {kind}" + (" inserted" if role else "")
        first, second = (html.escape(t) for t in view.labels[name])
        tip = html.escape(f"{name}: {g.nodes[name]['op']} {g.nodes[name]['target']} [{kind}]")
        out.append(
            f'<g class="{classes}" id="{view.name}-{html.escape(name)}" '
            f'data-name="{html.escape(name)}" data-role="{role or ""}" data-status="{kind}">'
            f"<title>{tip}</title>"
            f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="6" '
            f'fill="{FILL.get(kind, "#fff")}"/>'
            f'<text x="{x + 8}" y="{y + 16}" class="l1">{first[:30]}</text>'
            f'<text x="{x + 8}" y="{y + 32}" class="l2">{second[:34]}</text></g>'
        )
    out.append(
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#888"/>'
        "</marker></defs></svg>"
    )
    return "\n".join(out)


_CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:16px;color:#222}
h1{font-size:20px;margin:0 0 8px} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;font-size:12px;margin-bottom:6px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left} th{background:#f3f3f3}
.num{text-align:right;font-variant-numeric:tabular-nums} .speedup{font-size:18px;color:#1b5e20}
.panels{display:flex;gap:16px;align-items:flex-start}
.panel{flex:1;min-width:0;border:1px solid #ccc;border-radius:6px;overflow:auto;max-height:90vh}
.panel svg{display:block;max-width:100%;height:auto}
.panel h2{margin:6px 10px}
svg text{font-size:11px} .l1{font-weight:bold} .l2{fill:#555;font-size:10px}
.node rect{stroke:#888;stroke-width:1} .node.inserted rect{stroke:#d84315;stroke-width:3}
.node.rewired rect{stroke:#ef6c00;stroke-width:2} .node.removed rect{stroke-dasharray:4 3}
.edge path{fill:none;stroke:#999;stroke-width:1.2}
.edge text{font-size:9px;fill:#666;paint-order:stroke;stroke:#fff;stroke-width:3px}
.group rect{fill:#f6f6f6;stroke:#bbb} .group.route rect{fill:#e3f2fd;stroke:#64b5f6}
.group text{font-size:11px;fill:#555;font-style:italic}
.legend span{display:inline-block;padding:2px 8px;margin-right:6px;border:1px solid #999;
border-radius:4px;font-size:12px}
.refusal{color:#b71c1c;font-weight:bold}
"""


def _rows(cells: list[list[str]], header: bool = True) -> str:
    out = []
    for i, row in enumerate(cells):
        tag = "th" if header and i == 0 else "td"
        out.append("<tr>" + "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in row) + "</tr>")
    return "<table>" + "".join(out) + "</table>"


def _summary(exp: Explanation) -> str:
    st = exp.stream
    parts = [f"<h1>tread_fx.explain: {html.escape(exp.model)}</h1>"]
    if exp.refusal:
        parts.append(
            f'<p class="refusal">route(strict=True) refuses: {html.escape(exp.refusal)}</p>'
        )
    rows = [
        ["block stack", "; ".join(f"{s['path']}: {s['count']} x {s['class']}" for s in exp.stacks)],
        [
            "token stream",
            f"{fmt_shape(tuple(st['shape']))} {st['dtype']}, token dim "
            f"{st['token_dim']}, {st['num_tokens']} tokens, prefix {st['prefix']}"
            + (f", suffix {st['suffix']}" if st.get("suffix") else ""),
        ],
    ]
    rows += [
        [
            f"route {r.index}",
            f"blocks {r.start}..{r.end - 1}, rate {r.rate}: {r.num_tokens} -> "
            f"{r.kept_tokens} tokens",
        ]
        for r in exp.routes
    ]
    if exp.flops is not None:
        f = exp.flops
        flops = f"{fmt_flops(f.original.flops)} -> {fmt_flops(f.routed.flops)}"
        rows.append(["FLOPs fwd+bwd", flops])
        rows.append(["predicted speed-up", f"{f.speedup:.2f}x (forward {f.forward_speedup:.2f}x)"])
    rows.append(["graph diff", ", ".join(f"{k} {v}" for k, v in exp.diff.counts().items())])
    parts.append(_rows(rows, header=False))
    side = [["route", "value", "dir", "shape", "treatment", "why", "block arg"]]
    plain = Style(color=False)
    side += [[r.index, *side_input_cells(v, plain)] for r in exp.routes for v in r.side_inputs]
    parts += ["<h2>Values crossing route boundaries</h2>", _rows(side)]
    blocks = [["#", "block", "tokens", "route", "fwd+bwd original", "fwd+bwd routed"]]
    for b in exp.blocks:
        costs = (
            (fmt_flops(b.original.flops), fmt_flops(b.routed.flops)) if b.original else ("-", "-")
        )
        tokens = f"{b.tokens_original} -> {b.tokens_routed}"
        blocks.append([b.index, b.path, tokens, "-" if b.route is None else b.route, *costs])
    parts += ["<h2>Blocks</h2>", _rows(blocks)]
    legend = "".join(
        f'<span style="background:{FILL[k]}">{k}</span>'
        for k in ("noise", "select", "gather", "scatter", "rewired", "resized", "unchanged")
    )
    parts.append(f'<h2>Graphs</h2><div class="legend">{legend}</div>')
    return "\n".join(parts)


def to_html(exp: Explanation, full: bool = False) -> str:
    """One self-contained HTML page: summary tables, then both graphs side by side."""
    original, routed = graph_views(exp, full)
    panels = "".join(
        f'<div class="panel" id="panel-{v.name}"><h2>{v.name}</h2>{_svg_side(v)}</div>'
        for v in (original, routed)
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>tread_fx.explain: {html.escape(exp.model)}</title><style>{_CSS}</style>"
        f'</head><body>{_summary(exp)}<div class="panels">{panels}</div></body></html>\n'
    )
