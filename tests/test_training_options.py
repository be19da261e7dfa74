"""Route info, losses, blend re-entry, fp32 re-entry, routing probability and guidance."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import dit_inputs, tiny_dit

import tread_fx
from tread_fx import losses
from tread_fx.api import RouteInfo
from tread_fx.routes import Route


def _info(kept: list[list[int]], num_tokens: int, prefix: int = 0) -> RouteInfo:
    return RouteInfo(Route(1, 3, 0.5), torch.tensor(kept), num_tokens, prefix, None)


def test_route_info_exposes_kept_ids_mask_and_grid(dit, inputs):
    tread_fx.route(dit, routes=[(1, 3), (3, 5, 0.25)], seed=0)
    assert tread_fx.route_info(dit) is None
    out = dit.train()(*inputs)
    first, second = tread_fx.route_info(dit)
    assert out.shape == (3, 2, 8, 8), "the model's own return value is unchanged"
    # random selection over blocks that show no grid: no grid is used, none is reported
    assert first.grid is None and first.num_tokens == 16 and first.prefix == 0
    assert second.kept.shape == (3, 16 - math.floor(16 * 0.25))
    mask = first.routed_mask
    assert mask.dtype == torch.bool and mask.shape == (3, 16)
    assert not mask.gather(1, first.kept).any() and mask.sum() == 3 * 8


def test_patch_loss_pools_like_patch_embed_order():
    per_pixel = torch.arange(64.0).view(1, 1, 8, 8)
    tokens = losses.patch_loss(per_pixel, 2)
    patches = per_pixel.view(1, 1, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 16, 4)
    assert torch.allclose(tokens, patches.mean(-1))
    with pytest.raises(losses.LossShapeError, match="divisible"):
        losses.patch_loss(torch.ones(1, 1, 7, 8), 2)


def test_masked_and_reconstruction_losses_equal_direct_computations():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    infos = [_info([[0, 2], [1, 3]], 4), _info([[3], [0]], 4)]
    processed = ((1 + 3) / 2 + (6 + 8) / 2) / 2, (4 + 5) / 2
    around = ((2 + 4) / 2 + (5 + 7) / 2) / 2, ((1 + 2 + 3) / 3 + (6 + 7 + 8) / 3) / 2
    masked = losses.masked_denoising_loss(per_token, infos)
    assert masked.item() == pytest.approx(sum(processed) / 2)
    assert losses.reconstruction_loss(per_token, infos).item() == pytest.approx(sum(around) / 2)
    weight = torch.tensor([1.0, 0.0])
    weighted = losses.masked_denoising_loss(per_token, infos[:1], weight)
    assert weighted.item() == pytest.approx((1 + 3) / 2 / 2)


def test_losses_skip_prefix_tokens_and_check_shapes():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    info = _info([[0, 1, 3]], 5, prefix=1)  # cls + image tokens 0 and 2 kept
    assert losses.masked_denoising_loss(per_token, [info]).item() == pytest.approx(2.0)
    assert losses.reconstruction_loss(per_token, [info]).item() == pytest.approx(3.0)
    with pytest.raises(losses.LossShapeError, match="patch_loss"):
        losses.masked_denoising_loss(torch.ones(1, 5), [info])
    with pytest.raises(losses.LossShapeError, match="route_info"):
        losses.masked_denoising_loss(per_token, None)


def test_tread_loss_modes_on_a_routed_step(dit, inputs):
    tread_fx.route(dit, routes=[(1, 4)], seed=0)
    x = inputs[0]
    pred = dit.train()(*inputs)[:, :1]
    per_pixel = (pred - x) ** 2
    infos = tread_fx.route_info(dit)
    full = losses.tread_loss(per_pixel, infos, 2)
    assert full.item() == pytest.approx(per_pixel.mean().item())
    tokens = losses.patch_loss(per_pixel, 2)
    masked = losses.tread_loss(per_pixel, infos, 2, mode="masked", reconstruction_weight=0.1)
    direct = (tokens * ~infos[0].routed_mask).sum(1) / 8
    rec = (tokens * infos[0].routed_mask).sum(1) / 8
    assert masked.item() == pytest.approx((direct.mean() + 0.1 * rec.mean()).item(), rel=1e-5)
    masked.backward()
    assert all(p.grad is not None for p in dit.parameters())
    with pytest.raises(losses.LossShapeError, match="'full' or 'masked'"):
        losses.tread_loss(per_pixel, infos, 2, mode="maskdit")


def test_blend_reentry_mixes_the_start_value_and_the_embedded_input(inputs):
    outputs = {}
    for name, reinsert in {
        "scatter": None,
        "identity-blend": tread_fx.Reinsert("blend", 1.0, 0.0),
        "blend": tread_fx.Reinsert("blend", 0.5, 0.5),
    }.items():
        model = tread_fx.route(tiny_dit(), routes=[(2, 5)], seed=0, reinsert=reinsert)
        outputs[name] = model.train()(*inputs)
    graph_code = tread_fx.routed_graphs(model)[0].gm.code
    assert "blend_tokens" in graph_code
    assert torch.allclose(outputs["scatter"], outputs["identity-blend"], atol=1e-6)
    assert not torch.allclose(outputs["scatter"], outputs["blend"])


def test_fp32_reentry_runs_the_block_after_the_route_outside_autocast(inputs):
    model = tread_fx.route(tiny_dit(), routes=[(1, 3)], seed=0, fp32_reentry=True)
    dtypes = {}
    for i in (2, 3):
        model.blocks[i].mlp.fc1.register_forward_hook(  # a Linear: bf16 under autocast
            lambda mod, args, out, i=i: dtypes.__setitem__(i, (args[0].dtype, out.dtype))
        )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.train()(*inputs).float().mean().backward()
    assert dtypes[3][1] == torch.float32, "block 3 re-enters in fp32"
    assert dtypes[2][1] == torch.bfloat16, "routed blocks stay in autocast"
    assert "call_in_fp32" in tread_fx.routed_graphs(model)[0].gm.code


def test_routing_probability_routes_only_a_fraction_of_steps(inputs):
    model = tread_fx.route(tiny_dit(), routes=[(1, 3)], seed=0, routing_probability=0.5)
    routed = 0
    for _ in range(40):
        model.train()(*inputs)
        routed += tread_fx.route_info(model) is not None
    assert 10 <= routed <= 30
    with pytest.raises(tread_fx.InvalidRateError, match="routing_probability"):
        tread_fx.route(tiny_dit(), routes=[(1, 3)], routing_probability=0.0)


def test_force_routing_in_eval_and_back(dit, inputs):
    reference = dit.eval()(*inputs)
    tread_fx.route(dit, routes=[(1, 4)], seed=0)
    with tread_fx.force_routing(dit, rate=0.5):
        forced = dit.eval()(*inputs)
        assert tread_fx.route_info(dit)[0].kept.shape == (3, 8)
    assert not torch.allclose(forced, reference)
    with tread_fx.force_routing(dit, rate=0.0):
        assert torch.allclose(dit.eval()(*inputs), reference, atol=1e-6)
    assert torch.equal(dit.eval()(*inputs), reference)


def test_sparse_guidance_combines_two_conditional_predictions(dit, inputs):
    tread_fx.route(dit, routes=[(1, 4)], seed=0)
    dit.eval()
    full = dit(*inputs)
    assert torch.equal(tread_fx.sparse_guidance(dit, *inputs, scale=1.0, rates=(0.0, 0.5)), full)
    guided = tread_fx.sparse_guidance(dit, *inputs, scale=2.0, rates=(0.0, 0.5))
    weak = tread_fx.route_info(dit)  # the weak branch ran last, routed at 0.5
    assert weak[0].kept.shape == (3, 8)
    assert not torch.allclose(guided, full)
    with pytest.raises(tread_fx.InvalidRateError, match="weak branch"):
        tread_fx.sparse_guidance(dit, *inputs, scale=2.0, rates=(0.5, 0.3))
    with pytest.raises(tread_fx.NotRoutedError):
        tread_fx.sparse_guidance(tiny_dit(), *dit_inputs(), scale=2.0)
