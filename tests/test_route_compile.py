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
    torch._dynamo.utils.counters.clear()  # graph breaks counted by tests run before this one
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


class _RecordingBackend:
    """``aot_eager`` that keeps the forward and backward aten graphs it compiles."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.forward, self.backward = [], []
        self.backend = aot_autograd(
            fw_compiler=self._keep(self.forward), bw_compiler=self._keep(self.backward)
        )

    @staticmethod
    def _keep(graphs):
        def compiler(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        return compiler

    def targets(self, graphs) -> list[str]:
        return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


def _state_space(family: str, input_size: int):
    from tread_fx.models import mamba, rwkv

    factory = {"mamba": mamba.Mamba_S_2, "rwkv": rwkv.RWKV_S_2}[family]
    torch.manual_seed(0)
    model = factory(
        input_size=input_size, in_channels=1, num_classes=10, depth=4, hidden_size=32,
        class_dropout_prob=0.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    inputs = (
        torch.randn(2, 1, input_size, input_size, generator=gen),
        torch.rand(2, generator=gen) * 999,
        torch.tensor([1, 7]),
    )
    return model, inputs


@pytest.mark.parametrize(
    ("family", "scan_op", "calls"),
    [("mamba", "selective_scan", 8), ("rwkv", "bi_wkv", 4)],  # Mamba: two directions per block
)
def test_compiled_state_space_scans_stay_one_opaque_op(family, scan_op, calls):
    """The Python-loop scans are custom ops: compiled graphs call them and never unroll them."""
    node_counts = []
    for input_size in (8, 16):  # 16 and 64 tokens: an unrolled loop would grow with them
        torch._dynamo.reset()
        model, inputs = _state_space(family, input_size)
        eager = type(model).forward(model.train(), *inputs)
        eager.square().mean().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        recorder = _RecordingBackend()
        compiled = torch.compile(model, backend=recorder.backend, fullgraph=True)
        out = compiled(*inputs)
        out.square().mean().backward()
        assert torch.allclose(out, eager, atol=1e-5)
        for p, g in zip(model.parameters(), eager_grads):
            assert torch.allclose(p.grad, g, atol=1e-5, rtol=1e-4)
        forward_ops, backward_ops = (
            recorder.targets(recorder.forward),
            recorder.targets(recorder.backward),
        )
        assert forward_ops.count(f"tread_fx.{scan_op}_forward.default") == calls
        assert backward_ops.count(f"tread_fx.{scan_op}_backward.default") == calls
        node_counts.append((len(forward_ops), len(backward_ops)))
    assert node_counts[0] == node_counts[1]


@pytest.mark.parametrize(("family", "selection"), [("mamba", "random"), ("rwkv", "rows")])
def test_compiled_routed_state_space_model_matches_eager(family, selection):
    torch._dynamo.reset()
    eager, inputs = _state_space(family, 8)
    compiled, _ = _state_space(family, 8)
    options = {"routes": [(1, 3)], "rate": 0.5, "selection": selection, "seed": 0}
    tread_fx.route(eager, **options)
    tread_fx.route(compiled, compile={"backend": "aot_eager"}, **options)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            a, b = eager.train()(*inputs), compiled.train()(*inputs)
            assert torch.allclose(a, b, atol=1e-5)
            (a.square().mean() + b.square().mean()).backward()
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    assert not torch._dynamo.utils.counters["graph_break"]
