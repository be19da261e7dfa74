"""Coverage sweep: how much of a population nobody here chose does ``route()`` route cleanly?

Each model is judged by :func:`benchmarks.coverage_checks.judge` with
``route(model, routes=[(1, -1)], rate=0.5)`` and nothing else. Models run in worker
subprocesses (a crash or a hang costs one row, not the sweep), ``-j`` at a time.

    python -m benchmarks.coverage diffusers --suite DIR [--commit SHA]   # diffusers' suite
    python -m benchmarks.coverage timm [--per-arch]                      # timm architectures
    python -m benchmarks.coverage transformers                           # SSM / hybrid LMs
    python -m benchmarks.coverage community [--snapshots DIR]            # libraries, research
    python -m benchmarks.coverage report                                 # rewrite the .md

``DIR`` is a folder holding diffusers' ``tests/``, or (community) one snapshot folder per
research repository (docs/support.md shows how to make both).
Results go to ``docs/results/coverage.json`` (one section per population; a run replaces its
population's section) and ``docs/results/coverage.md`` (generated from the JSON).

Example:
    >>> from benchmarks.coverage import totals
    >>> counts = totals([{"verdict": "routes"}, {"verdict": "broken"},
    ...                  {"verdict": "not buildable"}])
    >>> counts["routes"], counts["broken"], counts["mixes samples"], counts["buildable"]
    (1, 1, 0, 2)
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["main", "totals", "write_markdown", "run_population", "expectation_line"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "coverage"
MARK = "COVERAGE-ROW "
CASE_TIMEOUT_S = 300


def totals(rows: Iterable[dict]) -> dict[str, int]:
    """Verdict counts, plus ``buildable`` (every row that is not *not buildable*).

    ``broken`` includes the *wrong stream* and *mixes samples* rows (also counted on their
    own): a model that routes the wrong tokens, or mixes samples, is broken, however clean
    its other checks.
    """
    from benchmarks.coverage_checks import VERDICTS

    counts = Counter(r["verdict"] for r in rows)
    out = {v: counts.get(v, 0) for v in VERDICTS}
    out["buildable"] = sum(out.values()) - out["not buildable"]
    out["broken"] += out["wrong stream"] + out["mixes samples"]
    return out


# -- worker (one subprocess) ------------------------------------------------------------------


def _alarm(seconds: int) -> None:
    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the case ran over {seconds} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)


def _emit(row: dict) -> None:
    print(MARK + json.dumps(row), flush=True)


def _judge_all(cases: Iterable[Any]) -> None:
    from benchmarks.coverage_checks import Verdict, judge

    for case in cases:
        if isinstance(case, tuple):  # (name, reason[, expected]): could not be made
            expected = case[2] if len(case) > 2 else ""
            _emit(Verdict(case[0], "", "not buildable", case[1], "config", expected=expected)
                  .to_dict())  # fmt: skip
            continue
        _alarm(CASE_TIMEOUT_S)
        try:
            _emit(judge(case).to_dict())
        finally:
            signal.alarm(0)


def _worker(argv: Sequence[str]) -> None:
    import torch

    torch.set_num_threads(1)
    family, *rest = argv
    if family == "diffusers":
        from benchmarks.coverage_sources import diffusers_cases

        _judge_all(diffusers_cases(Path(rest[0]), rest[1]))
    elif family == "transformers":
        from benchmarks.coverage_sources import transformers_cases

        _judge_all(transformers_cases())
    elif family == "community":
        from benchmarks.coverage_community import community_cases

        _judge_all(community_cases(rest[0], Path(rest[1]) if rest[1:] else None))
    elif family == "timm":
        _judge_all(_timm_cases(rest[0].split(",")))
    elif family == "research":
        from benchmarks.research.population import research_cases

        _judge_all(research_cases(Path(rest[0]), rest[1]))
    else:
        raise SystemExit(f"unknown family {family!r}")


def _timm_cases(names: list[str]) -> Iterable[Any]:
    from benchmarks.coverage_sources import timm_case

    for name in names:
        try:
            yield timm_case(name)
        except Exception as err:  # noqa: BLE001 - reported as not buildable
            yield name, f"{type(err).__name__}: {err}"[:200]


# -- parent -----------------------------------------------------------------------------------


def _run_worker(args: list[str], label: str, timeout: float) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.coverage", "_worker", *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, code = (exc.stdout or b"").decode(), "worker timed out", "timeout"
    rows = [json.loads(line[len(MARK) :]) for line in out.splitlines() if line.startswith(MARK)]
    if code != 0 and code is not None:
        tail = (err or "").strip().splitlines()[-1:] or [""]
        rows.append(
            {
                "name": label,
                "family": "",
                "verdict": "broken",
                "stage": "worker",
                "reason": f"worker exited with {code} after {len(rows)} rows: {tail[0][:300]}",
            }
        )
    for row in rows:
        print(f"  {row['verdict']:<13} {row['name']:<44} {row.get('reason', '')[:90]}", flush=True)
    return rows


def run_population(jobs: list[tuple[list[str], str]], parallel: int, timeout: float) -> list:
    """Run worker jobs ``(args, label)``, ``parallel`` at a time; returns every row."""
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(_run_worker, a, label, timeout) for a, label in jobs]
        return [row for f in futures for row in f.result()]


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "diffusers", "timm", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
    out["tread_fx"] = head.stdout.decode().strip() or "unknown"
    return out


def _sweep_diffusers(args: argparse.Namespace) -> tuple[list, dict]:
    from benchmarks.coverage_sources import diffusers_modules

    suite = Path(args.suite).resolve()
    modules = [
        m for m in diffusers_modules(suite) if not args.only or any(s in m for s in args.only)
    ]
    jobs = [(["diffusers", str(suite), m], m) for m in modules]
    rows = run_population(jobs, args.jobs, timeout=CASE_TIMEOUT_S * 4)
    meta = {
        "source": f"diffusers tests/models/transformers ({len(modules)} modules)",
        "diffusers_commit": args.commit or "unknown",
    }
    return rows, meta


def _sweep_timm(args: argparse.Namespace) -> tuple[list, dict]:
    from benchmarks.coverage_sources import TIMM_TINY, timm_names

    names, skipped = timm_names(per_arch=args.per_arch)
    if args.only:
        names = [n for n in names if any(s in n for s in args.only)]
    chunks = [names[i : i + 8] for i in range(0, len(names), 8)]
    jobs = [(["timm", ",".join(c)], ",".join(c)) for c in chunks]
    rows = run_population(jobs, args.jobs, timeout=CASE_TIMEOUT_S * 10)
    scope = "one model per (model class, block class)" if args.per_arch else "every model"
    meta = {
        "source": f"timm.list_models(), {scope}, built with {TIMM_TINY}",
        "left_out": f"{len(skipped)} models not tiny-buildable or without a block stack",
    }
    return rows, meta


def _sweep_transformers(args: argparse.Namespace) -> tuple[list, dict]:
    from benchmarks.coverage_sources import TRANSFORMERS_TINY

    rows = run_population([(["transformers"], "transformers")], 1, timeout=CASE_TIMEOUT_S * 10)
    meta = {
        "source": "transformers' state-space and hybrid models (Mamba, Mamba2, FalconMamba, "
        f"RWKV, Bamba, GraniteMoeHybrid, LFM2, Nemotron-H, Qwen3-Next, Jamba), tiny configs "
        f"{TRANSFORMERS_TINY} plus per-family scan sizes, inputs_embeds [2, 16, 32]"
    }
    return rows, meta


def _sweep_community(args: argparse.Namespace) -> tuple[list, dict]:
    from benchmarks.coverage_community import SOURCES, package_versions, snapshot_commits

    snapshots = [str(Path(args.snapshots).resolve())] if args.snapshots else []
    sources = [s for s in SOURCES if not args.only or s in args.only]
    jobs = [(["community", s, *snapshots], s) for s in sources]
    rows = run_population(jobs, args.jobs, timeout=CASE_TIMEOUT_S * 10)
    if args.only:  # the other sources keep their rows from the last run
        old = _load(args.out.with_suffix(".json")).get("community", {}).get("rows", [])
        rows = [r for r in old if (r.get("family") or r["name"]) not in sources] + rows
    meta = {
        "source": f"{len(SOURCES)} sources outside diffusers, timm and transformers: model "
        "libraries from the package index and research repositories' model files (snapshots), "
        "tiny configs in benchmarks/coverage_community.py",
        "packages": package_versions(),
        "repositories": snapshot_commits(Path(args.snapshots) if args.snapshots else None),
    }
    return rows, meta


def _sweep_research(args: argparse.Namespace) -> tuple[list, dict]:
    from benchmarks.research.population import entries, make_snapshot

    listed = [e for e in entries() if not args.only or any(s in e["repo"] for s in args.only)]
    for entry in listed:
        make_snapshot(entry, Path(args.mirrors), Path(args.snapshots))
    snapshots = str(Path(args.snapshots).resolve())
    jobs = [(["research", snapshots, e["repo"]], e["repo"]) for e in listed]
    rows = run_population(jobs, args.jobs, timeout=CASE_TIMEOUT_S * 2)
    if args.only:  # the other repositories keep their rows from the last run
        old = _load(args.out.with_suffix(".json")).get("research", {}).get("rows", [])
        done = {f"{e['repo']}: {e['class']}" for e in listed}
        rows = [r for r in old if r["name"] not in done] + rows
    meta = {
        "source": f"{len(entries())} research repositories listed in "
        "benchmarks/research/population.json before any was run (issue 58), built from "
        "their snapshots at the listed commits",
    }
    return rows, meta


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _cell(text: Any) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def _causes(rows: list[dict]) -> list[tuple[str, int]]:
    causes = Counter(
        f"{r['verdict']} at {r.get('stage') or '?'}: {r.get('reason', '').split(' (at ')[0][:110]}"
        for r in rows
        if r["verdict"] in ("refused", "broken", "wrong stream", "mixes samples")
    )
    return causes.most_common()


_HEADERS = {"name": "model", "flop_ratio": "FLOP ratio"}


def _meta(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} `{v}`" for k, v in value.items())
    return f"`{value}`"


def expectation_line(rows: list[dict]) -> str:
    """How the verdicts meet the expected ones: the share of should-route models routing,
    and how many should-refuse models are refused.

    Example:
        >>> expectation_line([{"verdict": "routes", "expected": "route"},
        ...                   {"verdict": "refused", "expected": "refuse: conv U-Net"}])
        'Expected to route: 1, routing cleanly: 1 (100%). Expected to be refused: 1, refused: 1.'
    """
    should = [r for r in rows if r.get("expected") == "route"]
    routes = sum(r["verdict"] == "routes" for r in should)
    share = f" ({100 * routes / len(should):.0f}%)" if should else ""
    refuse = [r for r in rows if str(r.get("expected", "")).startswith("refuse")]
    refused = sum(r["verdict"] == "refused" for r in refuse)
    return (
        f"Expected to route: {len(should)}, routing cleanly: {routes}{share}. "
        f"Expected to be refused: {len(refuse)}, refused: {refused}."
    )


def write_markdown(data: dict, path: Path) -> None:
    """Write the coverage report (totals, causes, one row per model) from the JSON data."""
    lines = [
        "# Coverage of `route()` with default arguments",
        "",
        "Generated by `python -m benchmarks.coverage` (do not edit by hand). Each model is",
        "routed with `route(model, routes=[(1, -1)], rate=0.5)` and nothing else; *routes*",
        "means eval output bitwise equal to the unrouted model, training output shape",
        "unchanged, rate 0 bitwise equal to the original training forward, a gradient for",
        "every parameter that learns, fewer tokens in the routed blocks, lower forward",
        "FLOPs, `explain()` working (text and JSON), and the selectable positions exactly",
        "those the noisy input reaches at the stack's first block (else *wrong stream*,",
        "counted in *broken*), and, with the selection fixed, changing one sample's noisy",
        "input moves no other sample's routed output (else *mixes samples*, counted in",
        "*broken*). See `benchmarks/coverage_checks.py`.",
        "",
        "| population | models | routes | refused | broken | not buildable | routes / buildable |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, section in data.items():
        t = totals(section["rows"])
        share = f"{100 * t['routes'] / t['buildable']:.0f}%" if t["buildable"] else "-"
        lines.append(
            f"| {family} | {len(section['rows'])} | {t['routes']} | {t['refused']} | "
            f"{t['broken']} | {t['not buildable']} | {share} |"
        )
    for family, section in data.items():
        lines += ["", f"## {family}", "", f"Source: {section['meta'].get('source', '')}."]
        lines += [f"- {k}: {_meta(v)}" for k, v in section["meta"].items() if k != "source"]
        lines += [f"- run: {section['date']}, {section['seconds']:.0f} s"]
        causes = _causes(section["rows"])
        if causes:
            lines += ["", "Not routed, by cause:", ""] + [f"- {n} x {c}" for c, n in causes]
        keys = ["name", "verdict", "stage", "reason", "tokens", "flop_ratio", "note"]
        if any(r.get("expected") for r in section["rows"]):
            keys.insert(2, "expected")
            lines += ["", expectation_line(section["rows"])]
        lines += [
            "",
            "| " + " | ".join(_HEADERS.get(k, k) for k in keys) + " |",
            "|" + "---|" * len(keys),
        ]
        for r in sorted(section["rows"], key=lambda r: (r["verdict"], r["name"])):
            lines.append("| " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
    path.write_text("\n".join(lines) + "\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.coverage", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="population", required=True)
    d = sub.add_parser("diffusers", help="every transformer in diffusers' own test suite")
    d.add_argument("--suite", required=True, help="folder holding diffusers' tests/")
    d.add_argument("--commit", default="", help="the diffusers commit the suite came from")
    t = sub.add_parser("timm", help="every timm architecture with a block stack")
    t.add_argument("--per-arch", action="store_true", help="one model per (model, block) class")
    f = sub.add_parser("transformers", help="transformers' state-space and hybrid models")
    c = sub.add_parser("community", help="model libraries and research repositories")
    c.add_argument("--snapshots", default="", help="folder of research-repository snapshots")
    c.epilog = "--only SOURCE... re-runs those sources; the others keep their last rows"
    for s in (d, t, c):
        s.add_argument("--only", nargs="*", default=[], help="substrings of names to keep")
        s.add_argument("-j", "--jobs", type=int, default=2, help="worker processes at once")
    for s in (d, t, f, c):
        s.add_argument("--out", type=Path, default=RESULTS, help="output path without suffix")
        s.add_argument("--no-write", action="store_true", help="print only")
    s = sub.add_parser("research", help="the research population (issue 58)")
    s.add_argument("--mirrors", required=True, help="folder of fetched mirrors (owner+name/repo)")
    s.add_argument("--snapshots", required=True, help="folder the listed commits go to")
    s.add_argument("--only", nargs="*", default=[], help="substrings of repositories to run")
    s.add_argument("-j", "--jobs", type=int, default=1, help="worker processes at once")
    s.add_argument("--out", type=Path, default=RESULTS.with_name("research"))
    s.add_argument("--no-write", action="store_true", help="print only")
    r = sub.add_parser("report", help="regenerate the markdown from the JSON")
    r.add_argument("--out", type=Path, default=RESULTS)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the command line; returns the section written (or the whole data for ``report``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        _worker(argv[1:])
        return {}
    args = _parser().parse_args(argv)
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    data = _load(json_path)
    if args.population == "report":
        write_markdown(data, md_path)
        return data
    started = time.time()
    sweeps = {
        "diffusers": _sweep_diffusers,
        "timm": _sweep_timm,
        "transformers": _sweep_transformers,
        "community": _sweep_community,
        "research": _sweep_research,
    }
    sweep = sweeps[args.population]
    rows, meta = sweep(args)
    name = args.population + (" (per architecture)" if getattr(args, "per_arch", False) else "")
    section = {
        "meta": {**meta, **_versions()},
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": time.time() - started,
    }
    print(name, totals(rows))
    if not args.no_write:
        data[name] = section
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1) + "\n")
        write_markdown(data, md_path)
    return section


if __name__ == "__main__":
    main()
