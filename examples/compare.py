"""Baseline vs TREAD under an equal wall-clock budget, over several seeds.

For each seed the two arms run *at the same time*, one CPU thread each, so whatever else the
machine does slows both alike. Each arm is ``examples/train.py`` with the same arguments but
``--routes none`` (baseline) or ``--routes auto`` (TREAD). The report is a markdown table and
PNG plots: validation loss vs training wall-clock and vs steps, and final FID/KID.

Usage:
    python examples/compare.py --out docs/results/compare_mnist --budget 600 --seeds 0 1 2 \\
        -- --data mnist --model dit --depth 8 --width 256 --patch-size 2
    python examples/compare.py --report-only --out docs/results/compare_mnist
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

__all__ = ["run_pair", "load_runs", "summarise", "write_report", "main"]

ARMS = ("baseline", "tread")
TRAIN = Path(__file__).with_name("train.py")


def run_pair(
    out: Path, seed: int, budget: float, train_args: list[str], fid: int, routes: str
) -> None:
    """Run both arms of one seed concurrently (one thread each) and wait for both."""
    procs = []
    for arm, routing in zip(ARMS, (["--routes", "none"], ["--routes", routes])):
        run_dir = out / f"seed{seed}" / arm
        command = [
            sys.executable, str(TRAIN), *train_args, *routing, "--seed", str(seed),
            "--time-budget", str(budget), "--threads", "1", "--out", str(run_dir),
            "--fid-samples", str(fid),
        ]  # fmt: skip
        run_dir.mkdir(parents=True, exist_ok=True)
        log = (run_dir / "stdout.log").open("w")
        procs.append((arm, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
    for arm, proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"compare.py: seed {seed} {arm} failed; see {out}/seed{seed}/{arm}")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_runs(out: Path) -> dict[str, list[dict]]:
    """Per arm, one dict per seed: the validation curve and the final FID/KID."""
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for seed_dir in sorted(out.glob("seed*")):
        for arm in ARMS:
            records = _records(seed_dir / arm / "metrics.jsonl")
            curve = [r for r in records if r.get("val_loss_ema") is not None and "event" not in r]
            fid = next((r for r in records if r.get("event") == "fid"), {})
            runs[arm].append(
                {
                    "seed": seed_dir.name,
                    "time": np.array([r["time_s"] for r in curve]),
                    "step": np.array([r["step"] for r in curve]),
                    "val": np.array([r["val_loss_ema"] for r in curve]),
                    "steps_per_s": curve[-1]["step"] / curve[-1]["time_s"],
                    "fid": fid.get("fid"),
                    "kid": fid.get("kid_mean", fid.get("kid")),
                }
            )
    return runs


def _at(run: dict, key: str, where: float) -> float:
    return float(np.interp(where, run[key], run["val"]))


def _mean_std(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.4g} (1 seed)"
    return f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g}"


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """Rows of the report table, one per arm (mean ± std over seeds)."""
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


def _plot(runs: dict[str, list[dict]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for key, label in (("time", "training wall-clock (s)"), ("step", "optimizer steps")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (arm, seeds), color in zip(runs.items(), ("tab:gray", "tab:red")):
            for i, run in enumerate(seeds):
                ax.plot(run[key], run["val"], color=color, alpha=0.8, label=arm if i == 0 else None)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (EMA, eval mode)")
        ax.set_yscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
        name = f"val_loss_vs_{key}.png"
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


def _saved_argv(out: Path) -> list[str]:
    path = out / "command.json"
    return json.loads(path.read_text())["argv"] if path.exists() else []


def write_report(out: Path, train_args: list[str], budget: float | None) -> Path:
    """Write ``report.md`` and the plots into ``out``; return the report path."""
    runs = load_runs(out)
    rows = summarise(runs)
    plots = _plot(runs, out)
    header = list(rows[0])
    lines = [
        "# Baseline vs TREAD at equal wall-clock",
        "",
        f"Command: `python examples/compare.py {' '.join(_saved_argv(out))}`; budget {budget} s "
        "per arm and seed; the baseline runs `--routes none`, TREAD `--tread-routes`; "
        "both arms of a seed run concurrently, one thread each. Validation loss: EMA model, "
        "eval mode (no routing), fixed held-out (x0, t, noise). Mean ± std over seeds.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows),
        *_per_seed_table(runs),
        "",
        *(f"![{p}]({p})" for p in plots),
        "",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps({"args": train_args, "rows": rows}, indent=1))
    return report


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=600.0, help="seconds per arm and seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fid-samples", type=int, default=1000)
    parser.add_argument("--tread-routes", default="auto", help="--routes of the TREAD arm")
    parser.add_argument("--report-only", action="store_true")
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (or only rebuild the report from a finished one) and print it."""
    args, train_args = _parse(sys.argv[1:] if argv is None else argv)
    if args.report_only:
        saved = _saved_argv(args.out)
        if saved:
            args, train_args = _parse(saved)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        command = sys.argv[1:] if argv is None else argv
        (args.out / "command.json").write_text(json.dumps({"argv": command}))
        for seed in args.seeds:
            run_pair(args.out, seed, args.budget, train_args, args.fid_samples, args.tread_routes)
    print(write_report(args.out, train_args, args.budget).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
