"""One configuration: ``explain`` describes exactly the routing that ``route`` runs."""

from __future__ import annotations

import pytest
import torch
from conftest import dit_inputs, tiny_dit

import tread_fx
from tread_fx.config import resolve_config

OPTIONS = [
    {},
    {"rate": 0.25},
    {"routes": [(1, -1, 0.75)]},
    {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]},
    {"routes": [(0, 2), (2, 4)]},
    {"selection": "rows"},
    {"selection": "rows", "grid": (4, 4)},
    {"blocks": "blocks"},
    {"keep_prefix": 0},
    {"strict": False},
    {"reinsert": tread_fx.Reinsert("blend", 0.5, 0.5)},
    {"share_selection": True},
    {"share_selection": False},
    {"fp32_reentry": True},
]


def _config(model: torch.nn.Module) -> tread_fx.RoutingConfig:
    return model.__dict__["_tread_fx"].config


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_explain_and_route_describe_the_same_routing(options):
    kwargs = {"routes": [(1, 3)], **options}
    inputs = dit_inputs()
    explanation = tread_fx.explain(tiny_dit(depth=4), example_inputs=inputs, flops=False, **kwargs)
    model = tread_fx.route(tiny_dit(depth=4), seed=0, **kwargs)
    model.train()(*inputs)
    built = tread_fx.routed_graphs(model)[0]
    assert explanation.config == _config(model)
    assert explanation.refusal is None
    assert [(r.start, r.end, r.rate, r.kept_tokens) for r in explanation.routes] == [
        (p.route.start, p.route.end, p.route.rate, p.kept_tokens) for p in built.plans
    ]
    assert explanation.routed_graph.code == built.gm.code
    fp32 = [n.name for n in built.gm.graph.nodes if n.meta.get("tread_fp32")]
    assert fp32 == [
        n.name for n in explanation.routed_graph.graph.nodes if n.meta.get("tread_fp32")
    ]


def test_config_is_resolved_once():
    model = tiny_dit(depth=4)
    config = resolve_config(model, [(1, -1)], 0.5, selection="rows")
    assert config.block_lists == ["blocks"] and config.depth == 4
    assert [(r.start, r.end) for r in config.resolved] == [(1, 3)]
    assert config.strategy.name == "rows"
    assert config.routes_for(4) is config.resolved


def test_force_routing_derives_from_the_same_config():
    model = tread_fx.route(tiny_dit(depth=4), [(1, 3, 0.25)], seed=0)
    state = model.__dict__["_tread_fx"]
    with tread_fx.force_routing(model, rate=0.3):
        forced = state.forced
        assert forced == state.config.at_rate(0.3)
        assert [r.rate for r in forced.resolved] == [0.3]
        assert forced.strategy is state.config.strategy
    assert state.forced is None
