"""``route(model)`` without routes: the paper's rule "start 2, end depth-4", scaled down for
shallow stacks (docs/options.md "The default route"), on the reference backbones and on
unmodified timm and diffusers models; ``explain(model)`` of a routed model explains the routing
it has; the ``tread-fx`` command applies the same rule when ``--routes`` is not given."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import dit_inputs, tiny_dit

import tread_fx
from tread_fx import cli
from tread_fx.routes import Route, default_route

ROOT = Path(__file__).resolve().parents[1]

# depth -> the default route; the table of docs/options.md
RULE = {1: (0, 1), 2: (0, 1), 3: (1, 2), 4: (1, 3), 5: (1, 4), 6: (1, 5), 7: (1, 6), 8: (1, 6)}
RULE |= {9: (1, 7), 10: (1, 8), 11: (1, 9), 12: (2, 8), 28: (2, 24)}


@pytest.mark.parametrize("depth", list(RULE))
def test_the_rule(depth):
    assert default_route(depth) == Route(*RULE[depth])


def test_the_rule_is_the_papers_from_12_blocks_and_covers_half_of_any_stack_from_4():
    for depth in range(1, 200):
        route = default_route(depth)
        assert 0 <= route.start < route.end <= depth, depth
        if depth >= 12:
            assert (route.start, route.end) == (2, depth - 4)
        if depth >= 4:
            assert 2 * (route.end - route.start) >= depth, depth


def test_the_docs_table_is_the_rule():
    text = (ROOT / "docs" / "options.md").read_text().split("## The default route")[1]
    rows = re.findall(r"^\| (\d+) \| `\((\d+), (\d+)\)` \|", text.split("\n## ")[0], re.M)
    assert {int(d): (int(s), int(e)) for d, s, e in rows} == RULE


@pytest.mark.parametrize("depth", [0, -3, 2.0, True])
def test_no_default_route_for_a_stack_without_blocks(depth):
    with pytest.raises(tread_fx.InvalidRouteError, match="at least one block"):
        default_route(depth)


# -- route(model) on real models: one routed training step ----------------------------------


def _reference(family: str, depth: int):
    from tread_fx.models.mamba import Mamba_S_2
    from tread_fx.models.rwkv import RWKV_S_2

    torch.manual_seed(0)
    tiny = dict(input_size=8, in_channels=1, num_classes=10, depth=depth, hidden_size=32)
    return {"mamba": Mamba_S_2, "rwkv": RWKV_S_2}[family](**tiny)


def _timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5
    )


def _diffusers(name: str):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    if name == "dit":
        return diffusers.DiTTransformer2DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            num_layers=3, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
        )  # fmt: skip
    return diffusers.FluxTransformer2DModel(  # 2 joint + 2 single blocks: depth 4, traced
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip


def _flux_inputs():
    gen = torch.Generator().manual_seed(1)
    grid = torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij")
    kwargs = dict(
        encoder_hidden_states=torch.randn(2, 7, 24, generator=gen),
        pooled_projections=torch.randn(2, 16, generator=gen),
        timestep=torch.tensor([0.01, 0.5]),
        img_ids=torch.stack(grid, -1).reshape(16, 3),
        txt_ids=torch.zeros(7, 3),
    )
    return (torch.randn(2, 16, 16, generator=gen),), kwargs


def _latents(channels: int) -> torch.Tensor:
    return torch.randn(2, channels, 8, 8, generator=torch.Generator().manual_seed(1))


LABELS = lambda: torch.tensor([1, 7])  # noqa: E731

MODELS = {  # name -> (model, (args, kwargs), the route the rule gives its depth)
    "dit-12": (lambda: tiny_dit(depth=12), lambda: (dit_inputs(), {}), (2, 8)),
    "mamba-4": (lambda: _reference("mamba", 4), lambda: (dit_inputs(), {}), (1, 3)),
    "rwkv-6": (lambda: _reference("rwkv", 6), lambda: (dit_inputs(), {}), (1, 5)),
    "timm-vit-2": (_timm_vit, lambda: ((torch.randn(2, 3, 16, 16),), {}), (0, 1)),
    "diffusers-dit-3": (
        lambda: _diffusers("dit"),
        lambda: ((_latents(4),), dict(timestep=torch.tensor([10, 500]), class_labels=LABELS())),
        (1, 2),
    ),
    "diffusers-flux-2+2": (lambda: _diffusers("flux"), _flux_inputs, (1, 3)),
}


def _first_tensor(out):
    while not isinstance(out, torch.Tensor):
        out = out.sample if hasattr(out, "sample") else out[0]
    return out


def _train_step(model, inputs) -> None:
    args, kwargs = inputs
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = _first_tensor(model.train()(*args, **kwargs)).float().square().mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", list(MODELS))
def test_route_without_routes_trains_on_the_rules_route(name):
    make, inputs, (start, end) = MODELS[name]
    model = make()
    assert tread_fx.route(model) is model
    _train_step(model, inputs())
    (info,) = tread_fx.route_info(model)
    assert info.route == Route(start, end, 0.5)
    assert info.kept.shape[1] < info.num_tokens + info.prefix + info.suffix  # tokens routed


def test_route_with_only_a_rate_keeps_the_rules_route_at_that_rate():
    model = tiny_dit(depth=4)
    tread_fx.route(model, rate=0.25)
    _train_step(model, (dit_inputs(), {}))
    (info,) = tread_fx.route_info(model)
    assert info.route == Route(1, 3, 0.25) and info.kept.shape == (3, 12)  # 16 tokens, 4 out


def test_force_routing_derives_from_the_default_route():
    model = tread_fx.route(tiny_dit(depth=8), seed=0).eval()
    with tread_fx.force_routing(model, rate=0.75):
        model(*dit_inputs())
    (info,) = tread_fx.route_info(model)
    assert info.route == Route(1, 6, 0.75) and info.kept.shape[1] == 4


# -- explain ---------------------------------------------------------------------------------


def test_explain_of_a_routed_model_explains_its_own_routing():
    model = tread_fx.route(tiny_dit(depth=6), rate=0.25, selection="rows", grid=(4, 4))
    report = tread_fx.explain(model, flops=False)
    (route,) = report.routes
    assert (route.start, route.end, route.rate, route.kept_tokens) == (1, 5, 0.25, 12)
    assert report.stream["selection"] == "rows"
    # an argument given replaces the model's own; the rest stays
    other = tread_fx.explain(model, rate=0.5, flops=False)
    assert (other.routes[0].start, other.routes[0].kept_tokens) == (1, 8)
    assert other.stream["selection"] == "rows"
    explicit = tread_fx.explain(model, [(0, 2)], flops=False).routes[0]
    assert (explicit.start, explicit.end, explicit.rate) == (0, 2, 0.25)


def test_explain_of_an_unrouted_model_uses_the_rule():
    (route,) = tread_fx.explain(tiny_dit(depth=12), flops=False).routes
    assert (route.start, route.end, route.rate) == (2, 8, 0.5)


def test_explain_of_a_model_routed_with_its_own_routes():
    model = tread_fx.route(tiny_dit(depth=6), [(0, 2), (3, 6, 0.75)])
    routes = tread_fx.explain(model, flops=False).routes
    assert [(r.start, r.end, r.rate) for r in routes] == [(0, 2, 0.5), (3, 6, 0.75)]


@pytest.mark.parametrize(("depth", "route"), [(4, "(1, 3, 0.5)"), (12, "(2, 8, 0.5)")])
def test_the_command_without_routes_applies_the_rule(capsys, depth, route):
    kwargs = dict(input_size=8, in_channels=1, depth=depth, hidden_size=32, num_heads=2)
    argv = ["diff", "tread_fx.models:DiT_S_2", "--model-kwargs", json.dumps(kwargs), "-q"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert f"routes [{route}]" in capsys.readouterr().out
