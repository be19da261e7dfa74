"""An exception from tread_fx's own code is named; the model's own exceptions stay the model's.

A fault is injected into each stage by replacing a function a pass calls with a builtin
that raises when called (so the innermost Python frame is tread_fx's, as for a real bug).
"""

from __future__ import annotations

import importlib
import operator
import time

import pytest
import torch
from torch import nn

import tread_fx
import tread_fx.passes.locate.stream as locate_pass
import tread_fx.passes.trace.tracer as trace_pass
import tread_fx.pipeline as pipeline
from tread_fx.errors import TreadFxError, TreadFxInternalError

B, N, D = 2, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Tiny(nn.Module):
    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.fail = fail
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.fail != "assert", "the model's own assertion"
        h = self.embed(x)
        if self.fail == "op":
            h = torch.cat([h, x], dim=0)  # the model's own shape error, raised while traced
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _fault() -> operator.itemgetter:
    """A builtin that raises TypeError/KeyError when called with the pass's arguments."""
    return operator.itemgetter("injected fault")


FAULTS = {
    "tracing": (trace_pass, "name_placeholders"),
    "locating": (locate_pass, "_carried_slots"),
    "planning": (pipeline, "plan_route"),
    "rewriting": (pipeline, "rewrite_route"),
    "outputs": (pipeline, "append_route_outputs"),
}


@pytest.mark.parametrize("where", list(FAULTS))
def test_a_fault_in_each_stage_is_a_named_internal_error(monkeypatch, where):
    module, name = FAULTS[where]
    monkeypatch.setattr(module, name, _fault())
    model = tread_fx.route(Tiny(), [(1, 3)], 0.5)
    with pytest.raises(TreadFxInternalError) as caught:
        model.train()(torch.randn(B, N, 4))
    err = caught.value
    assert isinstance(err, TreadFxError) and isinstance(err.__cause__, TypeError)
    first = str(err).splitlines()[0]
    assert first.startswith("internal error in tread_fx while ") and len(first) <= 150
    assert err.stage.split()[0] in {"tracing", "locating", "planning", "rewriting"}
    assert ".py:" in str(err) and "report" in str(err)
    if where in ("planning", "rewriting"):
        assert err.block == "blocks.1" and "block blocks.1" in first


def test_explain_names_an_internal_error_too(monkeypatch):
    monkeypatch.setattr(locate_pass, "_carried_slots", _fault())
    with pytest.raises(TreadFxInternalError, match="while locating"):
        tread_fx.explain(Tiny(), [(1, 3)], 0.5, (torch.randn(B, N, 4),), flops=False)


def test_explains_trace_of_the_original_graph_is_a_stage_too(monkeypatch):
    explain_module = importlib.import_module("tread_fx.inspection.explain")
    monkeypatch.setattr(explain_module, "trace_call", _fault())
    with pytest.raises(TreadFxInternalError, match="while tracing"):
        tread_fx.explain(Tiny(), [(1, 3)], 0.5, (torch.randn(B, N, 4),), flops=False)


def test_the_models_own_exceptions_stay_the_models():
    """A shape error the model's own code raises while traced, and a missing argument."""
    model = tread_fx.route(Tiny("op"), [(1, 3)], 0.5)
    with pytest.raises(RuntimeError) as caught:
        model.train()(torch.randn(B, N, 4))
    assert not isinstance(caught.value, TreadFxError)
    with pytest.raises(TypeError, match="missing 1 required positional argument") as caught:
        tread_fx.route(Tiny(), [(1, 3)], 0.5).train()()
    assert not isinstance(caught.value, TreadFxError)


def test_the_models_own_assertion_is_not_called_internal():
    """(Traced, it is refused as untraceable, as before: never as tread_fx's own bug.)"""
    model = tread_fx.route(Tiny("assert"), [(1, 3)], 0.5)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the point is what it is not
        model.train()(torch.randn(B, N, 4))
    assert not isinstance(caught.value, TreadFxInternalError)


def test_each_stage_of_a_build_is_timed_and_a_slow_stage_shows(monkeypatch):
    real_plan = pipeline.plan_route

    def slow_plan(*args, **kwargs):
        time.sleep(0.2)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(pipeline, "plan_route", slow_plan)
    model = tread_fx.route(Tiny(), [(1, 3)], 0.5)
    model.train()(torch.randn(B, N, 4))
    seconds = tread_fx.routed_graphs(model)[0].stage_seconds
    assert set(seconds) == {"tracing", "locating", "planning", "rewriting", "checking"}
    assert all(s >= 0 for s in seconds.values())
    assert seconds["planning"] >= 0.2 and max(seconds, key=seconds.get) == "planning"
