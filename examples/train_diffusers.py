"""Train or fine-tune a diffusers transformer with TREAD token routing, on accelerate.

Any diffusers transformer whose inputs ``diffusers_adapters.py`` can build (Flux-like packed
tokens, SD3/PixArt-like images with text), built from a class name and a config or loaded from
a local folder, is routed in place with ``tread_fx.route`` and trained with flow matching
(rectified flow, velocity target) on the example data sets in pixel space, or on precomputed
latents; text conditioning is a per-class table (stand-in embeddings unless ``--text-embeds``)::

    python examples/train_diffusers.py --config examples/configs/tiny_flux.json
    python examples/train_diffusers.py --model SD3Transformer2DModel --config my_sd3.json \\
        --routes 2:-2 --mixed-precision bf16 --grad-accum 2
    python examples/train_diffusers.py --pretrained runs/train_diffusers/transformer --lr 1e-4
    torchrun --nproc_per_node 2 examples/train_diffusers.py --config ...   # DDP (CPU: gloo)
    accelerate launch --config_file fsdp.yaml examples/train_diffusers.py --config ...  # FSDP2

Order: route, EMA copy, then ``accelerator.prepare`` (DDP, or FSDP2 with ``fully_shard`` per
block and activation checkpointing as the accelerate config says). Validation and sampling run
in eval mode, i.e. the original forward with routing off. Checkpoints are
``accelerator.save_state`` folders plus ``ema.safetensors`` and ``meta.json``; the final
weights are saved as a diffusers folder (``transformer/``) that ``--pretrained`` loads. Bad
arguments, configs, checkpoints or routes stop with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint as ckpt  # noqa: E402
import diffusers_adapters as da  # noqa: E402
import diffusion  # noqa: E402
import run_dir  # noqa: E402
import train_utils as tu  # noqa: E402
from train import TrainingError, load_data, run_cli  # noqa: E402
from train_args import Parser, UsageError, add_shared_args, make_shards  # noqa: E402

__all__ = ["Run", "make_parser", "parse_routes", "setup", "train", "main"]


def make_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = Parser(prog="train_diffusers.py", description=__doc__.split("\n")[0])
    add_shared_args(
        p, routes="1:-1", routes_help="none | START:END[,START:END] (half-open, negatives ok)",
        selection="auto", batch_size=32, steps=300, sample_steps=16,
        num_samples=40, out="runs/train_diffusers", log_every=25, eval_every=100, save_every=0,
    )  # fmt: skip
    a = p.add_argument
    a("--model", help="diffusers class name (default: the config's _class_name)")
    a("--config", help="JSON file of constructor arguments: a new, randomly initialised model")
    a("--pretrained", help="local folder (config.json + safetensors, or a pipeline folder)")
    a("--text-embeds", help="safetensors: prompt_embeds [K(+1), T, D] (+ pooled_prompt_embeds)")
    a("--text-tokens", type=int, default=8, help="tokens of the stand-in text embeddings")
    a("--gradient-checkpointing", action="store_true", help="diffusers' own, per block")
    a("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    a("--ema", type=float, default=0.999, help="EMA decay (0: no EMA; off under FSDP)")
    a("--guidance", type=float, default=1.0, help="guidance input of guidance-distilled models")
    a("--mixed-precision", choices=["no", "bf16", "fp16"], help="default: accelerate config")
    a("--cpu", action="store_true", help="force CPU (default when no accelerator is present)")
    return p


def parse_routes(text: str) -> list[tuple[int, int]]:
    """``none`` or ``a:b[,c:d]`` into ``(start, end)`` pairs; tread_fx checks the range.

    Example:
        >>> parse_routes("1:-1"), parse_routes("none")
        ([(1, -1)], [])
    """
    if text == "none":
        return []
    routes = []
    for part in text.split(","):
        try:
            start, end = (int(v) for v in part.split(":"))
        except ValueError:
            raise UsageError(f"--routes {text}: {part!r} is not START:END (e.g. 1:-1)") from None
        routes.append((start, end))
    return routes


def check_args(args: argparse.Namespace, world: int) -> None:
    """Value checks argparse cannot express."""
    checks = [
        (args.steps >= 0, "--steps must be >= 0"),
        (args.grad_accum >= 1, "--grad-accum must be >= 1"),
        (
            args.batch_size >= 1 and args.batch_size % (world * args.grad_accum) == 0,
            f"--batch-size must be a multiple of processes x --grad-accum ({world} x "
            f"{args.grad_accum})",
        ),
        (args.lr > 0, "--lr must be > 0"),
        (0 <= args.rate < 1, "--rate must be in [0, 1)"),
        (0 <= args.ema < 1, "--ema must be in [0, 1)"),
        (0 <= args.label_drop < 1, "--label-drop must be in [0, 1)"),
        (args.cfg_scale == 1 or args.label_drop > 0, "--cfg-scale != 1 needs --label-drop > 0"),
        (min(args.log_every, args.eval_every) >= 1, "--log-every/--eval-every must be >= 1"),
        (args.sample_steps >= 1 and args.num_samples >= 1, "--sample-steps/--num-samples >= 1"),
        (args.text_tokens >= 1 and args.val_size >= 1, "--text-tokens/--val-size must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


@dataclasses.dataclass
class Run:
    """One training run: the setup (built once) and the progress (mutable)."""

    args: argparse.Namespace
    acc: Any  # accelerate.Accelerator
    out: Path
    data: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    num_classes: int
    core: nn.Module  # the routed transformer (unwrapped; sharded in place under FSDP)
    model: nn.Module  # what training calls: core, DDP(core), or core sharded by FSDP2
    ema: nn.Module | None
    adapter: da.Adapter  # calls ``model``
    routes: list[tuple[int, int]]
    opt: Any
    fsdp: bool
    objective: Any = dataclasses.field(default_factory=lambda: diffusion.RectifiedFlow(0, 1, 1))
    logger: Any = None
    shards: Any = None
    step: int = 0
    train_time: float = 0.0

    def say(self, message: str) -> None:
        """Prints one line (main process only), above the progress bar."""
        if self.acc.is_main_process:
            tqdm.write(message)


def make_accelerator(args: argparse.Namespace):
    """The ``Accelerator``: CPU when asked or when no accelerator is present."""
    from accelerate import Accelerator

    if args.threads or (os.cpu_count() or 1) <= 2:
        torch.set_num_threads(args.threads or 1)  # two threads on two busy cores collapse
    cpu = args.cpu or not torch.accelerator.is_available()
    return Accelerator(
        mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum, cpu=cpu
    )


def build_model(args: argparse.Namespace, shape: tuple, num_classes: int, device) -> tuple:
    """The transformer (routed), its conditioning table and its adapter.

    Returns:
        ``(core, adapter, routes)``.
    """
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    core = da.build_model(args.model, args.config, args.pretrained).to(device)
    text_dim, pooled_dim = da.text_widths(core)
    if args.text_embeds:
        cond = da.load_conditioning(args.text_embeds, num_classes, text_dim, pooled_dim)
    else:
        cond = da.standin_conditioning(num_classes, text_dim, pooled_dim, args.text_tokens)
    adapter = da.make_adapter(core, shape, cond.to(device), args.guidance)
    if args.gradient_checkpointing:
        core.enable_gradient_checkpointing()
    routes = parse_routes(args.routes)
    if routes:
        import tread_fx

        tread_fx.route(core, routes=routes, rate=args.rate, selection=args.selection)
    return core, adapter, routes


def setup(args: argparse.Namespace) -> Run:
    """Accelerator, data, routed model, EMA, optimizer and ``accelerator.prepare``."""
    from accelerate.utils import DistributedType

    acc = make_accelerator(args)
    check_args(args, acc.num_processes)
    fsdp = acc.distributed_type == DistributedType.FSDP
    if fsdp and not acc.is_fsdp2:
        raise UsageError("this script shards with FSDP2: set fsdp_version: 2 in the config")
    data, num_classes = load_data(args, acc.device, diffusion.RectifiedFlow(0, 1, 1))
    shape = tuple(data["train_x"].shape[1:])
    core, adapter, routes = build_model(args, shape, num_classes, acc.device)
    n_train, micro = data["train_x"].shape[0], args.batch_size // args.grad_accum
    shards = make_shards(n_train, micro, acc.process_index, acc.num_processes, args.seed)
    run_dir.claim_run_dir(args)  # after every argument check; prepare() syncs the processes
    ema = diffusion.make_ema(core) if args.ema > 0 and not fsdp else None
    opt = torch.optim.AdamW(core.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model, opt = acc.prepare(core, opt)
    adapter.model = model
    torch.manual_seed(args.seed + 1000 * (acc.process_index + 1))  # noise, dropout, selection
    return Run(args, acc, Path(args.out), data, shape, num_classes, acc.unwrap_model(model),
               model, ema, adapter, routes, opt, fsdp, shards=shards)  # fmt: skip


def save(run: Run) -> Path:
    """``accelerator.save_state`` plus ``ema.safetensors`` and ``meta.json`` (all ranks call)."""
    root = run.out / "checkpoints"
    path = root / f"step_{run.step:07d}"
    run.acc.save_state(str(path))
    if run.acc.is_main_process:
        from safetensors.torch import save_file

        if run.ema is not None:
            save_file({k: v.contiguous() for k, v in run.ema.state_dict().items()},
                      str(path / "ema.safetensors"))  # fmt: skip
        meta = {"step": run.step, "train_time": run.train_time, "args": vars(run.args),
                "model_class": _class_name(run.core),
                "config": _config(run.core), "world_size": run.acc.num_processes}  # fmt: skip
        (path / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        (root / "latest.tmp").write_text(path.name)
        (root / "latest.tmp").replace(root / "latest")
        ckpt.prune_checkpoints(root, run.args.keep_checkpoints, path)
    run.acc.wait_for_everyone()
    return path


def _class_name(model: nn.Module) -> str:
    """The diffusers class of ``model`` (FSDP2 makes its class ``FSDP<name>``)."""
    return next(c.__name__ for c in type(model).__mro__ if c.__module__.startswith("diffusers."))


def _config(model: nn.Module) -> dict:
    """The model's constructor arguments as JSON values (not ``_name_or_path`` and the like)."""
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    return json.loads(json.dumps(config, default=str))


def resume(run: Run) -> None:
    """Loads ``--resume``: weights, optimizer and RNG states (accelerate), EMA, step and time."""
    path = ckpt.find_checkpoint(run.args.resume)
    try:
        meta = json.loads((path / "meta.json").read_text())
        step, train_time, config = int(meta["step"]), float(meta["train_time"]), meta["config"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ckpt.CheckpointError(f"{path}/meta.json: unreadable or incomplete ({err})") from None
    if config != _config(run.core):
        changed = sorted(k for k in config.keys() | _config(run.core).keys()
                         if config.get(k) != _config(run.core).get(k))  # fmt: skip
        raise ckpt.CheckpointError(f"{path}/meta.json: saved for another model config "
                                   f"(differs in {', '.join(changed)})")  # fmt: skip
    try:
        run.acc.load_state(str(path))
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ckpt.CheckpointError(f"{path}: cannot load ({line})") from None
    if run.ema is not None:
        ckpt._load_module(run.ema, path / "ema.safetensors")
    run.step, run.train_time = step, train_time
    run.say(f"resumed from {path} at step {run.step}")


@torch.no_grad()
def evaluate(run: Run) -> tuple[float, float | None]:
    """Held-out loss of the model and of its EMA, routing off (every rank computes it)."""
    d, losses = run.data, []
    for net in (run.core, run.ema):
        if net is None:
            losses.append(None)
            continue
        adapter = dataclasses.replace(run.adapter, model=net).eval()
        with run.acc.autocast():
            total = sum(
                run.objective.loss(adapter, x, y, t=t, noise=z).item() * x.shape[0]
                for x, y, t, z in zip(
                    *(d[k].split(256) for k in ("val_x", "val_y", "val_t", "val_noise"))
                )
            )
        losses.append(total / d["val_x"].shape[0])
    run.core.train()
    return losses[0], losses[1]


@torch.no_grad()
def sample_grid(run: Run, path: Path) -> None:
    """``--num-samples`` samples, one class per column, from the EMA (or the model), routing off.

    Every rank samples (an FSDP-sharded model needs all of them); the main process writes.
    """
    args, net = run.args, run.ema if run.ema is not None else run.core
    adapter = dataclasses.replace(run.adapter, model=net).eval()
    gen = torch.Generator(run.acc.device).manual_seed(0)
    labels = torch.arange(args.num_samples, device=run.acc.device) % run.num_classes
    with run.acc.autocast():
        x = diffusion.sample(run.objective, adapter, labels, run.shape, args.sample_steps,
                             args.sampler, args.cfg_scale, adapter.cond.null_id, gen)  # fmt: skip
    run.core.train()
    if run.acc.is_main_process:
        tu.save_grid(x.float(), path, min(run.num_classes, 10))


def train_step(run: Run) -> float:
    """One optimizer step of ``--grad-accum`` micro-batches; returns the mean loss."""
    args, acc, t0 = run.args, run.acc, time.perf_counter()
    total = 0.0
    for micro in range(args.grad_accum):
        idx = run.shards.indices(run.step * args.grad_accum + micro).to(acc.device)
        x0, ids = run.data["train_x"][idx], run.data["train_y"][idx]
        drop = torch.rand(ids.shape, device=ids.device) < args.label_drop
        ids = torch.where(drop, run.adapter.cond.null_id, ids)
        with acc.accumulate(run.model):  # prepare() made the forward autocast
            loss = run.objective.loss(run.adapter, x0, ids)
            acc.backward(loss)
            if acc.sync_gradients and args.grad_clip > 0:
                acc.clip_grad_norm_(run.model.parameters(), args.grad_clip)
            run.opt.step()
            run.opt.zero_grad(set_to_none=True)
        total += loss.item() / args.grad_accum
    (mean,) = tu.all_reduce_floats([total], acc.device, acc.num_processes)
    mean /= acc.num_processes
    if not math.isfinite(mean):
        raise TrainingError(f"loss is {mean} at step {run.step + 1}; lower --lr or use fp32")
    if run.ema is not None:
        diffusion.update_ema(run.ema, run.core, diffusion.warmup_ema_decay(args.ema, run.step))
    run.step += 1
    run.train_time += time.perf_counter() - t0
    return mean


def log_progress(run: Run, train_loss: float, since: tuple[int, float], last: bool) -> None:
    """Logs a metrics record (held-out losses when due) and prints one progress line."""
    args, step = run.args, run.step
    record = {"step": step, "time_s": round(run.train_time, 4), "train_loss": train_loss,
              "val_loss": None, "val_loss_ema": None, "lr": run.opt.param_groups[0]["lr"],
              "steps_per_s": (step - since[0]) / max(1e-9, run.train_time - since[1])}  # fmt: skip
    if step % args.eval_every == 0 or last:
        record["val_loss"], record["val_loss_ema"] = evaluate(run)
    run.logger.log(record)
    val = ""
    if record["val_loss"] is not None:
        ema = record["val_loss_ema"]
        val = f" | val {record['val_loss']:.4f}" + (f" (ema {ema:.4f})" if ema else "")
    eta = (args.steps - step) / max(record["steps_per_s"], 1e-9)
    run.say(f"step {step}/{args.steps} | loss {train_loss:.4f}{val} | "
            f"{record['steps_per_s']:.2f} it/s | ETA {tu.format_seconds(eta)}")  # fmt: skip


def prepare_output(run: Run) -> None:
    """Writes ``args.json``, opens the metrics logger, prints the setup."""
    args, acc = run.args, run.acc
    if acc.is_main_process:
        if args.overwrite and (removed := run_dir.clear_run(run.out)):
            run.say(f"--overwrite: removed the previous run's {', '.join(p.name for p in removed)}")
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / "args.json").write_text(json.dumps(vars(args), indent=1))
    run.logger = tu.Logger(run.out, acc.is_main_process)
    n_params = sum(p.numel() for p in run.core.parameters())
    kind = str(acc.distributed_type).split(".")[-1]
    run.say(
        f"{_class_name(run.core)} ({run.adapter.family} inputs): "
        f"{n_params / 1e6:.2f}M params, routes {run.routes or 'none'} rate "
        f"{args.rate if run.routes else 0}; data {args.data} {tuple(run.data['train_x'].shape)}; "
        f"text {run.adapter.cond.source}; {tu.processes(acc.num_processes, kind)} on "
        f"{acc.device}, mixed precision {acc.mixed_precision}, {torch.get_num_threads()} thread(s)"
    )


def training_loop(run: Run) -> float | None:
    """Trains to ``--steps``, logging, saving and sampling when due; returns the last loss."""
    args = run.args
    run.core.train()
    since, loss_sum, count, loss = (run.step, run.train_time), 0.0, 0, None
    bar = tqdm(total=args.steps, initial=run.step, dynamic_ncols=True,
               disable=True if not run.acc.is_main_process else None)  # fmt: skip
    while run.step < args.steps:
        loss = train_step(run)
        loss_sum, count = loss_sum + loss, count + 1
        bar.update(1)
        step, last = run.step, run.step >= args.steps
        if step % args.log_every == 0 or step % args.eval_every == 0 or last:
            log_progress(run, loss_sum / count, since, last)
            since, loss_sum, count = (step, run.train_time), 0.0, 0
        if args.save_every and step % args.save_every == 0 and not last:
            save(run)
        if args.sample_every and step % args.sample_every == 0 and not last:
            sample_grid(run, run.out / f"samples_{step:07d}.png")
    bar.close()
    return loss


def save_model(run: Run) -> Path:
    """The trained transformer (EMA weights when kept) as a diffusers folder, unrouted."""
    path = run.out / "transformer"
    state = run.acc.get_state_dict(run.model) if run.ema is None else run.ema.state_dict()
    if run.acc.is_main_process:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        run.core.save_config(str(path))
        config = json.loads((path / "config.json").read_text())  # fully_shard renamed the class
        config["_class_name"] = _class_name(run.core)
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(tensors, str(path / "diffusion_pytorch_model.safetensors"))
    return path


def train(args: argparse.Namespace) -> dict:
    """Runs training as configured by ``args``; returns a summary dictionary."""
    run = setup(args)
    if args.resume:
        resume(run)
    prepare_output(run)
    loss = training_loop(run)
    summary = {"step": run.step, "train_time": run.train_time, "final_loss": loss}
    summary["checkpoint"] = str(save(run))
    if run.acc.num_processes > 1 and not run.fsdp:  # DDP: the ranks must hold equal weights
        ok, checksum = tu.ranks_in_sync([run.core], run.acc.device, run.acc.num_processes)
        run.logger.log({"event": "sync_check", "step": run.step, "ok": ok,
                        "world_size": run.acc.num_processes, "checksum": checksum})  # fmt: skip
        run.say(f"rank sync check over {run.acc.num_processes} processes: {ok and 'ok'}")
        if not ok:
            raise TrainingError(f"parameters differ across ranks after step {run.step}")
    summary["transformer"] = str(save_model(run))
    sample_grid(run, run.out / "samples.png")
    summary["samples"] = str(run.out / "samples.png")
    run.say(f"samples: {summary['samples']}; model: {summary['transformer']}")
    run.acc.end_training()
    return summary


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    return run_cli(train, make_parser().parse_args(argv), "train_diffusers.py")


if __name__ == "__main__":
    sys.exit(main())
