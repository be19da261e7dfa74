"""torch.compile(routed_model, fullgraph=True), seeded or not: no graph break, no recompile,
the same selections as the eager model (slow tests)."""

from __future__ import annotations

import pytest
import torch
from conftest import dit_inputs, tiny_dit

import tread_fx

pytestmark = pytest.mark.slow


def _routed(seed, **kwargs):
    model = tiny_dit(depth=4, class_dropout_prob=0.0)
    return tread_fx.route(model, routes=[(1, 3)], seed=seed, **kwargs)


def _step(model, inputs):
    out = model(*inputs)
    out.square().mean().backward()
    return out


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_seeded_routed_model_selects_like_the_eager_one(backend):
    torch._dynamo.reset()
    eager, routed, inputs = _routed(0), _routed(0), dit_inputs()
    eager.train(), routed.train()
    _step(eager, inputs), _step(routed, inputs)  # traced (and a selection drawn) eagerly
    compiled = torch.compile(routed, fullgraph=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            out, expected = _step(compiled, inputs), _step(eager, inputs)
            kept = tread_fx.route_info(compiled)[0].kept
            assert torch.equal(kept, tread_fx.route_info(eager)[0].kept)
            assert torch.allclose(out, expected, atol=1e-4)
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_compiled_unseeded_routed_model_has_no_break_and_no_recompile():
    torch._dynamo.reset()
    model, inputs = _routed(None), dit_inputs()
    _step(model.train(), inputs)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    kept = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            _step(compiled, inputs)
            kept.append(tread_fx.route_info(model)[0].kept)
    assert not torch.equal(kept[0], kept[1])  # fresh draws every step


def test_example_inputs_let_the_first_call_be_compiled():
    torch._dynamo.reset()
    inputs = dit_inputs()
    model = _routed(0, example_inputs=inputs)
    compiled = torch.compile(model.train(), fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            _step(compiled, inputs)
    assert len(tread_fx.routed_graphs(model)) == 1


@pytest.mark.parametrize("seed", [0, None])
def test_the_first_call_can_be_compiled_with_fullgraph(seed):
    torch._dynamo.reset()
    inputs = dit_inputs()
    model, eager = _routed(seed).train(), _routed(seed).train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # before any call
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            out, expected = _step(compiled, inputs), _step(eager, inputs)
            assert tread_fx.route_info(model)[0].kept.shape == (3, 8)
            if seed is not None:
                assert torch.equal(
                    tread_fx.route_info(model)[0].kept, tread_fx.route_info(eager)[0].kept
                )
                assert torch.allclose(out, expected, atol=1e-4)
    assert len(tread_fx.routed_graphs(model)) == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_new_signature_under_fullgraph_is_traced_before_the_compiled_call():
    torch._dynamo.reset()
    model, inputs = _routed(0).train(), dit_inputs()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _step(compiled, inputs)
    _step(compiled, [v[:2] for v in inputs])  # a smaller last batch: a second routed graph
    assert tread_fx.route_info(model)[0].kept.shape == (2, 8)
    assert len(tread_fx.routed_graphs(model)) == 2
    assert not torch._dynamo.utils.counters["graph_break"]


class _WithLoss(torch.nn.Module):
    """A routed model compiled as a submodule: dynamo inlines its call, nothing runs before."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *inputs):
        return self.inner(*inputs).square().mean()


def test_a_first_call_inlined_inside_fullgraph_says_to_call_once_before_compiling():
    torch._dynamo.reset()
    model, inputs = _routed(0).train(), dit_inputs()
    compiled = torch.compile(_WithLoss(model), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="run one training call before compiling"):
        compiled(*inputs)
    torch._dynamo.reset()
    loss = torch.compile(_WithLoss(model), backend="aot_eager")(*inputs)  # one graph break
    assert loss.ndim == 0 and tread_fx.route_info(model)[0].kept.shape == (3, 8)


def test_a_failed_guard_under_inductor_is_a_clear_error_not_a_device_assert():
    from benchmarks.guard_change import MaskedBackbone

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tread_fx.route(MaskedBackbone(width=16, depth=4), routes=[(1, 3)], seed=0,
                           compile={"backend": "inductor"})  # fmt: skip
    x, on = torch.randn(2, 8, 4), torch.ones(2, 3, dtype=torch.bool)
    model.train()(x, on)  # compiled with the guard inside
    with pytest.raises(tread_fx.RoutedGraphError, match="guard_change.py"):
        model.train()(x, torch.zeros_like(on))
