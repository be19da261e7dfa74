"""The coverage verdict: does ``route()`` with default arguments route one model cleanly?

A :class:`Case` is a model factory and its inputs. :func:`judge` routes a fresh copy with
``route(model, routes=case.routes, rate=0.5)`` and nothing else, and checks what a user
relies on:

- *routes*: the eval output is bitwise the unrouted model's, the training output keeps its
  shape, rate 0 reproduces the original training forward bitwise, every parameter that
  learns in the original training step gets a gradient, fewer tokens reach the routed blocks
  and the forward FLOPs drop, the routed positions are the noisy input's (else *wrong
  stream*), changing one sample's noisy input moves no other sample's routed output (else
  *mixes samples*), and ``explain()`` (text and JSON) works on the same call;
- *refused*: ``route()`` or the first routed call raised a ``TreadFxError`` (the reason is
  the message's first line, where it states why and what to do);
- *broken*: anything else: another exception, or one of the invariants above failed;
- *not buildable*: the model or its unrouted forward fails before tread_fx is involved.

A model that compiles its own code (``@torch.compile`` on its forward, a helper, a block) is
checked with that compilation off for the whole check (``force_eager``; the row's note says
so): the comparisons are then eager against eager, and ``route()`` still traces the decorated
code.

A ``route()`` that silently does nothing scores *broken* (no FLOP drop, no token drop): the
sweep cannot be satisfied by a no-op.

Example:
    >>> import torch, tread_fx
    >>> from benchmarks.coverage_checks import Case, judge
    >>> case = Case(
    ...     "dit", "tread_fx",
    ...     lambda: tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4),
    ...     lambda: ((torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])), {}),
    ... )
    >>> judge(case).verdict
    'routes'
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import tread_fx
from benchmarks.coverage_provenance import samples_mixed, stream_mismatch
from tread_fx.inspection.flops import flop_counter
from tread_fx.module_state import random_state_kept, seed_every_generator

__all__ = [
    "Case",
    "Verdict",
    "judge",
    "compiled_parts",
    "first_tensor",
    "randomize_zero_init",
    "VERDICTS",
]

VERDICTS = ("routes", "refused", "broken", "wrong stream", "mixes samples", "not buildable")
DEFAULT_ROUTES = [(1, -1)]


@dataclass
class Case:
    """One model of a population.

    Attributes:
        name: Row id in the table.
        family: Population (``diffusers``, ``timm``, ...).
        make: Builds the model (called under ``torch.manual_seed(0)``).
        inputs: Builds ``(args, kwargs)`` of a forward call (deterministic).
        routes: Routes given to ``route()``.
        note: How the case was built (e.g. layer counts raised), shown in the table.
        noisy: The forward argument holding the noisy input (keyword name or position;
            ``None``: the first positional argument, else the first tensor keyword).
        expected: The verdict expected where it is known (``route``, or ``refuse: <why>``);
            shown in the table, it never changes the verdict.
        batch_dim: The dim of the noisy input and of the first output holding the samples
            (1 for a sequence-first ``[T, B, C]`` model).
    """

    name: str
    family: str
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple[tuple, dict]]
    routes: list = field(default_factory=lambda: list(DEFAULT_ROUTES))
    note: str = ""
    noisy: str | int | None = None
    expected: str = ""
    batch_dim: int = 0


@dataclass
class Verdict:
    """The outcome for one case (JSON-friendly)."""

    name: str
    family: str
    verdict: str
    reason: str = ""
    stage: str = ""
    note: str = ""
    model_class: str = ""
    depth: int | None = None
    tokens: str = ""
    flop_ratio: float | None = None
    seconds: float = 0.0
    expected: str = ""
    detail: str = ""  # a refusal's lines below its first (the reason)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Failed(Exception):
    """A check failed: ``verdict`` and ``stage`` say which."""

    def __init__(self, verdict: str, stage: str, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.verdict, self.stage, self.reason, self.detail = verdict, stage, reason, detail


def randomize_zero_init(model: nn.Module, scale: float = 0.02) -> None:
    """Give zero-initialised weights (adaLN-Zero, zero output layers) small random values.

    Without it the output of many diffusion transformers is constant at init, and an
    invariant such as "routing changes the output" or "every parameter learns" is vacuous.
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.abs().sum() == 0:
                p.normal_(0, scale)


def first_tensor(out: Any) -> torch.Tensor:
    """The main output tensor of a model's return value (tuple, ModelOutput or tensor)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return first_tensor(out[0])
    for key in ("sample", "last_hidden_state", "logits"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, dict) and out:
        return first_tensor(next(iter(out.values())))
    raise TypeError(f"no tensor output in {type(out).__name__}")


def _reason(err: BaseException) -> str:
    """The error's message on one line (a refusal's short first line and its details)."""
    text = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return f"{type(err).__name__}: {text}"[:400]


def _refusal(err: BaseException) -> tuple[str, str]:
    """A refusal's reason (its first line, where tread_fx states the reason and what to do)
    and its detail (the other lines, on one line)."""
    first, *rest = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [""]
    return f"{type(err).__name__}: {first}", " ".join(rest)[:600]


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _fresh(case: Case) -> nn.Module:
    torch.manual_seed(0)
    model = case.make()
    randomize_zero_init(model)
    return model


def _forward(model: nn.Module, case: Case, train: bool, rng_seed: int = 123) -> torch.Tensor:
    args, kwargs = case.inputs()
    model.train(train)
    with random_state_kept():  # a forward drawing with np.random or random too (efficientvit)
        seed_every_generator(rng_seed)
        return first_tensor(model(*args, **kwargs))


def _no_grad_forward(model: nn.Module, case: Case, train: bool) -> torch.Tensor:
    with torch.no_grad():
        return _forward(model, case, train)


def _learning(model: nn.Module, case: Case) -> set[str]:
    model.zero_grad(set_to_none=True)
    out = _forward(model, case, train=True)
    out.float().square().mean().backward()
    return {n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}


def _forward_flops(model: nn.Module, case: Case) -> int:
    """Forward FLOPs of a training call, with grad (the counter's module hooks need
    grad_fns). A first call outside the counter traces a routed model for this grad mode:
    the trace's own real forward is not counted."""
    _forward(model, case, train=True)
    counter = flop_counter()
    with counter:
        _forward(model, case, train=True)
    return counter.get_total_flops()


def _attempt(stage: str, fn: Callable[[], Any]) -> Any:
    """Run one step of the check; a TreadFxError is a refusal, anything else is broken."""
    try:
        return fn()
    except tread_fx.TreadFxError as err:
        raise _Failed("refused", stage, *_refusal(err)) from err
    except Exception as err:  # noqa: BLE001 - any other exception is what "broken" means
        raise _Failed("broken", stage, f"{_reason(err)} (at {_where(err)})") from err


def _require(ok: bool, stage: str, reason: str) -> None:
    if not ok:
        raise _Failed("broken", stage, reason)


@dataclass
class _Reference:
    """The unrouted model's behaviour, measured before routing."""

    pristine: nn.Module
    eval_out: torch.Tensor
    train_out: torch.Tensor
    learning: set[str]
    flops: int


def _reference(case: Case, model: nn.Module) -> _Reference:
    pristine = copy.deepcopy(model)
    eval_out = _no_grad_forward(model, case, train=False)
    train_out = _no_grad_forward(model, case, train=True)
    learning = _learning(copy.deepcopy(pristine), case)
    return _Reference(pristine, eval_out, train_out, learning, _forward_flops(model, case))


def _resolving_routes(case: Case, ref: _Reference, route_fn: Callable, verdict: Verdict) -> list:
    """``case.routes``, or ``(0, -1)`` where the stack is too shallow for them (depth <= 2,
    when the suite's inputs fix the layer count)."""
    try:
        route_fn(copy.deepcopy(ref.pristine), routes=case.routes, rate=0.5, seed=0)
    except tread_fx.InvalidRouteError:
        fallback = [(0, -1)]
        try:
            route_fn(copy.deepcopy(ref.pristine), routes=fallback, rate=0.5, seed=0)
        except Exception:  # noqa: BLE001 - the real check reports the original refusal
            return case.routes
        verdict.note = "; ".join(filter(None, [verdict.note, "shallow stack: route (0, -1)"]))
        return fallback
    except Exception:  # noqa: BLE001 - the real check reports it
        pass
    return case.routes


def _check_routed(case: Case, ref: _Reference, route_fn: Callable, verdict: Verdict) -> None:
    model = copy.deepcopy(ref.pristine)
    _attempt("route()", lambda: route_fn(model, routes=case.routes, rate=0.5, seed=0))
    out = _attempt("first routed call", lambda: _no_grad_forward(model, case, train=True))
    _require(
        out.shape == ref.train_out.shape,
        "training output",
        f"routed training output has shape {tuple(out.shape)}, "
        f"unrouted {tuple(ref.train_out.shape)}",
    )
    infos = tread_fx.route_info(model) if tread_fx.is_routed(model) else None
    _require(bool(infos), "route info", "route() left no route info: nothing was routed")
    verdict.tokens = ", ".join(f"{i.num_tokens}->{i.kept.shape[1]}" for i in infos)
    _require(
        all(i.kept.shape[1] < i.num_tokens for i in infos),
        "route info",
        f"no route keeps fewer tokens than it receives ({verdict.tokens})",
    )
    eval_out = _attempt("eval after route()", lambda: _no_grad_forward(model, case, train=False))
    _require(
        torch.equal(eval_out, ref.eval_out),
        "eval output",
        "eval output differs from the unrouted model's (must be bitwise equal)",
    )
    routed_flops = _attempt("FLOP count", lambda: _forward_flops(model, case))
    verdict.flop_ratio = round(routed_flops / ref.flops, 4) if ref.flops else None
    _require(
        routed_flops < ref.flops,
        "FLOPs",
        f"routed forward FLOPs {routed_flops} not below unrouted {ref.flops}",
    )
    _check_stream(case, ref, model)
    _check_samples_apart(case, ref, model, verdict)
    learned = _attempt("backward", lambda: _learning(model, case))
    missing = sorted(ref.learning - learned)
    _require(
        not missing,
        "gradients",
        f"{len(missing)} parameters that learn unrouted get no gradient: {missing[:3]}",
    )


def _check_stream(case: Case, ref: _Reference, model: nn.Module) -> None:
    """The routed positions are the noisy input's (see ``coverage_provenance.py``)."""
    try:
        why = stream_mismatch(ref.pristine, model, case.inputs(), case.noisy)
    except Exception as err:  # noqa: BLE001 - a check that cannot run is a broken row
        raise _Failed("broken", "stream provenance", f"{_reason(err)} (at {_where(err)})") from err
    if why:
        raise _Failed("wrong stream", "stream provenance", why)


def _check_samples_apart(case: Case, ref: _Reference, model: nn.Module, verdict: Verdict) -> None:
    """Changing one sample's noisy input changes no other sample's routed output."""
    try:
        why, note = samples_mixed(ref.pristine, model, case.inputs(), case.noisy, case.batch_dim)
    except Exception as err:  # noqa: BLE001 - a check that cannot run is a broken row
        raise _Failed("broken", "samples apart", f"{_reason(err)} (at {_where(err)})") from err
    if note:
        verdict.note = "; ".join(filter(None, [verdict.note, note]))
    if why:
        raise _Failed("mixes samples", "samples apart", why)


def _check_rate_zero(case: Case, ref: _Reference, route_fn: Callable) -> None:
    model = copy.deepcopy(ref.pristine)
    _attempt("route(rate=0)", lambda: route_fn(model, routes=case.routes, rate=0.0, seed=0))
    out = _attempt("rate-0 call", lambda: _no_grad_forward(model, case, train=True))
    _require(
        torch.equal(out, ref.train_out),
        "rate 0",
        "at rate 0 the training output differs from the original training forward",
    )


def _check_explain(case: Case, ref: _Reference, verdict: Verdict) -> None:
    model = copy.deepcopy(ref.pristine)
    args, kwargs = case.inputs()

    def explain() -> None:
        exp = tread_fx.explain(model, case.routes, 0.5, (args, kwargs))
        str(exp), exp.to_json()
        verdict.depth = len(exp.blocks) if getattr(exp, "blocks", None) else None

    try:
        explain()
    except Exception as err:  # noqa: BLE001 - explain must work wherever route() does
        raise _Failed("broken", "explain()", f"{_reason(err)} (at {_where(err)})") from err


def judge(case: Case, route_fn: Callable = tread_fx.route) -> Verdict:
    """Route ``case`` with default arguments and return its verdict (never raises).

    Args:
        case: The model and its inputs.
        route_fn: The routing function under test (``tread_fx.route``; tests pass others to
            check that a no-op cannot score).

    Returns:
        The :class:`Verdict`.
    """
    verdict = Verdict(case.name, case.family, "routes", note=case.note, expected=case.expected)
    started = time.perf_counter()
    try:
        try:
            model = _fresh(case)
        except Exception as err:  # noqa: BLE001 - the model itself cannot be built here
            raise _Failed("not buildable", "unrouted model", _reason(err)) from err
        with _own_compile_off(model, verdict):
            _judge_built(case, model, route_fn, verdict)
    except _Failed as failed:
        verdict.verdict, verdict.stage, verdict.reason = failed.verdict, failed.stage, failed.reason
        verdict.detail = failed.detail
    verdict.seconds = round(time.perf_counter() - started, 2)
    return verdict


def _judge_built(case: Case, model: nn.Module, route_fn: Callable, verdict: Verdict) -> None:
    try:
        ref = _reference(case, model)
    except Exception as err:  # noqa: BLE001 - the model itself does not run here
        raise _Failed("not buildable", "unrouted model", _reason(err)) from err
    verdict.model_class = type(ref.pristine).__name__
    case = dataclasses.replace(case, routes=_resolving_routes(case, ref, route_fn, verdict))
    _check_routed(case, ref, route_fn, verdict)
    _check_rate_zero(case, ref, route_fn)
    _check_explain(case, ref, verdict)


def compiled_parts(model: nn.Module) -> list[str]:
    """What of ``model``'s code is wrapped by ``torch.compile``: submodules compiled one by one
    and functions decorated in its classes or in the Python modules defining them.

    Example:
        >>> compiled_parts(nn.Sequential(torch.compile(nn.Linear(2, 2)), nn.ReLU()))
        ['0']
    """
    found = [path for path, m in model.named_modules() if type(m).__name__ == "OptimizedModule"]
    classes = {c for m in model.modules() for c in type(m).__mro__}
    spaces = [(c.__qualname__ + ".", vars(c)) for c in classes]
    modules = {sys.modules[c.__module__] for c in classes if c.__module__ in sys.modules}
    spaces += [("", vars(module)) for module in modules]
    for prefix, space in spaces:
        found += [
            prefix + name
            for name, value in list(space.items())
            if inspect.isfunction(value) and hasattr(value, "_torchdynamo_orig_callable")
        ]
    return sorted(set(found))


@contextlib.contextmanager
def _own_compile_off(model: nn.Module, verdict: Verdict) -> Iterator[None]:
    """Run the whole check of a model that compiles its own code with that compilation off
    (``torch.compiler.set_stance("force_eager")``): the bitwise checks then compare eager
    numbers on both sides (the routed model's eval still calls the decorated code), and no
    inductor compile runs on the sweep's CPUs. ``route()`` still traces the decorated code
    (the stance applies where dynamo would compile, after its check for fx tracing)."""
    parts = compiled_parts(model)
    if not parts:
        yield
        return
    shown = ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")
    note = f"its own @torch.compile ({shown}) off for the whole check (force_eager)"
    verdict.note = "; ".join(filter(None, [verdict.note, note]))
    with torch.compiler.set_stance("force_eager"):
        yield
