"""Shared checks for routing unmodified third-party models (docs/design.md#invariants).

Each model case is a :class:`Case`: a factory for a fresh model (tiny random config, no
weights) and its inputs. ``check_*`` functions route a fresh model and assert one invariant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from conftest import randomize_zero_init

import tread_fx
from benchmarks.coverage_checks import first_tensor

__all__ = [
    "Case",
    "first_tensor",
    "train_forward",
    "check_eval_is_bitwise_unrouted",
    "check_rate_zero_equals_training",
    "check_routed_shape_count_and_change",
    "check_gradients",
    "check_compiled",
    "capture_block_inputs",
    "gather_rows",
    "scatter_rows",
    "INVARIANTS",
]


@dataclass
class Case:
    """A model to route and how to call it.

    Attributes:
        name: Test id.
        make: Builds the model (seeded, tiny, random weights).
        inputs: Builds ``(args, kwargs)``.
        routes: Routes to use.
        route_kwargs: Extra ``route()`` arguments.
    """

    name: str
    make: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple[tuple, dict]]
    routes: list = field(default_factory=lambda: [(1, 3)])
    route_kwargs: dict = field(default_factory=dict)

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        model = self.make()
        randomize_zero_init(model)
        return model

    def route(self, model: torch.nn.Module, rate: float = 0.5, **kwargs: Any) -> torch.nn.Module:
        options = {"seed": 0, **self.route_kwargs, **kwargs}
        return tread_fx.route(model, routes=self.routes, rate=rate, **options)


def train_forward(model: torch.nn.Module, case: Case, rng_seed: int = 123) -> torch.Tensor:
    """One training forward with the global RNG forked and seeded (in-forward dropout)."""
    args, kwargs = case.inputs()
    with torch.random.fork_rng():
        torch.manual_seed(rng_seed)
        return first_tensor(model.train()(*args, **kwargs))


def _eval_forward(model: torch.nn.Module, case: Case) -> torch.Tensor:
    args, kwargs = case.inputs()
    with torch.no_grad():
        return first_tensor(model.eval()(*args, **kwargs))


def check_eval_is_bitwise_unrouted(case: Case) -> None:
    model = case.model()
    reference = _eval_forward(model, case)
    keys, cls = list(model.state_dict()), type(model)
    case.route(model)
    train_forward(model, case)
    assert torch.equal(_eval_forward(model, case), reference)
    assert type(model) is cls and list(model.state_dict()) == keys
    tread_fx.unroute(model)
    assert "forward" not in model.__dict__


def check_rate_zero_equals_training(case: Case) -> None:
    model = case.model()
    reference = train_forward(model, case)
    case.route(model, rate=0.0)
    assert torch.equal(train_forward(model, case), reference)


def check_routed_shape_count_and_change(case: Case) -> list[tread_fx.RouteInfo]:
    model = case.model()
    reference = train_forward(model, case)
    case.route(model)
    out = train_forward(model, case)
    assert out.shape == reference.shape
    assert not torch.allclose(out, reference), "routing must change the training output"
    infos = tread_fx.route_info(model)
    for info in infos:
        routable = info.num_tokens - info.prefix - info.suffix
        kept = info.prefix + routable - int(routable * info.route.rate) + info.suffix
        assert info.kept.shape[1] == kept
        assert (info.kept.diff(dim=1) > 0).all(), "kept ids must be ascending and unique"
    return infos


def _grad_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum()}


def check_gradients(case: Case) -> None:
    """Every parameter that learns in the original training step learns in the routed one."""
    model = case.model()
    train_forward(model, case).square().mean().backward()
    expected = _grad_names(model)
    model.zero_grad(set_to_none=True)
    case.route(model)
    train_forward(model, case).square().mean().backward()
    missing = expected - _grad_names(model)
    assert expected and not missing, f"no gradient for {sorted(missing)}"


def check_compiled(case: Case, backend: str = "aot_eager") -> None:
    """Compiled routed graph: runs twice without recompiling; at rate 0 equals eager."""
    import torch._dynamo

    model = case.model()
    reference = train_forward(model, case)
    torch._dynamo.reset()
    case.route(model, rate=0.0, compile={"backend": backend})
    torch.testing.assert_close(train_forward(model, case), reference, rtol=1e-4, atol=1e-5)
    case.route(model, rate=0.5, compile={"backend": backend}, reroute=True)
    first = train_forward(model, case)
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = train_forward(model, case)
    assert first.shape == second.shape == reference.shape
    first.square().mean().backward()


@contextlib.contextmanager
def capture_block_inputs(block: torch.nn.Module) -> Iterator[list[tuple[tuple, dict]]]:
    """Record ``(args, kwargs)`` of every call of ``block`` inside the context."""
    calls: list[tuple[tuple, dict]] = []

    def hook(module, args, kwargs):
        calls.append((args, kwargs))

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


INVARIANTS = [
    check_eval_is_bitwise_unrouted,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
    check_gradients,
]
"""The DESIGN §5 invariant checks, for ``@pytest.mark.parametrize("check", INVARIANTS)``."""


def gather_rows(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Hand-written TREAD references: the tokens ``ids`` [B, k] of ``x`` [B, N, D]."""
    return x.gather(1, ids[..., None].expand(-1, -1, x.shape[-1]))


def scatter_rows(full: torch.Tensor, ids: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Hand-written TREAD references: ``part`` written back into ``full`` at ``ids``."""
    return full.scatter(1, ids[..., None].expand(-1, -1, full.shape[-1]), part)
