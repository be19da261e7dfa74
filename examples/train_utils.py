"""Helpers of ``train.py``: data sharding, metric logging, PNG grids, distributed utilities."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from diffusion import sample

__all__ = ["CSV_FIELDS", "Logger", "Shards", "all_reduce_floats", "gather_rng_states", "generate"]
__all__ += ["final_fid", "format_seconds", "processes", "ranks_in_sync", "save_grid"]

CSV_FIELDS = ("step", "time_s", "train_loss", "val_loss", "val_loss_ema", "steps_per_s", "lr")


class Shards:
    """Per-step global batch indices: a fresh permutation per epoch, rank ``r`` takes ``r::world``.

    Depends only on ``(seed, step)``, so a resumed run draws exactly the batches it would have.
    """

    def __init__(self, n: int, batch: int, rank: int, world: int, seed: int) -> None:
        if n < batch:
            raise ValueError(f"only {n} training images, fewer than --batch-size {batch}")
        self.n, self.batch, self.rank, self.world, self.seed = n, batch, rank, world, seed
        self.per_epoch, self._epoch, self._perm = n // batch, -1, None

    def indices(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=gen)
        return self._perm[i * self.batch : (i + 1) * self.batch][self.rank :: self.world]


def save_grid(images: torch.Tensor, path: Path, nrow: int) -> None:
    """Saves images ``[N, C, H, W]`` in ``[-1, 1]`` as a PNG grid (latents: first 3 channels,
    min-max scaled per image), upscaled with nearest neighbours to at least 32 pixels."""
    from PIL import Image

    x = images.detach().float().cpu()
    if x.shape[1] not in (1, 3):
        x = x[:, :3] if x.shape[1] > 3 else x[:, :1]
        lo, hi = x.amin((1, 2, 3), keepdim=True), x.amax((1, 2, 3), keepdim=True)
        x = (x - lo) / (hi - lo).clamp_min(1e-8) * 2 - 1
    n, c, h, w = x.shape
    scale = max(1, math.ceil(32 / max(h, w)))
    x = x.repeat_interleave(scale, 2).repeat_interleave(scale, 3)
    rows = math.ceil(n / nrow)
    grid = torch.full((c, rows * (h * scale + 2) + 2, nrow * (w * scale + 2) + 2), -1.0)
    for k in range(n):
        r, col = divmod(k, nrow)
        top, left = 2 + r * (h * scale + 2), 2 + col * (w * scale + 2)
        grid[:, top : top + h * scale, left : left + w * scale] = x[k]
    pixels = ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(pixels[..., 0] if c == 1 else pixels).save(path)


def processes(count: int, kind: str | None = None) -> str:
    """``1 process`` or ``2 processes (MULTI_CPU)``, for the setup line of a run.

    Example:
        >>> processes(1, "NO"), processes(2, "MULTI_CPU")
        ('1 process', '2 processes (MULTI_CPU)')
    """
    if count == 1:
        return "1 process"
    return f"{count} processes" + (f" ({kind})" if kind and kind != "NO" else "")


class Logger:
    """Appends records to ``metrics.jsonl``; step records also to ``metrics.csv`` (rank 0 only)."""

    def __init__(self, out: Path, enabled: bool) -> None:
        self.enabled, self.jsonl, self.csv = enabled, out / "metrics.jsonl", out / "metrics.csv"

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if "event" not in record:
            new = not self.csv.exists()
            with self.csv.open("a", newline="") as f:
                writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
                if new:
                    writer.writeheader()
                writer.writerow(record)


def gather_rng_states(gen: torch.Generator, device: torch.device, rank: int, world: int) -> dict:
    """Every rank's CPU, noise-generator (and CUDA) RNG states, keyed ``"<kind>/<rank>"``.

    A collective: all ranks must call it. Every rank receives every state.
    """
    local = {"cpu": torch.get_rng_state(), "gen": gen.get_state()}
    if device.type == "cuda":
        local["cuda"] = torch.cuda.get_rng_state(device)
    gathered = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
    return {f"{k}/{r}": v.cpu() for r, states in enumerate(gathered) for k, v in states.items()}


def all_reduce_floats(
    values: list[float], device: torch.device, world: int, op=None
) -> list[float]:
    """All-reduces a few floats (float64; sum by default); the identity for one process."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def ranks_in_sync(modules, device: torch.device, world: int) -> tuple[bool, list[float]]:
    """Whether all ranks hold identical parameters: a checksum (sum, sum of squares, in float64)
    is all-reduced with MAX and MIN, which agree only if every rank has the same value."""
    params = [p.detach().double() for m in modules for p in m.parameters()]
    checksum = [sum(float(p.sum()) for p in params), sum(float(p.square().sum()) for p in params)]
    hi = all_reduce_floats(checksum, device, world, dist.ReduceOp.MAX)
    lo = all_reduce_floats(checksum, device, world, dist.ReduceOp.MIN)
    return hi == lo, checksum


@torch.no_grad()
def generate(objective, model, n: int, num_classes: int, shape, args, device, seed: int):
    """Class-balanced samples (labels ``0, 1, ..., 0, 1, ...``) from ``model`` in eval mode."""
    model.eval()
    gen = torch.Generator(device).manual_seed(seed)
    labels = torch.arange(n, device=device) % num_classes
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.bf16)
    out = []
    with autocast:
        for chunk in labels.split(256):
            out.append(
                sample(
                    objective,
                    model,
                    chunk,
                    shape,
                    args.sample_steps,
                    args.sampler,
                    args.cfg_scale,
                    num_classes,
                    gen,
                )
            )
    return torch.cat(out).float()


def sample_fid(
    args, objective, ema, train_x, train_y, num_classes, shape, device, n: int, say=print
) -> dict:
    """FID/KID of ``n`` EMA samples against ``n`` training images, plus their class accuracy.

    Samples are class-balanced (see :func:`generate`, seed 1); the real images are a fixed
    draw (seed 7). ``class_accuracy`` is the share of samples that the feature network's own
    classifier assigns to the class they were generated for: a per-class check that FID alone
    misses (a model that draws good digits of the wrong class).
    """
    import metrics

    fake = generate(objective, ema, n, num_classes, shape, args, device, 1).cpu()
    pick = torch.randperm(train_x.shape[0], generator=torch.Generator().manual_seed(7))[:n]
    real = train_x[pick].cpu()
    net, acc = metrics.train_feature_net(
        train_x.cpu(), train_y.cpu(), num_classes, name=args.data, cache_dir=args.cache_dir, log=say
    )
    result = metrics.fid_kid(real, fake, metrics.FeatureExtractor(net))
    with torch.no_grad():
        labels = torch.arange(n) % num_classes
        predicted = torch.cat([net(chunk).argmax(1) for chunk in fake.split(512)])
    result["class_accuracy"] = float((predicted == labels).float().mean())
    result.update(feature_net_accuracy=acc, num_samples=n)
    if args.inception_fid:
        result["inception_fid"] = metrics.inception_fid(real, fake)
    return result


def final_fid(
    args, objective, ema, train_x, train_y, num_classes, shape, device, logger, step, say
) -> dict:
    """FID/KID of ``--fid-samples`` EMA samples (see :func:`sample_fid`), logged."""
    result = sample_fid(
        args, objective, ema, train_x, train_y, num_classes, shape, device, args.fid_samples, say
    )
    logger.log({"event": "fid", "step": step, **result})
    say("final: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items() if v is not None))
    return result


def format_seconds(seconds: float) -> str:
    """``h:mm:ss`` (or ``m:ss``) for progress lines.

    Example:
        >>> format_seconds(3725.2), format_seconds(65)
        ('1:02:05', '1:05')
    """
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
