"""Builders of the research population's image DiT/SiT cases (see ``population.py``).

Class-conditional image diffusion transformers over ``[B, N, C]`` patch tokens: DiT/SiT
variants (mixture-of-experts MLPs, dynamic widths, layer gates, feature caches, muP), the
decoupled DDT/PixNerd encoders, FiT's packed variable-resolution input and PixelFlow.

Example:
    >>> from benchmarks.research.cases_image import BUILDERS
    >>> "Anima-Lab/MaskDiT" in BUILDERS and len(BUILDERS) == 13
    True
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.coverage_community_repos import import_snapshot
from benchmarks.research.kernels import provide_module
from benchmarks.research.population import Build

__all__ = ["BUILDERS", "dit_inputs"]

Inputs = Callable[[], tuple[tuple, dict]]

#: The listed tiny DiT config most entries share.
DIT = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=4, num_heads=4,
           num_classes=10)  # fmt: skip


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def dit_inputs(channels: int = 4, size: int = 8, t: torch.Tensor | None = None) -> Inputs:
    """``(x [2, C, S, S], t [2], y [2])``: the class-conditional DiT call."""

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, channels, size, size, generator=_gen())
        steps = torch.tensor([0.1, 0.7]) if t is None else t
        return (x, steps, torch.tensor([1, 2])), {}

    return inputs


# -- plain DiT/SiT variants -----------------------------------------------------------------


def _maskdit_inputs() -> tuple[tuple, dict]:
    x = torch.randn(2, 4, 8, 8, generator=_gen())
    onehot = F.one_hot(torch.tensor([1, 2]), 10).float()
    return (x, torch.tensor([0.1, 0.7]), onehot), {}


def _maskdit(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.maskdit")
    config = dict(DIT, learn_sigma=False, use_decoder=False)
    note = "mask_ratio=0 (default); y one-hot [2, 10] float (LabelEmbedder is an nn.Linear)"
    return Build(lambda: mod.DiT(**config), _maskdit_inputs, note=note)


def _dit_moe(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models")
    config = dict(DIT, mlp_ratio=4, num_experts=4, num_experts_per_tok=2, pretraining_tp=2,
                  learn_sigma=True, use_flash_attn=False)  # fmt: skip
    return Build(lambda: mod.DiT(**config), dit_inputs())


def _dydit(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models")
    config = dict(DIT, mlp_ratio=4.0, learn_sigma=True)
    return Build(lambda: mod.DiT(**config), dit_inputs(), note="complete_model=False (default)")


def _tinyfusion(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models_with_layer_pruning")
    config = dict(DIT, mlp_ratio=4.0, learn_sigma=True, groups=[[1, 2], [1, 2]])
    return Build(lambda: mod.DiT(**config), dit_inputs())


def _learning_to_cache(root: Path) -> Build:
    (mod,) = import_snapshot(root / "DiT", "models.router_models")
    config = dict(DIT, mlp_ratio=4.0, learn_sigma=True)
    note = "activate_router=False (default); t [2] holds DiT step indices (t[0].item() is read)"
    return Build(lambda: mod.DiT(**config), dit_inputs(t=torch.tensor([10.0, 700.0])), note=note)


def _mup(root: Path) -> Build:
    (mod,) = import_snapshot(root / "DiT", "models_mup")
    import mup

    config = dict(DIT, mlp_ratio=4.0, learn_sigma=True, output_mult=1.0)

    def make() -> torch.nn.Module:
        model = mod.DiT(**config)
        mup.set_base_shapes(model, None)
        readout = model.final_layer.linear
        width = readout.width_mult()
        readout.width_mult = lambda: width  # deepcopy drops the weight's infshape attribute
        return model

    note = ("mup.set_base_shapes(model, None) after construction (MuReadout needs base shapes); "
            "MuReadout.width_mult fixed to its value (1.0) on the instance, since a deepcopy "
            "of the model drops the parameters' infshape")  # fmt: skip
    return Build(make, dit_inputs(), note=note)


def _reg_inputs() -> tuple[tuple, dict]:
    g = _gen()
    x = torch.randn(2, 4, 8, 8, generator=g)
    cls_token = torch.randn(2, 32, generator=g)
    return (x, torch.tensor([0.1, 0.7]), torch.tensor([1, 2])), {"cls_token": cls_token}


def _reg(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.sit")
    config = dict(DIT, path_type="linear", decoder_hidden_size=64, encoder_depth=2, z_dims=[32],
                  projector_dim=64, cls_token_dim=32, qk_norm=False)  # fmt: skip
    return Build(lambda: mod.SiT(**config), _reg_inputs, note="cls_token [2, 32] passed")


def _diffmoe(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.models_DiffMoE")
    from omegaconf import OmegaConf

    # One process: all_reduce over a world of 1 is the identity (the listed edit).
    mod.dist = types.SimpleNamespace(
        all_reduce=lambda tensor, op=None: None,
        get_world_size=lambda: 1,
        ReduceOp=torch.distributed.ReduceOp,
    )
    moe = OmegaConf.create(dict(num_experts=4, capacity=2, n_shared_experts=0, interleave=False,
                                init_MoeMLP=False))  # fmt: skip
    config = dict(DIT, mlp_ratio=4.0, learn_sigma=True, MoE_config=moe)
    note = ("MoE_config as an OmegaConf DictConfig; torch.distributed in models_DiffMoE "
            "replaced by a 1-process stand-in (all_reduce = identity, world size 1)")  # fmt: skip
    return Build(lambda: mod.DiT(**config), dit_inputs(), note=note)


# -- RoPE / decoupled-encoder DiTs ----------------------------------------------------------


def _ddt(root: Path) -> Build:
    (mod,) = import_snapshot(root, "src.models.denoiser.decoupled_improved_dit")
    config = dict(in_channels=4, num_groups=4, hidden_size=64, num_blocks=8, patch_size=2,
                  num_encoder_blocks=4, num_classes=10, learn_sigma=False)  # fmt: skip
    return Build(lambda: mod.DDT(**config), dit_inputs())


def _pixnerd(root: Path) -> Build:
    (mod,) = import_snapshot(root, "src.models.transformer.pixnerd_c2i")
    config = dict(in_channels=3, num_groups=4, hidden_size=64, hidden_size_x=16,
                  nerf_mlpratio=2, num_blocks=6, num_cond_blocks=4, patch_size=4,
                  num_classes=10, learn_sigma=False)  # fmt: skip
    return Build(lambda: mod.PixNerDiT(**config), dit_inputs(channels=3, size=16))


def _missing(*_: Any, **__: Any) -> None:
    raise NotImplementedError("fit/model/sincos.py is not in the repository")


def _fit_inputs() -> tuple[tuple, dict]:
    x = torch.randn(2, 16, 16, generator=_gen())
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    grid = torch.stack([cols.flatten(), rows.flatten()]).expand(2, 2, 16).clone()
    return (x, torch.tensor([0.1, 0.7]), torch.tensor([1, 2]), grid, torch.ones(2, 16)), {}


def _fit(root: Path) -> Build:
    import_snapshot(root, "fit.model.modules")  # the namespace packages fit, fit.model
    provide_module("fit.model.sincos", get_2d_sincos_pos_embed_from_grid=_missing)
    saved = sys.path[:]
    sys.path.insert(0, str(root))
    try:
        import fit.model.fit_model as mod
    finally:
        sys.path[:] = saved
    config = dict(context_size=16, patch_size=2, in_channels=4, hidden_size=64, depth=4,
                  num_heads=4, num_classes=10, learn_sigma=True, rel_pos_embed="rope",
                  norm_type="layernorm")  # fmt: skip
    note = ("fit.model.sincos (missing from the repository, imported unused) provided as a "
            "stub module; x [2, 16, 16] packed patches of a 4x4 grid, mask all ones")  # fmt: skip
    return Build(lambda: mod.FiT(**config), _fit_inputs, note=note)


# -- other token layouts --------------------------------------------------------------------


def _linformer_dit(root: Path) -> Build:
    (mod,) = import_snapshot(root, "dit")
    config = dict(img_size=16, dim=64, patch_size=4, depth=4, heads=4, mlp_dim=128, k=8,
                  in_channels=3)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (torch.randn(2, 3, 16, 16, generator=_gen()), torch.tensor([0.1, 0.7])), {}

    return Build(lambda: mod.DiT(**config), inputs)


def _pixelflow(root: Path) -> Build:
    import_snapshot(root, "pixelflow.model")
    raise ValueError(
        "PixelFlowModel has no input that runs in both modes: in train mode Attention asserts "
        "a packed [tokens, p*p*C] input with cu_seqlens and PatchEmbed is a matmul over it; in "
        "eval mode PatchEmbed is a Conv2d over an image [B, C, H, W]"
    )


BUILDERS = {
    "Anima-Lab/MaskDiT": _maskdit,
    "whlzy/FiT": _fit,
    "feizc/DiT-MoE": _dit_moe,
    "MCG-NJU/DDT": _ddt,
    "NUS-HPC-AI-Lab/Dynamic-Diffusion-Transformer-DyDiT-": _dydit,
    "MCG-NJU/PixNerd": _pixnerd,
    "Martinser/REG": _reg,
    "KwaiVGI/DiffMoE": _diffmoe,
    "ShoufaChen/PixelFlow": _pixelflow,
    "VainF/TinyFusion": _tinyfusion,
    "milmor/diffusion-transformer": _linformer_dit,
    "horseee/learning-to-cache": _learning_to_cache,
    "ML-GSAI/Scaling-Diffusion-Transformers-muP": _mup,
}
