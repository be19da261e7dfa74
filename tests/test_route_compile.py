"""torch.compile of routed graphs: no graph break, no recompile across steps (slow tests)."""

from __future__ import annotations

import pytest
import torch
from conftest import dit_inputs, tiny_dit

import tread_fx

pytestmark = pytest.mark.slow


def _steps(model, inputs, count):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(count):
        optimizer.zero_grad()
        model.train()(*inputs).square().mean().backward()
        optimizer.step()


def test_compiled_routed_dit_has_no_graph_break_and_no_recompile():
    torch._dynamo.reset()
    model = tread_fx.route(tiny_dit(depth=4), routes=[(1, 3)], seed=0, compile=True)
    inputs = dit_inputs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        _steps(model, inputs, 1)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        _steps(model, inputs, 3)  # would raise on a recompile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert not torch._dynamo.utils.counters["graph_break"]


def test_compiled_routed_graph_matches_eager_with_the_same_selection():
    torch._dynamo.reset()
    eager = tread_fx.route(tiny_dit(depth=4, class_dropout_prob=0.0), routes=[(1, 3)], seed=0)
    compiled = tread_fx.route(
        tiny_dit(depth=4, class_dropout_prob=0.0),
        routes=[(1, 3)],
        seed=0,
        compile={"backend": "aot_eager"},
    )
    inputs = dit_inputs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            a, b = eager.train()(*inputs), compiled.train()(*inputs)
            assert torch.allclose(a, b, atol=1e-5)
            assert torch.equal(
                tread_fx.route_info(eager)[0].kept, tread_fx.route_info(compiled)[0].kept
            )
