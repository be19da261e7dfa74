"""Per-call cost of a routed call's checks (call signature, module modes, hooks added later).

Builds a DiT with the module tree of DiT-S/2 (12 blocks) and of DiT-XL/2 (28 blocks, 606
modules) at a tiny width (the checks do not depend on the width), routes it, traces it once,
then times, per call: the checks as ``route()`` does them now (:class:`ModuleModes`: a cached
module tuple, the hook-handle counter) against the previous per-call walk
(``model.modules()`` for the modes, ``has_call_hooks`` over every inlined module).

Usage:
    python -m benchmarks.call_overhead [--repeats 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils import _pytree as pytree

import tread_fx
from tread_fx.api import _STATE
from tread_fx.module_state import call_signature
from tread_fx.passes.trace.support import has_call_hooks

__all__ = ["measure", "main"]


def _walk_checks(model: torch.nn.Module, state, spec, flat) -> None:
    """The checks as every call made them before (walks the whole module tree)."""
    modes = tuple(m.training for m in model.modules())
    call_signature(spec, flat, modes)
    entry = next(iter(state.entries.values()))
    any(has_call_hooks(m) for m in entry.inlined)


def _cached_checks(model: torch.nn.Module, state, spec, flat) -> None:
    """The checks as ``route()`` makes them now."""
    hooks_added = state.modules.hooks_changed()
    call_signature(spec, flat, state.modules.modes(model, hooks_added))


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(depth: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of both ways of checking, for a DiT of ``depth`` blocks.

    Example:
        >>> row = measure(depth=2, repeats=5)
        >>> sorted(row)
        ['cached_us', 'depth', 'modules', 'walk_us']
    """
    torch.manual_seed(0)
    model = tread_fx.models.DiT(
        input_size=8, patch_size=2, in_channels=1, num_classes=10, depth=depth,
        hidden_size=32, num_heads=2,
    )  # fmt: skip
    tread_fx.route(model, routes=[(1, depth - 1)], seed=0)
    inputs = (torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2]))
    model.train()(*inputs)  # traced
    state = model.__dict__[_STATE]
    flat, spec = pytree.tree_flatten((inputs, {}))
    return {
        "depth": depth,
        "modules": len(list(model.modules())),
        "walk_us": _median_us(lambda: _walk_checks(model, state, spec, flat), repeats),
        "cached_us": _median_us(lambda: _cached_checks(model, state, spec, flat), repeats),
    }


def main(argv: list[str] | None = None) -> None:
    """Print one line per model size: module count, both costs, and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args(argv)
    for depth, name in ((12, "DiT-S/2 tree"), (28, "DiT-XL/2 tree")):
        row = measure(depth, args.repeats)
        print(
            f"{name}: {row['modules']} modules, per-call checks {row['cached_us']:.1f} us "
            f"(walking every module: {row['walk_us']:.1f} us, "
            f"{row['walk_us'] / row['cached_us']:.1f}x)"
        )


if __name__ == "__main__":
    main()
