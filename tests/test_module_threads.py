"""Tracing patches only the tracing thread: a bystander thread, and two threads routing at once."""

from __future__ import annotations

import random
import threading

import torch
from torch import nn

import tread_fx
from tread_fx.passes.trace import thread_patch


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class Gate(nn.Module):
    """Runs ``hook()`` (once) while the model is being traced, then a plain linear head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 1)
        self.hook = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self.lin(x)


class TokenModel(nn.Module):
    def __init__(self, depth: int = 4, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = Gate(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _model(seed: int) -> TokenModel:
    torch.manual_seed(seed)
    return TokenModel()


def _inputs(seed: int, batch: int = 2, tokens: int = 16) -> torch.Tensor:
    return torch.randn(batch, tokens, 3, generator=torch.Generator().manual_seed(seed))


def _bystander_sees(report: dict) -> None:
    """What a data-loading thread does: Python and torch randomness, grad mode, modules."""
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        for _ in range(50):
            report["random"].append(isinstance(random.random(), float))
            report["grad"].append(torch.is_grad_enabled() is False)
            report["is_tensor"].append(torch.is_tensor(lin.weight) and not torch.is_tensor(1.0))
            report["rand"].append(type(torch.rand(2)) is torch.Tensor)
            report["ones"].append(torch.equal(torch.ones(2, 3), torch.full((2, 3), 1.0)))
            report["expand"].append(torch.zeros(1, 3).expand(2, 3).shape == (2, 3))
            report["module"].append(lin(torch.zeros(1, 3)).shape == (1, 2))


def _nothing_left_patched() -> None:
    assert thread_patch._INSTALLED == {}
    assert "ones" in vars(torch) and not thread_patch.is_dispatcher(torch.ones)
    assert not thread_patch.is_dispatcher(random.random)
    assert not thread_patch.is_dispatcher(torch.is_grad_enabled)
    assert not thread_patch.is_dispatcher(torch.is_tensor)  # trace_compat's patch
    assert not thread_patch.is_dispatcher(nn.Module.__call__)
    assert "expand" not in vars(torch.Tensor)  # restored to the inherited method


def test_a_bystander_thread_sees_normal_behaviour_during_a_first_routed_call():
    model = tread_fx.route(_model(0), routes=[(1, 3)], seed=0)
    report: dict[str, list] = {
        k: [] for k in ("random", "grad", "rand", "ones", "expand", "is_tensor")
    }
    report["module"], errors = [], []

    def bystander() -> None:
        try:
            _bystander_sees(report)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def while_tracing() -> None:  # the main thread is inside the trace here
        thread = threading.Thread(target=bystander)
        thread.start()
        thread.join(timeout=60)

    model.head.hook = while_tracing
    out = model.train()(_inputs(1))
    assert model.head.hook is None, "the hook ran (the trace happened)"
    assert not errors, errors
    assert all(len(v) == 50 and all(v) for v in report.values()), {
        k: v.count(False) for k, v in report.items()
    }
    assert out.shape == (2, 16, 1)
    assert tread_fx.route_info(model)[0].kept.shape == (2, 8)
    _nothing_left_patched()


def test_two_threads_routing_two_models_at_once_both_get_correct_results():
    expected = []
    for seed in (0, 1):
        model = tread_fx.route(_model(seed), routes=[(1, 3)], seed=seed)
        expected.append((model.train()(_inputs(seed)), tread_fx.route_info(model)[0].kept))

    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    models = {seed: _model(seed) for seed in (0, 1)}  # built here: init draws from global RNG

    def worker(seed: int) -> None:
        try:
            model = tread_fx.route(models[seed], routes=[(1, 3)], seed=seed)
            barrier.wait(timeout=30)
            results[seed] = (model.train()(_inputs(seed)), tread_fx.route_info(model)[0].kept)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for seed in (0, 1):
        out, kept = results[seed]
        assert torch.equal(kept, expected[seed][1])
        assert torch.allclose(out, expected[seed][0])
    _nothing_left_patched()


def test_a_patch_is_seen_by_its_thread_only_and_nests():
    seen = []
    outer = thread_patch.thread_local_patch(random, "random", lambda prev: lambda: 2.0)
    inner = thread_patch.thread_local_patch(random, "random", lambda prev: lambda: prev() + 1)
    with outer, inner:
        thread = threading.Thread(target=lambda: seen.append(random.random()))
        thread.start()
        thread.join()
        assert random.random() == 3.0
    assert 0.0 <= seen[0] < 1.0
    _nothing_left_patched()
