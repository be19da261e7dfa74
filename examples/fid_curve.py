"""FID/KID along a finished training run: one evaluation per saved checkpoint.

``train.py --save-every K --keep-checkpoints 0`` leaves ``checkpoints/step_*/`` with the EMA
weights and the training wall-clock of each step. This script samples from every checkpoint's
EMA model after training (so the evaluation never slows the run it measures) and appends one
record per checkpoint to ``RUN/fid_curve.jsonl``: step, training seconds, FID, KID and the
class accuracy of the samples (see ``train_utils.sample_fid``). Checkpoints already in the file
are skipped, so an interrupted evaluation continues where it stopped.

Usage:
    python examples/fid_curve.py runs/base runs/tread --samples 2000
    python examples/fid_curve.py runs/base --samples 2000 --sample-steps 20 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint as ckpt  # noqa: E402
import diffusion  # noqa: E402
import train_utils as tu  # noqa: E402
from train import build_core, load_data  # noqa: E402

__all__ = ["evaluated_steps", "evaluate_checkpoint", "evaluate_run", "main"]

CURVE = "fid_curve.jsonl"


def evaluated_steps(run_dir: Path) -> set[int]:
    """Steps that already have a record in ``run_dir/fid_curve.jsonl``."""
    path = run_dir / CURVE
    if not path.exists():
        return set()
    return {json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()}


def evaluate_checkpoint(directory: Path, samples: int, overrides: dict) -> dict:
    """FID/KID of ``samples`` EMA samples of one checkpoint (settings from its ``meta.json``).

    Args:
        directory: A ``checkpoints/step_*`` directory.
        samples: Number of generated (and of real) images.
        overrides: Sampling settings that replace the run's (``sample_steps``, ``sampler``,
            ``cfg_scale``); ``None`` values keep the run's.

    Returns:
        The record: ``step``, ``time_s`` (training seconds at that step) and the metrics.
    """
    _, meta = ckpt.read_meta(directory)
    args = argparse.Namespace(**meta["args"])
    for key, value in overrides.items():
        if value is not None:
            setattr(args, key, value)
    device = torch.device("cpu")
    objective = diffusion.make_objective(args.objective)
    data, num_classes = load_data(args, device, objective)
    shape = tuple(data["train_x"].shape[1:])
    nets = [build_core(args, shape, num_classes) for _ in range(2)]
    ckpt.load_checkpoint(directory, nets[0], nets[1], None)
    result = tu.sample_fid(
        args, objective, nets[1], data["train_x"], data["train_y"], num_classes, shape,
        device, samples, say=lambda msg: None,
    )  # fmt: skip
    settings = {k: getattr(args, k) for k in ("sampler", "sample_steps", "cfg_scale")}
    return {"step": meta["step"], "time_s": float(meta["train_time"]), **result, **settings}


def evaluate_run(run_dir: Path, samples: int, overrides: dict, say=print) -> list[dict]:
    """Evaluates every checkpoint of ``run_dir`` not evaluated yet; returns the new records."""
    done = evaluated_steps(run_dir)
    records = []
    for directory in sorted((run_dir / "checkpoints").glob("step_*")):
        if int(directory.name.split("_")[1]) in done:
            continue
        record = evaluate_checkpoint(directory, samples, overrides)
        with (run_dir / CURVE).open("a") as f:
            f.write(json.dumps(record) + "\n")
        say(f"{run_dir} step {record['step']}: FID {record['fid']:.3f} KID "
            f"{record['kid_mean']:.4f} class acc {record['class_accuracy']:.3f}")  # fmt: skip
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="train.py output directories")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--sample-steps", type=int), parser.add_argument("--cfg-scale", type=float)
    parser.add_argument("--sampler", choices=["euler", "heun"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if min(args.samples, args.threads, 1 if args.sample_steps is None else args.sample_steps) < 1:
        parser.error("--samples, --sample-steps and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    overrides = {"sample_steps": args.sample_steps, "sampler": args.sampler,
                 "cfg_scale": args.cfg_scale}  # fmt: skip
    for run_dir in args.runs:  # every folder before the first evaluation
        if not (run_dir / "checkpoints").is_dir():
            print(f"fid_curve.py: error: {run_dir} has no checkpoints/", file=sys.stderr)
            return 2
    for run_dir in args.runs:
        try:
            evaluate_run(run_dir, args.samples, overrides)
        except ckpt.CheckpointError as err:
            print(f"fid_curve.py: error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
