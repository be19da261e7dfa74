"""Other models of the same families route with no model-specific code, or are refused
precisely (tiny random configs, no weights). One smoke check each: rate-0 training equals
the original training forward, and a routed step runs and back-propagates."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import Case, check_rate_zero_equals_training, train_forward

import tread_fx

diffusers = pytest.importorskip("diffusers")
timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

B = 2


def _randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _t() -> torch.Tensor:
    return torch.tensor([10.0, 500.0])


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (B, 16), generator=torch.Generator().manual_seed(1))


def _images():
    return (_randn(B, 3, 16, 16),), {}


VIT = dict(pretrained=False, img_size=16, num_classes=5, patch_size=4, embed_dim=32, depth=4,
           num_heads=2)  # fmt: skip
LM = dict(vocab_size=50, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
          intermediate_size=64)  # fmt: skip


def _sana():
    return diffusers.SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
        num_layers=4, num_cross_attention_heads=2, cross_attention_head_dim=16,
        cross_attention_dim=32, caption_channels=24, sample_size=8, patch_size=2,
    )  # fmt: skip


def _sana_inputs():
    return (_randn(B, 4, 8, 8),), dict(
        encoder_hidden_states=_randn(B, 7, 24, seed=2), timestep=_t()
    )


ROUTED = {
    # the [N, N] relative position index inside each block: traced through, bias cut
    "timm-beit": Case("beit", lambda: timm.create_model("beit_base_patch16_224", **VIT), _images),
    "diffusers-sana-rows": Case("sana", _sana, _sana_inputs, route_kwargs={"selection": "rows"}),
    "diffusers-sana-auto": Case("sana", _sana, _sana_inputs),  # the default picks rows
    # the class-attention blocks' (tokens, cls) hand-off is unclear: the stack ends before them
    "timm-cait-auto": Case("cait", lambda: timm.create_model("cait_xxs24_224", **VIT), _images),
    "diffusers-hunyuan-dit": Case(
        "hunyuan-dit",
        lambda: diffusers.HunyuanDiT2DModel(
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            patch_size=2,
            sample_size=8,
            hidden_size=32,
            num_layers=4,
            cross_attention_dim=24,
            cross_attention_dim_t5=24,
            pooled_projection_dim=16,
            text_len=7,
            text_len_t5=5,
            use_style_cond_and_image_meta_size=False,
        ),  # fmt: skip
        lambda: (
            (_randn(B, 4, 8, 8),),
            dict(
                timestep=_t(),
                encoder_hidden_states=_randn(B, 7, 24, seed=2),
                text_embedding_mask=torch.ones(B, 7),
                encoder_hidden_states_t5=_randn(B, 5, 24, seed=3),
                text_embedding_mask_t5=torch.ones(B, 5),
                image_rotary_emb=(_randn(16, 16, seed=4), _randn(16, 16, seed=5)),
            ),
        ),
    ),
    "diffusers-wan": Case(
        "wan",
        lambda: diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            text_dim=24,
            freq_dim=32,
            ffn_dim=64,
            num_layers=4,
            rope_max_seq_len=32,
        ),  # fmt: skip
        lambda: (
            (_randn(B, 4, 1, 8, 8),),
            dict(timestep=_t(), encoder_hidden_states=_randn(B, 7, 24)),
        ),
    ),
    "diffusers-ltx-video": Case(
        "ltx",
        lambda: diffusers.LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            num_attention_heads=2,
            attention_head_dim=16,
            cross_attention_dim=32,
            num_layers=4,
            caption_channels=24,
        ),  # fmt: skip
        lambda: (
            (_randn(B, 16, 8),),
            dict(
                encoder_hidden_states=_randn(B, 7, 24, seed=2),
                timestep=_t(),
                encoder_attention_mask=torch.ones(B, 7),
                num_frames=1,
                height=4,
                width=4,
            ),  # fmt: skip
        ),
    ),
    "diffusers-auraflow-single": Case(
        "auraflow",
        lambda: diffusers.AuraFlowTransformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_mmdit_layers=2,
            num_single_dit_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=24,
            caption_projection_dim=32,
            out_channels=4,
            pos_embed_max_size=64,
        ),  # fmt: skip
        lambda: (
            (_randn(B, 4, 8, 8),),
            dict(encoder_hidden_states=_randn(B, 7, 24), timestep=_t()),
        ),
        routes=[(2, 4)],
    ),
    "timm-deit-distilled": Case(
        "deit", lambda: timm.create_model("deit_tiny_distilled_patch16_224", **VIT), _images
    ),
    "timm-vit-rope-mixed": Case(
        "vit-rope",
        lambda: timm.create_model("vit_base_patch16_rope_reg1_gap_256", **VIT),
        _images,
    ),
    "timm-cait-blocks": Case(
        "cait",
        lambda: timm.create_model("cait_xxs24_224", **VIT),
        _images,
        route_kwargs={"blocks": "blocks"},
    ),
    "hf-rwkv": Case(
        "rwkv",
        lambda: transformers.RwkvModel(
            transformers.RwkvConfig(
                vocab_size=50,
                hidden_size=32,
                num_hidden_layers=4,
                attention_hidden_size=32,
                intermediate_size=64,
                context_length=32,
            )  # fmt: skip
        ),
        lambda: ((_ids(),), {}),
    ),
    "hf-llama-no-cache": Case(
        "llama",
        lambda: transformers.LlamaModel(
            transformers.LlamaConfig(**LM, num_key_value_heads=2, max_position_embeddings=32)
        ),
        lambda: ((_ids(),), {"use_cache": False}),
    ),
    "hf-bert-mask": Case(
        "bert",
        lambda: transformers.BertModel(transformers.BertConfig(**LM, max_position_embeddings=32)),
        lambda: ((_ids(),), {"attention_mask": torch.ones(B, 16, dtype=torch.long)}),
    ),
}


@pytest.mark.parametrize("name", list(ROUTED))
def test_routes_with_the_same_machinery(name):
    case = ROUTED[name]
    check_rate_zero_equals_training(case)
    model = case.route(case.model())
    train_forward(model, case).square().mean().backward()
    assert tread_fx.route_info(model)[0].kept.shape[0] == B


REFUSED = {
    "sana-random": (
        Case("sana", _sana, _sana_inputs, route_kwargs={"selection": "random"}),
        tread_fx.errors.SelectionError,
        "height=4 and width=4 as numbers",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_is_refused_saying_why(name):
    case, error, message = REFUSED[name]
    model = case.route(case.model())
    with pytest.raises(error, match=message):
        train_forward(model, case)
