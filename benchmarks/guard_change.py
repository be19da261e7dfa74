"""A runtime guard that fails on the device: the routed model traces again and keeps training.

A model whose own forward reads tensor data (``if mask.any():``) routes with a runtime guard
(``tread_fx.runtime.guards``). This script routes such a model, trains a step, then changes the
data so the guard fails: the routed call must trace again and return what the unrouted model
returns, and the device must stay usable (a device-side assert would poison a CUDA context).
It also times a routed call with its guard against the same call without data-dependent code.

Usage:
    python -m benchmarks.guard_change --device cuda     # part of benchmarks/gpu.sh
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import tread_fx

__all__ = ["MaskedBackbone", "run", "main"]


class MaskedBackbone(nn.Module):
    """Tokens through a block stack; the forward branches on ``mask.any()`` (a guard)."""

    def __init__(self, width: int = 64, depth: int = 6, guarded: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 4)
        self.guarded = guarded

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.guarded and mask.any():  # read from tensor data: a runtime guard
            h = h * 2
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _time_calls(model: nn.Module, x: torch.Tensor, mask: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        model(x, mask)
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        model(x, mask)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def run(device: str, repeats: int = 50) -> dict[str, float]:
    """Run the guard change on ``device``; return timings (microseconds) and the re-trace time.

    Example:
        >>> sorted(run("cpu", repeats=2))
        ['guarded_us', 'retrace_s', 'unguarded_us']
    """
    dev = torch.device(device)
    torch.manual_seed(0)
    model = MaskedBackbone().to(dev)
    x = torch.randn(8, 64, 4, device=dev)
    on, off = torch.ones(8, 3, dtype=torch.bool, device=dev), torch.zeros(8, 3, dtype=torch.bool)
    off = off.to(dev)
    with torch.no_grad():
        expected = model.train()(x, off)
    tread_fx.route(model, routes=[(1, 5)], rate=0.0, seed=0)
    model.train()(x, on).square().mean().backward()  # traced with the guard
    start = time.perf_counter()
    with torch.no_grad():
        changed = model(x, off)  # the guard fails on the device: traced again
    retrace = time.perf_counter() - start
    if not torch.allclose(changed, expected, atol=1e-5):
        raise AssertionError("the re-traced call differs from the unrouted model")
    model(x, off).square().mean().backward()  # the device is still usable: train on
    if dev.type == "cuda":
        torch.cuda.synchronize()
    plain = tread_fx.route(MaskedBackbone(guarded=False).to(dev), routes=[(1, 5)], rate=0.0)
    return {
        "retrace_s": retrace,
        "guarded_us": _time_calls(model.train(), x, off, repeats),
        "unguarded_us": _time_calls(plain.train(), x, off, repeats),
    }


def main(argv: list[str] | None = None) -> None:
    """Print the guard-change result and the per-call cost of the guard."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    row = run(args.device, args.repeats)
    print(
        f"guard change on {args.device}: traced again in {row['retrace_s']:.2f} s, same output "
        f"as the unrouted model, device still usable; routed call with its guard "
        f"{row['guarded_us']:.0f} us, without data-dependent code {row['unguarded_us']:.0f} us"
    )


if __name__ == "__main__":
    main()
