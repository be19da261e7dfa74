"""Builders of the research population's motion and robot-policy cases (see ``population.py``).

Human-motion denoisers (MDM, MotionDiffuse, MLD, EDGE, InterGen, HumanMAC, Listen-Denoise-
Action, DiffGesture, MID) and action/trajectory denoisers of robot policies (Diffusion Policy,
RDT, Diffuser, BESO, MDT, CogACT), each built from its snapshot with the listed tiny config.

Example:
    >>> from benchmarks.research.cases_motion import BUILDERS
    >>> "real-stanford/diffusion_policy" in BUILDERS
    True
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.coverage_community_repos import import_snapshot
from benchmarks.research.population import Build

__all__ = ["BUILDERS", "import_bare"]

Inputs = Callable[[], tuple[tuple, dict]]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen())


def _randn2(*shape: int) -> torch.Tensor:
    """A second deterministic tensor, not equal to :func:`_randn` of the same shape."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


def _steps() -> torch.Tensor:
    """Two integer diffusion steps (below every schedule length used here)."""
    return torch.tensor([3, 71])


def _sigmas() -> torch.Tensor:
    """Two EDM noise levels (positive floats)."""
    return torch.tensor([0.5, 8.0])


def import_bare(root: Path, dotted: str, packages: tuple[str, ...] | list[str]) -> Any:
    """Import module ``dotted`` from snapshot ``root`` with ``packages`` registered bare
    (``import_snapshot(..., bare=...)``)."""
    return import_snapshot(root, dotted, bare=tuple(packages))[0]


# -- human motion ------------------------------------------------------------------------


class _NoSMPL:
    """Stands in for MDM's ``Rotation2xyz`` (SMPL body model from license-gated files); the
    denoiser's forward never calls it."""

    def __init__(self, device: str = "cpu", dataset: str = "amass") -> None:
        self.smpl_model = nn.Identity()


def _mdm(root: Path) -> Build:
    _, mod = import_snapshot(root, "utils.misc", "model.mdm")
    mod.Rotation2xyz = _NoSMPL
    config = dict(modeltype="", njoints=16, nfeats=1, num_actions=1, translation=True,
                  pose_rep="rot6d", glob=True, glob_rot=True, latent_dim=64, ff_size=128,
                  num_layers=4, num_heads=2, dropout=0.1, activation="gelu",
                  data_rep="hml_vec", dataset="humanml", arch="trans_enc", cond_mode="no_cond",
                  mask_frames=True)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        y = {"mask": torch.ones(2, 1, 1, 32, dtype=torch.bool)}
        return (_randn(2, 16, 1, 32), _steps()), {"y": y}

    note = "edit: rot2xyz (SMPL from license-gated files, unused in forward) stubbed"
    return Build(lambda: mod.MDM(**config), inputs, note=note)


def _tiny_clip(*_: Any, **__: Any) -> tuple[nn.Module, None]:
    """A randomly initialised CLIP of the openai package, small (MotionDiffuse passes
    precomputed text features, so the CLIP is never called in the forward)."""
    import clip

    model = clip.model.CLIP(embed_dim=512, image_resolution=32, vision_layers=1,
                            vision_width=64, vision_patch_size=16, context_length=77,
                            vocab_size=49408, transformer_width=64, transformer_heads=1,
                            transformer_layers=1)  # fmt: skip
    return model, None


def _motiondiffuse(root: Path) -> Build:
    (mod,) = import_snapshot(root / "text2motion", "models.transformer")
    mod.clip = types.SimpleNamespace(load=_tiny_clip, tokenize=mod.clip.tokenize)
    config = dict(input_feats=16, num_frames=64, latent_dim=64, ff_size=128, num_layers=4,
                  num_heads=2, dropout=0.0, activation="gelu", num_text_layers=1,
                  text_latent_dim=32, text_ff_size=64, text_num_heads=2, no_clip=True,
                  no_eff=False)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        kw = dict(length=[32, 32], xf_proj=_randn2(2, 256), xf_out=_randn2(2, 77, 32))
        return (_randn(2, 32, 16), _steps()), kw

    note = ("edit: clip.load('ViT-B/32') (a weight download) -> a small randomly initialised "
            "clip.model.CLIP (unused in forward: xf_proj/xf_out given)")  # fmt: skip
    return Build(lambda: mod.MotionTransformer(**config), inputs, note=note)


def _mld(root: Path) -> Build:
    (mod,) = import_snapshot(root, "mld.models.architectures.mld_denoiser")
    ablation = types.SimpleNamespace(SKIP_CONNECT=True, VAE_TYPE="mld", DIFF_PE_TYPE="mld")
    config = dict(nfeats=263, condition="text", latent_dim=[1, 64], ff_size=128, num_layers=5,
                  num_heads=2, dropout=0.1, normalize_before=False, activation="gelu",
                  flip_sin_to_cos=True, return_intermediate_dec=False,
                  position_embedding="learned", arch="trans_enc", freq_shift=0,
                  guidance_scale=7.5, guidance_uncondp=0.1, text_encoded_dim=32)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 1, 64), _steps(), _randn2(2, 1, 32)), {}

    note = "ablation as an attribute namespace"
    return Build(lambda: mod.MldDenoiser(ablation, **config), inputs, note=note)


def _edge(root: Path) -> Build:
    (mod,) = import_snapshot(root, "model.model")
    config = dict(nfeats=16, seq_len=32, latent_dim=64, ff_size=128, num_layers=4,
                  num_heads=2, dropout=0.1, cond_feature_dim=24, use_rotary=True)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 32, 16), _randn2(2, 32, 24), _steps()), {"cond_drop_prob": 0.0}

    return Build(lambda: mod.DanceDecoder(**config), inputs)


def _intergen(root: Path) -> Build:
    _, mod = import_snapshot(root, "utils.utils", "models.nets")
    config = dict(input_feats=16, latent_dim=64, num_frames=64, ff_size=128, num_layers=4,
                  num_heads=2, dropout=0.1, activation="gelu", cfg_weight=0.0)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 32, 32), _steps()), {"mask": None, "cond": _randn2(2, 768)}

    return Build(lambda: mod.InterDenoiser(**config), inputs)


def _humanmac(root: Path) -> Build:
    _, mod = import_snapshot(root, "utils", "models.transformer")
    config = dict(input_feats=48, num_frames=20, latent_dim=64, ff_size=128, num_layers=4,
                  num_heads=2, dropout=0.2, activation="gelu")  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 20, 48), _steps()), {"mod": _randn2(2, 20, 48)}

    return Build(lambda: mod.MotionTransformer(**config), inputs)


def _lda(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.nn")
    nn_args = dict(num_blocks=2, num_heads=2, activation="relu", dropout=0.0, norm="LN",
                   d_ff=128, seq_len=32, use_preln=False, bias=False,
                   dilation_cycle=[0, 1, 2])  # fmt: skip
    config = dict(pose_dim=16, residual_layers=4, residual_channels=64, embedding_dim=64,
                  l_cond_dim=12, g_cond_dim=4, n_noise_schedule=100, nn_name="tisa",
                  nn_args=nn_args)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        style = torch.zeros(2, 32, 4)
        style[0, :, 1], style[1, :, 3] = 1.0, 1.0
        return (_randn(2, 32, 16), _randn2(2, 32, 12), style, _steps()), {}

    return Build(lambda: mod.LDA(**config), inputs)


def _diffgesture(root: Path) -> Build:
    (mod,) = import_snapshot(root / "scripts", "model.diffusion_util")
    config = dict(num_pose=32, pose_dim=16, embed_dim=32, hidden_dim=64, depth=2, num_heads=2,
                  decoder_depth=2, decoder_num_heads=2, mlp_ratio=2.0)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 32, 16), torch.tensor([0.01, 0.3]), _randn2(2, 32, 13)), {}

    return Build(lambda: mod.TransformerModel(**config), inputs)


def _mid(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.diffusion")

    def make() -> nn.Module:
        return mod.TransformerConcatLinear(point_dim=2, context_dim=32, tf_layer=4, residual=False)

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 12, 2), torch.tensor([0.01, 0.3]), _randn2(2, 32)), {}

    return Build(make, inputs)


# -- robot policies and planners ---------------------------------------------------------


def _diffusion_policy(root: Path) -> Build:
    (mod,) = import_snapshot(root, "diffusion_policy.model.diffusion.transformer_for_diffusion")
    config = dict(input_dim=4, output_dim=4, horizon=16, n_obs_steps=2, cond_dim=16, n_layer=4,
                  n_head=2, n_emb=64, p_drop_emb=0.0, p_drop_attn=0.0, causal_attn=True,
                  time_as_cond=True, obs_as_cond=True, n_cond_layers=0)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 16, 4), _steps(), _randn2(2, 2, 16)), {}

    return Build(lambda: mod.TransformerForDiffusion(**config), inputs)


def _rdt(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.rdt.model")
    config = dict(output_dim=8, horizon=16, hidden_size=64, depth=4, num_heads=2,
                  max_lang_cond_len=8, img_cond_len=16, lang_pos_embed_config=None,
                  img_pos_embed_config=None, dtype=torch.float32)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        lang_mask = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
        cond = _randn2(2, 24, 64)
        args = (_randn(2, 17, 64), torch.tensor([25.0, 10.0]), _steps(), cond[:, :8], cond[:, 8:])
        return args, {"lang_mask": lang_mask, "img_mask": None}

    return Build(lambda: mod.RDT(**config), inputs, note="dtype float32 (default bfloat16)")


def _diffuser(root: Path) -> Build:
    packages = ["diffuser", "diffuser.models", "diffuser.utils"]
    mod = import_bare(root, "diffuser.models.temporal", packages)

    def make() -> nn.Module:
        return mod.TemporalUnet(horizon=16, transition_dim=6, cond_dim=4, dim=16,
                                dim_mults=[1, 2], attention=False)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 16, 6), {}, _steps()), {}

    note = ("diffuser/models/temporal.py imported by path: the diffuser, diffuser.models and "
            "diffuser.utils package __init__ files (gym, d4rl, mujoco_py) not run")  # fmt: skip
    return Build(make, inputs, note=note)


def _beso(root: Path) -> Build:
    from omegaconf import OmegaConf

    (mod,) = import_snapshot(root, "beso.agents.diffusion_agents.k_diffusion.score_gpts")
    time_fn = OmegaConf.create({
        "_target_": "beso.agents.diffusion_agents.k_diffusion.utils."
        "return_time_sigma_embedding_model",
        "embedding_type": "Linear", "time_embed_dim": 64, "device": "cpu",
    })  # fmt: skip
    config = dict(state_dim=16, device="cpu", goal_conditioned=True, action_dim=4, embed_dim=64,
                  embed_pdrob=0.0, attn_pdrop=0.0, resid_pdrop=0.0, n_layers=4, n_heads=2,
                  goal_seq_len=2, obs_seq_len=8, sigma_vocab_size=1000,
                  time_embedding_fn=time_fn, goal_drop=0.1, linear_output=True)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        feats = _randn2(2, 10, 16)
        return (feats[:, :8], _randn(2, 8, 4), feats[:, 8:], _sigmas()), {}

    return Build(lambda: mod.DiffusionGPT(**config), inputs, noisy=1)


def _mdt(root: Path) -> Build:
    (mod,) = import_snapshot(root, "mdt.models.networks.mdt_transformer")
    config = dict(obs_dim=32, goal_dim=32, device="cpu", goal_conditioned=True, action_dim=4,
                  embed_dim=64, embed_pdrob=0.0, attn_pdrop=0.0, resid_pdrop=0.0, mlp_pdrop=0.0,
                  n_dec_layers=4, n_enc_layers=2, n_heads=2, goal_seq_len=1, obs_seq_len=1,
                  action_seq_len=16, goal_drop=0.1, bias=False, use_abs_pos_emb=True,
                  use_rot_embed=False, linear_output=True, use_ada_conditioning=True)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        feats = _randn2(3, 2, 1, 32)
        states = {"static": feats[0], "gripper": feats[1]}
        return (states, _randn(2, 16, 4), feats[2], _sigmas()), {}

    return Build(lambda: mod.MDTTransformer(**config), inputs, noisy=1)


def _cogact(root: Path) -> Build:
    (mod,) = import_snapshot(root, "action_model.models")
    config = dict(in_channels=7, hidden_size=64, depth=4, num_heads=2, mlp_ratio=2.0,
                  class_dropout_prob=0.1, token_size=4096, future_action_window_size=15,
                  past_action_window_size=0, learn_sigma=False)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 16, 7), _steps(), _randn2(2, 1, 4096)), {}

    return Build(lambda: mod.DiT(**config), inputs)


BUILDERS: dict[str, Callable[[Path], Build]] = {
    "GuyTevet/motion-diffusion-model": _mdm,
    "mingyuan-zhang/MotionDiffuse": _motiondiffuse,
    "ChenFengYe/motion-latent-diffusion": _mld,
    "real-stanford/diffusion_policy": _diffusion_policy,
    "thu-ml/RoboticsDiffusionTransformer": _rdt,
    "jannerm/diffuser": _diffuser,
    "Stanford-TML/EDGE": _edge,
    "tr3e/InterGen": _intergen,
    "Gutianpei/MID": _mid,
    "intuitive-robots/beso": _beso,
    "intuitive-robots/mdt_policy": _mdt,
    "Advocate99/DiffGesture": _diffgesture,
    "microsoft/CogACT": _cogact,
    "LinghaoChan/HumanMAC": _humanmac,
    "simonalexanderson/ListenDenoiseAction": _lda,
}
