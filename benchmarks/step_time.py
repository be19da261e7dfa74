"""Training-step time of TREAD routing: unrouted vs ``tread_fx.route()`` vs hand-written.

For each model, in one process and interleaved (round ``r`` runs every variant once), this
measures the forward + backward + AdamW step time of the three variants in eager and
``torch.compile`` mode, the FLOP ratio (the project's counter,
:func:`tread_fx.inspection.flops.flop_counter`: CPU attention included), the efficiency
(measured speed-up / FLOP-predicted speed-up), the activation-memory ratio and, for DiT-XL/2,
the time of the first routed call (trace + rewrite). Writes ``<out>.json`` and ``<out>.md``.

Usage:
    python -m benchmarks.step_time                       # the CPU preset (docs/results/)
    python -m benchmarks.step_time --preset gpu          # DiT-XL/2, batch 64, bf16, CUDA
    python -m benchmarks.step_time --models dit-s2 --modes eager --repeats 5
    python -m benchmarks.step_time --tiny --repeats 1 --modes eager --out /tmp/bench
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import measure
from benchmarks.report import evaluate_targets, summarise_mode, to_markdown, write_outputs
from benchmarks.specs import SPECS, ModelSpec, get_spec, make_inputs, model_available

__all__ = ["PRESETS", "parse_args", "run", "run_model", "main"]

PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(models="dit-s2,dit-b2,mamba,mamba-rows,rwkv,rwkv-random", modes="eager,compiled",
                repeats=12, warmup=2, device="cpu", dtype="fp32", first_call="dit-xl2",
                first_call_batch=1, model_budget=1200.0, out="docs/results/cpu_step_time",
                threads=1, clock="cpu"),
    "gpu": dict(models="dit-xl2", modes="eager,compiled", repeats=12, warmup=3, batch=64,
                device="cuda", dtype="bf16", first_call="dit-xl2", first_call_batch=64,
                model_budget=300.0, out="docs/results/gpu_step_time", threads=0, clock="wall"),
}  # fmt: skip
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FALLBACK = dict(PRESETS["cpu"], batch=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; unset options take the preset's value."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.step_time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="defaults for a machine (cpu when --device is cpu, gpu for cuda)",
    )
    p.add_argument("--models", help="comma list of: " + ", ".join(SPECS))
    p.add_argument("--modes", help="comma list of: eager, compiled")
    p.add_argument("--repeats", type=int, help="timed rounds (each runs every variant once)")
    p.add_argument("--warmup", type=int, help="untimed rounds first (compilation happens here)")
    p.add_argument("--batch", type=int, help="batch size (default: per model, 8 for DiT)")
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="autocast dtype (fp32: none)")
    p.add_argument(
        "--first-call",
        dest="first_call",
        help="model for the first-call overhead (dit-xl2), or 'none'",
    )
    p.add_argument("--first-call-batch", dest="first_call_batch", type=int)
    p.add_argument(
        "--model-budget",
        dest="model_budget",
        type=float,
        help="seconds of timed rounds per model before stopping early (>= 3 rounds)",
    )
    p.add_argument("--out", help="output path without suffix: writes <out>.json and <out>.md")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="every model at test size (depth 4, width 32, 16 tokens, batch 2)",
    )
    p.add_argument("--threads", type=int, help="torch.set_num_threads (0: torch's default)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        help="clock of the table and targets (both are recorded); cpu = process time",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    preset = args.preset or ("gpu" if (args.device or "").startswith("cuda") else None)
    defaults = PRESETS[preset] if preset else _FALLBACK
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.batch = getattr(args, "batch", None)
    args.preset = preset
    return args


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def _git_revision() -> str:
    """HEAD of the checkout the benchmark runs from (``+dirty`` with uncommitted changes)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "n/a"
    return head + ("+dirty" if dirty else "")  # fmt: skip


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _memory(setups, steps, device, autocast) -> dict[str, dict[str, int] | None]:
    """Per mode: bytes per variant (CPU: saved activations; CUDA: step peak)."""
    out: dict[str, dict[str, int] | None] = {}
    for setup in setups:
        if device.type == "cuda":
            out[setup.mode] = {
                v.name: measure.cuda_step_peak_bytes(setup, steps[(setup.mode, v.name)], device)
                for v in setup.variants
            }
        else:
            out[setup.mode] = {
                v.name: measure.saved_activation_bytes(setup.model, v.forward, autocast)
                for v in setup.variants
            }
    return out


def run_model(
    spec: ModelSpec, args: argparse.Namespace, device: torch.device, log: Callable[[str], None]
) -> dict[str, Any]:
    """Measure one model in every requested mode; returns its entry."""
    modes = args.modes.split(",")
    batch = args.batch or spec.batch
    inputs = make_inputs(spec, batch, device)
    target = inputs[3]
    dtype = _DTYPES[args.dtype]

    def autocast():
        return measure.autocast_for(device, dtype)

    setups = [measure.build_setup(spec, m, inputs, device, args.seed) for m in modes]
    eager = next((s for s in setups if s.mode == "eager"), None)
    counting = eager or measure.build_setup(spec, "eager", inputs, device, args.seed)
    with autocast():  # route() traces lazily (per grad mode): not part of the counted step
        counting.variants[1].forward()
    flops = {v.name: measure.count_flops(v.forward, target, autocast) for v in counting.variants}
    counting.optimizer.zero_grad(set_to_none=True)
    steps = {
        (s.mode, v.name): measure.make_step(s, v, target, autocast)
        for s in setups
        for v in s.variants
    }
    log(f"{spec.label}: batch {batch}, modes {modes}, FLOPs {flops}")
    deadline = time.monotonic() + args.model_budget if args.model_budget else None
    named = {f"{mode}/{name}": step for (mode, name), step in steps.items()}
    times, first = measure.time_interleaved(named, args.warmup, args.repeats, device, deadline, log)
    optimizer = {s.mode: measure.time_optimizer_step(s, device) for s in setups}
    memory = _memory(setups, steps, device, autocast)
    model = setups[0].model
    entry: dict[str, Any] = {
        "model": spec.name, "label": spec.label, "route": list(spec.route), "rate": spec.rate,
        "selection": spec.selection, "batch": batch, "note": spec.note,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens": model.grid_size[0] * model.grid_size[1], "kept": spec.kept_tokens(model),
        "flops": flops, "times_s": times, "optimizer_s": optimizer, "modes": {},
        "attention": measure.attention_kernels(counting.variants[1].forward, autocast),
    }  # fmt: skip
    for mode in modes:
        mode_first = {v: first[f"{mode}/{v}"] for v in measure.VARIANTS if f"{mode}/{v}" in first}
        entry["modes"][mode] = {
            clock: summarise_mode(
                {v: times[clock][f"{mode}/{v}"] for v in measure.VARIANTS},
                mode_first, flops, memory.get(mode), optimizer[mode][clock],
            )
            for clock in measure.CLOCKS
        }  # fmt: skip
    return entry


def _first_call(args: argparse.Namespace, device: torch.device, log) -> dict[str, Any] | None:
    if not args.first_call or args.first_call == "none":
        return None
    spec = get_spec(args.first_call, tiny=args.tiny)
    batch = args.first_call_batch or 1
    inputs = make_inputs(spec, batch, device)
    dtype = _DTYPES[args.dtype]
    log(f"first call: {spec.label}, batch {batch}")
    result = measure.first_call_overhead(
        spec, inputs, device, lambda: measure.autocast_for(device, dtype)
    )
    tokens = (spec.input_size() // 2) ** 2
    log(f"  {result}")
    return {"model": spec.name, "label": spec.label, "batch": batch, "tokens": tokens,
            "route": list(spec.route), **result}  # fmt: skip


def _method_notes(device: torch.device) -> list[str]:
    memory = measure.MEMORY_METHOD_CUDA if device.type == "cuda" else measure.MEMORY_METHOD_CPU
    return [
        "step = zero_grad, forward, MSE loss on every output token, backward, AdamW step; the "
        "three variants of a model share one model and one optimizer per mode",
        "interleaved: every round runs each variant once, mode by mode, in a balanced order "
        "(Williams design: over 6 rounds each variant follows each other variant of its mode "
        "twice; the modes swap places every 6 rounds); times are medians over rounds; "
        "speed-ups and route()/hand are medians of per-round ratios",
        "FLOPs: tread_fx.inspection.flops.flop_counter (torch's FlopCounterMode plus the CPU "
        "attention kernel's formula and a groups-aware convolution backward) over one eager "
        "forward + backward (matmul, convolution, attention); FLOP-predicted speed-up = "
        "1 / FLOP ratio; "
        "efficiency = measured speed-up / predicted speed-up; the optimizer step is timed but "
        "not counted",
        f"memory: {memory}",
        "compiled: torch.compile(fullgraph=True, dynamic=False) of the forward of each variant "
        "(route(compile=True) for route()); the optimizer step stays eager",
        "hand-written: benchmarks/handwritten.py, sorted random ids drawn per step, gather "
        "before block start, scatter into the route-start stream after block end-1",
        "optimizer s/step: the AdamW step alone (median of 3, after the rounds); routing does "
        "not shrink it and FLOPs do not count it, so 'efficiency route() fwd+bwd only' = "
        "(unrouted - optimizer) / (route() - optimizer) x FLOP ratio, from the median times",
        "first call: fresh model, one untimed plain training forward, then the plain training "
        "forward (median of 3), then route() and the first and second routed training calls",
    ]


def _release(device: torch.device, log: Callable[[str], None]) -> None:
    """Free the finished model's memory (and compiled graphs) before the next one is built."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):  # glibc keeps freed heap otherwise
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    log(f"  released; resident memory now {_rss()}")


def _rss() -> str:
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return line.split(":", 1)[1].strip()
    return "n/a"


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the whole benchmark and return the results (also written to ``args.out``)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and args.clock == "cpu":
        raise SystemExit("--clock cpu measures host CPU time: use the wall clock on CUDA")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    device = torch.device(args.device)
    results: dict[str, Any] = {"meta": {
        "command": "python -m benchmarks.step_time " + shlex.join(sys.argv[1:]),
        "torch": torch.__version__, "device": str(device), "device_name": _device_name(device),
        "threads": torch.get_num_threads(), "dtype": args.dtype, "load_start": _load(),
        "method": _method_notes(device), "tiny": args.tiny, "clock": args.clock,
        "git": _git_revision(),
    }, "models": [], "skipped": []}  # fmt: skip
    for name in [n for n in args.models.split(",") if n and n != "none"]:
        spec = get_spec(name, tiny=args.tiny)
        if not model_available(spec):
            results["skipped"].append(f"{spec.label}: tread_fx.models.{spec.module} not present")
            continue
        results["models"].append(run_model(spec, args, device, log))
        _release(device, log)
    results["first_call"] = _first_call(args, device, log)
    results["meta"]["load_end"] = _load()
    results["targets"] = evaluate_targets(results)
    paths = write_outputs(results, args.out)
    log(to_markdown(results))
    log(f"wrote {paths[0]} and {paths[1]}")
    return results


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = parse_args(argv)
    run(args, log=(lambda _: None) if args.quiet else print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
