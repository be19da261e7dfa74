"""The text report and the JSON form of a :class:`tread_fx.inspection.explain.Explanation`.

Example:
    >>> import tread_fx
    >>> m = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> data = tread_fx.explain(m, [(1, 3)], flops=False).to_dict()
    >>> data["schema"], data["routes"][0]["kept_tokens"]
    ('tread_fx.explain/1', 8)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tread_fx.inspection.flops import Cost

if TYPE_CHECKING:
    from tread_fx.inspection.explanation import Explanation

__all__ = ["format_report", "to_dict", "SCHEMA", "Style"]

_NUM = {"type": "integer"}
_STR = {"type": "string"}
_SHAPE = {"type": ["array", "null"]}
_COST = {
    "type": "object",
    "required": ["forward", "backward", "total"],
    "properties": {"forward": _NUM, "backward": _NUM, "total": _NUM},
}


def _obj(required: dict[str, Any], nullable: bool = False) -> dict[str, Any]:
    return {
        "type": ["object", "null"] if nullable else "object",
        "required": list(required),
        "properties": required,
    }


def _arr(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


SCHEMA: dict[str, Any] = _obj(
    {
        "schema": {"const": "tread_fx.explain/1"},
        "model": _STR,
        "stacks": _arr(_obj({"path": _STR, "class": _STR, "count": _NUM})),
        "candidates": _arr(_STR),
        "stream": _obj(
            {
                "shape": _arr(_NUM),
                "dtype": _STR,
                "batch_dim": _NUM,
                "token_dim": _NUM,
                "num_tokens": _NUM,
                "prefix": _NUM,
                "suffix": _NUM,
                "grid": _SHAPE,
                "selection": _STR,
                "enters_at": _STR,
            }
        ),
        "routes": _arr(
            _obj(
                {
                    "index": _NUM,
                    "start": _NUM,
                    "end": _NUM,
                    "rate": {"type": "number"},
                    "num_tokens": _NUM,
                    "kept_tokens": _NUM,
                    "prefix": _NUM,
                    "suffix": _NUM,
                    "units": _NUM,
                    "keep_units": _NUM,
                    "inserted": _arr(
                        _obj(
                            {
                                "name": _STR,
                                "role": {"enum": ["noise", "select", "gather", "scatter"]},
                                "target": _STR,
                                "shape": _SHAPE,
                                "inputs": _arr(_STR),
                            }
                        )
                    ),
                    "side_inputs": _arr(
                        _obj(
                            {
                                "name": _STR,
                                "direction": {"enum": ["in", "out"]},
                                "shape": _SHAPE,
                                "source": _STR,
                                "received_as": _arr(_STR),
                                "treatment": _STR,
                                "reason": _STR,
                            }
                        )
                    ),
                }
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
                "speedup": {"type": "number"},
                "forward_speedup": {"type": "number"},
                "aten_ops": _obj({"original": {"type": "object"}, "routed": {"type": "object"}}),
                "aten_delta": {"type": "object"},
            },
            nullable=True,
        ),
        "guards": _arr(_obj({"kind": _STR, "what": _STR, "value": _STR, "note": _STR})),
        "auto_leaves": {"type": "object"},
        "diff": _obj(
            {
                "counts": _obj(
                    {k: _NUM for k in ("added", "removed", "rewired", "resized", "unchanged")}
                ),
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


# -- JSON ---------------------------------------------------------------------------------------


def _shape(shape: Any) -> Any:
    if isinstance(shape, tuple):
        return [_shape(s) for s in shape]
    return shape


def _cost(cost: Cost) -> dict[str, int]:
    return {"forward": cost.forward.flops, "backward": cost.backward.flops, "total": cost.flops}


def _block(block: Any) -> dict[str, Any]:
    costs = block.original is not None and block.routed is not None
    return {
        "index": block.index,
        "path": block.path,
        "class": block.cls,
        "route": block.route,
        "tokens": {"original": block.tokens_original, "routed": block.tokens_routed},
        "flops": {"original": _cost(block.original), "routed": _cost(block.routed)}
        if costs
        else None,
        "aten_ops": {
            "original": block.original.forward.num_ops,
            "routed": block.routed.forward.num_ops,
        }
        if costs
        else None,
    }


def _flops(report: Any) -> dict[str, Any] | None:
    if report is None:
        return None
    return {
        "original": _cost(report.original),
        "routed": _cost(report.routed),
        "outside": {
            "original": _cost(report.outside_original),
            "routed": _cost(report.outside_routed),
        },
        "speedup": report.speedup,
        "forward_speedup": report.forward_speedup,
        "aten_ops": {
            "original": dict(sorted(report.original.forward.ops.items())),
            "routed": dict(sorted(report.routed.forward.ops.items())),
        },
        "aten_delta": report.aten_delta(),
    }


def to_dict(exp: Explanation) -> dict[str, Any]:
    """The JSON-ready form of an explanation (validates against :data:`SCHEMA`)."""
    return {
        "schema": "tread_fx.explain/1",
        "model": exp.model,
        "stacks": exp.stacks,
        "candidates": exp.candidates,
        "stream": exp.stream,
        "routes": [
            {
                **{
                    k: getattr(r, k)
                    for k in (
                        "index",
                        "start",
                        "end",
                        "rate",
                        "num_tokens",
                        "kept_tokens",
                        "prefix",
                        "suffix",
                        "units",
                        "keep_units",
                    )
                },
                "inserted": [{**n.__dict__, "shape": _shape(n.shape)} for n in r.inserted],
                "side_inputs": [{**s.__dict__, "shape": _shape(s.shape)} for s in r.side_inputs],
            }
            for r in exp.routes
        ],
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

    CODES = {
        "bold": "1",
        "dim": "2",
        "red": "31",
        "green": "32",
        "yellow": "33",
        "blue": "34",
        "magenta": "35",
        "cyan": "36",
    }

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


def fmt_shape(shape: Any) -> str:
    """``[1, 256, 768]``, ``([..], [..])`` for tuples, ``-`` for Python values."""
    if isinstance(shape, tuple) and all(isinstance(s, int) for s in shape):
        return "[" + ", ".join(map(str, shape)) + "]"
    if isinstance(shape, tuple):
        return "(" + ", ".join(fmt_shape(s) for s in shape) + ")"
    return "-"


def fmt_flops(flops: int) -> str:
    """FLOPs with a unit: ``139.2 G``."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f} {unit}"
    return str(flops)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    import re

    plain = lambda s: re.sub(r"\033\[[0-9;]*m", "", s)
    widths = [max(len(plain(r[i])) for r in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(c + " " * (w - len(plain(c))) for c, w in zip(r, widths)).rstrip()
        for r in rows
    ]


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
        for n in r.inserted:
            rows.append(
                [
                    "",
                    s(n.name, "bold"),
                    s(n.role, _ROLE.get(n.role, "bold")),
                    fmt_shape(n.shape),
                    ", ".join(n.inputs),
                ]
            )
        lines += _table(rows, "    ")
        rows = [["side inputs", "name", "dir", "shape", "treatment", "why", "block arg"]]
        for v in r.side_inputs:
            rows.append(
                [
                    "",
                    v.name,
                    v.direction,
                    fmt_shape(v.shape),
                    s(v.treatment, _TREATMENT.get(v.treatment, "bold")),
                    v.reason,
                    ", ".join(v.received_as) or "-",
                ]
            )
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
            row += [
                fmt_flops(b.original.forward.flops),
                fmt_flops(b.routed.forward.flops),
                fmt_flops(b.original.flops),
                fmt_flops(b.routed.flops),
                f"{b.original.forward.num_ops} / {b.routed.forward.num_ops}",
            ]
        rows.append(row)
    if costs:
        f = exp.flops
        for name, a, b in (
            ("outside blocks", f.outside_original, f.outside_routed),
            ("total", f.original, f.routed),
        ):
            rows.append(
                [
                    "",
                    s(name, "bold"),
                    "",
                    "",
                    "",
                    fmt_flops(a.forward.flops),
                    fmt_flops(b.forward.flops),
                    fmt_flops(a.flops),
                    fmt_flops(b.flops),
                    f"{a.forward.num_ops} / {b.forward.num_ops}",
                ]
            )
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
    for st in exp.stacks:
        lines.append(f"  {st['path']}: {st['count']} x {st['class']}")
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
