"""Code the tracer cannot follow runs as it is (issue 41, bullet 3; ``passes/trace/opaque.py``).

A custom ``autograd.Function`` is one node (its own backward is used in routed training; fx
traced its forward before, a silently wrong gradient), and a helper function with a numpy
round trip or a C call that rejects a traced value becomes a leaf function (refused before).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.dlpack as dlpack
from torch import nn

import tread_fx
import tread_fx.passes.trace.tracer as tracer_module
from tread_fx.errors import UntraceableModelError
from tread_fx.passes.trace.opaque import FunctionApply
from tread_fx.passes.trace.tracer import trace_call

B, N, D = 2, 16, 32


class Scale(torch.autograd.Function):
    """``2 x`` with a hand-written backward of ``3 g`` (not the true gradient, on purpose)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 3


def scale(x: torch.Tensor) -> torch.Tensor:
    return Scale.apply(x)


def numpy_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.tanh(x.detach().cpu().numpy())).to(x.device)


def dlpack_copy(x: torch.Tensor) -> torch.Tensor:
    return dlpack.from_dlpack(dlpack.to_dlpack(x.contiguous())).clone()


OPS = ["function", "numpy", "c-call"]


def opaque(op: str, x: torch.Tensor) -> torch.Tensor:
    """Calls by the global name (a leaf function is patched under its name)."""
    if op == "function":
        return scale(x)
    return numpy_tanh(x) if op == "numpy" else dlpack_copy(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x) + pos)


class Model(nn.Module):
    """The opaque op on the embedded tokens (outside the blocks) or on the position table."""

    def __init__(self, op: str, where: str) -> None:
        super().__init__()
        self.op, self.where = op, where
        self.inp, self.out = nn.Linear(8, D), nn.Linear(D, 8)
        self.pos = nn.Parameter(torch.randn(1, N, D))
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, pos = self.inp(x), self.pos.expand(x.shape[0], -1, -1)
        if self.where == "embed":
            return opaque(self.op, h), pos
        return h, opaque(self.op, pos)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, pos = self.embed(x)
        for block in self.blocks:
            h = block(h, pos)
        return self.out(h)


def _reference(model: Model, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Route (1, 3) written out: tokens ``idx`` (per sample) and their table rows."""
    h, pos = model.embed(x)
    h = model.blocks[0](h, pos)
    rows = idx[..., None].expand(-1, -1, D)
    kept, kept_pos = h.gather(1, rows), pos.gather(1, rows)
    for block in model.blocks[1:3]:
        kept = block(kept, kept_pos)
    h = h.scatter(1, rows, kept)
    return model.out(model.blocks[3](h, pos))


@pytest.mark.parametrize("where", ["embed", "side"])
@pytest.mark.parametrize("op", OPS)
def test_routed_equals_the_hand_written_routed_forward(op, where):
    torch.manual_seed(0)
    model, x = Model(op, where), torch.randn(B, N, 8)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    out = model.train()(x)
    (info,) = tread_fx.route_info(model)
    ref_model = Model(op, where)
    ref_model.load_state_dict(model.state_dict())
    expected = _reference(ref_model, x, info.kept)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        if q.grad is not None:  # the Function's own backward, in both
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_custom_function_is_one_node():
    """Before: fx traced ``forward`` (a ``mul`` node) and training used its gradient."""
    torch.manual_seed(0)
    model = Model("function", "embed")
    traced = trace_call(model, (torch.randn(B, N, 8),), {}, {f"blocks.{i}" for i in range(4)})
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert FunctionApply.of(Scale) in targets


class InstanceForward(nn.Module):
    """Its class has no ``forward``; the instance has one (``torch.compile``'s wrapper of a
    module is built so): the class's call fails in the tracer's own generated ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.forward = self.lin


def test_a_failure_in_the_tracers_own_code_is_refused_without_retrying(monkeypatch):
    """Before: the generated ``forward`` (a new function on every retry) was taken for a
    helper of the model's to make a leaf function, and the trace retried without end."""
    traces = []
    original = tracer_module.trace_restoring_state

    def counted(*args):
        traces.append(1)
        if len(traces) > 3:
            pytest.fail("the trace retries without progress")
        return original(*args)

    monkeypatch.setattr(tracer_module, "trace_restoring_state", counted)
    with pytest.raises(UntraceableModelError):
        trace_call(InstanceForward(), (torch.randn(B, N, D),), {}, set())


class BetweenBlocks(nn.Module):
    """The opaque op on the tokens between blocks 1 and 2 (inside route (1, 3), outside
    route (0, 1))."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.inp, self.out = nn.Linear(8, D), nn.Linear(D, 8)
        self.pos = nn.Parameter(torch.randn(1, N, D))
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, pos = self.inp(x), self.pos.expand(x.shape[0], -1, -1)
        for i, block in enumerate(self.blocks):
            h = block(h, pos)
            if i == 1:
                h = opaque(self.op, h)
        return self.out(h)


@pytest.mark.parametrize("op", OPS)
def test_an_opaque_call_on_the_tokens_inside_a_route_is_refused_naming_it(op):
    model = tread_fx.route(BetweenBlocks(op), routes=[(1, 3)], rate=0.5, seed=0)
    name = {"function": "Scale_apply", "numpy": "numpy_tanh", "c-call": "dlpack_copy"}[op]
    with pytest.raises(UntraceableModelError, match=rf"(?s){name} \(kept as one call.*at .*py:"):
        model.train()(torch.randn(B, N, 8))


@pytest.mark.parametrize("op", OPS)
def test_an_opaque_call_outside_the_route_routes(op):
    model = tread_fx.route(BetweenBlocks(op), routes=[(2, 4)], rate=0.5, seed=0)
    out = model.train()(torch.randn(B, N, 8))
    assert out.shape == (B, N, 8)
    assert tread_fx.route_info(model)[0].kept.shape == (B, N // 2)


class SetupScale(torch.autograd.Function):
    """``k x`` in the ``setup_context`` style (``forward`` takes no ctx), backward ``3 g``."""

    @staticmethod
    def forward(x, k=2.0):
        return x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * 3, None


stored_scale, stored_setup_scale = Scale.apply, SetupScale.apply  # taken before any trace


class StoredApplyBlock(nn.Module):
    """Calls a Function's ``apply`` stored before the trace: a global, or an attribute."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin, self.where = nn.Linear(D, D), where
        self.fn = Scale.apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.where == "global":
            return x + stored_scale(h)
        return x + (stored_setup_scale(h) if self.where == "setup-context" else self.fn(h))


@pytest.mark.parametrize("where", ["global", "setup-context", "attribute"])
def test_a_stored_apply_is_one_node_with_its_own_backward(where):
    """Before: the stored ``apply`` bypassed the class attribute the retrace patches: refused."""
    torch.manual_seed(0)
    block, x = StoredApplyBlock(where), torch.randn(B, N, D)
    traced = trace_call(block, (x,), {}, set())
    function = SetupScale if where == "setup-context" else Scale
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert FunctionApply.of(function) in targets and not traced.auto_leaves
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    traced.gm(a)[0].square().sum().backward()
    block(b).square().sum().backward()  # the Function's own backward (3 g), in both
    torch.testing.assert_close(a.grad, b.grad)


class HeldHelperBlock(nn.Module):
    """Holds a helper with a numpy round trip as an attribute and calls it as ``self.op``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.op = nn.Linear(D, D), numpy_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.op(self.lin(x))


def test_a_helper_held_as_an_attribute_is_a_leaf_function():
    """Before: fx patches the helper's global name; ``self.op`` bypassed it: refused."""
    block, x = HeldHelperBlock(), torch.randn(B, N, D)
    traced = trace_call(block, (x,), {}, set())
    assert numpy_tanh in [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    torch.testing.assert_close(traced.gm(x)[0], block(x))
    assert block.op is numpy_tanh  # the attribute is itself again after the trace
