"""diffusers models from the coverage worklist, built tiny here and routed.

In the diffusers-suite sweep these models failed at the tracer: item assignment into a
tensor (PRX, LTX-2, Wan-Animate), Python read from tensor data (GLM-Image's per-token prior
ids dropped per sample by a boolean index, HunyuanVideo 1.5's prompt lengths read from a
mask), ``torch.finfo`` on a traced value (ACE-Step), a traced value passed to a C function
(Cosmos). Lumina2, HiDream and Bria-FIBO move their image tokens into longer joint streams
between blocks (per-sample buffers, a text suffix re-appended around every single block);
OmniGen casts its mask with ``type_as(hidden_states)`` (not data flow: never the stream).
The suite's own configurations of HiDream and Bria-FIBO have one block per list, too shallow
for a route. Each is built from a configuration written here (tiny, random weights) and
checked against docs/design.md#invariants with ``route()``'s default arguments. The
self-written models that pin each class are in ``test_trace_real_forwards.py``,
``test_stream_forms.py`` and ``test_stream_choice.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from third_party_checks import (
    Case,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)

diffusers = pytest.importorskip("diffusers")


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _prx() -> torch.nn.Module:
    return diffusers.PRXTransformer2DModel(
        in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0,
        num_heads=2, depth=4, axes_dim=[8, 8],
    )  # fmt: skip


def _prx_inputs() -> tuple[tuple, dict[str, Any]]:
    return (), {
        "hidden_states": _randn(2, 4, 8, 8),
        "encoder_hidden_states": _randn(2, 6, 16, seed=1),
        "timestep": torch.tensor([0.3, 0.7]),
    }


def _ltx2() -> torch.nn.Module:
    return diffusers.LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
        num_layers=4, caption_channels=16, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
        audio_pos_embed_max_pos=20,
    )  # fmt: skip


def _ltx2_inputs() -> tuple[tuple, dict[str, Any]]:
    frames, height, width, audio_frames = 2, 4, 5, 5
    return (), {
        "hidden_states": _randn(2, frames * height * width, 4),
        "audio_hidden_states": _randn(2, audio_frames, 4, seed=1),
        "encoder_hidden_states": _randn(2, 6, 16, seed=2),
        "audio_encoder_hidden_states": _randn(2, 6, 16, seed=3),
        "timestep": torch.tensor([300.0, 700.0]),
        "encoder_attention_mask": torch.ones(2, 6, dtype=torch.bool),
        "num_frames": frames,
        "height": height,
        "width": width,
        "audio_num_frames": audio_frames,
        "fps": 25.0,
    }


def _wan_animate() -> torch.nn.Module:
    return diffusers.WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12,
        latent_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=4,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=16, rope_max_seq_len=32,
        motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_encoder_size=16,
        motion_style_dim=8, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
        face_encoder_num_heads=2, inject_face_latents_blocks=2, motion_encoder_batch_size=8,
    )  # fmt: skip


def _wan_animate_inputs() -> tuple[tuple, dict[str, Any]]:
    pose_frames = 2  # latent frames = 1 + pose frames; face frames = 4 * (pose frames - 1) + 1
    return (), {
        "hidden_states": _randn(2, 12, pose_frames + 1, 8, 8),
        "timestep": torch.tensor([100, 900]),
        "encoder_hidden_states": _randn(2, 6, 16, seed=1),
        "encoder_hidden_states_image": _randn(2, 5, 16, seed=2),
        "pose_hidden_states": _randn(2, 4, pose_frames, 8, 8, seed=3),
        "face_pixel_values": _randn(2, 3, 4 * (pose_frames - 1) + 1, 16, 16, seed=4),
    }


def _hidream() -> torch.nn.Module:
    return diffusers.HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2,
        attention_head_dim=8, num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8,
        num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32), llama_layers=(0, 1, 2, 3), force_inference_output=True,
    )  # fmt: skip


def _hidream_inputs() -> tuple[tuple, dict[str, Any]]:
    return (), {
        "hidden_states": _randn(2, 4, 16, 16),
        "encoder_hidden_states_t5": _randn(2, 8, 8, seed=1),
        "encoder_hidden_states_llama3": _randn(4, 2, 8, 4, seed=2),  # one per block
        "pooled_embeds": _randn(2, 8, seed=3),
        "timesteps": torch.tensor([100, 900]),
    }


def _bria_fibo() -> torch.nn.Module:
    return diffusers.BriaFiboTransformer2DModel(
        patch_size=1, in_channels=48, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=None,
        guidance_embeds=False, axes_dims_rope=[0, 4, 4], text_encoder_dim=32,
    )  # fmt: skip


def _bria_fibo_inputs() -> tuple[tuple, dict[str, Any]]:
    return (), {
        "hidden_states": _randn(2, 64, 48),
        "encoder_hidden_states": _randn(2, 12, 64, seed=1),
        "img_ids": _randn(64, 3, seed=2),
        "txt_ids": _randn(12, 3, seed=3),
        "timestep": torch.tensor([0.3, 0.7]),
        "text_encoder_layers": [_randn(2, 12, 32, seed=4 + i) for i in range(4)],  # per block
    }


def _lumina2() -> torch.nn.Module:
    return diffusers.Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=24, num_layers=4,
        num_refiner_layers=2, num_attention_heads=3, num_kv_heads=1, multiple_of=2,
        axes_dim_rope=(4, 2, 2), axes_lens=(64, 64, 64), cap_feat_dim=16,
    )  # fmt: skip


def _lumina2_inputs() -> tuple[tuple, dict[str, Any]]:
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False  # a shorter prompt: the joint stream is padded per sample
    return (), {
        "hidden_states": _randn(2, 4, 8, 8),
        "encoder_hidden_states": _randn(2, 6, 16, seed=1),
        "timestep": torch.tensor([0.3, 0.7]),
        "encoder_attention_mask": mask,
    }


def _omnigen() -> torch.nn.Module:
    return diffusers.OmniGenTransformer2DModel(
        in_channels=4, patch_size=2, hidden_size=16, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=32, num_layers=4, vocab_size=100,
        pad_token_id=0, rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]},
        time_step_dim=4,
    )  # fmt: skip


def _omnigen_inputs() -> tuple[tuple, dict[str, Any]]:
    length = 10 + 1 + 16  # text ids, the time token, the image tokens
    return (), {
        "hidden_states": _randn(2, 4, 8, 8),
        "timestep": torch.tensor([0.3, 0.7]),
        "input_ids": torch.randint(1, 100, (2, 10), generator=torch.Generator().manual_seed(1)),
        "input_img_latents": [],
        "input_image_sizes": {},
        "attention_mask": torch.ones(2, length, length),  # cast with type_as(hidden_states)
        "position_ids": torch.arange(length).expand(2, length),
    }


def _glm_image() -> torch.nn.Module:
    return diffusers.GlmImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=8,
        num_attention_heads=2, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
        prior_vq_quantizer_codebook_size=32,
    )  # fmt: skip


def _glm_image_inputs() -> tuple[tuple, dict[str, Any]]:
    return (), {
        "hidden_states": _randn(2, 4, 8, 8),
        "encoder_hidden_states": _randn(2, 5, 16, seed=1),
        "prior_token_id": torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(4)),
        "prior_token_drop": torch.tensor([False, True]),
        "timestep": torch.tensor([100, 900]),
        "target_size": torch.tensor([[64.0, 64.0], [64.0, 64.0]]),
        "crop_coords": torch.zeros(2, 2),
    }


def _hunyuan_video15() -> torch.nn.Module:
    return diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=4, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        qk_norm="rms_norm", text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12,
        rope_axes_dim=(2, 2, 4), target_size=16,
    )  # fmt: skip


def _hunyuan_video15_inputs() -> tuple[tuple, dict[str, Any]]:
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0  # the second prompt is shorter: the lengths are read from the mask
    return (), {
        "hidden_states": _randn(2, 4, 1, 4, 4),
        "timestep": torch.tensor([300.0, 700.0]),
        "encoder_hidden_states": _randn(2, 6, 16, seed=1),
        "encoder_hidden_states_2": _randn(2, 4, 8, seed=2),
        "encoder_attention_mask": mask,
        "encoder_attention_mask_2": torch.ones(2, 4),
        "image_embeds": _randn(2, 3, 12, seed=3),
    }


def _ace_step() -> torch.nn.Module:
    return diffusers.AceStepTransformer1DModel(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8,
        patch_size=2, sliding_window=8,
    )  # fmt: skip


def _ace_step_inputs() -> tuple[tuple, dict[str, Any]]:
    return (), {
        "hidden_states": _randn(2, 16, 8),
        "timestep": torch.tensor([0.3, 0.7]),
        "timestep_r": torch.tensor([0.1, 0.2]),
        "encoder_hidden_states": _randn(2, 6, 32, seed=1),
        "context_latents": _randn(2, 16, 16, seed=2),
    }


def _cosmos() -> torch.nn.Module:
    return diffusers.CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
        num_layers=4, mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 16, 16),
        patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=True,
        extra_pos_embed_type="learnable",
    )  # fmt: skip


def _cosmos_inputs() -> tuple[tuple, dict[str, Any]]:
    return (), {
        "hidden_states": _randn(2, 4, 1, 8, 8),
        "timestep": torch.tensor([100, 900]),
        "encoder_hidden_states": _randn(2, 6, 16, seed=1),
        "attention_mask": torch.ones(2, 6),
        "fps": 30,
        "padding_mask": torch.zeros(1, 1, 8, 8),  # one mask, repeated over the batch
    }


CASES = [
    Case("PRX (item assignment)", _prx, _prx_inputs, routes=[(1, -1)]),
    Case("LTX-2 (item assignment)", _ltx2, _ltx2_inputs, routes=[(1, -1)]),
    Case("Wan-Animate (item assignment)", _wan_animate, _wan_animate_inputs, routes=[(1, -1)]),
    Case("Lumina2 (per-sample joint stream)", _lumina2, _lumina2_inputs, routes=[(1, -1)]),
    Case("OmniGen (mask cast with type_as)", _omnigen, _omnigen_inputs, routes=[(1, -1)]),
    Case("HiDream (per-sample joint stream)", _hidream, _hidream_inputs, routes=[(1, -1)]),
    Case("Bria-FIBO (joint stream)", _bria_fibo, _bria_fibo_inputs, routes=[(1, -1)]),
    Case("GLM-Image (data-derived Python)", _glm_image, _glm_image_inputs, routes=[(1, -1)]),
    Case(
        "HunyuanVideo-1.5 (lengths from a mask)",
        _hunyuan_video15,
        _hunyuan_video15_inputs,
        routes=[(1, -1)],
    ),
    Case("ACE-Step (torch.finfo)", _ace_step, _ace_step_inputs, routes=[(1, -1)]),
    Case("Cosmos (traced value into a C function)", _cosmos, _cosmos_inputs, routes=[(1, -1)]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name.split()[0])
def test_eval_is_bitwise_the_unrouted_model(case):
    check_eval_is_bitwise_unrouted(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name.split()[0])
def test_rate_zero_equals_the_original_training_forward(case):
    check_rate_zero_equals_training(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name.split()[0])
def test_routed_with_default_arguments_and_every_parameter_learns(case):
    infos = check_routed_shape_count_and_change(case)
    assert all(info.kept.shape[1] < info.num_tokens for info in infos)
    check_gradients(case)
