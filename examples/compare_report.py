"""The report of ``compare.py``: tables, convergence speed-ups and plots from finished runs.

Reads ``OUT/seed*/{baseline,tread}/metrics.jsonl`` (validation curve, final FID) and, when
``fid_curve.py`` has run, ``fid_curve.jsonl`` (FID/KID at every checkpoint). Writes
``OUT/report.md``, ``OUT/summary.json`` and PNG plots. A hand-written ``OUT/notes.md`` (what
the machine was doing, what the numbers mean) is appended to the report when present.

The convergence speed-up of a seed is ``T_base / T_tread``: ``T_base`` is the training
wall-clock of the baseline's last point, ``T_tread`` the earliest wall-clock at which TREAD's
curve reaches the baseline's final value (linear between measured points). It is left empty
when TREAD never gets there.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

__all__ = [
    "ARMS",
    "load_runs",
    "first_reach",
    "convergence",
    "summarise",
    "setup_figures",
    "write_report",
]

ARMS = ("baseline", "tread")


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _curve(records: list[dict], keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {k: np.array([r[k] for r in records], dtype=float) for k in keys}


def load_runs(out: Path) -> dict[str, list[dict]]:
    """Per arm, one dict per seed: the validation curve, the FID curve and the final FID/KID."""
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for seed_dir in sorted(out.glob("seed*")):
        for arm in ARMS:
            records = _records(seed_dir / arm / "metrics.jsonl")
            curve = [r for r in records if r.get("val_loss_ema") is not None and "event" not in r]
            fid = next((r for r in records if r.get("event") == "fid"), {})
            fids = sorted(_records(seed_dir / arm / "fid_curve.jsonl"), key=lambda r: r["step"])
            val = _curve(curve, ("time_s", "step", "val_loss_ema"))
            runs[arm].append(
                {
                    "seed": seed_dir.name,
                    "time": val["time_s"],
                    "step": val["step"],
                    "val": val["val_loss_ema"],
                    "steps_per_s": curve[-1]["step"] / curve[-1]["time_s"],
                    "fid": fid.get("fid"),
                    "kid": fid.get("kid_mean", fid.get("kid")),
                    "curve": _curve(fids, ("time_s", "step", "fid", "kid_mean", "class_accuracy"))
                    if fids
                    else None,
                }
            )
    return runs


def first_reach(times: np.ndarray, values: np.ndarray, target: float) -> float | None:
    """Earliest time at which ``values`` (over ``times``) falls to ``target``, else ``None``.

    Linear between measured points.

    Example:
        >>> first_reach(np.array([0.0, 10.0, 20.0]), np.array([3.0, 2.0, 1.0]), 1.5)
        15.0
    """
    for i, value in enumerate(values):
        if value <= target:
            if i == 0:
                return float(times[0])
            t0, t1, v0, v1 = times[i - 1], times[i], values[i - 1], values[i]
            return float(t0 + (t1 - t0) * (v0 - target) / (v0 - v1))
    return None


FRACTIONS = (0.25, 0.5, 0.75, 0.9)


def _speedups_along(base_t, base_v, tread_t, tread_v, fractions=FRACTIONS) -> tuple:
    """Speed-ups at points along the baseline's run: for each fraction f, the baseline's value
    at ``f * T_base`` against the wall-clock at which TREAD first reaches it."""
    out = []
    for fraction in fractions:
        when = fraction * float(base_t[-1])
        reach = first_reach(tread_t, tread_v, float(np.interp(when, base_t, base_v)))
        out.append(when / reach if reach else None)
    return tuple(out)


def _interp(curve: dict, at_key: str, where: float, key: str) -> float:
    return float(np.interp(where, curve[at_key], curve[key]))


def convergence(base: dict, tread: dict) -> dict:
    """One seed's convergence figures: speed-ups, and FID/KID at equal wall-clock and steps."""
    t_base = float(base["time"][-1])
    reach = first_reach(tread["time"], tread["val"], float(base["val"][-1]))
    row = {
        "seed": base["seed"],
        "steps": (int(base["step"][-1]), int(tread["step"][-1])),
        "steps/s": (base["steps_per_s"], tread["steps_per_s"]),
        "final val": (float(base["val"][-1]), float(tread["val"][-1])),
        "base time": t_base,
        "val reach time": reach,
        "val speed-up": t_base / reach if reach else None,
    }
    row["val speed-up @ base 25/50/75/90%"] = _speedups_along(
        base["time"], base["val"], tread["time"], tread["val"]
    )
    b, t = base["curve"], tread["curve"]
    if b is None or t is None:
        return row
    row["FID speed-up @ base 50/75/90%"] = _speedups_along(
        b["time_s"], b["fid"], t["time_s"], t["fid"], FRACTIONS[1:]
    )
    fid_reach = first_reach(t["time_s"], t["fid"], float(b["fid"][-1]))
    step_base = float(b["step"][-1])
    row.update(
        {
            "fid reach time": fid_reach,
            "fid speed-up": float(b["time_s"][-1]) / fid_reach if fid_reach else None,
            "fid @ time": (float(b["fid"][-1]), _interp(t, "time_s", b["time_s"][-1], "fid")),
            "kid @ time": (
                float(b["kid_mean"][-1]),
                _interp(t, "time_s", b["time_s"][-1], "kid_mean"),
            ),
            "fid @ steps": (float(b["fid"][-1]), _interp(t, "step", step_base, "fid")),
            "kid @ steps": (float(b["kid_mean"][-1]), _interp(t, "step", step_base, "kid_mean")),
            "class acc @ time": (
                float(b["class_accuracy"][-1]),
                _interp(t, "time_s", b["time_s"][-1], "class_accuracy"),
            ),
            "tread curve end": float(t["time_s"][-1]),
        }
    )
    return row


def _mean_std(values: list[float | None], digits: int = 4) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}g} (1 seed)"
    return f"{statistics.mean(values):.{digits}g} ± {statistics.stdev(values):.2g}"


def _at(run: dict, key: str, where: float) -> float:
    return float(np.interp(where, run[key], run["val"]))


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """Rows of the per-arm table (mean ± std over seeds)."""
    common_time = min(r["time"][-1] for arm in runs.values() for r in arm)
    half_time = common_time / 2
    rows = []
    for arm, seeds in runs.items():
        rows.append(
            {
                "arm": arm,
                "seeds": len(seeds),
                "steps": _mean_std([float(r["step"][-1]) for r in seeds]),
                "steps/s": _mean_std([r["steps_per_s"] for r in seeds]),
                f"val loss @ {half_time:.0f}s": _mean_std(
                    [_at(r, "time", half_time) for r in seeds]
                ),
                f"val loss @ {common_time:.0f}s": _mean_std(
                    [_at(r, "time", common_time) for r in seeds]
                ),
                "final FID": _mean_std([r["fid"] for r in seeds]),
                "final KID": _mean_std([r["kid"] for r in seeds]),
            }
        )
    return rows


def _pair(value, digits: int = 4) -> str:
    if value is None:
        return "not reached"
    if isinstance(value, tuple):
        return " / ".join("-" if v is None else f"{v:.{digits}g}" for v in value)
    return f"{value:.{digits}g}"


CONVERGENCE_COLUMNS = (
    ("steps", "steps (base / TREAD)"),
    ("steps/s", "steps/s (base / TREAD)"),
    ("final val", "final val loss (base / TREAD)"),
    ("base time", "base time s"),
    ("val reach time", "TREAD reaches base final val at s"),
    ("val speed-up", "val-loss speed-up"),
    ("val speed-up @ base 25/50/75/90%", "val-loss speed-up at the baseline's 25/50/75/90% time"),
    ("fid reach time", "TREAD reaches base final FID at s"),
    ("fid speed-up", "FID speed-up"),
    ("FID speed-up @ base 50/75/90%", "FID speed-up at the baseline's 50/75/90% time"),
    ("fid @ time", "FID @ equal time (base / TREAD)"),
    ("kid @ time", "KID @ equal time"),
    ("fid @ steps", "FID @ equal steps"),
    ("kid @ steps", "KID @ equal steps"),
    ("class acc @ time", "class acc @ equal time"),
)


def _convergence_tables(rows: list[dict]) -> list[str]:
    columns = [c for c in CONVERGENCE_COLUMNS if any(c[0] in row for row in rows)]
    lines = ["| seed | " + " | ".join(label for _, label in columns) + " |"]
    lines.append("|---|" + "---|" * len(columns))
    for row in rows:
        cells = [_pair(row.get(key)) for key, _ in columns]
        lines.append(f"| {row['seed']} | " + " | ".join(cells) + " |")
    cells = []
    for key, _ in columns:
        values = [row.get(key) for row in rows]
        if all(isinstance(v, tuple) for v in values):
            width = len(values[0])
            cells.append(" / ".join(_mean_std([v[i] for v in values]) for i in range(width)))
        else:
            reached = [v for v in values if v is not None]
            if len(reached) == len(values):
                cells.append(_mean_std(reached))
            elif reached:
                shown = ", ".join(_pair(v) for v in reached)  # a tuple where curves exist
                cells.append(f"reached in {len(reached)} of {len(values)} seeds: {shown}")
            else:
                cells.append("not reached in any seed")
    lines.append("| mean ± std | " + " | ".join(cells) + " |")
    return lines


def _plot(runs: dict[str, list[dict]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("val", "time", "step", "validation loss (EMA, eval mode)", "val_loss")]
    if all(r["curve"] is not None for arm in runs.values() for r in arm):
        panels.append(("fid", "time_s", "step", "FID (classifier features)", "fid"))
    names = []
    for value, time_key, step_key, ylabel, stem in panels:
        for key, label in ((time_key, "training wall-clock (s)"), (step_key, "optimizer steps")):
            fig, ax = plt.subplots(figsize=(6, 4))
            for (arm, seeds), color in zip(runs.items(), ("tab:gray", "tab:red")):
                for i, run in enumerate(seeds):
                    data = run if value == "val" else run["curve"]
                    ax.plot(data[key], data[value], color=color, alpha=0.8, marker=None
                            if value == "val" else "o", label=arm if i == 0 else None)  # fmt: skip
            ax.set_xlabel(label)
            ax.set_ylabel(ylabel)
            ax.set_yscale("log")
            ax.legend()
            ax.grid(alpha=0.3)
            name = f"{stem}_vs_{'time' if key == time_key else 'step'}.png"
            fig.tight_layout()
            fig.savefig(out / name, dpi=120)
            plt.close(fig)
            names.append(name)
    return names


def _per_seed_table(runs: dict[str, list[dict]]) -> list[str]:
    """Per seed: steps and validation loss of both arms at that seed's common wall-clock."""
    lines = ["", "| seed | arm | steps | steps/s | val loss at the seed's common time |",
             "|---|---|---|---|---|"]  # fmt: skip
    for i, base in enumerate(runs["baseline"]):
        pair = (base, runs["tread"][i])
        common = min(r["time"][-1] for r in pair)
        for arm, run in zip(ARMS, pair):
            lines.append(
                f"| {run['seed']} | {arm} | {int(run['step'][-1])} | {run['steps_per_s']:.3f} "
                f"| {_at(run, 'time', common):.4f} @ {common:.0f}s |"
            )
    return lines


def setup_figures(out: Path) -> dict | None:
    """What was compared: tokens, parameters, routes and the measured FLOP ratio of a step.

    Both arms are rebuilt from the first seed's saved arguments; one training step (forward and
    backward, batch 2) of each is counted with the project's FLOP counter, so the ratio is the
    speed-up the FLOPs predict. Steps per arm are in the ``convergence`` rows.
    """
    import diffusion
    import torch
    from train import build_routed_model, load_data

    import tread_fx
    from tread_fx.inspection.flops import flop_counter

    seed_dirs = sorted(out.glob("seed*"))
    if not seed_dirs:
        return None
    figures: dict = {}
    for arm in ARMS:
        path = seed_dirs[0] / arm / "args.json"
        if not path.exists():
            return None
        args = argparse.Namespace(**json.loads(path.read_text()))
        data, num_classes = load_data(args, torch.device("cpu"), diffusion.RectifiedFlow(0, 1, 1))
        shape = tuple(data["train_x"].shape[1:])
        model, routes = build_routed_model(args, shape, num_classes, torch.device("cpu"))
        x, y = data["train_x"][:2], data["train_y"][:2]
        model.train()(x, torch.rand(2), y)  # a routed model traces at its first call
        with flop_counter() as counter:
            model(x, torch.rand(2), y).square().mean().backward()
        figures[arm] = {"step_flops_batch2": counter.get_total_flops(), "routes": routes}
        if routes:
            info = tread_fx.route_info(model)[0]
            figures.update(tokens=info.num_tokens, kept=int(info.kept.shape[1]))
        figures["parameters"] = sum(p.numel() for p in model.parameters())
    base, tread = (figures[arm]["step_flops_batch2"] for arm in ARMS)
    figures["flop_ratio"] = base / tread
    return figures


def _setup_lines(setup: dict | None) -> list[str]:
    if not setup or "tokens" not in setup:
        return []
    return [
        f"Setup: {setup['tokens']} tokens ({setup['kept']} kept inside the route), "
        f"{setup['parameters'] / 1e6:.2f}M parameters, TREAD routes {setup['tread']['routes']}; "
        f"measured FLOPs of a training step, baseline / TREAD = {setup['flop_ratio']:.3f} "
        "(the speed-up the FLOPs predict).",
        "",
    ]


def write_report(out: Path, argv: list[str], train_args: list[str], limit: str) -> Path:
    """Write ``report.md``, ``summary.json`` and the plots into ``out``; return the report path.

    Args:
        out: The comparison's output directory.
        argv: The ``compare.py`` command line (for the report's first line).
        train_args: The ``train.py`` arguments both arms shared.
        limit: How long each arm ran, in words.
    """
    runs = load_runs(out)
    rows = summarise(runs)
    setup = setup_figures(out)
    seeds = [convergence(b, t) for b, t in zip(runs["baseline"], runs["tread"])]
    plots = _plot(runs, out)
    header = list(rows[0])
    notes = out / "notes.md"
    lines = [
        "# Baseline vs TREAD at equal wall-clock",
        "",
        f"Command: `python examples/compare.py {' '.join(argv)}`; {limit}; the baseline runs "
        "`--routes none`, TREAD `--tread-routes`; both arms of a seed run concurrently, one "
        "thread each. Validation loss: EMA model, eval mode (no routing), fixed held-out (x0, "
        "t, noise). Mean ± std over seeds.",
        "",
        *_setup_lines(setup),
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows),
        *_per_seed_table(runs),
        "",
        "## Convergence",
        "",
        "Speed-up = baseline's final training wall-clock / the wall-clock at which TREAD first "
        "reaches the baseline's final value (linear between measured points). Equal time: the "
        "baseline's last checkpoint against TREAD's curve at the same training wall-clock; "
        "equal steps: against TREAD's curve at the baseline's last step. The same speed-up "
        "at points along the baseline's run (its value at 25/50/75/90% of its wall-clock) "
        "shows where in training TREAD is ahead; '-' marks a value TREAD never reached.",
        "",
        *_convergence_tables(seeds),
        "",
        *(f"![{p}]({p})" for p in plots),
        "",
        notes.read_text() if notes.exists() else "",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    summary = {"args": train_args, "setup": setup, "rows": rows, "convergence": seeds}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return report
