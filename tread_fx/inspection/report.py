"""What :func:`tread_fx.explain` returns: :class:`Explanation`, its text report and JSON form.

:class:`Explanation` holds the routes, blocks, boundary values, FLOP counts, guards and both
graphs (the records are in :mod:`tread_fx.inspection.records`); ``str()`` is the readable
report and :meth:`Explanation.to_dict` validates against :data:`SCHEMA`.

Example:
    >>> import tread_fx
    >>> m = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> data = tread_fx.explain(m, [(1, 3)], flops=False).to_dict()
    >>> data["schema"], data["routes"][0]["kept_tokens"]
    ('tread_fx.explain/1', 8)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from tread_fx.config import RoutingConfig
from tread_fx.inspection.graphdiff import GraphDiff, fmt_shape, json_shape
from tread_fx.inspection.guards import Guard
from tread_fx.inspection.records import (
    SCHEMA,
    SCHEMA_VERSION,
    BlockReport,
    Cost,
    FlopReport,
    GraphProfile,
    RouteReport,
    SideInput,
)

__all__ = [
    "Explanation",
    "format_report",
    "to_dict",
    "fmt_flops",
    "side_input_cells",
    "SCHEMA",
    "Style",
]


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
        """JSON-ready dict (schema ``tread_fx.explain/1``, see :data:`SCHEMA`)."""
        return to_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The :meth:`to_dict` result as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


# -- JSON ---------------------------------------------------------------------------------------


def _cost(cost: Cost) -> dict[str, int]:
    return {"forward": cost.forward.flops, "backward": cost.backward.flops, "total": cost.flops}


def _both(original: Any, routed: Any, how: Callable[[Any], Any] = _cost) -> dict[str, Any]:
    return {"original": how(original), "routed": how(routed)}


def _block(block: BlockReport) -> dict[str, Any]:
    costs = block.original is not None and block.routed is not None
    num_ops = lambda cost: cost.forward.num_ops
    return {
        "index": block.index,
        "path": block.path,
        "class": block.cls,
        "route": block.route,
        "tokens": {"original": block.tokens_original, "routed": block.tokens_routed},
        "flops": _both(block.original, block.routed) if costs else None,
        "aten_ops": _both(block.original, block.routed, num_ops) if costs else None,
    }


def _flops(report: FlopReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    ops = lambda cost: dict(sorted(cost.forward.ops.items()))
    return {
        **_both(report.original, report.routed),
        "outside": _both(report.outside_original, report.outside_routed),
        "speedup": report.speedup,
        "forward_speedup": report.forward_speedup,
        "aten_ops": _both(report.original, report.routed, ops),
        "aten_delta": report.aten_delta(),
    }


def _route(route: RouteReport) -> dict[str, Any]:
    lists = ("inserted", "side_inputs", "region")
    return {
        **{k: v for k, v in vars(route).items() if k not in lists},
        "inserted": [{**n.__dict__, "shape": json_shape(n.shape)} for n in route.inserted],
        "side_inputs": [{**v.__dict__, "shape": json_shape(v.shape)} for v in route.side_inputs],
    }


def to_dict(exp: Explanation) -> dict[str, Any]:
    """The JSON-ready form of an explanation (validates against :data:`SCHEMA`)."""
    return {
        "schema": SCHEMA_VERSION,
        "model": exp.model,
        "stacks": exp.stacks,
        "candidates": exp.candidates,
        "stream": exp.stream,
        "routes": [_route(r) for r in exp.routes],
        "blocks": [_block(b) for b in exp.blocks],
        "flops": _flops(exp.flops),
        "guards": [g.__dict__ for g in exp.guards],
        "auto_leaves": exp.auto_leaves,
        "diff": exp.diff.to_dict(),
        "refusal": exp.refusal,
    }


# -- text ---------------------------------------------------------------------------------------


class Style:
    """ANSI styling that becomes a no-op when colour is off."""

    COLORS = ("red", "green", "yellow", "blue", "magenta", "cyan")  # SGR codes 31..36
    CODES = {"bold": "1", "dim": "2", **{c: str(31 + i) for i, c in enumerate(COLORS)}}

    def __init__(self, color: bool) -> None:
        self.color = color

    def __call__(self, text: Any, *styles: str) -> str:
        if not self.color or not styles:
            return str(text)
        codes = ";".join(self.CODES[s] for s in styles)
        return f"\033[{codes}m{text}\033[0m"


_TREATMENT = {
    "gathered": "cyan",
    "scattered back": "magenta",
    "passed through": "dim",
    "refused": "red",
}
_ROLE = {"noise": "dim", "select": "yellow", "gather": "cyan", "scatter": "magenta"}


def fmt_flops(flops: int) -> str:
    """FLOPs with a unit: ``139.2 G``."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f} {unit}"
    return str(flops)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    plain = lambda s: re.sub(r"\033\[[0-9;]*m", "", s)
    widths = [max(len(plain(r[i])) for r in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(c + " " * (w - len(plain(c))) for c, w in zip(r, widths)).rstrip()
        for r in rows
    ]


def side_input_cells(value: SideInput, s: Style) -> list[str]:
    """A boundary value's cells: name, direction, shape, treatment, why, block argument."""
    return [
        value.name,
        value.direction,
        fmt_shape(value.shape),
        s(value.treatment, _TREATMENT.get(value.treatment, "bold")),
        value.reason,
        ", ".join(value.received_as) or "-",
    ]


def _cost_cells(a: Cost, b: Cost) -> list[str]:
    """Forward and forward + backward FLOPs of both graphs, then their forward ATen ops."""
    flops = (a.forward.flops, b.forward.flops, a.flops, b.flops)
    return [*map(fmt_flops, flops), f"{a.forward.num_ops} / {b.forward.num_ops}"]


def _choice_lines(choice: dict[str, Any] | None, s: Style) -> list[str]:
    """How the routed stream was chosen, with the option that picks another."""
    if not choice:
        return []
    lines = [f"  routed: {choice['chosen']}", f"  because: {choice['reason']}"]
    if len(choice["candidates"]) > 1:
        lines.append("  candidates: " + "; ".join(choice["candidates"]))
    if choice["guessed"]:
        lines.append(
            s("  (a rule chose among several streams; ", "yellow")
            + f"{choice['option']} keeps it, stream=<another argument> routes another)"
        )
    return lines


def _routes_section(exp: Explanation, s: Style) -> list[str]:
    lines = [s("Routes", "bold")]
    for r in exp.routes:
        head = (
            f"route {r.index}: blocks {r.start}..{r.end - 1} (start {r.start}, end {r.end}), "
            f"rate {r.rate}: {r.num_tokens} -> {r.kept_tokens} tokens"
        )
        lines.append("  " + s(head, "bold"))
        if r.prefix:
            lines.append(f"    {r.prefix} prefix token(s) always kept")
        if r.suffix:
            lines.append(
                f"    {r.suffix} suffix token(s) (tokens {r.num_tokens - r.suffix}.."
                f"{r.num_tokens - 1}, behind the image tokens) never routed, always kept"
            )
        lines.append(f"    selection keeps {r.keep_units} of {r.units} units")
        rows = [["inserted", "name", "role", "shape", "inputs"]]
        rows += [
            [
                "",
                s(n.name, "bold"),
                s(n.role, _ROLE.get(n.role, "bold")),
                fmt_shape(n.shape),
                ", ".join(n.inputs),
            ]
            for n in r.inserted
        ]
        lines += _table(rows, "    ")
        rows = [["side inputs", "name", "dir", "shape", "treatment", "why", "block arg"]]
        rows += [["", *side_input_cells(v, s)] for v in r.side_inputs]
        lines += _table(rows, "    ")
    return lines


def _blocks_section(exp: Explanation, s: Style) -> list[str]:
    costs = exp.flops is not None
    header = ["#", "block", "class", "tokens", "route"]
    if costs:
        header += ["fwd orig", "fwd routed", "fwd+bwd orig", "fwd+bwd routed", "ATen ops"]
    rows = [header]
    for b in exp.blocks:
        tokens = f"{b.tokens_original} -> {b.tokens_routed}"
        if b.tokens_routed != b.tokens_original:
            tokens = s(tokens, "cyan")
        row = [str(b.index), b.path, b.cls, tokens, "-" if b.route is None else str(b.route)]
        if costs and (b.original is None or b.routed is None):  # inlined: counted outside
            row += ["-"] * 5
        elif costs:
            row += _cost_cells(b.original, b.routed)
        rows.append(row)
    if costs:
        f = exp.flops
        for name, a, b in (
            ("outside blocks", f.outside_original, f.outside_routed),
            ("total", f.original, f.routed),
        ):
            rows.append(["", s(name, "bold"), "", "", "", *_cost_cells(a, b)])
    return [s("Blocks (tokens entering each block; FLOPs per call)", "bold"), *_table(rows)]


def _flops_section(exp: Explanation, s: Style) -> list[str]:
    f = exp.flops
    if f is None:
        return [s("FLOPs", "bold"), "  not counted (flops=False / --no-flops)"]
    speed = s(f"{f.speedup:.2f}x", "green", "bold")
    lines = [
        s("Predicted speed-up", "bold"),
        f"  {speed} per training step (forward + backward FLOPs "
        f"{fmt_flops(f.original.flops)} -> {fmt_flops(f.routed.flops)}), "
        f"forward alone {f.forward_speedup:.2f}x",
        "  (FLOPs of matmuls, convolutions and attention, torch.utils.flop_counter with "
        "tread_fx's CPU attention formula; memory-bound ops not included)",
        s("ATen ops added / removed by routing (forward)", "bold"),
    ]
    delta = f.aten_delta()
    items = [f"{d:+d} {op}" for op, d in sorted(delta.items(), key=lambda kv: (-kv[1], kv[0]))]
    wrapped = [""]
    for item in items:
        if wrapped[-1] and len(wrapped[-1]) + len(item) > 94:
            wrapped.append("")
        wrapped[-1] += (", " if wrapped[-1] else "") + item
    lines += ["  " + line for line in wrapped] if items else ["  none"]
    return lines


def format_report(exp: Explanation, color: bool = False) -> str:
    """The readable report of an explanation (see :func:`tread_fx.explain`)."""
    s = Style(color)
    routes = ", ".join(f"({r.start}, {r.end}, {r.rate})" for r in exp.routes)
    title = f"tread_fx.explain: {exp.model}, routes [{routes}]"
    lines = [s(title, "bold"), "=" * len(title)]
    if exp.refusal:
        lines += [
            s("route(strict=True) refuses this model:", "red", "bold"),
            "  " + exp.refusal,
            "  (the graph below is what strict=False would do)",
        ]
    lines.append(s("Block stack", "bold"))
    lines += [f"  {st['path']}: {st['count']} x {st['class']}" for st in exp.stacks]
    if exp.candidates:
        lines.append("  also considered: " + ", ".join(exp.candidates))
    st = exp.stream
    grid = f", grid {' x '.join(map(str, st['grid']))}" if st["grid"] else ""
    suffix = f", {st['suffix']} suffix token(s) kept" if st.get("suffix") else ""
    lines += [
        s("Token stream", "bold"),
        f"  {fmt_shape(tuple(st['shape']))} {st['dtype']} entering {st['enters_at']}; "
        + (
            "packed: no batch dim, token dim 0; selection per segment when the blocks receive "
            "segment boundaries"
            if st["batch_dim"] == -1
            else f"batch dim {st['batch_dim']}, token dim {st['token_dim']}"
        ),
        *([f"  batch dim: {st['batch_reason']}"] if st.get("batch_reason") else []),
        f"  {st['num_tokens']} tokens, {st['prefix']} prefix token(s) kept{suffix}{grid}; "
        f"selection '{st['selection']}'",
    ]
    lines += _choice_lines(st.get("choice"), s)
    if st.get("unit"):
        lines.append(f"  routed unit: {st['unit']}")
    if st.get("folded", 1) > 1:
        lines.append(
            f"  dim 0 folds {st['folded']} sequences per sample (frames or positions) into the "
            "batch: one selection shared by all rows, the same tokens in every folded sequence"
        )
    lines += _routes_section(exp, s) + _blocks_section(exp, s) + _flops_section(exp, s)
    lines += [s("Graph diff (networkx; matched by op, target, module path)", "bold")]
    lines += ["  " + line for line in str(exp.diff).splitlines()]
    lines += [s("Guards (specialisations fixed at trace time)", "bold")]
    lines += _table([[g.kind, g.what, "=", g.value, g.note] for g in exp.guards])
    if exp.auto_leaves:
        lines.append(s("Auto-leaves (traced as one call)", "bold"))
        lines += [f"  {path}: {why}" for path, why in exp.auto_leaves.items()]
    return "\n".join(lines)
