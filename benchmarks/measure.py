"""Measurements: training-step time (interleaved), FLOPs, activation memory, first-call overhead.

Every measurement runs the same three variants on one model and one optimizer:

- ``unrouted``: the model's original forward (``type(model).forward``), all tokens;
- ``route()``: the model routed in place by :func:`tread_fx.route`;
- ``hand-written``: :mod:`benchmarks.handwritten`, the same routing written by hand.

Example:
    >>> from benchmarks.measure import median, paired_ratio
    >>> median([3.0, 1.0, 2.0]), paired_ratio([2.0, 4.0], [1.0, 1.0])
    (2.0, 3.0)
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tread_fx
from benchmarks.handwritten import forward_for
from benchmarks.specs import ModelSpec
from tread_fx.inspection.flops import flop_counter

__all__ = [
    "VARIANTS",
    "CLOCKS",
    "Setup",
    "Variant",
    "median",
    "paired_ratio",
    "build_setup",
    "time_interleaved",
    "median_interval",
    "attention_kernels",
    "round_order",
    "balanced_orders",
    "count_flops",
    "time_optimizer_step",
    "saved_activation_bytes",
    "cuda_step_peak_bytes",
    "first_call_overhead",
    "autocast_for",
]

VARIANTS = ("unrouted", "route()", "hand-written")

MEMORY_METHOD_CPU = (
    "activation memory: bytes of the distinct storages that autograd saves for backward during "
    "one training forward (torch.autograd.graph.saved_tensors_hooks), parameters and buffers "
    "excluded (compiled: what the compiled graphs save); deterministic. This is what a training "
    "step holds at its forward/backward turn."
)
MEMORY_METHOD_CUDA = (
    "torch.cuda.max_memory_allocated during one training step minus the memory allocated "
    "before it (weights and optimizer state, gradients freed)"
)


def median(values: list[float]) -> float:
    """Median of a non-empty list."""
    return float(statistics.median(values))


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over repeats of ``numerator[r] / denominator[r]``.

    Both lists come from the same interleaved repeats, so each pair ran back to back and
    shares the machine's load at that moment: the paired ratio is steadier than a ratio of
    medians on a shared machine.
    """
    return median([a / b for a, b in zip(numerator, denominator)])


def median_interval(
    values: list[float], level: float = 0.9, draws: int = 2000, seed: int = 0
) -> list[float]:
    """A bootstrap interval of the median of ``values`` (rounds resampled with replacement).

    On a shared host one round's ratio moves by 10-30%, so a median over a dozen rounds is
    known only to a few percent; the interval says how far (``level`` of the resampled
    medians lie inside it). Seeded: the same rounds give the same interval.

    Example:
        >>> lo, hi = median_interval([0.98, 1.0, 1.01, 1.03, 0.99, 1.02])
        >>> lo <= 1.005 <= hi
        True
    """
    rng = random.Random(seed)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(draws))
    cut = int(draws * (1.0 - level) / 2)
    return [medians[cut], medians[draws - 1 - cut]]


def autocast_for(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device`` (``None`` or float32: no autocast)."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_forward(model: nn.Module, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
    """The model's original forward, bypassing routing."""
    return type(model).forward(model, x, t, y)


@dataclass
class Variant:
    """One way of running a training forward on fixed inputs (fresh ids on every call)."""

    name: str
    mode: str
    forward: Callable[[], Tensor]


@dataclass
class Setup:
    """A model routed for one mode, its optimizer and its three variants."""

    spec: ModelSpec
    mode: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    variants: list[Variant] = field(default_factory=list)


def build_setup(
    spec: ModelSpec,
    mode: str,
    inputs: tuple[Tensor, ...],
    device: torch.device,
    seed: int = 0,
) -> Setup:
    """Build the model (weights from ``seed``), route it and make the three variants.

    Args:
        spec: The model.
        mode: ``"eager"`` or ``"compiled"`` (``torch.compile(fullgraph=True)`` of the forward
            in every variant; the optimizer step stays eager everywhere).
        inputs: ``(x, t, y, target)`` on ``device``.
        device: Where to run.
        seed: Weight seed (the same for every mode, so every mode starts from the same model).
    """
    compiled = mode == "compiled"
    model = spec.build(seed).to(device)
    tread_fx.route(
        model, routes=[spec.route], rate=spec.rate, selection=spec.selection, seed=seed,
        compile=compiled,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, t, y, _ = inputs
    start, end = spec.route
    hand = forward_for(model)
    plain = _plain_forward
    if compiled:
        plain = torch.compile(_plain_forward, fullgraph=True, dynamic=False)
        hand = torch.compile(hand, fullgraph=True, dynamic=False)
    generator = torch.Generator(device).manual_seed(seed)
    batch = x.shape[0]

    def run_hand() -> Tensor:
        ids = spec.draw_ids(model, batch, generator, device)
        return hand(model, x, t, y, ids, start, end)

    variants = [
        Variant("unrouted", mode, lambda: plain(model, x, t, y)),
        Variant("route()", mode, lambda: model(x, t, y)),
        Variant("hand-written", mode, run_hand),
    ]
    return Setup(spec, mode, model, optimizer, variants)


def make_step(
    setup: Setup,
    variant: Variant,
    target: Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> Callable[[], None]:
    """One optimisation step: forward, MSE loss on every output token, backward, AdamW step."""

    def step() -> None:
        setup.optimizer.zero_grad(set_to_none=True)
        with autocast():
            out = variant.forward()
        F.mse_loss(out.float(), target).backward()
        setup.optimizer.step()

    return step


CLOCKS = ("wall", "cpu")


def time_interleaved(
    steps: dict[str, Callable[[], None]],
    warmup: int,
    repeats: int,
    device: torch.device,
    deadline: float | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, float]]:
    """Time each step ``repeats`` times, interleaved, after ``warmup`` untimed rounds.

    Round ``r`` runs every step once, in the order :func:`round_order` gives: steps named
    ``group/variant`` run group by group, and over a full cycle of rounds every variant
    follows every other one of its group equally often (a rotated order would have each step
    follow the same one every round, so whatever one step leaves behind in caches and the
    allocator would weigh on the same neighbour every time). Stops early (after at least 3
    rounds) once ``deadline`` (``time.monotonic()``) has passed. Two clocks are read around
    every step: ``wall`` (``time.perf_counter``) and ``cpu`` (``time.process_time``: CPU
    seconds of this process, all its threads; on a shared machine it leaves out the time the
    process waited for a core).

    Returns:
        ``times[clock][step]``: seconds per round; and the wall time of each step's first
        warm-up call (which includes tracing, rewriting and, when compiled, compilation).
    """
    names = list(steps)
    first: dict[str, float] = {}
    for w in range(warmup):
        for name in names:
            wall, _ = _timed(steps[name], device)
            first.setdefault(name, wall)
            log(f"  warm-up {w + 1}/{warmup} {name}: {wall:.3f} s")
    times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in CLOCKS}
    for r in range(repeats):
        for name in round_order(names, r):
            for clock, value in zip(CLOCKS, _timed(steps[name], device)):
                times[clock][name].append(value)
        row = ", ".join(f"{n} {times['wall'][n][-1]:.3f}/{times['cpu'][n][-1]:.3f}" for n in names)
        log(f"  round {r + 1}/{repeats} (wall/cpu s): {row}")
        if deadline is not None and r + 1 >= 3 and time.monotonic() > deadline:
            log("  time budget reached: stopping the rounds here")
            break
    return times, first


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: orders of ``range(n)`` in which every item follows every other one
    equally often (once over ``n`` orders for even ``n``, twice over ``2n`` for odd ``n``).

    Example:
        >>> balanced_orders(3)
        [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]
    """
    base = [0]
    for i in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        base.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[(b + r) % n for b in base] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def round_order(names: list[str], r: int) -> list[str]:
    """The order of round ``r``: groups (the part of a name before ``/``) one after the other,
    each group's steps in a :func:`balanced_orders` order; the groups' order is balanced too,
    changing once every full cycle of the orders within a group.

    Example:
        >>> names = ["eager/a", "eager/b", "compiled/a", "compiled/b"]
        >>> [round_order(names, r) for r in (0, 1, 2)]  # doctest: +NORMALIZE_WHITESPACE
        [['eager/a', 'eager/b', 'compiled/a', 'compiled/b'],
         ['eager/b', 'eager/a', 'compiled/b', 'compiled/a'],
         ['compiled/a', 'compiled/b', 'eager/a', 'eager/b']]
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.split("/")[0] if "/" in name else "", []).append(name)
    members = list(groups.values())
    inner = max(len(balanced_orders(len(m))) for m in members)
    outer = balanced_orders(len(members))
    order = []
    for g in outer[(r // inner) % len(outer)]:
        rows = balanced_orders(len(members[g]))
        order += [members[g][i] for i in rows[r % len(rows)]]
    return order


def _timed(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def time_optimizer_step(setup: Setup, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """Median time of the optimizer step alone (gradients as the last step left them)."""
    runs = [_timed(setup.optimizer.step, device) for _ in range(repeats)]
    return {clock: median([run[i] for run in runs]) for i, clock in enumerate(CLOCKS)}


def count_flops(
    forward: Callable[[], Tensor],
    target: Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> int:
    """FLOPs of one forward + backward: matmul, convolution and attention.

    Counted with the project's counter (:func:`tread_fx.inspection.flops.flop_counter`):
    torch's stock ``FlopCounterMode`` has no formula for the CPU attention kernel and would
    leave attention out of every CPU FLOP ratio.
    """
    with flop_counter() as counter:
        with autocast():
            out = forward()
        F.mse_loss(out.float(), target).backward()
    return int(counter.get_total_flops())


@contextlib.contextmanager
def _recording_saved(exclude: set[int]) -> Iterator[dict[int, int]]:
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in exclude:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield seen


def saved_activation_bytes(
    model: nn.Module,
    forward: Callable[[], Tensor],
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> int:
    """Bytes of the distinct storages saved for backward by one training forward.

    Parameters and buffers are excluded (every variant holds them alike); the outputs are
    dropped without a backward, which frees the graph.
    """
    tensors = [*model.parameters(), *model.buffers()]
    exclude = {p.untyped_storage().data_ptr() for p in tensors}
    with _recording_saved(exclude) as seen, autocast():
        out = forward()
    del out
    return int(sum(seen.values()))


def attention_kernels(
    forward: Callable[[], Tensor], autocast: Callable[[], contextlib.AbstractContextManager]
) -> list[str]:
    """The attention ops one forward runs (``aten::_scaled_dot_product_flash_attention`` when
    ``F.scaled_dot_product_attention`` picks flash attention), from a profile of that forward.

    Example:
        >>> q = torch.randn(1, 2, 8, 4)
        >>> attend = lambda: F.scaled_dot_product_attention(q, q, q)
        >>> attention_kernels(attend, contextlib.nullcontext)
        ['aten::_scaled_dot_product_flash_attention_for_cpu']
    """
    from torch.profiler import profile

    with profile() as prof, autocast():
        forward()
    return sorted({
        e.key for e in prof.key_averages()
        if e.key.startswith("aten::_") and "attention" in e.key
    })  # fmt: skip


def cuda_step_peak_bytes(setup: Setup, step: Callable[[], None], device: torch.device) -> int:
    """Peak CUDA memory of one step above the resting weights and optimizer state."""
    setup.optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def first_call_overhead(
    spec: ModelSpec,
    inputs: tuple[Tensor, ...],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
    plain_repeats: int = 3,
) -> dict[str, dict[str, float]]:
    """Time of the first routed training call (trace + rewrite + run) against a plain one.

    The model is fresh. One untimed plain training forward warms the kernels; then the plain
    training forward is timed ``plain_repeats`` times (median), the model is routed, and its
    first and second routed training calls are timed.

    Returns:
        Per clock (``wall``, ``cpu``): ``plain_s``, ``first_routed_s``, ``second_routed_s``,
        ``overhead_s`` (first routed minus plain: what the user waits for beyond an ordinary
        forward) and ``pipeline_s`` (first minus second routed call: trace and rewrite); and
        ``stages``: the wall seconds of each pipeline stage of the first call (tracing,
        locating, planning, rewriting).
    """
    x, t, y, _ = inputs
    model = spec.build().to(device)

    def timed() -> tuple[float, float]:
        with autocast():
            return _timed(lambda: model(x, t, y), device)

    timed()
    plains = [timed() for _ in range(plain_repeats)]
    tread_fx.route(model, routes=[spec.route], rate=spec.rate, selection=spec.selection, seed=0)
    first, second = timed(), timed()
    out = {}
    for i, clock in enumerate(CLOCKS):
        plain = median([p[i] for p in plains])
        out[clock] = {
            "plain_s": plain,
            "first_routed_s": first[i],
            "second_routed_s": second[i],
            "overhead_s": first[i] - plain,
            "pipeline_s": first[i] - second[i],
        }
    out["stages"] = dict(tread_fx.routed_graphs(model)[0].stage_seconds)
    return out
