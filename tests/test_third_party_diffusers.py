"""Unmodified diffusers transformers routed by tread_fx (tiny random configs, no weights)."""

from __future__ import annotations

import warnings

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
from tread_fx.adapters.token_tables import take_rows

diffusers = pytest.importorskip("diffusers")
warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # diffusers deprecations

B, T = 2, 7  # batch, text tokens; 8x8 latents at patch 2 (or 4x4 at patch 1): N = 16


def _latents(channels: int = 4) -> torch.Tensor:
    return torch.randn(B, channels, 8, 8, generator=torch.Generator().manual_seed(1))


def _text(width: int = 24, tokens: int = T) -> torch.Tensor:
    return torch.randn(B, tokens, width, generator=torch.Generator().manual_seed(2))


def _dit() -> torch.nn.Module:
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=4, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
    )  # fmt: skip


def _pixart() -> torch.nn.Module:
    return diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=4, sample_size=8, patch_size=2, cross_attention_dim=32,
        caption_channels=24, norm_type="ada_norm_single",
    )  # fmt: skip


def _sd3() -> torch.nn.Module:
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
    )  # fmt: skip


def _flux() -> torch.nn.Module:
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
        pooled_projection_dim=16, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip


def _labels() -> torch.Tensor:
    return torch.tensor([1, 7])


def _timesteps() -> torch.Tensor:
    return torch.tensor([10.0, 500.0])


def _flux_inputs(text_tokens: int = T):
    def inputs():
        grid = torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij")
        img_ids = torch.stack(grid, -1).reshape(16, 3)
        txt_ids = torch.zeros(text_tokens, 3)
        hidden = torch.randn(B, 16, 16, generator=torch.Generator().manual_seed(1))
        kwargs = dict(
            encoder_hidden_states=_text(tokens=text_tokens),
            pooled_projections=torch.randn(B, 16, generator=torch.Generator().manual_seed(3)),
            timestep=_timesteps() / 1000,
            img_ids=img_ids,
            txt_ids=txt_ids,
        )
        return (hidden,), kwargs

    return inputs


def _sd3_kwargs(controlnet: bool = False) -> dict:
    kwargs = dict(
        encoder_hidden_states=_text(),
        pooled_projections=torch.randn(B, 16, generator=torch.Generator().manual_seed(3)),
        timestep=_timesteps(),
    )
    if controlnet:
        gen = torch.Generator().manual_seed(4)
        kwargs["block_controlnet_hidden_states"] = [torch.randn(B, 16, 32, generator=gen)] * 2
    return kwargs


CASES = {
    "dit": Case(
        "dit",
        _dit,
        lambda: ((_latents(),), dict(timestep=_timesteps().long(), class_labels=_labels())),
    ),
    "pixart": Case(
        "pixart",
        _pixart,
        lambda: (
            (_latents(),),
            dict(
                encoder_hidden_states=_text(),
                timestep=_timesteps(),
                added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            ),
        ),
    ),
    "sd3": Case("sd3", _sd3, lambda: ((_latents(),), _sd3_kwargs()), routes=[(1, 4)]),
    "sd3-controlnet": Case(
        "sd3-controlnet", _sd3, lambda: ((_latents(),), _sd3_kwargs(True)), routes=[(1, 3)]
    ),
    "flux": Case("flux", _flux, _flux_inputs(), routes=[(1, 3)]),
    "flux-text-as-long-as-image": Case("flux-16", _flux, _flux_inputs(16), routes=[(0, 4)]),
}
IDS = list(CASES)


@pytest.mark.parametrize("name", IDS)
def test_eval_is_bitwise_the_unrouted_model(name):
    check_eval_is_bitwise_unrouted(CASES[name])


@pytest.mark.parametrize("name", IDS)
def test_rate_zero_training_equals_the_original_training_forward(name):
    # diffusers' DiT drops class labels inside every block in training: the global RNG is
    # forked and seeded identically, and tread_fx draws its selection from its own generator
    check_rate_zero_equals_training(CASES[name])


@pytest.mark.parametrize("name", IDS)
def test_routed_training_keeps_shape_and_token_count(name):
    (info,) = check_routed_shape_count_and_change(CASES[name])
    assert info.num_tokens == 16 and info.prefix == 0


@pytest.mark.parametrize("name", IDS)
def test_every_learning_parameter_gets_a_gradient(name):
    check_gradients(CASES[name])


def _plan(model):
    return tread_fx.routed_graphs(model)[0].plans[0]


def _reasons(plan) -> dict[str, str]:
    return {c.reason for c in plan.entering} | {c.reason for c in plan.leaving}


def test_pixart_cross_attention_context_is_passed_untouched():
    case = CASES["pixart"]
    model = case.route(case.model())
    with capture_block_inputs(model.transformer_blocks[1]) as calls:
        train_forward(model, case)
    (args, kwargs) = calls[-1]
    hidden = args[0] if args else kwargs["hidden_states"]
    assert hidden.shape[1] == 8 and kwargs["encoder_hidden_states"].shape[1] == T


def test_sd3_text_stream_is_never_routed_and_last_block_returns_none_context():
    case = CASES["sd3"]  # route (1, 4) ends after the last block, which returns (None, hidden)
    model = case.route(case.model())
    with capture_block_inputs(model.transformer_blocks[2]) as calls:
        train_forward(model, case)
    kwargs = calls[-1][1]  # the last call: the first one is the trace's
    assert kwargs["hidden_states"].shape[1] == 8
    assert kwargs["encoder_hidden_states"].shape[1] == T
    assert any("carried non-token stream" in r for r in _reasons(_plan(model)))


def test_sd3_controlnet_residuals_between_routed_blocks_are_gathered():
    """The residuals are added to the stream between the blocks: a per-sample table by that
    use (tread_fx/passes/plan/region_uses.py), its rows gathered per sample with the kept ids."""
    case = CASES["sd3-controlnet"]
    model = case.route(case.model())
    train_forward(model, case)
    gathered = [c for c in _plan(model).entering if c.reason == "adapter 'rope-per-sample'"]
    assert gathered and all(c.action is take_rows and c.options["batch"] == 0 for c in gathered)


@pytest.mark.parametrize("name", ["flux", "flux-text-as-long-as-image"])
def test_flux_rope_rows_follow_a_batch_shared_selection_and_text_is_never_routed(name):
    case = CASES[name]
    model = case.model()
    with capture_block_inputs(model.transformer_blocks[0]) as calls:
        train_forward(model, case)
    cos, sin = calls[0][1]["image_rotary_emb"]
    text = calls[0][1]["encoder_hidden_states"].shape[1]
    case.route(model)
    block = model.single_transformer_blocks[0]
    with capture_block_inputs(block) as calls:
        train_forward(model, case)
    kwargs = calls[-1][1]  # the last call: the first one is the trace's
    (info,) = tread_fx.route_info(model)
    kept = info.kept
    assert (kept == kept[:1]).all(), "a batch-shared RoPE table needs a batch-shared selection"
    rows = torch.cat([torch.arange(text), text + kept[0]])
    routed_cos, routed_sin = kwargs["image_rotary_emb"]
    assert torch.equal(routed_cos, cos[rows]) and torch.equal(routed_sin, sin[rows])
    assert kwargs["hidden_states"].shape[1] == 8
    assert kwargs["encoder_hidden_states"].shape[1] == text
    assert any("carried non-token stream" in r for r in _reasons(_plan(model)))


def test_flux_share_selection_false_is_refused_naming_the_table():
    case = CASES["flux"]
    model = case.route(case.model(), share_selection=False)
    with pytest.raises(tread_fx.errors.SideInputError, match="batch-shared token tables"):
        train_forward(model, case)


def test_share_selection_true_shares_it_on_any_model():
    case = CASES["dit"]
    model = case.route(case.model(), share_selection=True)
    train_forward(model, case)
    kept = tread_fx.route_info(model)[0].kept
    assert (kept == kept[:1]).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dit", "pixart", "sd3-controlnet", "flux"])
def test_compiled_routed_graph(name):
    check_compiled(CASES[name])


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_diffusers_gradient_checkpointing_is_kept_in_the_routed_graph(name):
    # diffusers checkpoints only when torch.is_grad_enabled(): the trace must see grad mode
    case = CASES[name]
    reference = train_forward(case.model(), case)
    model = case.model()
    model.enable_gradient_checkpointing()
    case.route(model, rate=0.0)
    assert torch.equal(train_forward(model, case), reference)
    gm = tread_fx.routed_graphs(model)[0].gm
    assert sum(bool(n.meta.get("tread_checkpoint")) for n in gm.graph.nodes) == 4


def _chroma() -> torch.nn.Module:
    return diffusers.ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
        axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=1,
    )  # fmt: skip


def _chroma_inputs():
    (hidden,), kwargs = _flux_inputs()()
    del kwargs["pooled_projections"]
    return (hidden,), kwargs


def test_single_blocks_on_text_plus_image_keep_the_text_as_prefix():
    # Chroma (like AuraFlow) concatenates the text in front of the image stream between its
    # joint and single blocks: in the single blocks the text is a prefix never routed
    case = Case("chroma-single", _chroma, _chroma_inputs, routes=[(2, 4)])
    check_rate_zero_equals_training(case)
    (info,) = check_routed_shape_count_and_change(case)
    assert (info.prefix, info.num_tokens) == (T, T + 16)


def test_a_route_across_the_text_concatenation_routes_the_image_tokens():
    """Chroma concatenates the text in front of the image between joint and single blocks:
    the kept image tokens travel through the concatenation (tests/test_mmdit_streams.py)."""
    case = Case("chroma-cross", _chroma, _chroma_inputs, routes=[(1, 3)])
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    (info,) = check_routed_shape_count_and_change(case)
    assert (info.prefix, info.num_tokens) == (0, 16)  # routed where the stream is image-only
    check_gradients(case)
    case = Case("chroma-joint", _chroma, _chroma_inputs, routes=[(0, 2)])
    check_rate_zero_equals_training(case)  # ending exactly at the change is fine


def test_cogvideox_text_sliced_off_the_joint_embedding_is_not_routed():
    def make():
        return diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            time_embed_dim=32, text_embed_dim=24, num_layers=4, sample_width=8,
            sample_height=8, sample_frames=1, patch_size=2, max_text_seq_length=T,
        )  # fmt: skip

    def inputs():
        latents = torch.randn(B, 1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
        return (latents,), dict(encoder_hidden_states=_text(), timestep=_timesteps().long())

    case = Case("cogvideox", make, inputs)
    check_rate_zero_equals_training(case)
    check_routed_shape_count_and_change(case)


def test_a_joint_key_mask_sized_by_a_sum_of_lengths_routes():
    # HunyuanVideo hands its blocks a [B, 1, 1, N + T] mask built without a concatenation:
    # torch.ones(B, image_len + text_len); the traced sum ties its first N rows to the stream
    def make():
        return diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
            num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=2,
            patch_size_t=1, text_embed_dim=24, pooled_projection_dim=16,
            rope_axes_dim=(4, 6, 6), guidance_embeds=False,
        )  # fmt: skip

    def inputs():
        latents = torch.randn(B, 4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        pooled = torch.randn(B, 16, generator=torch.Generator().manual_seed(3))
        kwargs = dict(
            timestep=_timesteps(),
            encoder_hidden_states=_text(),
            encoder_attention_mask=torch.ones(B, T),
            pooled_projections=pooled,
        )
        return (latents,), kwargs

    case = Case("hunyuan-video", make, inputs)
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    check_routed_shape_count_and_change(case)
    check_gradients(case)
    exp = str(tread_fx.explain(case.model(), case.routes, 0.5, inputs()))
    assert "adapter 'attention-mask'" in exp
