"""Our DiT + ``route()`` beside the authors' hand-edited DiT, interleaved in one process.

The authors' code (github.com/CompVis/tread: ``dit.py`` and ``routing_module.py``) is imported
at run time from ``--official PATH`` (the repository root, or the path of its ``dit.py``); it is
never copied into this project. Both models are built at the same size (width, depth, heads,
patch, tokens, ``learn_sigma``) and hold the same weights (ours are loaded into theirs); their
routing runs at the same blocks and rate as ours (our half-open route ``(start, end)`` is their
inclusive ``{"start_layer_idx": start, "end_layer_idx": end - 1}``). Before timing, two checks
show that the two are the same network: equal outputs unrouted (eval) and routed with the same
kept tokens.

Timed variants (one fwd + MSE loss + bwd + AdamW step each, :mod:`benchmarks.measure`):

- ``authors unrouted`` / ``authors routed``: their ``DiT`` with ``enable_routing`` off / on,
  ``class_drop_prob=0.1`` (what their training passes; our label dropout is 0.1 too);
- ``ours unrouted`` (``type(model).forward``), ``ours route()`` (``tread_fx.route``) and
  ``ours hand-written`` (:mod:`benchmarks.handwritten`: separates the model from the pass).

Their ``TransformerBlock.forward`` and ``FinalLayer.forward`` carry ``@torch.compile``; it is
stripped at import (the eager rows compare eager code; ``--keep-official-compile`` keeps it).
Their ``dit.py`` needs ``numpy`` and ``timm`` (``timm.models.vision_transformer``: ``Attention``,
``Mlp``, ``PatchEmbed``, the same timm layers as ours), both in this project's environment.

Usage:
    python -m benchmarks.official --official /path/to/tread --threads 2 --repeats 9
    python -m benchmarks.official --official /path/to/tread --tiny --repeats 1 --warmup 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import tread_fx
from benchmarks import measure
from benchmarks.coverage_checks import randomize_zero_init
from benchmarks.handwritten import dit_forward
from benchmarks.specs import SPECS, ModelSpec, get_spec, make_inputs

__all__ = ["VARIANTS", "load_official", "build_official", "check_same_network", "run", "main"]

VARIANTS = ("authors unrouted", "authors routed", "ours unrouted", "ours route()",
            "ours hand-written")  # fmt: skip
LABEL_DROPOUT = 0.1


@contextlib.contextmanager
def _without_torch_compile() -> Iterator[None]:
    """Make ``@torch.compile`` (with or without arguments) return the function unchanged."""
    original = torch.compile

    def identity(model: Any = None, **kwargs: Any) -> Any:
        return (lambda fn: fn) if model is None else model

    torch.compile = identity
    try:
        yield
    finally:
        torch.compile = original


def load_official(path: str | Path, keep_compile: bool = False) -> types.ModuleType:
    """Import the authors' ``dit.py`` (with its sibling ``routing_module.py``) from ``path``.

    Args:
        path: Their repository root, or the path of their ``dit.py``.
        keep_compile: Keep their ``@torch.compile`` decorators (default: stripped).

    Returns:
        Their ``dit`` module, under the private name ``tread_official_dit``.

    Raises:
        SystemExit: When the files are missing or a dependency of theirs is not installed.
    """
    path = Path(path).expanduser()
    dit_path = path if path.suffix == ".py" else path / "dit.py"
    router_path = dit_path.with_name("routing_module.py")
    missing = [str(p) for p in (dit_path, router_path) if not p.is_file()]
    if missing:
        raise SystemExit(
            f"--official {path}: {', '.join(missing)} not found; pass the root of a checkout "
            "of github.com/CompVis/tread (it holds dit.py and routing_module.py)."
        )
    saved = sys.modules.get("routing_module")
    try:  # their dit.py does `from routing_module import Router`
        sys.modules["routing_module"] = _exec_module("tread_official_router", router_path)
        with contextlib.nullcontext() if keep_compile else _without_torch_compile():
            return _exec_module("tread_official_dit", dit_path)
    except ModuleNotFoundError as err:
        raise SystemExit(
            f"the authors' {dit_path.name} imports {err.name!r}, which is not installed here "
            "(it needs numpy and timm); install it into this environment."
        ) from err
    finally:
        if saved is None:
            sys.modules.pop("routing_module", None)
        else:
            sys.modules["routing_module"] = saved


def _exec_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _our_config(model: nn.Module) -> dict[str, Any]:
    """The size of our DiT, in the authors' constructor arguments."""
    size = model.grid_size[0] * model.patch_size
    if model.grid_size[0] != model.grid_size[1]:
        raise SystemExit("the authors' DiT takes square inputs only; use a square input_size")
    return dict(
        input_size=size, patch_size=model.patch_size, in_channels=model.in_channels,
        hidden_size=model.pos_embed.shape[-1], depth=len(model.blocks),
        num_heads=model.num_heads, mlp_ratio=model.blocks[0].mlp.fc1.out_features
        / model.pos_embed.shape[-1], num_classes=model.num_classes,
        learn_sigma=model.learn_sigma,
    )  # fmt: skip


def build_official(
    module: types.ModuleType, ours: nn.Module, route: tuple[int, int], rate: float
) -> nn.Module:
    """The authors' DiT at our model's size, routing ``route`` at ``rate``, with our weights.

    Raises:
        SystemExit: When our weights do not load into theirs (a different architecture).
    """
    start, end = route
    routes = [{"selection_ratio": rate, "start_layer_idx": start, "end_layer_idx": end - 1}]
    theirs = module.DiT(**_our_config(ours), cond_mode="adaln", enable_routing=True, routes=routes)
    try:
        theirs.load_state_dict(ours.state_dict(), strict=True)
    except RuntimeError as err:
        raise SystemExit(f"our DiT's weights do not load into the authors' DiT: {err}") from err
    return theirs.to(next(ours.parameters()).device).train()


def check_same_network(
    theirs: nn.Module,
    ours: nn.Module,
    inputs: tuple[Tensor, ...],
    route: tuple[int, int],
    ids: Tensor,
) -> dict[str, float]:
    """Max abs difference of the two models' outputs, unrouted (eval) and routed on ``ids``.

    Runs on copies whose zero-initialised weights (adaLN-Zero) are randomised, so that the
    outputs are not trivially zero; the timed models are untouched. The routed comparison
    hands the same kept tokens ``ids`` [B, k] to their router and to our hand-written forward
    (which :mod:`tests.test_benchmarks` checks against ``route()``).
    """
    ours, theirs = copy.deepcopy(ours), copy.deepcopy(theirs)
    randomize_zero_init(ours)
    theirs.load_state_dict(ours.state_dict())
    theirs.router.get_mask = lambda x, selection_rate=0.0: ids
    x, t, y, _ = inputs
    with torch.no_grad():
        plain = (ours.eval()(x, t, y) - theirs.eval()(x, t, y)).abs().max()
        routed_theirs = theirs(x, t, y, force_routing=True)
        routed = (dit_forward(ours, x, t, y, ids, *route) - routed_theirs).abs().max()
    return {"unrouted": float(plain), "routed": float(routed)}


def _variants(
    spec: ModelSpec, ours: nn.Module, theirs: nn.Module, inputs: tuple[Tensor, ...], seed: int
) -> dict[str, tuple[nn.Module, Callable[[], Tensor]]]:
    """Every variant's model (for its optimizer) and training forward."""
    x, t, y, _ = inputs
    start, end = spec.route
    generator = torch.Generator(x.device).manual_seed(seed)

    def official(routed: bool) -> Callable[[], Tensor]:
        def forward() -> Tensor:
            theirs.enable_routing = routed
            return theirs(x, t, y, class_drop_prob=LABEL_DROPOUT)

        return forward

    def hand() -> Tensor:
        ids = spec.draw_ids(ours, x.shape[0], generator, x.device)
        return dit_forward(ours, x, t, y, ids, start, end)

    return {
        "authors unrouted": (theirs, official(False)),
        "authors routed": (theirs, official(True)),
        "ours unrouted": (ours, lambda: type(ours).forward(ours, x, t, y)),
        "ours route()": (ours, lambda: ours(x, t, y)),
        "ours hand-written": (ours, hand),
    }


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float | None:
    if a in times and b in times:
        return measure.paired_ratio(times[a], times[b])
    return None


def summarise(times: dict[str, list[float]], flops: dict[str, int]) -> dict[str, Any]:
    """Medians, the ours/authors ratios (targets <= 1), speed-ups, FLOP ratios, efficiencies.

    Example:
        >>> t = {"authors unrouted": [2.0], "authors routed": [1.3], "ours unrouted": [2.0],
        ...      "ours route()": [1.4]}
        >>> f = {"authors unrouted": 3, "authors routed": 2, "ours unrouted": 3, "ours route()": 2}
        >>> s = summarise(t, f)
        >>> round(s["ours/authors routed"], 3), round(s["efficiency"]["ours route()"], 3)
        (1.077, 0.952)
    """
    out: dict[str, Any] = {
        "median_s": {v: measure.median(ts) for v, ts in times.items()},
        "ours/authors unrouted": _ratio(times, "ours unrouted", "authors unrouted"),
        "ours/authors routed": _ratio(times, "ours route()", "authors routed"),
        "ours hand-written/authors routed": _ratio(times, "ours hand-written", "authors routed"),
        "route()/hand-written": _ratio(times, "ours route()", "ours hand-written"),
        "speedup": {}, "flop_ratio": {}, "efficiency": {},
    }  # fmt: skip
    for routed in ("authors routed", "ours route()", "ours hand-written"):
        plain = "authors unrouted" if routed.startswith("authors") else "ours unrouted"
        if routed in times and plain in times:
            speedup = measure.paired_ratio(times[plain], times[routed])
            flop_ratio = flops[routed] / flops[plain]
            out["speedup"][routed] = speedup
            out["flop_ratio"][routed] = flop_ratio
            out["efficiency"][routed] = speedup * flop_ratio
    return out


def to_markdown(result: dict[str, Any]) -> str:
    """The run as a markdown table, one row per variant, then the ratios."""
    meta, s = result["meta"], result["summary"]
    lines = [
        f"Authors' DiT vs ours ({meta['model']}, route {tuple(meta['route'])} rate "
        f"{meta['rate']}, batch {meta['batch']}, {meta['threads']} thread(s), "
        f"{meta['rounds']} interleaved rounds, {meta['clock']} clock)",
        "",
        "| variant | median s/step | FLOPs (G) | speed-up | FLOP ratio | efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for v, median in s["median_s"].items():
        cells = [f"{s[k][v]:.3f}" if v in s[k] else "" for k in ("speedup", "flop_ratio")]
        eff = f"{s['efficiency'][v]:.3f}" if v in s["efficiency"] else ""
        lines.append(
            f"| {v} | {median:.3f} | {result['flops'][v] / 1e9:.2f} | {cells[0]} | "
            f"{cells[1]} | {eff} |"
        )
    lines.append("")
    for key in ("ours/authors unrouted", "ours/authors routed",
                "ours hand-written/authors routed", "route()/hand-written"):  # fmt: skip
        if s[key] is not None:
            lines.append(f"- {key} (median of per-round ratios): {s[key]:.3f}")
    checks = result["same_network"]
    lines.append(
        f"- same network: max |ours - authors| unrouted {checks['unrouted']:.2e}, routed with "
        f"the same kept tokens {checks['routed']:.2e}"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build both models, check them, time the variants interleaved; returns the result."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    module = load_official(args.official, keep_compile=args.keep_official_compile)
    spec = get_spec(args.model, tiny=args.tiny)
    batch = args.batch or spec.batch
    inputs = make_inputs(spec, batch, device)
    ours = spec.build(args.seed).to(device)
    theirs = build_official(module, ours, spec.route, spec.rate)
    tread_fx.route(ours, routes=[spec.route], rate=spec.rate, seed=args.seed)
    none = contextlib.nullcontext
    ours(*inputs[:3])  # route() traces lazily, on the first training call: not timed
    check_ids = spec.draw_ids(ours, batch, torch.Generator(device).manual_seed(1), device)
    same = check_same_network(theirs, ours, inputs, spec.route, check_ids)
    log(f"same network: max abs difference {same}")
    tolerance = 1e-4
    if max(same.values()) > tolerance:
        raise SystemExit(f"the two models disagree by more than {tolerance}: {same}")
    variants = _variants(spec, ours, theirs, inputs, args.seed)
    variants = {v: variants[v] for v in args.variants.split(",")}
    flops = {v: measure.count_flops(fwd, inputs[3], none) for v, (_, fwd) in variants.items()}
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (ours, theirs)}
    steps = {}
    for name, (model, forward) in variants.items():
        setup = measure.Setup(spec, "eager", model, optimizers[id(model)])
        steps[name] = measure.make_step(setup, measure.Variant(name, "eager", forward),
                                        inputs[3], none)  # fmt: skip
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    log(f"{spec.label}: batch {batch}, FLOPs {flops}")
    times, _ = measure.time_interleaved(steps, args.warmup, args.repeats, device, log=log)
    result = {
        "meta": {
            "model": spec.label, "route": list(spec.route), "rate": spec.rate, "batch": batch,
            "threads": torch.get_num_threads(), "clock": args.clock, "device": str(device),
            "rounds": len(times[args.clock][next(iter(steps))]), "torch": torch.__version__,
            "official": str(args.official), "official_compile": args.keep_official_compile,
        },
        "same_network": same, "flops": flops, "times_s": times,
        "summary": summarise(times[args.clock], flops),
    }  # fmt: skip
    log(to_markdown(result))
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(to_markdown(result) + "\n")
        log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.official", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--official", required=True, help="checkout of CompVis/tread, or its dit.py")
    dits = [name for name, spec in SPECS.items() if spec.module == "dit"]
    p.add_argument("--model", default="dit-s2", choices=dits)
    p.add_argument("--repeats", type=int, default=9, help="timed interleaved rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--batch", type=int, help="batch size (default: the spec's, 8)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    p.add_argument("--clock", choices=measure.CLOCKS, default="wall")
    p.add_argument("--device", default="cpu")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " +
                   ", ".join(VARIANTS))  # fmt: skip
    p.add_argument("--keep-official-compile", action="store_true",
                   help="keep the @torch.compile of their block and final layer")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="test size: depth 4, width 32, 16 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write <out>.json and <out>.md")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = parse_args(argv)
    run(args, log=(lambda _: None) if args.quiet else print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
