"""Train a class-conditional diffusion model with TREAD token routing (``tread_fx.route``).

A small, complete training script to copy and adapt. The defaults train an 8-block DiT on
scikit-learn's 8x8 digits in a few minutes on a laptop CPU, with route ``(2, 4)`` at rate 0.5::

    python examples/train.py                                  # digits, DiT, routed, RF
    python examples/train.py --routes none --out runs/base    # the unrouted baseline
    python examples/train.py --data fashion-mnist --model DiT_S_2 --depth 8 --bf16 --steps 5000
    python examples/train.py --resume --out runs/base --steps 2000  # continue a run exactly
    python examples/train.py --overwrite --steps 100          # replace the run in runs/train
    torchrun --nproc_per_node=2 examples/train.py --steps 200 # DDP (gloo on CPU, nccl on CUDA)

Order of wrappers: the model is routed first (in place), the EMA copy is a ``copy.deepcopy`` of
the routed model, then DDP wraps it. Eval mode runs the original forward, so validation losses
and samples of routed and unrouted runs are directly comparable. Checkpoints hold the plain,
unrouted ``model.state_dict()`` (safetensors) and load into any copy of the architecture.

Outputs in ``--out``: ``metrics.jsonl`` (and ``metrics.csv``) with step, training wall-clock
seconds (evaluation excluded), train loss, val loss and steps/s; ``samples.png``;
``checkpoints/step_*/``. A folder holding a previous run is refused unless ``--resume`` or
``--overwrite`` says what to do with it (``run_dir.py``). Errors in arguments or data stop the
run with one line and exit code 2; a non-finite loss stops it (exit code 1) naming the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint as ckpt  # noqa: E402
import data as data_lib  # noqa: E402
import diffusion  # noqa: E402
import run_dir  # noqa: E402
import train_utils as tu  # noqa: E402
from train_args import (  # noqa: E402, F401 - re-exported: tests and users call train.X
    FAMILIES,
    UsageError,
    build_model,
    check_args,
    make_parser,
    make_shards,
    num_blocks,
    parse_routes,
)

from tread_fx.errors import TreadFxError  # noqa: E402

ARCH_ARGS = ("model", "depth", "width", "heads", "patch_size", "objective", "data", "learn_sigma")


class TrainingError(Exception):
    """Training diverged (exit code 1)."""


def training_loss(args, objective, model, core, x0, y, gen, routed: bool) -> torch.Tensor:
    """The step's loss: full-token, or TREAD's masked/reconstruction variants."""
    if not routed or (args.loss == "full" and not args.reconstruction_weight):
        return objective.loss(model, x0, y, generator=gen)
    import tread_fx

    per_pixel = objective.loss(model, x0, y, generator=gen, reduction="none")
    return tread_fx.losses.tread_loss(
        per_pixel,
        tread_fx.route_info(core),
        core.patch_size,
        mode=args.loss,
        reconstruction_weight=args.reconstruction_weight,
    )


@dataclasses.dataclass
class Run:
    """Everything one training run holds: the setup (built once) and the progress (mutable)."""

    args: argparse.Namespace
    world: int
    rank: int
    cuda: bool
    device: torch.device
    out: Path
    say: Callable[[str], None]
    objective: Any
    data: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    num_classes: int
    core: nn.Module
    model: nn.Module
    ema: nn.Module
    routes: list[tuple[int, int]]
    opt: torch.optim.Optimizer
    gen: torch.Generator
    autocast: torch.autocast
    logger: Any = None
    shards: Any = None
    step: int = 0
    train_time: float = 0.0

    @property
    def main_rank(self) -> bool:
        """Whether this process writes files and logs (rank 0)."""
        return self.rank == 0


def setup_device(args: argparse.Namespace) -> tuple[int, int, bool, torch.device]:
    """Checks ``args``, sets threads, picks the device and joins the process group if any.

    Returns:
        ``(world, rank, cuda, device)``.
    """
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    check_args(args, world)
    if args.threads or (os.cpu_count() or 1) <= 2:
        # Two threads on two cores collapse (10x and worse) as soon as anything else runs.
        torch.set_num_threads(args.threads or 1)
    cuda = torch.cuda.is_available() if args.device is None else args.device.startswith("cuda")
    device = torch.device(
        f"cuda:{local_rank}" if cuda and world > 1 else args.device or ("cuda" if cuda else "cpu")
    )
    if world > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
    return world, rank, cuda, device


def load_data(args: argparse.Namespace, device: torch.device, objective) -> tuple[dict, int]:
    """Loads the data set and splits off a fixed held-out set with fixed times and noise.

    Returns:
        ``(data, num_classes)``; ``data`` holds ``train_x``, ``train_y``, ``val_x``, ``val_y``,
        ``val_t`` and ``val_noise`` on ``device``.
    """
    loaded = data_lib.load_dataset(args.data, args.data_dir)
    images, labels, num_classes = data_lib.pad_images(loaded, getattr(args, "pad_to", None))
    val_gen = torch.Generator().manual_seed(1234)  # the same held-out set for every run
    perm = torch.randperm(images.shape[0], generator=val_gen)
    n_val = max(1, min(args.val_size, images.shape[0] // 10))
    data = {
        "val_x": images[perm[:n_val]].to(device),
        "val_y": labels[perm[:n_val]].to(device),
        "train_x": images[perm[n_val:]].to(device),
        "train_y": labels[perm[n_val:]].to(device),
    }
    data["val_t"] = objective.sample_time(n_val, val_gen, "cpu").to(device)
    data["val_noise"] = torch.randn(data["val_x"].shape, generator=val_gen).to(device)
    return data, num_classes


def build_core(args: argparse.Namespace, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The unrouted model that ``args`` describes, for images of ``shape`` (C, H, W)."""
    return build_model(
        args.model,
        depth=args.depth,
        hidden_size=args.width,
        num_heads=args.heads,
        patch_size=args.patch_size,
        input_size=shape[1],
        in_channels=shape[0],
        num_classes=num_classes,
        learn_sigma=args.learn_sigma,
        class_dropout_prob=args.label_drop,
    )


def build_routed_model(
    args: argparse.Namespace, shape: tuple[int, ...], num_classes: int, device: torch.device
) -> tuple[nn.Module, list[tuple[int, int]]]:
    """Builds the model with seed ``args.seed`` and routes it as ``--routes`` asks.

    Returns:
        ``(core, routes)``: the (routed) model and the parsed routes.
    """
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    core = build_core(args, shape, num_classes).to(device)
    routes = parse_routes(args.routes, num_blocks(core))
    if routes:
        import tread_fx

        if not hasattr(tread_fx, "route"):
            raise UsageError("this tread_fx has no route(); pass --routes none")
        extra = {} if args.selection == "random" else {"selection": args.selection}
        if args.reinsert == "blend":
            extra["reinsert"] = tread_fx.Reinsert("blend", *args.blend)
        if args.fp32_reentry:
            extra["fp32_reentry"] = True
        if args.routing_probability != 1.0:
            extra["routing_probability"] = args.routing_probability
        try:
            tread_fx.route(
                core, routes=routes, rate=args.rate, seed=None, compile=args.compile, **extra
            )
        except TreadFxError as err:
            raise UsageError(f"tread_fx.route failed: {err}") from None
    return core, routes


def setup(args: argparse.Namespace) -> Run:
    """Device, data, model (routed), EMA, optimizer and generators, in a fixed RNG order.

    Every argument (values, data, model, routes, batch size) is checked before ``--out`` is
    looked at, so a bad argument is reported whatever the folder holds.
    """
    world, rank, cuda, device = setup_device(args)
    say = (lambda msg: tqdm.write(msg)) if rank == 0 else (lambda msg: None)
    objective = diffusion.make_objective(args.objective)
    data, num_classes = load_data(args, device, objective)
    shape = tuple(data["train_x"].shape[1:])
    core, routes = build_routed_model(args, shape, num_classes, device)
    shards = make_shards(data["train_x"].shape[0], args.batch_size, rank, world, args.seed)
    run_dir.claim_run_dir(args)  # every process, before DDP syncs them (rank 0 writes later)
    ema = diffusion.make_ema(core)  # deep copy of the routed model, fp32, eval mode
    if args.compile and not routes:
        core.compile()
    model = core
    if world > 1:
        model = DistributedDataParallel(core, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(core.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    gen = torch.Generator(device).manual_seed(args.seed + 1000 * (rank + 1))
    torch.manual_seed(args.seed + 1000 * (rank + 1) + 1)  # label dropout, token selection
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.bf16)
    return Run(
        args, world, rank, cuda, device, Path(args.out), say, objective, data, shape,
        num_classes, core, model, ema, routes, opt, gen, autocast, shards=shards,
    )  # fmt: skip


def resume(run: Run) -> None:
    """Loads ``--resume``: weights, EMA, optimizer, step, time and this rank's RNG states."""
    args, rank = run.args, run.rank
    _, meta = ckpt.read_meta(args.resume)
    old = meta.get("args", {})
    changed = [k for k in ARCH_ARGS if k in old and old[k] != getattr(args, k)]
    if changed:
        raise ckpt.CheckpointError(
            f"{meta['path']}/meta.json: saved with different "
            + ", ".join(f"--{k.replace('_', '-')} {old[k]}" for k in changed)
        )
    meta, rng = ckpt.load_checkpoint(meta["path"], run.core, run.ema, run.opt)
    run.step, run.train_time = meta["step"], float(meta.get("train_time", 0.0))
    if f"gen/{rank}" in rng:
        torch.set_rng_state(rng[f"cpu/{rank}"])
        run.gen.set_state(rng[f"gen/{rank}"])
        if f"cuda/{rank}" in rng and run.cuda:
            torch.cuda.set_rng_state(rng[f"cuda/{rank}"], run.device)
    else:
        run.say(f"warning: {meta['path']} has no RNG state for rank {rank}; reseeding")
        torch.manual_seed(args.seed + 1000 * (rank + 1) + run.step)
    run.say(f"resumed from {meta['path']} at step {run.step}")


def prepare_output(run: Run) -> None:
    """Writes ``args.json``, opens the metrics logger, prints the setup."""
    args = run.args
    if run.main_rank:
        if args.overwrite and (removed := run_dir.clear_run(run.out)):
            run.say(f"--overwrite: removed the previous run's {', '.join(p.name for p in removed)}")
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / "args.json").write_text(json.dumps(vars(args), indent=1))
    run.logger = tu.Logger(run.out, run.main_rank)
    n_params = sum(p.numel() for p in run.core.parameters())
    routes = run.routes
    run.say(
        f"{args.model}: {num_blocks(run.core)} blocks, {n_params / 1e6:.2f}M params, routes "
        f"{routes or 'none'} rate {args.rate if routes else 0}; data {args.data} "
        f"{tuple(run.data['train_x'].shape)}; {tu.processes(run.world)} on {run.device}, "
        f"{torch.get_num_threads()} thread(s)"
    )


def evaluate(run: Run) -> tuple[float, float]:
    """Held-out loss of the model and of its EMA (fixed times and noise); back to train mode."""
    d, losses = run.data, []
    for net in (run.core, run.ema):
        net.eval()
        with torch.no_grad(), run.autocast:
            total = sum(
                run.objective.loss(net, x, y, t=t, noise=z).item() * x.shape[0]
                for x, y, t, z in zip(
                    *(d[k].split(256) for k in ("val_x", "val_y", "val_t", "val_noise"))
                )
            )
        losses.append(total / max(1, d["val_x"].shape[0]))
    run.core.train()
    return losses[0], losses[1]


def save(run: Run) -> Path | None:
    """Saves a checkpoint (every rank contributes its RNG state); returns its path on rank 0."""
    rng = tu.gather_rng_states(run.gen, run.device, run.rank, run.world)
    if not run.main_rank:
        return None
    meta = {"args": vars(run.args), "train_time": run.train_time, "world_size": run.world}
    return ckpt.save_checkpoint(
        run.out / "checkpoints", run.step, run.core, run.ema, run.opt, rng, meta,
        keep=run.args.keep_checkpoints,
    )  # fmt: skip


def train_step(run: Run) -> tuple[float, bool]:
    """One optimizer and EMA step on this rank's shard; returns the mean loss and "time is up"."""
    args, t0 = run.args, time.perf_counter()
    idx = run.shards.indices(run.step).to(run.device)
    x0, y = run.data["train_x"][idx], run.data["train_y"][idx]
    with run.autocast:
        loss = training_loss(
            args, run.objective, run.model, run.core, x0, y, run.gen, bool(run.routes)
        )
    over = (args.time_budget is not None and run.train_time >= args.time_budget) or bool(
        args.stop_file and os.path.exists(args.stop_file)
    )
    mean_loss, flag = tu.all_reduce_floats([loss.item(), float(over)], run.device, run.world)
    mean_loss /= run.world
    if not math.isfinite(mean_loss):
        raise TrainingError(f"loss is {mean_loss} at step {run.step + 1}; lower --lr or use fp32")
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    if args.grad_clip > 0:
        nn.utils.clip_grad_norm_(run.core.parameters(), args.grad_clip)
    run.opt.step()
    decay = diffusion.warmup_ema_decay(args.ema, run.step) if args.ema_warmup else args.ema
    diffusion.update_ema(run.ema, run.core, decay)
    run.step += 1
    run.train_time += time.perf_counter() - t0
    return mean_loss, flag > 0


def log_progress(run: Run, train_loss: float, since: tuple[int, float], stop: bool) -> None:
    """Logs a metrics record (with held-out losses when due) and prints one progress line.

    Args:
        run: The run.
        train_loss: Mean training loss since the last record.
        since: ``(step, train_time)`` of the last record, for the speed.
        stop: Whether this is the last step (held-out losses are then always computed).
    """
    args, step = run.args, run.step
    record = {
        "step": step,
        "time_s": round(run.train_time, 4),
        "train_loss": train_loss,
        "val_loss": None,
        "val_loss_ema": None,
        "steps_per_s": (step - since[0]) / max(1e-9, run.train_time - since[1]),
        "lr": run.opt.param_groups[0]["lr"],
    }
    if run.main_rank and (step % args.eval_every == 0 or stop):
        record["val_loss"], record["val_loss_ema"] = evaluate(run)
    run.logger.log(record)
    val = (
        record["val_loss"] and f" | val {record['val_loss']:.4f} (ema {record['val_loss_ema']:.4f})"
    )
    eta = (args.steps - step) / max(record["steps_per_s"], 1e-9)
    run.say(
        f"step {step}/{args.steps} | loss {record['train_loss']:.4f}{val or ''} | "
        f"{record['steps_per_s']:.1f} it/s | ETA {tu.format_seconds(eta)}"
    )


def sample_grid(run: Run, path: Path) -> None:
    """Samples ``--num-samples`` images from the EMA model into an image grid at ``path``."""
    args = run.args
    grid = tu.generate(
        run.objective, run.ema, args.num_samples, run.num_classes, run.shape, args, run.device, 0
    )
    tu.save_grid(grid, path, min(run.num_classes, 10))


def training_loop(run: Run) -> tuple[Path | None, bool, float | None]:
    """Trains to ``--steps`` (or the time budget), logging, saving and sampling when due.

    Returns:
        ``(path, saved, final_loss)``: the last checkpoint saved, whether one was, the last loss.
    """
    args = run.args
    run.core.train()
    path, saved, final_loss = None, False, None
    since, loss_sum, loss_count = (run.step, run.train_time), 0.0, 0
    bar = tqdm(total=args.steps, initial=run.step, disable=True if run.rank else None,
               dynamic_ncols=True)  # fmt: skip
    stop = run.step >= args.steps
    while not stop:
        final_loss, over = train_step(run)
        loss_sum, loss_count = loss_sum + final_loss, loss_count + 1
        bar.update(1)
        step = run.step
        stop = step >= args.steps or over
        if step % args.log_every == 0 or step % args.eval_every == 0 or stop:
            log_progress(run, loss_sum / loss_count, since, stop)
            since, loss_sum, loss_count = (step, run.train_time), 0.0, 0
        if (args.save_every and step % args.save_every == 0) or stop:
            path, saved = save(run), True
        if run.main_rank and args.sample_every and step % args.sample_every == 0 and not stop:
            sample_grid(run, run.out / f"samples_{step:07d}.png")
    bar.close()
    return path, saved, final_loss


def check_ranks_in_sync(run: Run) -> bool:
    """Logs a checksum of every rank's weights; raises if the ranks differ."""
    ok, checksum = tu.ranks_in_sync([run.core, run.ema], run.device, run.world)
    record = {"event": "sync_check", "step": run.step, "ok": ok, "world_size": run.world}
    run.logger.log({**record, "checksum": checksum})
    run.say(
        f"rank sync check over {run.world} processes: {'ok' if ok else 'MISMATCH'} ({checksum})"
    )
    if not ok:
        raise TrainingError(f"parameters differ across ranks after step {run.step}")
    return ok


def finish(run: Run, summary: dict) -> None:
    """Final samples (and FID when asked) on rank 0, added to ``summary``."""
    args, out = run.args, run.out
    sample_grid(run, out / "samples.png")
    summary["samples"] = str(out / "samples.png")
    run.say(f"samples: {out / 'samples.png'}")
    if args.fid_samples:
        d = run.data
        summary.update(
            tu.final_fid(
                args, run.objective, run.ema, d["train_x"], d["train_y"], run.num_classes,
                run.shape, run.device, run.logger, run.step, run.say,
            )
        )  # fmt: skip


def train(args: argparse.Namespace) -> dict:
    """Runs training as configured by ``args``; returns a summary dictionary.

    Example:
        >>> args = make_parser().parse_args(["--steps", "2", "--out", "runs/tiny"])
        >>> summary = train(args)  # doctest: +SKIP
        >>> summary["step"]  # doctest: +SKIP
        2
    """
    run = setup(args)
    if args.resume:
        resume(run)
    prepare_output(run)
    path, saved, final_loss = training_loop(run)
    summary = {"step": run.step, "train_time": run.train_time, "final_loss": final_loss}
    summary["out"] = str(run.out)
    if not saved:  # nothing trained in this invocation: still leave a checkpoint
        path = save(run)
    summary["checkpoint"] = str(path) if run.main_rank and path else None
    if run.world > 1:  # the ranks must hold identical weights; log the proof
        summary["sync_ok"] = check_ranks_in_sync(run)
    if run.main_rank:
        finish(run, summary)
    if run.world > 1:
        dist.barrier()
    return summary


def run_cli(train_fn: Callable[[argparse.Namespace], dict], args, name: str) -> int:
    """Runs ``train_fn(args)`` for a command line; returns the exit code.

    Bad arguments or data print one line and give 2, a diverged run 1; the thread count and
    the process group are restored/destroyed either way (``main()`` may run in-process).
    """
    threads = torch.get_num_threads()
    try:
        train_fn(args)
    except (UsageError, data_lib.DataError, TreadFxError) as err:
        # one line, as the scripts promise: TreadFxError breaks long messages after a clause
        print(f"{name}: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2
    except TrainingError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(train, make_parser().parse_args(argv), "train.py")


if __name__ == "__main__":
    sys.exit(main())
