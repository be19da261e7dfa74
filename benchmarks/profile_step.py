"""Where ``route()`` and the hand-written forward spend their step time, op by op.

Profiles (``torch.profiler``, CPU activity) the training steps of two variants of one model,
interleaved, and prints the aten ops whose self time differs the most, with their call counts.
Use it when a ``route() / hand-written`` or efficiency target in ``benchmarks.step_time`` is
missed: an extra copy, a re-trace or a synchronisation in the pass shows up as extra calls.

With ``--mode compiled`` the variants are ``torch.compile``d as in ``benchmarks.step_time`` and
the table lists inductor's generated kernels too (``cpp_fused_*``, named without their graph
number so that both variants' kernels line up) beside the aten ops they call out to.

Usage:
    python -m benchmarks.profile_step --model dit-b2 --steps 3
    python -m benchmarks.profile_step --model dit-b2 --mode compiled
    python -m benchmarks.profile_step --model rwkv --variants unrouted,route()
    python -m benchmarks.profile_step --model dit-s2 --tiny --steps 1 --top 5
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import measure
from benchmarks.specs import get_spec, make_inputs

__all__ = ["STEP", "profile_variants", "op_table", "main"]

#: Key of the whole step's wall time (profiler running) in a variant's profile.
STEP = "(whole step)"


#: What a compiled graph's kernels are called in a profile, without the graph's number.
_KERNEL = re.compile(r"^graph_\d+_(cpp_fused_.*)$")


def _op_totals(prof: Any) -> dict[str, tuple[int, float]]:
    """``{op: (calls, self CPU seconds)}`` of the aten ops and compiled kernels profiled."""
    totals: dict[str, tuple[int, float]] = {}
    for event in prof.key_averages():
        kernel = _KERNEL.match(event.key)
        if not (event.key.startswith("aten::") or kernel):
            continue
        key = kernel.group(1) if kernel else event.key
        calls, seconds = totals.get(key, (0, 0.0))
        totals[key] = (calls + event.count, seconds + event.self_cpu_time_total / 1e6)
    return totals


def _kernel_profiling(mode: str) -> contextlib.AbstractContextManager:
    """Have inductor name each generated kernel in the profile (read when it compiles)."""
    if mode != "compiled":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"cpp.enable_kernel_profile": True})


def profile_variants(
    model: str,
    variants: list[str],
    steps: int,
    tiny: bool = False,
    threads: int = 1,
    mode: str = "eager",
) -> dict[str, dict[str, tuple[int, float]]]:
    """Profile ``steps`` training steps of each variant (interleaved, after 2 warm-ups).

    Args:
        model: A ``benchmarks.specs`` name (``dit-b2``).
        variants: Names from ``measure.VARIANTS``.
        steps: Profiled steps per variant.
        tiny: Use the test-size model.
        threads: ``torch.set_num_threads`` (the CPU benchmark uses 1).
        mode: ``"eager"`` or ``"compiled"`` (compiled kernels are listed as ``cpp_fused_*``).

    Returns:
        Per variant, ``{aten op or kernel: (calls per step, self seconds per step)}``, plus the wall
        seconds of the whole profiled step under the key :data:`STEP` (the profiler's op times
        are wall durations on the calling thread, so the two compare).

    Example:
        >>> totals = profile_variants("dit-s2", ["route()", "hand-written"], 1, tiny=True)
        >>> totals["route()"]["aten::mm"][0] == totals["hand-written"]["aten::mm"][0]
        True
    """
    torch.set_num_threads(threads)
    with _kernel_profiling(mode):
        return _profile(get_spec(model, tiny=tiny), variants, steps, mode)


def _profile(spec: Any, variants: list[str], steps: int, mode: str) -> dict:
    inputs = make_inputs(spec, spec.batch)
    setup = measure.build_setup(spec, mode, inputs, torch.device("cpu"))
    by_name = {v.name: v for v in setup.variants}
    fp32 = functools.partial(measure.autocast_for, torch.device("cpu"), None)  # no autocast
    step: dict[str, Callable[[], None]] = {
        name: measure.make_step(setup, by_name[name], inputs[3], fp32) for name in variants
    }
    for _ in range(2):
        for name in variants:
            step[name]()
    calls: dict[str, Counter] = {name: Counter() for name in variants}
    seconds: dict[str, Counter] = {name: Counter() for name in variants}
    for _ in range(steps):  # interleaved, one profile per step: both variants see the same load
        for name in variants:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                wall = time.perf_counter()
                step[name]()
                wall = time.perf_counter() - wall
            for op, (count, sec) in _op_totals(prof).items():
                calls[name][op] += count
                seconds[name][op] += sec
            calls[name][STEP] += 1
            seconds[name][STEP] += wall
    return {
        name: {op: (calls[name][op] // steps, seconds[name][op] / steps) for op in calls[name]}
        for name in variants
    }


def op_table(profiles: dict[str, dict[str, tuple[int, float]]], top: int = 15) -> str:
    """A markdown table of the ``top`` ops by largest self-time difference (first two variants).

    The last rows give all aten ops (and compiled kernels) together, the whole step (wall clock,
    profiler running) and what lies outside those (Python, dispatch, the profiler itself).
    """
    (a_name, a_all), (b_name, b_all) = list(profiles.items())[:2]
    a = {op: v for op, v in a_all.items() if op != STEP}
    b = {op: v for op, v in b_all.items() if op != STEP}
    ops = sorted(
        set(a) | set(b), key=lambda op: -abs(a.get(op, (0, 0.0))[1] - b.get(op, (0, 0.0))[1])
    )
    rows = [
        f"| op | calls {a_name} | calls {b_name} | self s {a_name} | self s {b_name} | diff s |",
        "|---|---|---|---|---|---|",
    ]

    def row(label: str, ca: int | str, cb: int | str, ta: float, tb: float) -> None:
        rows.append(f"| {label} | {ca} | {cb} | {ta:.4f} | {tb:.4f} | {ta - tb:+.4f} |")

    for op in ops[:top]:
        (ca, ta), (cb, tb) = a.get(op, (0, 0.0)), b.get(op, (0, 0.0))
        row(op, ca, cb, ta, tb)
    total_a, total_b = sum(t for _, t in a.values()), sum(t for _, t in b.values())
    kernels = any(op.startswith("cpp_fused") for op in (*a, *b))
    row(
        "all aten ops and kernels" if kernels else "all aten ops",
        sum(c for c, _ in a.values()),
        sum(c for c, _ in b.values()),
        total_a,
        total_b,
    )
    if STEP in a_all and STEP in b_all:
        step_a, step_b = a_all[STEP][1], b_all[STEP][1]
        row("whole step (wall clock)", "", "", step_a, step_b)
        row("outside those", "", "", step_a - total_a, step_b - total_b)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="dit-b2", help="dit-s2, dit-b2, dit-xl2, mamba, rwkv, ...")
    p.add_argument(
        "--variants", default="route(),hand-written", help="two of: " + ", ".join(measure.VARIANTS)
    )
    p.add_argument("--steps", type=int, default=3, help="profiled steps per variant")
    p.add_argument("--top", type=int, default=15, help="rows of the table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="test-size model")
    p.add_argument("--mode", choices=("eager", "compiled"), default="eager")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in measure.VARIANTS]
    if len(variants) != 2 or unknown:
        p.error(f"--variants: give two of {', '.join(measure.VARIANTS)}; got {args.variants!r}")
    profiles = profile_variants(
        args.model, variants, args.steps, args.tiny, args.threads, args.mode
    )
    header = f"{args.mode}, {args.steps} steps each, interleaved, {args.threads} thread(s)"
    print(f"{args.model}: aten ops and compiled kernels per training step ({header})")
    print(op_table(profiles, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
