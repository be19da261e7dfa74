"""Summaries, targets, the JSON file and the markdown table of a benchmark run.

Example:
    >>> from benchmarks.report import summarise_mode
    >>> times = {"unrouted": [2.0, 2.2], "route()": [1.4, 1.5], "hand-written": [1.4, 1.5]}
    >>> flops = {"unrouted": 300, "route()": 200, "hand-written": 200}
    >>> round(summarise_mode(times, {}, flops)["efficiency_route"], 3)
    0.976
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.measure import CLOCKS, VARIANTS, median, median_interval, paired_ratio

__all__ = [
    "merge_results",
    "summarise_mode",
    "evaluate_targets",
    "to_markdown",
    "write_outputs",
    "resummarise",
    "TARGETS",
]

#: The issue's targets (CPU, S/2 size); checked on every model and mode they apply to.
TARGETS = {
    "efficiency_eager": 0.95,
    "efficiency_compiled_dit": 0.97,
    "route_vs_hand": 1.02,
    "memory_slack": 0.05,
    "first_call_overhead_s": 2.0,
}
_CLOCK_TEXT = {
    "wall": "time.perf_counter, what a user waits for",
    "cpu": "time.process_time, CPU seconds of the process: on a shared machine it leaves out the "
    "time spent waiting for a core",
}
_TARGET_NOTE = (
    "A target is met or not by the median of the per-round ratios; the 90% interval beside "
    "it resamples the rounds (bootstrap, 2000 draws, seeded), and 'within noise' marks a "
    "verdict whose limit lies inside that interval."
)
#: The paper's throughput (one A100, batch 64, DiT-XL/2), for the GPU table.
PAPER_A100 = {"route() it/s": 7.10, "unrouted it/s": 4.30}


def _quartiles(values: list[float]) -> list[float]:
    """First and third quartile (both the value itself for a single round)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [q1, q3]


def summarise_mode(
    times: dict[str, list[float]],
    first: dict[str, float],
    flops: dict[str, int],
    memory: dict[str, int] | None = None,
    optimizer_s: float | None = None,
) -> dict[str, Any]:
    """Ratios of one mode: speed-ups, FLOP prediction, efficiency, route() vs hand, memory.

    Speed-ups and the route()/hand-written ratio are medians of per-round ratios (see
    :func:`benchmarks.measure.paired_ratio`); efficiency = measured speed-up / (1 / FLOP ratio).
    With ``optimizer_s`` (the AdamW step alone, which routing does not shrink and FLOPs do not
    count) also the efficiency of forward + backward alone, from the median step times.
    """
    u, r, h = (times[v] for v in VARIANTS)
    flop_ratio = flops["route()"] / flops["unrouted"]
    summary: dict[str, Any] = {
        "repeats": len(u),
        "median_s": {v: median(times[v]) for v in VARIANTS},
        "first_call_s": dict(first),
        "flop_ratio": flop_ratio,
        "flop_ratio_hand": flops["hand-written"] / flops["unrouted"],
        "predicted_speedup": 1.0 / flop_ratio,
        "speedup_route": paired_ratio(u, r),
        "speedup_hand": paired_ratio(u, h),
        "route_vs_hand": paired_ratio(r, h),
    }
    summary["speedup_route_iqr"] = _quartiles([a / b for a, b in zip(u, r)])
    summary["route_vs_hand_iqr"] = _quartiles([a / b for a, b in zip(r, h)])
    summary["route_vs_hand_ci"] = median_interval([a / b for a, b in zip(r, h)])
    speedup_ci = median_interval([a / b for a, b in zip(u, r)])
    summary["efficiency_route_ci"] = [bound * flop_ratio for bound in speedup_ci]
    summary["efficiency_route"] = summary["speedup_route"] * flop_ratio
    summary["efficiency_hand"] = summary["speedup_hand"] * summary["flop_ratio_hand"]
    if optimizer_s is not None:
        m = summary["median_s"]
        speedup = (m["unrouted"] - optimizer_s) / (m["route()"] - optimizer_s)
        summary["optimizer_s"] = optimizer_s
        summary["efficiency_route_fwd_bwd"] = speedup * flop_ratio
    if memory:
        summary["memory_bytes"] = dict(memory)
        summary["memory_ratio_route"] = memory["route()"] / memory["unrouted"]
        summary["memory_ratio_hand"] = memory["hand-written"] / memory["unrouted"]
    return summary


def _check(
    name: str, where: str, value: float | None, limit: float, upper: bool, ci: list | None = None
) -> dict:
    """One target: ``met`` by the measured value; ``resolved`` when the 90% interval of that
    value (``ci``, rounds resampled) lies on one side of the limit, so the verdict is not the
    host's noise."""
    if value is None:
        return {"target": name, "where": where, "value": None, "limit": limit, "met": None}
    met = value <= limit if upper else value >= limit
    check = {"target": name, "where": where, "value": value, "limit": limit, "met": bool(met)}
    if ci is not None:
        check["ci"] = list(ci)
        check["resolved"] = not ci[0] <= limit <= ci[1]
    return check


def evaluate_targets(results: dict[str, Any]) -> list[dict]:
    """Check every target where it applies; ``met`` is None when it could not be measured."""
    checks = []
    clock = results["meta"]["clock"]
    for entry in results["models"]:
        for mode, by_clock in entry["modes"].items():
            s, where = by_clock[clock], f"{entry['label']} {mode}"
            efficiency = None
            if mode == "eager":
                efficiency = ("efficiency >= 0.95", TARGETS["efficiency_eager"])
            elif entry["model"].startswith("dit"):  # the compiled DiT rows
                efficiency = ("efficiency >= 0.97", TARGETS["efficiency_compiled_dit"])
            if efficiency:
                name, limit = efficiency
                checks.append(_check(name, where, s["efficiency_route"], limit, upper=False,
                                     ci=s.get("efficiency_route_ci")))  # fmt: skip
            checks.append(
                _check(
                    "route() / hand-written <= 1.02",
                    where,
                    s["route_vs_hand"],
                    TARGETS["route_vs_hand"],
                    upper=True,
                    ci=s.get("route_vs_hand_ci"),
                )
            )
            if "memory_ratio_route" in s:
                limit = s["flop_ratio"] + TARGETS["memory_slack"]
                checks.append(
                    _check(
                        "memory ratio <= FLOP ratio + 0.05",
                        where,
                        s["memory_ratio_route"],
                        limit,
                        upper=True,
                    )
                )
    first = results.get("first_call")
    if first:
        checks.append(
            _check(
                f"first-call overhead <= 2 s ({clock})",
                first["label"],
                first[clock]["overhead_s"],
                TARGETS["first_call_overhead_s"],
                upper=True,
            )
        )
    return checks  # fmt: skip


def _f(value: Any, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _iqr(s: dict[str, Any]) -> str:
    q = s.get("route_vs_hand_iqr")
    return f" ({q[0]:.3f}-{q[1]:.3f})" if q else ""


def _main_table(results: dict[str, Any], clock: str) -> list[str]:
    head = (
        "| model | mode | batch | unrouted s/step | route() s/step | hand-written s/step "
        "| FLOP ratio | FLOP-predicted speed-up | measured speed-up route() | measured speed-up "
        "hand | efficiency route() | efficiency hand | route() / hand time (IQR) | memory ratio "
        "route() | memory ratio hand | optimizer s/step | efficiency route() fwd+bwd only |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for e in results["models"]:
        for mode, by_clock in e["modes"].items():
            s = by_clock[clock]
            m = s["median_s"]
            lines.append(
                f"| {e['label']} | {mode} | {e['batch']} | {_f(m['unrouted'])} | "
                f"{_f(m['route()'])} | {_f(m['hand-written'])} | {_f(s['flop_ratio'])} | "
                f"{_f(s['predicted_speedup'])} | {_f(s['speedup_route'])} | "
                f"{_f(s['speedup_hand'])} | {_f(s['efficiency_route'])} | "
                f"{_f(s['efficiency_hand'])} | {_f(s['route_vs_hand'])}{_iqr(s)} | "
                f"{_f(s.get('memory_ratio_route'))} | {_f(s.get('memory_ratio_hand'))} | "
                f"{_f(s.get('optimizer_s'))} | {_f(s.get('efficiency_route_fwd_bwd'))} |"
            )
    return lines


def _first_call_lines(first: dict[str, Any]) -> list[str]:
    rows = [
        f"| {clock} | {_f(c['plain_s'])} s | {_f(c['first_routed_s'])} s | "
        f"{_f(c['second_routed_s'])} s | {_f(c['overhead_s'])} s | {_f(c['pipeline_s'])} s |"
        for clock, c in ((k, first[k]) for k in CLOCKS)
    ]
    return [
        f"First routed call, {first['label']} (batch {first['batch']}, {first['tokens']} tokens, "
        f"route {tuple(first['route'])}), model fresh:",
        "",
        "| clock | plain training forward | first routed call | second routed call | overhead "
        "(first routed - plain) | trace + rewrite (first - second routed) |",
        "|---|---|---|---|---|---|",
        *rows,
        *_stage_lines(first.get("stages")),
    ]


def _stage_lines(stages: dict[str, float] | None) -> list[str]:
    """Where the first call's pipeline time went, stage by stage (wall seconds and share)."""
    if not stages:
        return []
    total = sum(stages.values())
    rows = [f"| {name} | {sec:.3f} s | {sec / total:.0%} |" for name, sec in stages.items()]
    return [
        "",
        f"Pipeline stages of the first routed call (wall clock, {total:.3f} s in all; the rest of "
        "the first call runs the routed graph):",
        "",
        "| stage | seconds | share |",
        "|---|---|---|",
        *rows,
    ]


def _target_lines(checks: list[dict]) -> list[str]:
    lines = [
        "| target | where | value | 90% interval (rounds resampled) | limit | met |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        met = {True: "yes", False: "**no**", None: "n/a"}[c["met"]]
        if c.get("resolved") is False:
            met += " (within noise)"
        ci = f"{c['ci'][0]:.3f}-{c['ci'][1]:.3f}" if c.get("ci") else ""
        lines.append(f"| {c['target']} | {c['where']} | {_f(c['value'])} | {ci} "
                     f"| {_f(c['limit'])} | {met} |")  # fmt: skip
    return lines


def _gpu_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for e in results["models"]:
        for mode, by_clock in e["modes"].items():
            u, r = (1.0 / by_clock["wall"]["median_s"][v] for v in ("unrouted", "route()"))
            lines.append(f"- {e['label']} {mode}: route() {r:.2f} it/s vs unrouted {u:.2f} it/s "
                         f"({r / u:.2f}x).")  # fmt: skip
    paper = PAPER_A100
    ratio = paper["route() it/s"] / paper["unrouted it/s"]
    lines.append(f"- Paper (one A100, DiT-XL/2, batch 64): TREAD {paper['route() it/s']} it/s vs "
                 f"DiT {paper['unrouted it/s']} it/s ({ratio:.2f}x).")  # fmt: skip
    return lines


def to_markdown(results: dict[str, Any]) -> str:
    """The markdown report: main table, first-call table, targets, method and command."""
    meta, clock = results["meta"], results["meta"]["clock"]
    other = next(c for c in CLOCKS if c != clock)
    lines = [
        f"# Step time: unrouted vs tread_fx.route() vs hand-written TREAD ({meta['device']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"tread_fx {meta.get('git', 'n/a')}, torch {meta['torch']}, {meta['device_name']}, "
        f"{meta['threads']} threads, dtype "
        f"{meta['dtype']}; load average at start {meta['load_start']}, at end {meta['load_end']}.",
        "",
        f"Times and ratios by the {clock} clock ({_CLOCK_TEXT[clock]}):",
        "",
        *_main_table(results, clock),
        "",
    ]
    if not meta["device"].startswith("cuda"):
        lines += [f"The same rounds by the {other} clock ({_CLOCK_TEXT[other]}):", "",
                  *_main_table(results, other), ""]  # fmt: skip
    if results.get("first_call"):
        lines += [*_first_call_lines(results["first_call"]), ""]
    if meta["device"].startswith("cuda"):
        lines += [*_gpu_lines(results), ""]
    lines += ["Targets:", "", *_target_lines(results["targets"]), "", _TARGET_NOTE, ""]
    for e in results["models"]:
        if e.get("note"):
            lines.append(f"- {e['label']}: route {tuple(e['route'])}, rate {e['rate']}, "
                         f"{e['tokens']} tokens -> {e['kept']} kept; {e['note']}.")  # fmt: skip
        if e.get("attention"):
            lines.append(f"- {e['label']}: attention runs {', '.join(e['attention'])} (route(), "
                         "eager).")  # fmt: skip
    for skipped in results.get("skipped", []):
        lines.append(f"- skipped: {skipped}")
    lines += ["", "Method:", "", *[f"- {m}" for m in meta["method"]], ""]
    return "\n".join(lines)


def write_outputs(results: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """Write ``<out>.json`` and ``<out>.md`` (parent folders created)."""
    base = Path(out)
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = base.with_name(base.name + ".json"), base.with_name(base.name + ".md")
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path.write_text(to_markdown(results))
    return json_path, md_path


def resummarise(results: dict[str, Any]) -> dict[str, Any]:
    """Recompute every summary and target from the raw per-round times kept in the results."""
    for entry in results["models"]:
        for mode, by_clock in entry["modes"].items():
            kept = next(iter(by_clock.values()))
            entry["modes"][mode] = {
                clock: summarise_mode(
                    {v: entry["times_s"][clock][f"{mode}/{v}"] for v in VARIANTS},
                    kept.get("first_call_s", {}),
                    entry["flops"],
                    kept.get("memory_bytes"),
                    entry.get("optimizer_s", {}).get(mode, {}).get(clock),
                )
                for clock in CLOCKS
            }
    results["targets"] = evaluate_targets(results)
    return results


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs of disjoint model lists (e.g. run side by side, one per core).

    The first run's metadata is kept, with every run's command, revision and load listed;
    models and skipped entries are concatenated; the first-call figures come from the run that
    measured them.

    Example:
        >>> a = {"meta": {"command": "a", "clock": "cpu"}, "models": [], "skipped": []}
        >>> merge_results([a, dict(a, meta={"command": "b"})])["meta"]["command"]
        'a; b'
    """
    merged = dict(parts[0], meta=dict(parts[0]["meta"]), models=[], skipped=[])
    for key in ("command", "git", "load_start", "load_end"):
        merged["meta"][key] = "; ".join(str(p["meta"].get(key, "n/a")) for p in parts)
    for part in parts:
        merged["models"] += part["models"]
        merged["skipped"] += part.get("skipped", [])
        merged["first_call"] = merged.get("first_call") or part.get("first_call")
    return merged


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.report RESULTS.json [MORE.json ...] [--out OUT]``.

    Re-renders the markdown from the raw times; several files (runs of different models) are
    merged into one table written to ``--out``.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    parser.add_argument("results", nargs="+", help="JSON files written by benchmarks.step_time")
    parser.add_argument("--out", help="output path without suffix (default: the first file)")
    args = parser.parse_args(argv)
    parts = [json.loads(Path(path).read_text()) for path in args.results]
    out = Path(args.out or args.results[0])
    json_path, md_path = write_outputs(resummarise(merge_results(parts)), out)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
