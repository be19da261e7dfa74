"""``python -m benchmarks.generated --seeds 0:300``: the differential check over a seed range.

Prints per feature how many models had it and how they ended (routed, refused, wrong,
foreign, generator error), the totals the issue asks for, and every finding with its seed,
features and message. ``--seed N --show`` prints one model's source; ``--keep DIR`` keeps the
written sources; ``--out FILE`` also writes the report as Markdown.

Example:
    >>> main(["--seed", "0", "--show"])  # doctest: +ELLIPSIS
    \"\"\"Generated backbone, seed 0...
    0
"""

from __future__ import annotations

import argparse
import collections
import functools
import multiprocessing
from pathlib import Path

from benchmarks.generated.check import OUTCOMES, Result, check, check_quietly
from benchmarks.generated.grammar import draw
from benchmarks.generated.source import module_source

__all__ = ["main", "report"]


def _seeds(text: str) -> range:
    lo, _, hi = text.partition(":")
    return range(int(lo), int(hi)) if hi else range(int(lo), int(lo) + 1)


def _table(results: list[Result]) -> list[str]:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        for feature in r.features:
            counts[feature]["models"] += 1
            counts[feature][r.outcome] += 1
    head = "| feature | models | " + " | ".join(OUTCOMES) + " |"
    lines = [head, "|" + "---|" * (len(OUTCOMES) + 2)]
    for feature in sorted(counts):
        row = counts[feature]
        cells = " | ".join(str(row[o]) for o in OUTCOMES)
        lines.append(f"| {feature} | {row['models']} | {cells} |")
    return lines


def _totals(results: list[Result]) -> list[str]:
    by = collections.Counter(r.outcome for r in results)
    routable = [r for r in results if r.routable]
    refuse = [r for r in results if not r.routable]
    routed = sum(r.outcome == "routed" for r in routable)
    refused = sum(r.outcome == "refused" for r in refuse)
    share = lambda a, b: f"{a}/{b} ({100 * a / b:.1f}%)" if b else "0/0"
    return [
        f"models: {len(results)}",
        f"wrong: {by['wrong']} (must be 0)",
        f"foreign exceptions: {by['foreign']} (must be 0)",
        f"generator errors: {by['generator error']} (must be 0)",
        f"routable models routed: {share(routed, len(routable))} (target >= 95%)",
        f"must-refuse refused: {share(refused, len(refuse))} (must be 100%)",
    ]


def report(results: list[Result]) -> str:
    """The table, the totals and every finding, as Markdown text."""
    lines = _table(results) + [""] + _totals(results) + ["", "Findings:"]
    for r in results:
        if r.finding or r.outcome == "generator error":
            lines.append(f"- seed {r.seed} [{r.outcome}] {', '.join(r.features)}: {r.message}")
            lines += [f"  - warning {w}" for w in r.warnings]
    return "\n".join(lines)


def _run(seeds: range, keep: Path | None, jobs: int) -> list[Result]:
    """``check`` of each seed, in order; in ``jobs`` fresh processes when above 1 (each seed
    is deterministic, so the report is the same)."""
    if jobs <= 1:
        return [check(seed, keep=keep) for seed in seeds]
    context = multiprocessing.get_context("spawn")
    with context.Pool(jobs, maxtasksperchild=50) as pool:
        return pool.map(functools.partial(check_quietly, keep=keep), seeds, chunksize=10)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generated")
    parser.add_argument("--seeds", default="0:200", help="range lo:hi (default 0:200)")
    parser.add_argument("--seed", type=int, help="one seed")
    parser.add_argument("--show", action="store_true", help="print the seed's source")
    parser.add_argument("--keep", type=Path, help="keep the written sources here")
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="worker processes")
    args = parser.parse_args(argv)
    seeds = _seeds(str(args.seed)) if args.seed is not None else _seeds(args.seeds)
    if args.show:
        for seed in seeds:
            print(module_source(draw(seed)))
        return 0
    results = _run(seeds, args.keep, args.jobs)
    text = report(results)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
