"""Instructions per training step: unrouted vs ``tread_fx.route()`` vs hand-written (callgrind).

A noise-free companion to :mod:`benchmarks.step_time`: on a shared CPU one step's time moves
10-30% between rounds, the number of instructions it executes does not. Per model, one
process runs under valgrind's callgrind (one thread): it builds the model and the three
variants exactly as the step-time benchmark does (:func:`benchmarks.measure.build_setup`,
:func:`benchmarks.measure.make_step`: zero_grad, forward, MSE loss, backward, AdamW step),
runs ``--warmup`` rounds of every variant uncounted (tracing, the optimizer's state), then
counts ``--steps`` steps of each variant, one dump per step (:mod:`benchmarks.callgrind`).
route() and the hand-written forward draw their ids from generators seeded alike and drawn
as often, so they route the same tokens. Writes ``<out>.json`` and ``<out>.md``, with the
time ratios of ``--times`` (the committed step-time table) beside the instruction ratios.

Usage:
    python -m benchmarks.instructions                          # docs/results/cpu_instructions
    python -m benchmarks.instructions --models dit-s2 --steps 3 --out /tmp/instr
    python -m benchmarks.instructions --tiny --steps 2 --out /tmp/instr   # under a minute
    # model lists counted side by side (one process per core) merge into one table
    python -m benchmarks.instructions --merge /tmp/a.json /tmp/b.json --out /tmp/instr
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import callgrind, measure
from benchmarks.specs import SPECS, get_spec, make_inputs, model_available

__all__ = ["DEFAULT_MODELS", "parse_args", "child", "count_model", "summarise", "run", "main"]
__all__ += ["COUNTED_ENV", "merge", "write"]

DEFAULT_MODELS = "dit-s2,dit-b2,mamba,mamba-rows,rwkv,rwkv-random"
TARGET = 1.01  # route() / hand-written instructions per step
# Under valgrind, MKL's AVX2 (FMA) sgemm ran ~3,000x slower than natively (a DiT-S/2 step never
# reached its count in 1 h 47 min), its SSE4.2 kernel ~20x: the counted process takes the kernels
# of a machine without AVX2 (MKL, oneDNN, ATen's dispatch), the same for every variant.
COUNTED_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "ATEN_CPU_CAPABILITY": "default",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.instructions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma list of: " + ", ".join(SPECS))
    p.add_argument("--steps", type=int, default=2, help="counted steps per variant (one dump each)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted rounds of every variant first")
    p.add_argument("--batch", type=int, default=2, help="batch size (the same for every variant)")
    p.add_argument("--modes", default="eager", help="comma list of: eager, compiled")
    p.add_argument("--repeats", type=int, default=1, help="processes per model (spread check)")
    p.add_argument("--tiny", action="store_true", help="every model at test size, batch 2")
    p.add_argument("--times", default="docs/results/cpu_step_time.json", help="time ratios")
    p.add_argument("--out", default="docs/results/cpu_instructions")
    p.add_argument("--keep", help="folder to keep the callgrind dumps in (for callgrind_annotate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="only merge finished runs' tables")
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON job: run inside valgrind
    return p.parse_args(argv)


def child(job: dict[str, Any]) -> dict[str, float]:
    """Inside valgrind: build, warm up, count ``job['steps']`` steps of every variant.

    Returns:
        Wall seconds of the phases (``setup``, ``warmup``, ``counted``).
    """
    torch.set_num_threads(1)
    marker = callgrind.Marker(job["library"])
    spec = get_spec(job["model"], tiny=job["tiny"])
    device = torch.device("cpu")
    inputs = make_inputs(spec, job["batch"], device)
    clock = time.perf_counter()
    setup = measure.build_setup(spec, job["mode"], inputs, device, job["seed"])
    steps = {
        v.name: measure.make_step(setup, v, inputs[3], contextlib.nullcontext)
        for v in setup.variants
    }
    seconds = {"setup": time.perf_counter() - clock}
    clock = time.perf_counter()
    for _ in range(job["warmup"]):
        for step in steps.values():
            step()
    seconds["warmup"] = time.perf_counter() - clock
    clock = time.perf_counter()
    for name, step in steps.items():
        _count(marker, name, step, job["steps"])
    seconds["counted"] = time.perf_counter() - clock
    return seconds


def _count(marker: callgrind.Marker, name: str, step, steps: int) -> None:
    """Count ``steps`` calls of ``step``, one dump each; no garbage collection inside."""
    gc.collect()
    gc.disable()
    try:
        marker.start()
        marker.zero()
        for k in range(steps):
            step()
            marker.dump(f"{name}#{k}")
        marker.stop()
    finally:
        gc.enable()


def count_model(name: str, mode: str, args: argparse.Namespace, library: Path) -> dict[str, Any]:
    """Run one model's child under valgrind; per variant, the instructions of every step."""
    job = dict(model=name, mode=mode, tiny=args.tiny, batch=args.batch, seed=args.seed,
               warmup=args.warmup, steps=args.steps, library=str(library))  # fmt: skip
    folder = Path(args.keep) / f"{name}-{mode}" if args.keep else None
    with contextlib.ExitStack() as stack:
        out_dir = folder or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("callgrind.out.*"):
            old.unlink()
        argv = [sys.executable, "-m", "benchmarks.instructions", "--child", json.dumps(job)]
        clock = time.perf_counter()
        run = subprocess.run(
            callgrind.command(out_dir, argv),
            env={**os.environ, **COUNTED_ENV},
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - clock
        if run.returncode != 0:
            raise RuntimeError(f"{name} ({mode}) under valgrind failed:\n{run.stderr[-4000:]}")
        dumps = callgrind.read_dumps(out_dir)
    counts = {
        v: [dumps[f"{v}#{k}"][0] for k in range(args.steps)] for v in measure.VARIANTS
    }  # fmt: skip
    phases = json.loads(run.stdout.strip().splitlines()[-1])
    return {"counts": counts, "valgrind_s": wall, "phases_s": phases}


def _time_ratios(path: str, name: str, mode: str, tiny: bool) -> dict[str, float | None]:
    """route()/hand-written and unrouted/route() time (cpu clock) of the step-time table."""
    found: dict[str, float | None] = {"route_vs_hand": None, "speedup_route": None}
    found["batch"] = None
    with contextlib.suppress(OSError, ValueError):
        results = json.loads(Path(path).read_text())
        for entry in results.get("models", []) if not tiny else []:
            if entry["model"] == name and mode in entry["modes"]:
                summary = entry["modes"][mode]["cpu"]
                found["route_vs_hand"] = summary["route_vs_hand"]
                found["speedup_route"] = summary["speedup_route"]
                found["batch"] = entry["batch"]
    return found


def summarise(counts: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Per variant, the median instructions per step over every counted step of every
    process, and the spread ((max - min) / median); the route()/hand and unrouted/route()
    ratios of the medians.

    Example:
        >>> s = summarise([{"unrouted": [30, 30], "route()": [20, 20], "hand-written": [20, 20]}])
        >>> s["per_step"]["route()"], s["route_vs_hand"], s["unrouted_vs_route"], s["spread"]
        (20, 1.0, 1.5, 0.0)
    """
    per_step, spread = {}, 0.0
    for variant in measure.VARIANTS:
        values = [n for run in counts for n in run[variant]]
        per_step[variant] = int(measure.median(values))
        spread = max(spread, (max(values) - min(values)) / per_step[variant])
    return {
        "per_step": per_step,
        "spread": spread,
        "route_vs_hand": per_step["route()"] / per_step["hand-written"],
        "unrouted_vs_route": per_step["unrouted"] / per_step["route()"],
    }


def _entry(name: str, mode: str, args: argparse.Namespace, library: Path, log) -> dict:
    spec = get_spec(name, tiny=args.tiny)
    runs = []
    for r in range(args.repeats):
        log(f"{spec.label} ({mode}): valgrind process {r + 1}/{args.repeats} ...")
        runs.append(count_model(name, mode, args, library))
        log(f"  {runs[-1]['valgrind_s']:.0f} s; phases {runs[-1]['phases_s']}")
    entry = {
        "model": name, "label": spec.label, "mode": mode, "batch": args.batch,
        "route": list(spec.route), "rate": spec.rate, "selection": spec.selection,
        "runs": runs, **summarise([run["counts"] for run in runs]),
        "time": _time_ratios(args.times, name, mode, args.tiny),
    }  # fmt: skip
    entry["met"] = entry["route_vs_hand"] <= TARGET
    return entry


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def to_markdown(results: dict[str, Any]) -> str:
    """The table of a run (rows: models; instruction ratios beside the time ratios)."""
    meta = results["meta"]
    lines = [
        "# Instructions per training step: unrouted vs tread_fx.route() vs hand-written (cpu)",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"torch {meta['torch']}, valgrind {meta['valgrind']}, 1 thread, fp32, eager; "
        f"{meta['steps']} counted steps per variant after {meta['warmup']} warm-up rounds.",
        "",
        "| model | mode | batch | unrouted instr/step | route() instr/step | hand-written "
        "instr/step | route() / hand instr | <= 1.01 | unrouted / route() instr | spread | "
        "route() / hand time (batch) | unrouted / route() time | valgrind s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in results["models"]:
        n, t = e["per_step"], e["time"]
        seconds = sum(run["valgrind_s"] for run in e["runs"]) / len(e["runs"])
        lines.append(
            f"| {e['label']} | {e['mode']} | {e['batch']} | {n['unrouted']:,} | "
            f"{n['route()']:,} | {n['hand-written']:,} | {e['route_vs_hand']:.4f} | "
            f"{'yes' if e['met'] else '**no**'} | {e['unrouted_vs_route']:.3f} | "
            f"{e['spread']:.1e} | {_ratio(t['route_vs_hand'])} ({t['batch'] or 'n/a'}) | "
            f"{_ratio(t['speedup_route'])} | {seconds:.0f} |"
        )
    lines += ["", "Method:", ""] + [f"- {m}" for m in meta["method"]]
    return "\n".join(lines) + "\n"


def _method(args: argparse.Namespace) -> list[str]:
    return [
        "one process per model under `valgrind --tool=callgrind --instr-atstart=no` "
        "(OMP_NUM_THREADS=1, torch.set_num_threads(1), PYTHONHASHSEED=0): start-up, tracing "
        "and warm-up run uncounted; the process switches counting on around its counted steps "
        "with callgrind's client requests (benchmarks/callgrind.py) and dumps after every step",
        "step = zero_grad, forward, MSE loss, backward, AdamW step (benchmarks.measure."
        "make_step), the three variants on one model and one optimizer, as in step_time",
        "instructions = callgrind's Ir (guest instructions executed, every thread); per step: "
        "the median over the counted steps; spread = (max - min) / median over the steps of "
        "every variant; garbage collection off inside the counted steps (gc.collect before)",
        "route() and hand-written draw from generators seeded alike and called as often, so "
        "they route the same tokens (route() picks them by topk, hand-written by argsort)",
        "the counted process takes the kernels of a CPU without AVX2 "
        "(MKL_ENABLE_INSTRUCTIONS=SSE4_2, ONEDNN_MAX_CPU_ISA=SSE41, ATEN_CPU_CAPABILITY="
        "default): under valgrind MKL's AVX2 sgemm ran ~3,000x slower than natively, its "
        "SSE4.2 kernel ~20x; the counts are those of an SSE4.2 machine, alike for every variant",
        f"time ratios: {args.times} (cpu clock, medians of per-round ratios, its own batch)",
        f"batch {args.batch} (the time table's 8 is ~4x slower under valgrind)",
    ]


def run(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Count every requested model and write ``<out>.json`` and ``<out>.md``."""
    library = callgrind.build_marker(Path(tempfile.gettempdir()) / "tread_fx_callgrind")
    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout
    results: dict[str, Any] = {"meta": {
        "command": "python -m benchmarks.instructions " + shlex.join(sys.argv[1:]),
        "torch": torch.__version__, "valgrind": version.strip(), "steps": args.steps,
        "warmup": args.warmup, "tiny": args.tiny, "method": _method(args),
    }, "models": [], "skipped": []}  # fmt: skip
    for name in [n for n in args.models.split(",") if n]:
        if not model_available(get_spec(name)):
            results["skipped"].append(name)
            continue
        for mode in args.modes.split(","):
            results["models"].append(_entry(name, mode, args, library, log))
    write(results, args.out, log)
    return results


def write(results: dict[str, Any], out: str, log=print) -> None:
    """Write ``<out>.json`` and ``<out>.md`` and print the table."""
    base = Path(out).with_suffix("") if Path(out).suffix else Path(out)
    base.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = base.with_name(base.name + ".json"), base.with_name(base.name + ".md")
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path.write_text(to_markdown(results))
    log(to_markdown(results))
    log(f"wrote {json_path} and {md_path}")


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One table from runs of disjoint model lists (their commands joined by ``; ``).

    Raises:
        ValueError: The runs counted under different torch, valgrind, steps or warm-up.

    Example:
        >>> meta = {"command": "a", "torch": "2", "valgrind": "3", "steps": 2, "warmup": 1}
        >>> a = {"meta": meta, "models": [{"model": "x"}], "skipped": []}
        >>> b = {"meta": dict(meta, command="b"), "models": [{"model": "y"}], "skipped": []}
        >>> m = merge([a, b])
        >>> m["meta"]["command"], [e["model"] for e in m["models"]]
        ('a; b', ['x', 'y'])
    """
    first = parts[0]["meta"]
    for part in parts[1:]:
        for key in ("torch", "valgrind", "steps", "warmup"):
            if part["meta"][key] != first[key]:
                raise ValueError(f"runs differ in {key}: {first[key]!r} vs {part['meta'][key]!r}")
    merged = {"meta": dict(first), "models": [], "skipped": []}
    merged["meta"]["command"] = "; ".join(p["meta"]["command"] for p in parts)
    for part in parts:
        merged["models"] += part["models"]
        merged["skipped"] += part.get("skipped", [])
    return merged


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.merge:
        write(merge([json.loads(Path(p).read_text()) for p in args.merge]), args.out)
        return 0
    reason = callgrind.unavailable()
    if reason:
        raise SystemExit(f"benchmarks.instructions counts with valgrind's callgrind: {reason}")
    run(args, log=(lambda _: None) if args.quiet else print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
