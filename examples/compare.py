"""Baseline vs TREAD under an equal wall-clock budget, over several seeds.

For each seed the two arms run *at the same time*, one CPU thread each, so whatever else the
machine does slows both alike. Each arm is ``examples/train.py`` with the same arguments but
``--routes none`` (baseline) or ``--routes auto`` (TREAD). The report is a markdown table and
PNG plots: validation loss vs training wall-clock and vs steps, and final FID/KID.

Usage:
    python examples/compare.py --out docs/results/compare_mnist --budget 600 --seeds 0 1 2 \\
        -- --data mnist --model dit --depth 8 --width 256 --patch-size 2
    python examples/compare.py --report-only --out docs/results/compare_mnist

Convergence (``--baseline-steps``: the baseline trains that many steps and TREAD trains as
long as the baseline runs; ``--curve-fid N``: afterwards, FID/KID of N samples at every saved
checkpoint, see ``fid_curve.py``; ``compare_report.py`` computes the speed-ups)::

    python examples/compare.py --out runs/convergence --baseline-steps 3000 --curve-fid 2000 \\
        -- --data mnist --depth 12 --width 64 --heads 4 --patch-size 4 --save-every 750 \\
        --keep-checkpoints 0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_report import ARMS, write_report  # noqa: E402

__all__ = ["run_pair", "curve_fids", "check_arms", "main"]

TRAIN = Path(__file__).with_name("train.py")
FID_CURVE = Path(__file__).with_name("fid_curve.py")


def run_pair(
    out: Path,
    seed: int,
    budget: float,
    train_args: list[str],
    fid: int,
    routes: str,
    baseline_steps: int | None = None,
) -> None:
    """Run both arms of one seed concurrently (one thread each) and wait for both.

    With ``baseline_steps`` the baseline trains that many steps and TREAD trains until the
    baseline is done (a stop file), so both arms get the same wall-clock and TREAD the extra
    steps its cheaper step buys. Otherwise both stop at ``budget`` training seconds.
    """
    stop_file = out / f"seed{seed}" / "baseline.done"
    stop_file.unlink(missing_ok=True)
    if baseline_steps:
        limits = (
            ["--steps", str(baseline_steps)],
            ["--steps", "1000000000", "--stop-file", str(stop_file)],
        )
    else:
        limits = (["--time-budget", str(budget)],) * 2
    procs = []
    for arm, routing, limit in zip(ARMS, (["--routes", "none"], ["--routes", routes]), limits):
        run_dir = out / f"seed{seed}" / arm
        command = [
            sys.executable, str(TRAIN), *train_args, *routing, "--seed", str(seed),
            *limit, "--threads", "1", "--out", str(run_dir), "--fid-samples", str(fid),
        ]  # fmt: skip
        run_dir.mkdir(parents=True, exist_ok=True)
        log = (run_dir / "stdout.log").open("w")
        procs.append((arm, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
    for arm, proc in procs:
        code = proc.wait()
        stop_file.touch()
        if code != 0:
            for _, other in procs:
                other.kill()
            raise SystemExit(f"compare.py: seed {seed} {arm} failed; see {out}/seed{seed}/{arm}")


def curve_fids(out: Path, seeds: list[int], samples: int, sample_steps: int | None) -> None:
    """FID/KID at every checkpoint of every arm (``fid_curve.py``), two runs at a time."""
    runs = [out / f"seed{seed}" / arm for seed in seeds for arm in ARMS]
    extra = ["--sample-steps", str(sample_steps)] if sample_steps else []
    for i in range(0, len(runs), 2):
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(FID_CURVE),
                    str(run),
                    "--samples",
                    str(samples),
                    "--threads",
                    "1",
                    *extra,
                ]
            )  # fmt: skip
            for run in runs[i : i + 2]
        ]
        if any(proc.wait() != 0 for proc in procs):
            raise SystemExit(f"compare.py: fid_curve.py failed on {runs[i : i + 2]}")


def _saved_argv(out: Path) -> list[str]:
    path = out / "command.json"
    return json.loads(path.read_text())["argv"] if path.exists() else []


def _claim(out: Path, overwrite: bool) -> None:
    """Refuses an ``--out`` holding a previous comparison unless ``--overwrite`` is given."""
    found = sorted(p.name for p in [out / "command.json", *out.glob("seed*")] if p.exists())
    if found and not overwrite:
        raise SystemExit(
            f"compare.py: error: --out {out} holds a previous comparison ({', '.join(found)}); "
            "add --overwrite to replace it, --report-only to rebuild its report, or pick "
            "another --out"
        )


def check_arms(args: argparse.Namespace, train_args: list[str]) -> None:
    """Checks the arms' ``train.py`` arguments as ``train.py`` does before it looks at its
    ``--out`` (values, data, model, the TREAD arm's routes, batch size), so a bad argument is
    reported before ``--out`` is claimed; the baseline arm differs only by ``--routes none``.

    Raises:
        SystemExit: status 2 with one line saying which argument is wrong.
    """
    import torch
    import train  # torch and tread_fx: imported only when the arms will train

    limit = ["--steps", str(args.baseline_steps)] if args.baseline_steps else []
    argv = [*train_args, "--routes", args.tread_routes, "--seed", str(args.seeds[0]), *limit,
            "--threads", "1", "--fid-samples", str(args.fid_samples)]  # fmt: skip
    parser = train.make_parser()
    parser.prog = "compare.py (the train.py arguments after --)"
    arm = parser.parse_args(argv)  # an argparse error exits here, status 2
    if not args.baseline_steps:
        arm.time_budget = args.budget
    cpu = torch.device("cpu")
    try:
        train.check_args(arm, world=1)
        data, num_classes = train.load_data(arm, cpu, train.diffusion.make_objective(arm.objective))
        train.build_routed_model(arm, tuple(data["train_x"].shape[1:]), num_classes, cpu)
        train.make_shards(data["train_x"].shape[0], arm.batch_size, 0, 1, arm.seed)
    except (train.UsageError, train.data_lib.DataError, train.TreadFxError) as err:
        print(f"compare.py: error: train.py: {' '.join(str(err).splitlines())}", file=sys.stderr)
        raise SystemExit(2) from None


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=600.0, help="seconds per arm and seed")
    parser.add_argument(
        "--baseline-steps",
        type=int,
        help="instead of --budget: the baseline trains this many steps, TREAD as long as it",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fid-samples", type=int, default=1000)
    parser.add_argument("--tread-routes", default="auto", help="--routes of the TREAD arm")
    parser.add_argument(
        "--curve-fid",
        type=int,
        default=0,
        help="after training: FID/KID of this many samples at every checkpoint (fid_curve.py)",
    )
    parser.add_argument("--curve-sample-steps", type=int, help="sampler steps for --curve-fid")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous comparison in --out (its runs' checkpoints, metrics, samples)",
    )
    args = parser.parse_args(argv[:split])
    checks = [
        (args.budget > 0, "--budget must be > 0"),
        (args.baseline_steps is None or args.baseline_steps >= 1, "--baseline-steps must be >= 1"),
        (min(args.fid_samples, args.curve_fid) >= 0, "--fid-samples/--curve-fid must be >= 0"),
        (args.curve_sample_steps is None or args.curve_sample_steps >= 1,
         "--curve-sample-steps must be >= 1"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            parser.error(message)
    return args, argv[split + 1 :]


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (or only rebuild the report from a finished one) and print it."""
    command = sys.argv[1:] if argv is None else argv
    args, train_args = _parse(command)
    if args.report_only:
        curve, out = (args.curve_fid, args.curve_sample_steps), args.out
        saved = _saved_argv(out)
        if saved:  # the run's settings, in this folder (it may have been moved)
            command = saved
            args, train_args = _parse(saved)
            args.out = out
        if curve[0]:  # evaluate checkpoints not evaluated yet, then report
            curve_fids(args.out, args.seeds, *curve)
    else:
        check_arms(args, train_args)  # every argument first, then the folder
        _claim(args.out, args.overwrite)
        if args.overwrite:
            train_args = [*train_args, "--overwrite"]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "command.json").write_text(json.dumps({"argv": command}))
        for seed in args.seeds:
            run_pair(
                args.out, seed, args.budget, train_args, args.fid_samples, args.tread_routes,
                args.baseline_steps,
            )  # fmt: skip
        if args.curve_fid:
            curve_fids(args.out, args.seeds, args.curve_fid, args.curve_sample_steps)
    limit = (
        f"the baseline trains {args.baseline_steps} steps, TREAD as long as the baseline runs"
        if args.baseline_steps
        else f"budget {args.budget} s per arm and seed"
    )
    print(write_report(args.out, command, train_args, limit).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
