"""Builders of the research population's audio cases (TTS, music, sound; see ``population.py``).

Each builder imports the listed model file from its snapshot, builds the listed class with the
listed tiny config and says how to call it (batch 2, deterministic inputs). Where a package's
``__init__`` pulls a training or inference pipeline the model file does not need, the file is
imported with that package left bare (:func:`import_bare`): no code of the snapshot is changed.

Example:
    >>> from benchmarks.research.cases_audio import BUILDERS
    >>> "SWivid/F5-TTS" in BUILDERS
    True
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.coverage_community_repos import import_snapshot
from benchmarks.research.kernels import provide_module
from benchmarks.research.population import Build

__all__ = ["BUILDERS", "import_bare"]

Inputs = Callable[[], tuple[tuple, dict]]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen())


def _tokens(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_gen())


def _times() -> torch.Tensor:
    return torch.tensor([0.1, 0.7])


def _call(*args: Any, **kwargs: Any) -> Inputs:
    """An inputs function returning ``(args, kwargs)``; callables among them are made fresh."""

    def inputs() -> tuple[tuple, dict]:
        made = tuple(a() if callable(a) else a for a in args)
        return made, {k: v() if callable(v) else v for k, v in kwargs.items()}

    return inputs


def _no_grad(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make`` run under ``torch.no_grad()`` (same parameters, no autograd history)."""

    def made() -> Any:
        with torch.no_grad():
            return make()

    return made


def import_bare(root: Path, dotted: str, packages: tuple[str, ...] | list[str]) -> Any:
    """Import module ``dotted`` from snapshot ``root`` with ``packages`` registered bare
    (``import_snapshot(..., bare=...)``)."""
    return import_snapshot(root, dotted, bare=tuple(packages))[0]


# -- flow-matching TTS: frame-aligned stacks -----------------------------------------------


def _f5_tts(root: Path) -> Build:
    (mod,) = import_snapshot(root / "src", "f5_tts.model.backbones.dit")
    config = dict(dim=64, depth=4, heads=2, dim_head=32, dropout=0.0, ff_mult=2, mel_dim=16,
                  text_num_embeds=32, text_dim=16, conv_layers=0, attn_backend="torch")  # fmt: skip
    inputs = _call(lambda: _randn(2, 32, 16), lambda: _randn(2, 32, 16) * 0.5,
                   lambda: _tokens(32, 2, 12), _times)  # fmt: skip
    return Build(lambda: mod.DiT(**config), inputs, note="mask None, cache False (defaults)")


def _e2_tts(root: Path) -> Build:
    mod = import_bare(root, "e2_tts_pytorch.e2_tts", ("e2_tts_pytorch",))
    config = dict(dim=64, dim_text=32, depth=4, heads=2, dim_head=32, ff_mult=2, text_depth=2,
                  text_heads=2, text_dim_head=16, max_seq_len=64, kernel_size=7, dropout=0.0,
                  num_registers=4, num_residual_streams=4)  # fmt: skip
    inputs = _call(lambda: _randn(2, 32, 64), times=_times,
                   text_embed=lambda: _randn(2, 32, 32) * 0.5)  # fmt: skip
    note = "e2_tts_pytorch/__init__.py not run (it imports the trainer)"
    return Build(lambda: mod.Transformer(**config), inputs, note=note)


def _voicebox(root: Path) -> Build:
    provide_module("fairseq")  # imported at the top of audiolm_pytorch (checkpoint loaders)
    (mod,) = import_snapshot(root, "voicebox_pytorch.voicebox_pytorch")
    config = dict(num_cond_tokens=16, dim_in=16, dim_cond_emb=16, dim=64, depth=4, dim_head=32,
                  heads=2, ff_mult=2, conv_pos_embed_kernel_size=7, attn_flash=False,
                  num_register_tokens=4, condition_on_text=True)  # fmt: skip
    inputs = _call(lambda: _randn(2, 32, 16), times=_times,
                   cond_token_ids=lambda: _tokens(16, 2, 32), cond=lambda: _randn(2, 32, 16) * 0.5,
                   cond_mask=lambda: (torch.arange(32) < 12).expand(2, 32).clone(),
                   cond_drop_prob=0.0)  # fmt: skip
    note = ("cond_mask: first 12 frames masked (given, so training draws none); fairseq (fails "
            "to build, only audiolm_pytorch's checkpoint loaders use it) provided as an empty "
            "module")  # fmt: skip
    return Build(lambda: mod.VoiceBox(**config), inputs, note=note)


def _seed_vc(root: Path) -> Build:
    (mod,) = import_snapshot(root, "modules.v2.dit_wrapper")
    config = dict(time_as_token=True, style_as_token=True, uvit_skip_connection=False,
                  block_size=128, depth=4, num_heads=2, hidden_dim=64, in_channels=16,
                  content_dim=32, style_encoder_dim=16, class_dropout_prob=0.1,
                  dropout_rate=0.0, attn_dropout_rate=0.0)  # fmt: skip
    inputs = _call(lambda: _randn(2, 16, 32), lambda: _randn(2, 16, 32) * 0.5,
                   lambda: torch.tensor([32, 32]), _times, lambda: _randn(2, 16),
                   lambda: _randn(2, 32, 32))  # fmt: skip
    note = ("built under no_grad: torch.nn.utils.weight_norm (x_embedder) leaves a non-leaf "
            "`weight` that deepcopy refuses; each forward recomputes it")  # fmt: skip
    return Build(_no_grad(lambda: mod.DiT(**config)), inputs, note=note)


def _transformers_at_least(major: int, minor: int) -> bool:
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (major, minor)


def _diffrhythm(root: Path) -> Build:
    if _transformers_at_least(4, 54):
        raise RuntimeError(
            "model/dit.py needs transformers==4.49 (pinned): `x, *_ = block(...)` unpacks the "
            "tuple LlamaDecoderLayer returned there; the installed one returns a tensor, so the "
            "forward unpacks the batch and fails in the next block"
        )
    mod = import_bare(root, "model.dit", ("model",))
    config = dict(dim=64, depth=4, heads=2, dim_head=32, dropout=0.0, ff_mult=2, mel_dim=16,
                  text_num_embeds=32, text_dim=512, conv_layers=0, long_skip_connection=False,
                  max_frames=2048)  # fmt: skip
    inputs = _call(lambda: _randn(2, 32, 16), lambda: _randn(2, 32, 16) * 0.5,
                   lambda: _tokens(32, 2, 32), _times, False, False,
                   style_prompt=lambda: _randn(2, 512),
                   start_time=lambda: torch.tensor([0.0, 0.3]))  # fmt: skip
    note = "text_dim 512, not 16: text_fusion_linears take the text embedding at cond_dim 512"
    return Build(lambda: mod.DiT(**config), inputs, note=note)


def _cosyvoice(root: Path) -> Build:
    (mod,) = import_snapshot(root, "cosyvoice.flow.DiT.dit")
    config = dict(dim=64, depth=4, heads=2, dim_head=32, dropout=0.0, ff_mult=2, mel_dim=16,
                  mu_dim=16, long_skip_connection=False, spk_dim=16, out_channels=16,
                  static_chunk_size=50, num_decoding_left_chunks=2)  # fmt: skip
    inputs = _call(lambda: _randn(2, 16, 32), lambda: torch.ones(2, 1, 32),
                   lambda: _randn(2, 16, 32) * 0.5, _times, spks=lambda: _randn(2, 16),
                   cond=lambda: _randn(2, 16, 32) * 0.3, streaming=False)  # fmt: skip
    return Build(lambda: mod.DiT(**config), inputs)


def _amphion(root: Path) -> Build:
    try:
        (mod,) = import_snapshot(root, "models.vc.flow_matching_transformer.llama_nar")
    except ValueError as err:  # a default argument LlamaConfig(0, 256, 1024, 1, 1)
        raise RuntimeError(
            f"llama_nar.py needs transformers==4.41.2 (pinned): {err} (at class definition)"
        ) from err
    config = dict(mel_dim=16, hidden_size=64, num_heads=2, num_layers=4, dropout=0.0,
                  ffn_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    inputs = _call(lambda: _randn(2, 32, 16), _times, lambda: _randn(2, 32, 64) * 0.5,
                   lambda: torch.ones(2, 32), return_dict=False)  # fmt: skip
    return Build(lambda: mod.DiffLlama(**config), inputs)


# -- channels-first estimators (TTS decoders) ----------------------------------------------


def _stable_tts(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.estimator")
    config = dict(noise_channels=16, cond_channels=16, hidden_channels=64, out_channels=16,
                  filter_channels=128, dropout=0.0, n_layers=4, n_heads=2, kernel_size=3,
                  gin_channels=16, use_lsc=True)  # fmt: skip
    inputs = _call(_times, lambda: _randn(2, 16, 32), lambda: torch.ones(2, 1, 32),
                   lambda: _randn(2, 16, 32) * 0.5, lambda: _randn(2, 16))  # fmt: skip
    return Build(lambda: mod.Decoder(**config), inputs, noisy=1, note="forward(t, x, mask, mu, c)")


def _matcha(root: Path) -> Build:
    (mod,) = import_snapshot(root, "matcha.models.components.decoder")
    config = dict(in_channels=32, out_channels=16, channels=[64, 64], dropout=0.0,
                  attention_head_dim=32, n_blocks=1, num_mid_blocks=2, num_heads=2,
                  act_fn="snakebeta", down_block_type="transformer",
                  mid_block_type="transformer", up_block_type="transformer")  # fmt: skip
    inputs = _call(lambda: _randn(2, 16, 32), lambda: torch.ones(2, 1, 32),
                   lambda: _randn(2, 16, 32) * 0.5, _times, spks=None)  # fmt: skip
    return Build(lambda: mod.Decoder(**config), inputs)


# -- text-to-audio / music latent models ---------------------------------------------------


def _stable_audio(root: Path) -> Build:
    mod = import_bare(root, "stable_audio_tools.models.dit",
                      ("stable_audio_tools", "stable_audio_tools.models"))  # fmt: skip
    config = dict(io_channels=16, patch_size=1, embed_dim=64, cond_token_dim=32,
                  global_cond_dim=32, depth=4, num_heads=2,
                  transformer_type="continuous_transformer", global_cond_type="prepend",
                  diffusion_objective="v")  # fmt: skip
    inputs = _call(lambda: _randn(2, 16, 32), _times, cross_attn_cond=lambda: _randn(2, 8, 32),
                   global_embed=lambda: _randn(2, 32))  # fmt: skip
    note = "package __init__ files not run (they import models.factory); flash_attn absent: SDPA"
    return Build(lambda: mod.DiffusionTransformer(**config), inputs, note=note)


def _ace_step(root: Path) -> Build:
    (mod,) = import_snapshot(root, "acestep.models.ace_step_transformer")
    config = dict(in_channels=8, num_layers=4, inner_dim=64, attention_head_dim=32,
                  num_attention_heads=2, mlp_ratio=2.0, out_channels=8, max_position=256,
                  speaker_embedding_dim=16, text_embedding_dim=32, ssl_encoder_depths=[2, 2],
                  ssl_names=["mert", "m-hubert"], ssl_latent_dims=[16, 16],
                  lyric_encoder_vocab_size=64, lyric_hidden_size=1024, patch_size=[16, 1],
                  max_height=16, max_width=64)  # fmt: skip
    inputs = _call(lambda: _randn(2, 8, 16, 32), lambda: torch.ones(2, 32),
                   encoder_text_hidden_states=lambda: _randn(2, 6, 32),
                   text_attention_mask=lambda: torch.ones(2, 6),
                   speaker_embeds=lambda: _randn(2, 16), lyric_token_idx=lambda: _tokens(64, 2, 10),
                   lyric_mask=lambda: torch.ones(2, 10, dtype=torch.long), timestep=_times,
                   return_dict=False)  # fmt: skip
    return Build(lambda: mod.ACEStepTransformer2DModel(**config), inputs)


def _ezaudio(root: Path) -> Build:
    (mod,) = import_snapshot(root / "src", "models.udit")
    config = dict(img_size=32, patch_size=1, in_chans=9, out_chans=4, input_type="1d",
                  embed_dim=64, depth=4, num_heads=2, mlp_ratio=2.0, qkv_bias=False,
                  qk_norm="layernorm", act_layer="geglu", norm_layer="layernorm",
                  context_norm=True, use_checkpoint=False, time_fusion="ada_sola_bias",
                  ada_sola_rank=8, ada_sola_alpha=8, cls_dim=None, context_dim=32,
                  context_fusion="cross", context_max_length=None, context_pe_method="none",
                  pe_method="none", rope_mode="shared", use_conv=True, skip=True,
                  skip_norm=True)  # fmt: skip
    inputs = _call(lambda: _randn(2, 9, 32), _times, lambda: _randn(2, 8, 32),
                   context_mask=lambda: torch.ones(2, 8, dtype=torch.bool))  # fmt: skip
    return Build(lambda: mod.UDiT(**config), inputs)


def _mmaudio(root: Path) -> Build:
    (mod,) = import_snapshot(root, "mmaudio.model.networks")
    config = dict(latent_dim=8, clip_dim=32, sync_dim=32, text_dim=32, hidden_dim=64, depth=6,
                  fused_depth=3, num_heads=2, mlp_ratio=2.0, latent_seq_len=32,
                  clip_seq_len=8, sync_seq_len=16, text_seq_len=8, v2=False)  # fmt: skip
    inputs = _call(lambda: _randn(2, 32, 8), lambda: _randn(2, 8, 32), lambda: _randn(2, 16, 32),
                   lambda: _randn(2, 8, 32), _times)  # fmt: skip
    return Build(lambda: mod.MMAudio(**config), inputs)


def _audioldm(root: Path) -> Build:
    mod = import_bare(root, "audioldm.latent_diffusion.openaimodel", ("audioldm",))
    config = dict(image_size=16, in_channels=4, model_channels=32, out_channels=4,
                  num_res_blocks=1, attention_resolutions=[2], dropout=0, channel_mult=[1, 2],
                  num_head_channels=16, extra_film_condition_dim=32, extra_film_use_concat=True,
                  use_spatial_transformer=False)  # fmt: skip
    inputs = _call(lambda: _randn(2, 4, 16, 8), lambda: torch.tensor([10, 700]),
                   y=lambda: _randn(2, 32))  # fmt: skip
    note = "audioldm/__init__.py not run (it imports the pipeline)"
    return Build(lambda: mod.UNetModel(**config), inputs, note=note)


def _make_an_audio_2(root: Path) -> Build:
    (mod,) = import_snapshot(root, "ldm.modules.diffusionmodules.concatDiT")
    config = dict(in_channels=20, context_dim=32, hidden_size=64, depth=4, num_heads=2,
                  max_len=128)  # fmt: skip
    inputs = _call(lambda: _randn(2, 20, 32), _times, lambda: _randn(2, 16, 32))
    return Build(lambda: mod.ConcatDiT2MLP(**config), inputs)


BUILDERS: dict[str, Callable[[Path], Build]] = {
    "SWivid/F5-TTS": _f5_tts,
    "lucidrains/e2-tts-pytorch": _e2_tts,
    "lucidrains/voicebox-pytorch": _voicebox,
    "Stability-AI/stable-audio-tools": _stable_audio,
    "ace-step/ACE-Step": _ace_step,
    "haidog-yaqub/EzAudio": _ezaudio,
    "hkchengrex/MMAudio": _mmaudio,
    "KdaiP/StableTTS": _stable_tts,
    "Plachtaa/seed-vc": _seed_vc,
    "ASLP-lab/DiffRhythm": _diffrhythm,
    "FunAudioLLM/CosyVoice": _cosyvoice,
    "shivammehta25/Matcha-TTS": _matcha,
    "haoheliu/AudioLDM": _audioldm,
    "bytedance/Make-An-Audio-2": _make_an_audio_2,
    "open-mmlab/Amphion": _amphion,
}
