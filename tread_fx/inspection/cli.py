"""The ``tread-fx`` command: explain or diff the routing of a model from the shell.

Usage::

    tread-fx explain tread_fx.models:DiT_B_2 --routes 2:9 --rate 0.5
    tread-fx explain tread_fx.models:DiT_S_2 --kwargs '{"depth": 4}' --format html --out a.html
    tread-fx diff my_pkg.nets:make_model --input-shape 1,4,32,32 --format dot

MODEL is ``package.module:factory`` (``factory`` may be a dotted attribute path); the factory is
called with ``--model-kwargs`` (JSON). Without ``--routes`` the default route is explained
(:func:`tread_fx.routes.default_route`: start 2, end depth-4, scaled down below 12 blocks).
Example inputs come from ``--input-shape`` or from the model's attributes (see
:mod:`tread_fx.inspection.inputs`). Exit status: 0 on success, 1 when the model cannot be
explained (the message says why), 2 for bad command lines.

Example:
    >>> from tread_fx.inspection.cli import parse_route_specs
    >>> parse_route_specs(["2:9", "10:12:0.25"])
    [(2, 9), (10, 12, 0.25)]
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tread_fx.errors import (
    ExampleInputError,
    InvalidRouteError,
    ModelSpecError,
    TreadFxError,
    with_article,
)

__all__ = ["load_model", "parse_route_specs", "parse_shape", "run"]


def parse_route_specs(specs: Sequence[str]) -> list[tuple]:
    """Parse ``START:END`` or ``START:END:RATE`` items (also comma-separated in one string).

    Raises:
        InvalidRouteError: for anything else.
    """
    routes: list[tuple] = []
    for spec in specs:
        for item in filter(None, (s.strip() for s in spec.split(","))):
            parts = item.split(":")
            try:
                if len(parts) not in (2, 3):
                    raise ValueError
                route: tuple = (int(parts[0]), int(parts[1]), *map(float, parts[2:]))
            except ValueError:
                raise InvalidRouteError(
                    f"--routes {item!r} is not a route; write START:END or START:END:RATE with "
                    "integer block indices (half-open, negatives allowed), e.g. 2:9 or 2:-4:0.5."
                ) from None
            routes.append(route)
    return routes


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``1,4,32,32`` (or ``1x4x32x32``) into a shape tuple."""
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise ExampleInputError(
            f"--input-shape {text!r} is not a shape; give positive integers such as 1,4,32,32."
        )
    return shape


def _resolve(module: Any, path: str, spec: str) -> Any:
    obj = module
    for part in path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=4)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ModelSpecError(
                f"model {spec!r} was asked for, but {getattr(obj, '__name__', obj)!s} has no "
                f"attribute {part!r}.{hint} Give MODEL as package.module:factory."
            )
        obj = getattr(obj, part)
    return obj


def load_model(spec: str, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Import ``package.module:factory`` and call it with ``kwargs``.

    Raises:
        ModelSpecError: when the spec is malformed, cannot be imported, or is not a factory
            of ``nn.Module`` s.

    Example:
        >>> load_model("tread_fx.models:DiT_S_2", {"depth": 2, "input_size": 8}).__class__.__name__
        'DiT'
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ModelSpecError(
            f"MODEL {spec!r} is not of the form package.module:factory; e.g. "
            "tread_fx.models:DiT_B_2 or my_pkg.nets:make_model."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelSpecError(
            f"MODEL {spec!r}: module {module_name!r} cannot be imported ({err}); check the "
            "spelling and that its package is installed in this environment."
        ) from None
    factory = _resolve(module, attr, spec)
    if isinstance(factory, nn.Module):
        return factory
    if not callable(factory):
        raise ModelSpecError(
            f"MODEL {spec!r} names {with_article(type(factory).__name__)}, not a factory; give "
            "a class or function that returns an nn.Module."
        )
    try:
        model = factory(**(kwargs or {}))
    except TypeError as err:
        raise ModelSpecError(
            f"MODEL {spec!r} rejected the constructor arguments {kwargs or {}} ({err}); fix "
            "--model-kwargs."
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelSpecError(
            f"MODEL {spec!r} returned {with_article(type(model).__name__)}, not an nn.Module; "
            "point MODEL at a factory of the model."
        )
    return model


def _json_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ModelSpecError(
            f"--model-kwargs {text!r} is not valid JSON ({err.msg}); write an object such as "
            '\'{"depth": 4, "input_size": 8}\'.'
        ) from None
    if not isinstance(value, dict):
        raise ModelSpecError(f"--model-kwargs must be a JSON object, got {type(value).__name__}.")
    return value


def _use_color(choice: str, out: str | None) -> bool:
    if choice != "auto":
        return choice == "always"
    if out or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return sys.stdout.isatty()


def _render(exp: Any, args: argparse.Namespace) -> str:
    from tread_fx.inspection import render

    fmt = args.format
    if fmt == "text" and args.command == "explain":
        return exp.report(color=_use_color(args.color, args.out)) + "\n"
    if fmt == "text":
        routes = ", ".join(f"({r.start}, {r.end}, {r.rate})" for r in exp.routes)
        return f"tread_fx diff: {exp.model}, routes [{routes}]\n{exp.diff}\n"
    if fmt == "json":
        diff = {"schema": "tread_fx.diff/1", "model": exp.model, **exp.diff.to_dict()}
        return json.dumps(exp.to_dict() if args.command == "explain" else diff, indent=2) + "\n"
    return getattr(render, f"to_{fmt}")(exp, full=args.full)  # to_dot, to_svg, to_html


def _run(args: argparse.Namespace) -> str:
    from tread_fx.inspection.explain import explain
    from tread_fx.inspection.inputs import example_inputs

    say = _Progress(quiet=args.quiet)
    torch.manual_seed(args.seed)
    model = load_model(args.model, _json_kwargs(args.model_kwargs))
    shape = parse_shape(args.input_shape) if args.input_shape else None
    inputs = example_inputs(model, shape, batch=args.batch, seed=args.seed)
    routes = parse_route_specs(args.routes) if args.routes else None  # None: the default rule
    try:
        exp = explain(
            model,
            routes,
            args.rate,
            inputs,
            selection=args.selection,
            blocks=args.blocks,
            keep_prefix=args.keep_prefix,
            strict=not args.no_strict,
            flops=args.command == "explain" and not args.no_flops,
            progress=say,
        )
    except TreadFxError:
        raise
    except Exception as err:  # the model's own code failed on the example inputs
        if args.debug:
            raise
        raise ExampleInputError(
            f"{type(model).__name__} failed while being traced on inputs "
            f"{[tuple(t.shape) for t in inputs[0]]}: {type(err).__name__}: {err}. Check "
            "--input-shape / --model-kwargs, or rerun with --debug for the traceback."
        ) from None
    say(f"rendering {args.format}")
    text = _render(exp, args)
    say.done()
    return text


class _Progress:
    """Prints ``tread-fx: <stage>... (elapsed)`` to stderr, so a long trace is never silent."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.start = time.perf_counter()

    def __call__(self, line: str) -> None:
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(f"tread-fx: {line}... [{elapsed:.1f} s]", file=sys.stderr, flush=True)

    def done(self) -> None:
        if not self.quiet:
            total = time.perf_counter() - self.start
            print(f"tread-fx: done in {total:.1f} s", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Runs a command line parsed by :func:`tread_fx.cli.main`; returns the exit status."""
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        text = _run(args)
    except TreadFxError as err:
        if args.debug:
            raise
        print(f"tread-fx: error: {err}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"tread-fx: wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
