"""Unmodified timm vision transformers routed by tread_fx (tiny random configs, no weights)."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import (
    Case,
    capture_block_inputs,
    check_compiled,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
    train_forward,
)

import tread_fx

timm = pytest.importorskip("timm")
from timm.models.eva import Eva  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

SMALL = dict(img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=5)


def _images():
    return (torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1)),), {}


CASES = {
    "vit-cls-registers": Case("vit", lambda: VisionTransformer(**SMALL, reg_tokens=2), _images),
    "vit-no-class-token": Case(
        "vit-avg",
        lambda: VisionTransformer(**SMALL, class_token=False, global_pool="avg"),
        _images,
    ),
    "eva-rope": Case(
        "eva",
        lambda: Eva(**SMALL, use_rot_pos_emb=True, ref_feat_shape=(4, 4), num_reg_tokens=1),
        _images,
    ),
    "eva-rope-mixed": Case(  # RoPE-ViT style: a learned table per depth and head
        "eva-mixed",
        lambda: Eva(**SMALL, use_rot_pos_emb=True, rope_type="mixed", use_abs_pos_emb=False),
        _images,
    ),
}
IDS = list(CASES)
PREFIX = {"vit-cls-registers": 3, "vit-no-class-token": 0, "eva-rope": 2, "eva-rope-mixed": 1}


@pytest.mark.parametrize("name", IDS)
def test_eval_is_bitwise_the_unrouted_model(name):
    check_eval_is_bitwise_unrouted(CASES[name])


@pytest.mark.parametrize("name", IDS)
def test_rate_zero_training_equals_the_original_training_forward(name):
    check_rate_zero_equals_training(CASES[name])


@pytest.mark.parametrize("name", IDS)
def test_prefix_tokens_are_found_from_the_model_and_never_routed(name):
    (info,) = check_routed_shape_count_and_change(CASES[name])
    prefix = PREFIX[name]
    assert info.prefix == prefix and info.num_tokens == 16 + prefix
    assert (info.kept[:, :prefix] == torch.arange(prefix)).all()


@pytest.mark.parametrize("name", IDS)
def test_every_learning_parameter_gets_a_gradient(name):
    check_gradients(CASES[name])


def _eva_per_sample(side) -> bool:
    """The user's knowledge that EVA's attention also takes a per-sample table."""
    return side.arg_names == {"rope"} and side.use == "table" and side.token_aligned is False


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("name", ["eva-rope", "eva-rope-mixed"])
def test_eva_rope_table_rows_follow_the_kept_patches(name, per_sample):
    """By use, EVA's `rope` is a batch-shared table: its rows are cut and the selection is
    shared. A user adapter (the library-specific fact that EVA's attention also takes a
    per-sample [B, 1|H, k, d] table) restores a per-sample selection."""
    from tread_fx.adapters import Adapter, register_adapter, unregister_adapter
    from tread_fx.adapters.token_tables import find_rows, per_sample_rope_table

    case = CASES[name]
    model = case.model()
    with capture_block_inputs(model.blocks[1]) as calls:
        train_forward(model, case)
    table = calls[-1][1]["rope"]  # [N - prefix, d] or per-depth [heads, N - prefix, d]
    adapter = Adapter(
        "eva-per-sample",
        _eva_per_sample,
        per_sample_rope_table,
        options=lambda side: find_rows(
            side, batch=None, features_last=True, all_dims=False
        ).options(None),
    )
    if per_sample:
        register_adapter(adapter)
    try:
        case.route(model)
        with capture_block_inputs(model.blocks[1]) as calls:
            train_forward(model, case)
    finally:
        unregister_adapter(adapter)
    routed = calls[-1][1]["rope"]
    (info,) = tread_fx.route_info(model)
    patches = info.kept[:, info.prefix :] - info.prefix  # [B, k] rows of the table
    assert (patches == patches[:1]).all() != per_sample
    if per_sample:
        heads = table if table.dim() == 3 else table[None]
        expected = torch.stack([heads[:, rows] for rows in patches])  # [B, heads|1, k, d]
    else:
        expected = table[..., patches[0], :]
    assert torch.equal(routed, expected)


def test_vit_routes_with_rows_selection_on_the_patch_grid():
    case = Case("vit", lambda: VisionTransformer(**SMALL, reg_tokens=2), _images)
    model = case.route(case.model(), selection="rows")
    train_forward(model, case)
    (info,) = tread_fx.route_info(model)
    assert info.grid == (4, 4) and info.kept.shape[1] == 3 + 2 * 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "backend"), [("vit-cls-registers", "inductor"), ("eva-rope", "aot_eager")]
)
def test_compiled_routed_graph(name, backend):
    check_compiled(CASES[name], backend=backend)
