"""The ``tread-fx`` command line: parsed before anything heavy is imported.

``tread-fx --help`` and bad command lines answer without importing torch; a command that runs
imports :func:`tread_fx.inspection.cli.run`, which explains or diffs the model (it never
imports this module back). Usage and exit statuses: :mod:`tread_fx.inspection.cli`.

Example:
    >>> build_parser().parse_args(["explain", "tread_fx.models:DiT_S_2"]).routes is None
    True
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["FORMATS", "build_parser", "main"]

FORMATS = ("text", "json", "dot", "svg", "html")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tread-fx``."""
    parser = argparse.ArgumentParser(
        prog="tread-fx", description="Inspect TREAD token routing of a diffusion backbone."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("explain", "full report: stacks, stream, routes, FLOPs, guards"),
        ("diff", "structural diff of the original and routed graphs"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("model", metavar="MODEL", help="package.module:factory")
        p.add_argument(
            "--routes",
            action="append",
            metavar="START:END[:RATE]",
            help="route(s), comma-separated or repeated (default: start 2, end depth-4, "
            "scaled down below 12 blocks; docs/options.md)",
        )
        p.add_argument("--rate", type=float, default=0.5, help="fraction routed around (0.5)")
        p.add_argument("--selection", default="random", choices=("random", "rows"))
        p.add_argument("--blocks", action="append", help="block container path(s)")
        p.add_argument("--keep-prefix", type=int, default=None, help="leading tokens kept")
        p.add_argument("--no-strict", action="store_true", help="guess side inputs")
        p.add_argument("--input-shape", type=str, default=None, help="latent shape, 1,4,32,32")
        p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
        p.add_argument(
            "--model-kwargs",
            "--kwargs",
            dest="model_kwargs",
            metavar="JSON",
            help="constructor kwargs of the factory, JSON",
        )
        p.add_argument("--seed", type=int, default=0, help="seed for weights and inputs")
        p.add_argument("--format", choices=FORMATS, default="text")
        p.add_argument(
            "--out",
            metavar="PATH",
            help="write here, not stdout (folders are created; runs/ is git-ignored)",
        )
        p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
        p.add_argument("--full", action="store_true", help="also draw Python-value nodes")
        p.add_argument("--no-flops", action="store_true", help="skip ATen/FLOP counting")
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
        p.add_argument(
            "--threads",
            type=int,
            default=1,
            help="torch intra-op threads (default 1: tracing runs many tiny ops, and more "
            "threads spin-wait for each other on a busy machine)",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tread-fx``: parses, then runs the command; returns the exit status."""
    args = build_parser().parse_args(argv)
    from tread_fx.inspection.cli import run

    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
