"""Forward+backward time of ONE block of each reference backbone, side by side.

Measures a DiT, Mamba and RWKV block of the same width on the same input (batch 8, 256
tokens, width 384 by default), interleaved round-robin in one process so that machine noise
hits all three alike, and prints medians and the ratio to the DiT block.

Usage:
    python -m benchmarks.block_time [--batch 8 --tokens 256 --width 384 --repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tread_fx.models import dit, mamba, rwkv

__all__ = ["make_blocks", "measure_blocks", "main"]


def make_blocks(width: int, tokens: int) -> dict[str, torch.nn.Module]:
    """One block of each family at ``width`` (heads of 64 channels for the DiT block)."""
    grid_width = int(tokens**0.5)
    return {
        "dit": dit.DiTBlock(width, num_heads=max(1, width // 64)),
        "mamba": mamba.MambaBlock(width),
        "rwkv": rwkv.RWKVBlock(width, grid_width=grid_width),
    }


def _step(name: str, block: torch.nn.Module, x: torch.Tensor, c: torch.Tensor) -> None:
    x = x.detach().requires_grad_(True)
    if name == "mamba":
        hidden, residual = block(x, torch.zeros_like(x), c)
        out = hidden + residual
    else:
        out = block(x, c)
    out.square().mean().backward()


def measure_blocks(batch: int, tokens: int, width: int, repeats: int, warmup: int) -> dict:
    """Median fwd+bwd seconds per block family, measured round-robin."""
    torch.manual_seed(0)
    blocks = make_blocks(width, tokens)
    x, c = torch.randn(batch, tokens, width), torch.randn(batch, width)
    times: dict[str, list[float]] = {name: [] for name in blocks}
    for i in range(warmup + repeats):
        for name, block in blocks.items():
            start = time.perf_counter()
            _step(name, block, x, c)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(v) for name, v in times.items()}
    return {
        "config": {"batch": batch, "tokens": tokens, "width": width, "repeats": repeats},
        "threads": torch.get_num_threads(),
        "median_s": medians,
        "ratio_to_dit": {name: medians[name] / medians["dit"] for name in medians},
    }


def main(argv: list[str] | None = None) -> dict:
    """Parse arguments, measure, print a table and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    result = measure_blocks(args.batch, args.tokens, args.width, args.repeats, args.warmup)
    print("| block | fwd+bwd median (s) | ratio to DiT block |\n|---|---|---|")
    for name, seconds in result["median_s"].items():
        print(f"| {name} | {seconds:.4f} | {result['ratio_to_dit'][name]:.2f} |")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
