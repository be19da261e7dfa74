"""The trace pass: shape-derived Python resolves, data-dependent Python never gets baked in."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tread_fx
from tread_fx.passes.trace.tracer import trace_call


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x))) * c[:, None]


class ShapeModel(nn.Module):
    """Reads shapes in Python like real patch embeddings do; returns a dict."""

    def __init__(self, depth: int = 4, width: int = 8, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.stem_norm = nn.BatchNorm1d(width)
        self.cond = nn.Linear(1, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor, t: torch.Tensor, scale: float | None = None) -> dict:
        batch, tokens, _ = x.shape
        side = int(tokens**0.5)
        if x.shape[1] != side * side:
            raise ValueError("square grids only")
        h = self.embed(x).reshape(batch, side, side, -1).flatten(1, 2)
        h = self.stem_norm(h.transpose(1, 2)).transpose(1, 2)
        if tokens > 10:
            h = h * 2
        if scale is not None:
            h = h * scale
        c = self.cond(t[:, None])
        for block in self.blocks:
            h = checkpoint(block, h, c, use_reentrant=False) if self.use_checkpoint else block(h, c)
        return {"out": h, "tokens": tokens}


def _inputs(tokens: int = 16, batch: int = 2):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(batch, tokens, 3, generator=gen), torch.rand(batch, generator=gen)


def test_plain_symbolic_trace_fails_where_the_value_tracer_resolves_shapes():
    model = ShapeModel()
    with pytest.raises(Exception):  # noqa: B017 - any fx error: it cannot resolve int(N ** 0.5)
        torch.fx.symbolic_trace(model)
    x, t = _inputs()
    traced = trace_call(model, (x, t), {}, {f"blocks.{i}" for i in range(4)})
    out = type(traced.gm).forward(traced.wrapper, x, t)
    assert torch.equal(out[0], model(x, t)["out"])
    assert out[1] == 16
    assert not traced.auto_leaves


def test_shape_dependent_branches_get_their_own_trace():
    torch.manual_seed(0)
    model = tread_fx.route(ShapeModel(), routes=[(1, 3)], rate=0.0, seed=0)
    for tokens in (16, 9):  # `if tokens > 10` goes both ways
        x, t = _inputs(tokens)
        expected = ShapeModel.forward(model.train(), x, t)["out"]
        assert torch.allclose(model.train()(x, t)["out"], expected)
    assert len(tread_fx.routed_graphs(model)) == 2
    x, t = _inputs(16)
    scaled = model(x, t, scale=3.0)["out"]
    assert torch.allclose(scaled, ShapeModel.forward(model, x, t, scale=3.0)["out"])
    assert len(tread_fx.routed_graphs(model)) == 3


def test_tracing_restores_buffers_and_the_global_rng():
    torch.manual_seed(0)
    plain, routed = ShapeModel(), ShapeModel()
    routed.load_state_dict(plain.state_dict())
    tread_fx.route(routed, routes=[(1, 3)], rate=0.5, seed=0)
    x, t = _inputs()
    with torch.random.fork_rng():
        torch.manual_seed(7)
        plain.train()(x, t)
        after_plain = torch.rand(3)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        routed.train()(x, t)  # traces, then runs the routed graph once
        after_routed = torch.rand(3)
    assert torch.equal(after_plain, after_routed), "tracing must not consume the global RNG"
    for name, buffer in plain.named_buffers():  # BatchNorm statistics updated exactly once
        assert torch.equal(buffer, routed.get_buffer(name)), name


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:
            return x * 2
        return x


class ItemCall(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.abs().max().item())


class PythonRandom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if random.random() < 0.5 else x


@pytest.mark.parametrize("sub_cls", [DataDependent, ItemCall, PythonRandom])
def test_submodules_reading_data_become_leaves_instead_of_being_baked_in(sub_cls):
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = sub_cls()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.pre(x)
            for block in self.blocks:
                x = block(x)
            return x

    model = Model()
    traced = trace_call(model, (torch.randn(2, 4, 8),), {}, {f"blocks.{i}" for i in range(3)})
    assert list(traced.auto_leaves) == ["pre"]
    assert (
        "test_trace.py" in traced.auto_leaves["pre"] or "Tensor.item" in traced.auto_leaves["pre"]
    )
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_module"]
    assert "model.pre" in targets
    if sub_cls is DataDependent:  # both branches still happen at run time
        for sign in (1.0, -1.0):
            x = sign * torch.ones(2, 4, 8)
            assert torch.equal(type(traced.gm).forward(traced.wrapper, x)[0], model(x))


def test_python_randomness_in_the_models_own_forward_is_refused():
    class LayerDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                if random.random() > 0.1:
                    x = block(x)
            return x

    model = tread_fx.route(LayerDrop(), routes=[(0, 2)]).train()
    with pytest.raises(tread_fx.UntraceableModelError, match="random.random.*test_trace.py:"):
        model(torch.randn(2, 4, 8))


def test_registered_leaf_module_and_function_are_single_nodes():
    @tread_fx.register_leaf_module
    class Opaque(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.cumsum(1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.opaque = Opaque()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = registered_scan(self.opaque(x))
            for block in self.blocks:
                x = block(x)
            return x

    traced = trace_call(Model(), (torch.randn(2, 4, 8),), {}, {"blocks.0", "blocks.1"})
    nodes = list(traced.gm.graph.nodes)
    assert any(n.op == "call_module" and n.target == "model.opaque" for n in nodes)
    assert any(n.op == "call_function" and n.target is registered_scan for n in nodes)
    assert not any(n.op == "call_method" and n.target == "flip" for n in nodes)


@tread_fx.register_leaf_function
def registered_scan(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1).cumsum(1).flip(1)


def test_registries_reject_the_wrong_kind_of_object():
    with pytest.raises(tread_fx.RegistrationError, match="nn.Module subclass"):
        tread_fx.register_leaf_module(nn.Linear(2, 2))
    with pytest.raises(tread_fx.RegistrationError, match="register_leaf_module"):
        tread_fx.register_leaf_function(nn.Linear)


def test_checkpointed_blocks_are_still_blocks_and_stay_checkpointed():
    torch.manual_seed(0)
    with_ckpt, without = ShapeModel(use_checkpoint=True), ShapeModel()
    without.load_state_dict(with_ckpt.state_dict())
    results = []
    for model in (with_ckpt, without):
        tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
        x, t = _inputs()
        x.requires_grad_(True)
        model.train()(x, t)["out"].square().sum().backward()
        results.append((model(x, t)["out"].detach(), x.grad))
    graph = tread_fx.routed_graphs(with_ckpt)[0].gm.graph
    calls = [n for n in graph.nodes if n.target is checkpoint]
    assert len(calls) == 4 and not any(
        n.op == "call_module" and "blocks" in n.target for n in graph.nodes
    )
    assert torch.equal(results[0][1], results[1][1])
