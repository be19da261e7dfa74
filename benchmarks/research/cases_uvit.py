"""Builders of the research population's U-ViT / hourglass cases (see ``population.py``).

U-shaped and multi-resolution backbones: U-ViTs with long skips, hourglass transformers,
transformer and conv U-Nets (the last as controls with no token stack).

Example:
    >>> from benchmarks.research.cases_uvit import BUILDERS
    >>> "thu-ml/unidiffuser" in BUILDERS
    True
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace as Args

import torch

from benchmarks.coverage_community_repos import import_snapshot
from benchmarks.research.cases_image import dit_inputs
from benchmarks.research.population import Build

__all__ = ["BUILDERS"]

Inputs = Callable[[], tuple[tuple, dict]]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen())


# -- U-ViTs over [B, N, C] ------------------------------------------------------------------


def _unidiffuser_inputs() -> tuple[tuple, dict]:
    g = _gen()
    img = torch.randn(2, 4, 8, 8, generator=g)
    clip_img = torch.randn(2, 1, 32, generator=g)
    text = torch.randn(2, 8, 16, generator=g)
    t_img, t_text = torch.tensor([0.1, 0.7]), torch.tensor([0.4, 0.9])
    return (img, clip_img, text, t_img, t_text, torch.tensor([0, 1])), {}


def _unidiffuser(root: Path) -> Build:
    (mod,) = import_snapshot(root, "libs.uvit_multi_post_ln_v1")
    config = dict(img_size=8, in_chans=4, patch_size=2, embed_dim=64, depth=4, num_heads=4,
                  mlp_ratio=4.0, qkv_bias=False, mlp_time_embed=False, text_dim=16,
                  num_text_tokens=8, clip_img_dim=32)  # fmt: skip
    return Build(lambda: mod.UViT(**config), _unidiffuser_inputs, note="noisy: img")


def _skip_dit(root: Path) -> Build:
    (mod,) = import_snapshot(root / "class-to-image", "models")
    config = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=4,
                  num_heads=4, mlp_ratio=4.0, num_classes=10, learn_sigma=True)  # fmt: skip
    return Build(lambda: mod.DiT_skip(**config), dit_inputs())


def _scalelong(root: Path) -> Build:
    (mod,) = import_snapshot(root, "libs.uvit")
    config = dict(img_size=8, patch_size=2, in_chans=4, embed_dim=64, depth=4, num_heads=4,
                  mlp_ratio=4.0, qkv_bias=False, mlp_time_embed=False, num_classes=10,
                  conv=True, skip=True, scalelong=3, kappa=0.5)  # fmt: skip
    return Build(lambda: mod.UViT(**config), dit_inputs(), note="scalelong=3 (LS)")


@contextlib.contextmanager
def _cuda_device_as_cpu(module: types.ModuleType) -> Iterator[None]:
    """While it runs, ``module``'s ``torch.device("cuda")`` is the CPU (no CUDA here)."""
    real = module.torch
    proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if k[:2] != "__"})
    proxy.device = lambda kind, *a: real.device("cpu" if kind == "cuda" else kind, *a)
    module.torch = proxy
    try:
        yield
    finally:
        module.torch = real


def _efficientvit_inputs() -> tuple[tuple, dict]:
    return (_randn(2, 4, 8, 8), torch.tensor([1, 2])), {}


def _efficientvit(root: Path) -> Build:
    (mod,) = import_snapshot(root, "efficientvit.diffusioncore.models.uvit")
    cfg = mod.UViTConfig(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=5,
                         num_heads=4, mlp_ratio=4.0, mlp_time_embed=False, qkv_bias=False,
                         act_layer="gelu", use_checkpoint=False, num_classes=10,
                         pretrained_path=None, train_scheduler="DPM_Solver")  # fmt: skip

    def make() -> torch.nn.Module:
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(key, value)  # what its dist_init() sets without a group
        with _cuda_device_as_cpu(mod):
            return mod.UViT(cfg)

    note = ("forward = training step (clean x, y; noise and timesteps drawn inside, np.random); "
            "edit: the eval DPM-Solver schedule's betas are built on the CPU, not "
            "torch.device('cuda') (construction only, unused by forward); RANK=0 WORLD_SIZE=1 "
            "as its dist_init() sets without a process group")  # fmt: skip
    return Build(make, _efficientvit_inputs, note=note)


# -- hourglass / multi-resolution token stacks ----------------------------------------------


def _kdiffusion_inputs() -> tuple[tuple, dict]:
    x = _randn(2, 3, 16, 16)
    return (x, torch.tensor([0.5, 3.0])), {"class_cond": torch.tensor([1, 2])}


def _kdiffusion(root: Path) -> Build:
    os.environ["K_DIFFUSION_USE_COMPILE"] = "0"
    os.environ["K_DIFFUSION_USE_FLASH_2"] = "0"
    (mod,) = import_snapshot(root, "k_diffusion.models.image_transformer_v2")

    def level() -> object:
        attn = mod.GlobalAttentionSpec(d_head=16)
        return mod.LevelSpec(depth=2, width=64, d_ff=128, self_attn=attn, dropout=0.0)

    def make() -> torch.nn.Module:
        mapping = mod.MappingSpec(depth=1, width=64, d_ff=128, dropout=0.0)
        return mod.ImageTransformerDenoiserModelV2(
            [level(), level()], mapping, in_channels=3, out_channels=3, patch_size=[2, 2],
            num_classes=10,
        )  # fmt: skip

    note = "K_DIFFUSION_USE_COMPILE=0, K_DIFFUSION_USE_FLASH_2=0 (the file's SDPA branch)"
    return Build(make, _kdiffusion_inputs, note=note)


def _crossflow_config() -> Args:
    low = Args(block_type="TransformerBlock", dim=64, hidden_dim=128, num_attention_heads=4,
               num_blocks=4, max_height=8, max_width=8, image_input_ratio=1,
               input_feature_ratio=4, final_kernel_size=3, dropout_prob=0)  # fmt: skip
    high = Args(block_type="ConvNeXtBlock", dim=32, hidden_dim=64, kernel_size=7, num_blocks=2,
                max_height=32, max_width=32, image_input_ratio=1, input_feature_ratio=1,
                final_kernel_size=3, dropout_prob=0)  # fmt: skip
    text = Args(num_blocks=2, hidden_dim=32, hidden_token_length=16, num_attention_heads=2,
                dropout_prob=0.1)  # fmt: skip
    return Args(channels=4, block_grad_to_lowres=False, norm_type="TDRMSN", use_t2i=True,
                clip_dim=32, num_clip_token=8, gradient_checking=False, cfg_indicator=0.1,
                textVAE=text, stage_configs=[low, high])  # fmt: skip


def _crossflow_inputs() -> tuple[tuple, dict]:
    kwargs = {"log_snr": torch.tensor([-1.0, 2.0]), "null_indicator": torch.tensor([True, False])}
    return (_randn(2, 4, 32, 32),), kwargs


def _crossflow(root: Path) -> Build:
    (mod,) = import_snapshot(root, "libs.model.dimr_t2i")
    note = ("config Args as configs/t2i_256px_clip_dimr.py, scaled down; config fix: x 32x32 "
            "(listed 8x8), high-res stage 32x32, low-res stage 8x8 tokens via "
            "input_feature_ratio=4: the text VE and image-clip heads are only built for a "
            "32x32 (256px) or 64x64 latent; no edit needed: "
            "sigmoid/module.py already calls exported_tdp(custom=False) (tdp_torch)")  # fmt: skip
    return Build(lambda: mod.MRModel(_crossflow_config()), _crossflow_inputs, note=note)


# -- U-Nets over [B, C, H, W] (controls) ----------------------------------------------------


def _udit(root: Path) -> Build:
    (mod,) = import_snapshot(root, "udit_models")
    config = dict(input_size=8, down_factor=2, in_channels=4, hidden_size=32,
                  depth=[1, 1, 2, 1, 1], num_heads=2, mlp_ratio=2, num_classes=10,
                  learn_sigma=True, rep=1, ffn_type="rep", attn_type="v2",
                  posemb_type="rope2d", downsampler="dwconv5", down_shortcut=1)  # fmt: skip
    return Build(lambda: mod.U_DiT(**config), dit_inputs())


def _dic(root: Path) -> Build:
    (mod,) = import_snapshot(root, "dic_models")
    config = dict(input_size=8, in_channels=4, hidden_size=32, depth=[1, 1, 2, 1, 1],
                  num_heads=2, mlp_ratio=2, num_classes=10, learn_sigma=True,
                  ffn_type="basic", mult_channels=[1, 2, 4, 2, 2], skip_stride=1)  # fmt: skip
    return Build(lambda: mod.DiC(**config), dit_inputs())


def _edm2_inputs() -> tuple[tuple, dict]:
    labels = torch.nn.functional.one_hot(torch.tensor([1, 2]), 10).float()
    return (_randn(2, 4, 8, 8), torch.tensor([0.1, 0.7]), labels), {}


def _edm2(root: Path) -> Build:
    _, mod = import_snapshot(root, "torch_utils.persistence", "training.networks_edm2")
    config = dict(img_resolution=8, img_channels=4, label_dim=10, model_channels=32,
                  channel_mult=[1, 2], num_blocks=1, attn_resolutions=[4])  # fmt: skip
    return Build(lambda: mod.UNet(**config), _edm2_inputs)


def _mdm_config(unet: types.ModuleType, nested: types.ModuleType) -> object:
    inner = unet.UNetConfig(
        nesting=True, resolution_channels=[64, 64], num_resnets_per_resolution=[1, 1],
        attention_levels=[1], num_attention_layers=[0, 2], conditioning_feature_dim=32,
        conditioning_feature_proj_dim=64, micro_conditioning="scale:8",
        resnet_config=unet.ResNetConfig(num_groups_norm=8, use_attention_ffn=True),
    )  # fmt: skip
    return nested.NestedUNetConfig(
        resolution_channels=[32, 64], num_resnets_per_resolution=[1, 1], attention_levels=[],
        num_attention_layers=[0, 0], conditioning_feature_dim=32,
        conditioning_feature_proj_dim=-1, masked_cross_attention=1,
        micro_conditioning="scale:16", temporal_dim=256, skip_cond_emb=True,
        skip_mid_blocks=True, skip_normalization=True,
        resnet_config=unet.ResNetConfig(num_groups_norm=8), inner_config=inner,
    )  # fmt: skip


def _mdm_inputs() -> tuple[tuple, dict]:
    g = _gen()
    x_t = [torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 3, 8, 8, generator=g)]
    cond = torch.randn(2, 8, 32, generator=g)
    return (x_t, torch.tensor([0.1, 0.7]), cond, torch.ones(2, 8)), {}


def _ml_mdm(root: Path) -> Build:
    unet, nested = import_snapshot(
        root / "ml-mdm-matryoshka", "ml_mdm.models.unet", "ml_mdm.models.nested_unet"
    )
    note = ("config fix: temporal_dim=256 (listed 128), the inner U-Net's 4 x 64 as in the "
            "yaml's 1024 = 4 x 256; else the inner cond_emb misfits the outer temb")  # fmt: skip
    make = lambda: nested.NestedUNet(3, 3, _mdm_config(unet, nested))  # noqa: E731
    return Build(make, _mdm_inputs, note=note)


BUILDERS = {
    "YuchuanTian/U-DiT": _udit,
    "thu-ml/unidiffuser": _unidiffuser,
    "OpenSparseLLMs/Skip-DiT": _skip_dit,
    "sail-sg/ScaleLong": _scalelong,
    "YuchuanTian/DiC": _dic,
    "crowsonkb/k-diffusion": _kdiffusion,
    "mit-han-lab/efficientvit": _efficientvit,
    "qihao067/CrossFlow": _crossflow,
    "NVlabs/edm2": _edm2,
    "apple/ml-mdm": _ml_mdm,
}
