"""Builders of the research population's 3-D generation cases (see ``population.py``).

Point clouds, shape-latent sets, triplanes and voxel grids. Two repositories import the PVCNN
C++/CUDA extension (``torch.utils.cpp_extension.load`` at import): its operations become the
plain-PyTorch functions below, of the same math as the extension's kernels, patched onto the
repository's ``functional`` package after import. Repositories whose package ``__init__``
imports the whole training stack are imported with those ``__init__`` files bypassed.

Example:
    >>> import torch
    >>> from benchmarks.research.cases_threed import BUILDERS, avg_voxelize
    >>> "DiT-3D/DiT-3D" in BUILDERS
    True
    >>> feats = torch.ones(1, 2, 5)
    >>> avg_voxelize(feats, torch.zeros(1, 3, 5, dtype=torch.int32), 2).shape
    torch.Size([1, 2, 2, 2, 2])
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.coverage_community_repos import import_snapshot
from benchmarks.research.population import Build

__all__ = [
    "BUILDERS",
    "avg_voxelize",
    "ball_query",
    "furthest_point_sample",
    "gather",
    "grouping",
    "nearest_neighbor_interpolate",
    "trilinear_devoxelize",
]

Inputs = tuple[tuple, dict]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen())


def _steps() -> torch.Tensor:
    """Two integer diffusion steps."""
    return torch.tensor([10, 500])


def _times() -> torch.Tensor:
    """Two continuous times in ``[0, 1]``."""
    return torch.tensor([0.3, 0.8])


# -- the PVCNN extension's operations in plain PyTorch -----------------------------------


def avg_voxelize(features: torch.Tensor, coords: torch.Tensor, resolution: int) -> torch.Tensor:
    """``[B, C, N]`` point features averaged into the voxels that ``coords`` (``[B, 3, N]`` ints)
    name: ``[B, C, R, R, R]``, zero where no point falls (the extension's kernel)."""
    b, c, n = features.shape
    r = int(resolution)
    coords = coords.long()
    index = (coords[:, 0] * r * r + coords[:, 1] * r + coords[:, 2])[:, None]
    sums = features.new_zeros(b, c, r**3).scatter_add(2, index.expand(b, c, n), features)
    counts = features.new_zeros(b, 1, r**3).scatter_add(2, index, features.new_ones(b, 1, n))
    return (sums / counts.clamp(min=1)).view(b, c, r, r, r)


def trilinear_devoxelize(
    features: torch.Tensor, coords: torch.Tensor, resolution: int, is_training: bool = True
) -> torch.Tensor:
    """``[B, C, R, R, R]`` voxel features interpolated trilinearly at the points ``coords``
    (``[B, 3, N]`` floats in voxel units): ``[B, C, N]`` (the extension's kernel)."""
    b, c = features.shape[:2]
    grid = coords.flip(1).transpose(1, 2) * (2.0 / (int(resolution) - 1)) - 1.0
    out = F.grid_sample(features, grid[:, :, None, None], mode="bilinear", align_corners=True)
    return out.reshape(b, c, -1)


def gather(features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``features[b, :, indices[b]]``: ``[B, C, N]`` and ``[B, M]`` to ``[B, C, M]``."""
    b, c = features.shape[:2]
    index = indices.long()[:, None].expand(b, c, indices.shape[-1])
    return features.gather(2, index)


def grouping(features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The neighbours' features: ``[B, C, N]`` and ``[B, M, K]`` to ``[B, C, M, K]``."""
    b, m, k = indices.shape
    return gather(features, indices.reshape(b, m * k)).view(b, features.shape[1], m, k)


def ball_query(
    centers: torch.Tensor, points: torch.Tensor, radius: float, num_neighbors: int
) -> torch.Tensor:
    """The first ``num_neighbors`` points (in point order) within ``radius`` of each centre,
    padded with the first one found, all 0 where none is: ``[B, M, K]`` int."""
    d2 = (centers[:, :3, :, None] - points[:, :3, None, :]).square().sum(1)
    n = points.shape[-1]
    order = torch.arange(n, device=points.device).expand_as(d2)
    found = torch.where(d2 < radius * radius, order, n).sort(-1).values[..., :num_neighbors]
    first = found[..., :1]
    indices = torch.where(found < n, found, first)
    return torch.where(first < n, indices, 0).int()


def furthest_point_sample(
    coords: torch.Tensor, num_samples: int, normals: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Iterative furthest point sampling from point 0: the sampled centres' coords
    ``[B, 3, M]`` (and their normals where given)."""
    xyz = coords[:, :3]
    b, _, n = xyz.shape
    dist = xyz.new_full((b, n), 1e10)
    last = torch.zeros(b, dtype=torch.long, device=xyz.device)
    chosen = [last]
    for _ in range(1, num_samples):
        centre = xyz.gather(2, last[:, None, None].expand(b, 3, 1))
        dist = torch.minimum(dist, (xyz - centre).square().sum(1))
        last = dist.argmax(1)
        chosen.append(last)
    indices = torch.stack(chosen, 1)
    centers = gather(coords, indices)
    return centers if normals is None else (centers, gather(normals, indices))


def nearest_neighbor_interpolate(
    points: torch.Tensor, centers: torch.Tensor, center_features: torch.Tensor
) -> torch.Tensor:
    """Inverse-squared-distance interpolation from each point's 3 nearest centres:
    ``[B, C, M]`` centre features to ``[B, C, N]``."""
    d2 = (points[:, :3, :, None] - centers[:, :3, None, :]).square().sum(1)
    best, index = d2.topk(3, dim=-1, largest=False)
    weights = 1.0 / best.clamp(1e-10, 1e10)
    weights = weights / weights.sum(-1, keepdim=True)
    b, n, _ = index.shape
    near = gather(center_features, index.reshape(b, n * 3)).view(b, -1, n, 3)
    return (near * weights[:, None]).sum(-1)


_PVCNN = dict(
    avg_voxelize=avg_voxelize,
    trilinear_devoxelize=trilinear_devoxelize,
    gather=gather,
    grouping=grouping,
    ball_query=ball_query,
    furthest_point_sample=furthest_point_sample,
    nearest_neighbor_interpolate=nearest_neighbor_interpolate,
)


def _no_backend(name: str) -> types.ModuleType:
    """A stand-in for the extension module ``name`` (``_backend``): importing it compiles
    nothing; the operations are patched above it, so using it is an error."""
    module = types.ModuleType(name)
    module._backend = None
    return module


# -- importing ---------------------------------------------------------------------------


def _bare_package(root: Path, name: str) -> types.ModuleType:
    """Package ``name`` of the snapshot without running its ``__init__``, with the
    threestudio-style ``register`` (a registry decorator) and ``warn`` that such ``__init__``
    files define beside their heavy imports."""
    module = types.ModuleType(name)
    module.__path__ = [str(root / name.replace(".", "/"))]
    module.register = lambda _name: lambda cls: cls
    module.warn = lambda *args, **_: warnings.warn(" ".join(map(str, args)), stacklevel=2)
    return module


def _import(
    root: Path, *modules: str, bare: tuple[str, ...] = (), fakes: dict | None = None
) -> list[Any]:
    """``import_snapshot``, with the packages in ``bare`` registered without their
    ``__init__`` and the modules in ``fakes`` registered as given (after the snapshot's
    top-level names are dropped from ``sys.modules``, before importing)."""
    if not bare and not fakes:
        return import_snapshot(root, *modules)
    tops = {m.split(".")[0] for m in (*modules, *bare, *(fakes or {}))}
    for name in [m for m in sys.modules if m.split(".")[0] in tops]:
        del sys.modules[name]
    sys.modules.update({name: _bare_package(root, name) for name in bare})
    sys.modules.update(fakes or {})

    def holds(entry: str) -> bool:
        where = Path(entry or ".")
        return any((where / t).exists() or (where / f"{t}.py").exists() for t in tops)

    saved = sys.path[:]
    sys.path[:] = [str(root), *(p for p in saved if not holds(p))]
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        sys.path[:] = saved


# -- builders ----------------------------------------------------------------------------


def _dit3d(root: Path) -> Build:
    backend = "modules.functional.backend"
    functional, mod = _import(
        root, "modules.functional", "models.dit3d", fakes={backend: _no_backend(backend)}
    )
    for name in ("avg_voxelize", "trilinear_devoxelize"):
        setattr(functional, name, _PVCNN[name])
    config = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=48, depth=4,
                  num_heads=2, mlp_ratio=2.0, class_dropout_prob=0.1, num_classes=1,
                  learn_sigma=False)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 3, 128), _steps(), torch.zeros(2, dtype=torch.long)), {}

    note = ("config: hidden_size 64 -> 48 (the 3-D sincos pos_embed asserts a width divisible "
            "by 3, 6 per axis); edit: PVCNN extension (cpp_extension.load) not loaded, "
            "modules.functional.avg_voxelize / trilinear_devoxelize -> plain PyTorch "
            "(scatter-mean, grid_sample)")  # fmt: skip
    return Build(lambda: mod.DiT(**config), inputs, note=note)


def _point_e(root: Path) -> Build:
    (mod,) = _import(root, "point_e.models.transformer")
    config = dict(device=torch.device("cpu"), dtype=torch.float32, input_channels=6,
                  output_channels=12, n_ctx=64, width=64, layers=4, heads=2, init_scale=0.25,
                  time_token_cond=True)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 6, 64), _steps()), {}

    return Build(lambda: mod.PointDiffusionTransformer(**config), inputs)


def _shape2vecset(root: Path) -> Build:
    (mod,) = _import(root, "models_class_cond")
    config = dict(n_latents=32, channels=8, use_fp16=False, n_heads=2, d_head=32, depth=4)

    def inputs() -> Inputs:
        return (_randn(2, 32, 8), torch.tensor([0.5, 2.0]), torch.tensor([3, 7])), {}

    return Build(lambda: mod.EDMPrecond(**config), inputs)


def _hunyuan3d(root: Path) -> Build:
    (mod,) = _import(
        root,
        "hy3dgen.shapegen.models.denoisers.hunyuan3ddit",
        bare=("hy3dgen", "hy3dgen.shapegen", "hy3dgen.shapegen.models"),
    )
    config = dict(in_channels=8, context_in_dim=32, hidden_size=64, mlp_ratio=2.0, num_heads=2,
                  depth=2, depth_single_blocks=4, axes_dim=[32], theta=10000, qkv_bias=True,
                  time_factor=1000, guidance_embed=False)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 32, 8), _times(), {"main": _randn(2, 16, 32)}), {}

    note = "hy3dgen package __init__ files bypassed (they import the pipelines)"
    return Build(lambda: mod.Hunyuan3DDiT(**config), inputs, note=note)


def _triposg(root: Path) -> Build:
    (mod,) = _import(root, "triposg.models.transformers.triposg_transformer")
    config = dict(num_attention_heads=2, width=64, in_channels=8, num_layers=5,
                  cross_attention_dim=32, use_cross_attention_2=False)  # fmt: skip

    def inputs() -> Inputs:
        kwargs = dict(encoder_hidden_states=_randn(2, 16, 32), return_dict=False)
        return (_randn(2, 32, 8), _times()), kwargs

    return Build(lambda: mod.TripoSGDiTModel(**config), inputs)


def _trellis(root: Path) -> Build:
    os.environ["ATTN_BACKEND"] = "sdpa"
    (mod,) = _import(root, "trellis.models.sparse_structure_flow", bare=("trellis",))
    config = dict(resolution=8, in_channels=4, model_channels=64, cond_channels=32,
                  out_channels=4, num_blocks=4, num_heads=2, num_head_channels=32,
                  mlp_ratio=2.0, patch_size=2, pe_mode="ape", use_fp16=False,
                  use_checkpoint=False, share_mod=False, qk_rms_norm=True,
                  qk_rms_norm_cross=False)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 4, 8, 8, 8), _times(), _randn(2, 16, 32)), {}

    note = "ATTN_BACKEND=sdpa (the repo's own switch); trellis/__init__ bypassed (pipelines)"
    return Build(lambda: mod.SparseStructureFlowModel(**config), inputs, note=note)


def _lion(root: Path) -> Build:
    backend = "third_party.pvcnn.functional.backend"
    functional, defaults, mod = _import(
        root,
        "third_party.pvcnn.functional",
        "default_config",
        "models.latent_points_ada_localprior",
        fakes={backend: _no_backend(backend)},
    )
    for name, fn in _PVCNN.items():
        setattr(functional, name, fn)
    cfg = defaults.cfg.clone()
    cfg.merge_from_list(["clipforge.enable", 0, "clipforge.feat_dim", 512,
                         "shapelatent.latent_dim", 1, "ddpm.input_dim", 3, "ddpm.time_dim", 64,
                         "ddpm.dropout", 0.0, "data.tr_max_sample_points", 2048,
                         "sde.embedding_scale", 1.0, "sde.mixed_prediction", False,
                         "sde.mixing_logit_init", -6])  # fmt: skip

    def inputs() -> Inputs:
        style = _randn(2, 128, 1, 1)
        return (_randn(2, 2048 * 4), _times()), {"condition_input": style}

    note = ("cfg: LION's default_config with the listed fields; edit: PVCNN extension not "
            "loaded, its 7 ops (voxelize, devoxelize, ball query, grouping, gather, FPS, 3-NN "
            "interpolation) -> plain PyTorch of the kernels' math")  # fmt: skip
    return Build(lambda: mod.PVCNN2Prior(None, 4, cfg), inputs, note=note)


def _craftsman(root: Path) -> Build:
    (mod,) = _import(
        root, "craftsman.models.denoisers.pixart_denoiser", bare=("craftsman", "craftsman.models")
    )
    cfg = dict(input_channels=8, output_channels=8, n_ctx=32, width=64, layers=4, heads=2,
               context_dim=32, n_views=1, context_ln=True, init_scale=0.25,
               use_checkpoint=False, drop_path=0.0, qkv_fuse=True, clip_weight=1.0,
               dino_weight=1.0, condition_type="dinov2", use_RMSNorm=False)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 32, 8), _steps(), _randn(2, 16, 32)), {}

    note = "craftsman and craftsman.models __init__ bypassed (data/systems stack)"
    return Build(lambda: mod.PixArtDinoDenoiser(cfg), inputs, note=note)


def _direct3d(root: Path) -> Build:
    (mod,) = _import(root, "direct3d.models.dit")
    sincos = mod.get_2d_sincos_pos_embed_from_grid  # diffusers': torch grids since 0.32
    mod.get_2d_sincos_pos_embed_from_grid = lambda dim, grid: sincos(
        dim, torch.from_numpy(grid)
    ).numpy()
    config = dict(num_attention_heads=2, attention_head_dim=32, in_channels=8, out_channels=8,
                  num_layers=4, dropout=0.0, attention_bias=False, sample_size=16,
                  patch_size=2, activation_fn="gelu-approximate", norm_elementwise_affine=False,
                  norm_eps=1e-6, semantic_channels=32, pixel_channels=32,
                  interpolation_scale=1.0, gradient_checkpointing=False)  # fmt: skip

    def inputs() -> Inputs:
        latent, semantic = _randn(2, 8, 16, 16), _randn(2, 4, 32)
        return (latent, semantic, _steps(), _randn(2, 16, 32)), {}

    note = "compat: the numpy pos-embed grid goes to diffusers' (now torch) sincos function"
    return Build(lambda: mod.D3D_DiT(**config), inputs, note=note)


def _michelangelo(root: Path) -> Build:
    (mod,) = _import(root, "michelangelo.models.asl_diffusion.asl_udt")
    config = dict(device=torch.device("cpu"), dtype=torch.float32, input_channels=8,
                  output_channels=8, n_ctx=32, width=64, layers=2, heads=2, context_dim=32,
                  context_ln=True, skip_ln=True, init_scale=0.25, flip_sin_to_cos=False,
                  use_checkpoint=False)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 32, 8), _steps(), _randn(2, 8, 32)), {}

    return Build(lambda: mod.ConditionalASLUDTDenoiser(**config), inputs)


def _step1x3d(root: Path) -> Build:
    (mod,) = _import(
        root,
        "step1x3d_geometry.models.transformers.flux_transformer_1d",
        bare=("step1x3d_geometry", "step1x3d_geometry.models"),
    )
    config = dict(num_attention_heads=2, width=64, in_channels=8, num_layers=2,
                  num_single_layers=4, cross_attention_dim=32)  # fmt: skip

    def inputs() -> Inputs:
        kwargs = dict(encoder_hidden_states=_randn(2, 16, 32), return_dict=False)
        return (_randn(2, 32, 8), _times()), kwargs

    note = "step1x3d_geometry and its models __init__ bypassed (data/systems stack)"
    return Build(lambda: mod.FluxTransformer1DModel(**config), inputs, note=note)


def _point_cloud(root: Path) -> Build:
    (mod,) = _import(root, "models.diffusion")

    def inputs() -> Inputs:
        return (_randn(2, 64, 3), torch.tensor([0.02, 0.05]), _randn(2, 32)), {}

    return Build(lambda: mod.PointwiseNet(point_dim=3, context_dim=32, residual=True), inputs)


def _diffusion_sdf(root: Path) -> Build:
    scatter = "torch_scatter"

    def unused(*_: Any, **__: Any) -> None:
        raise NotImplementedError("torch_scatter stand-in: only the cond=True encoder uses it")

    fake = types.ModuleType(scatter)
    fake.scatter_mean = fake.scatter_max = unused
    (mod,) = _import(root, "models.archs.diffusion_arch", bare=("models",), fakes={scatter: fake})
    config = dict(dim=64, dim_in_out=64, num_timesteps=None, num_time_embeds=1, cond=False,
                  depth=4, dim_head=32, heads=2, ff_mult=2, cross_attn=False)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 64), _steps()), {}

    note = ("models/__init__ bypassed (pytorch_lightning, open3d); torch_scatter (compiled, "
            "imported by the unused cond encoder) given as an erroring stand-in")  # fmt: skip
    return Build(lambda: mod.DiffusionNet(**config), inputs, note=note)


def _diffuscene(root: Path) -> Build:
    (mod,) = _import(
        root, "scene_synthesis.networks.denoise_net", bare=("scene_synthesis.networks",)
    )
    config = dict(dim=32, dim_mults=[1, 1], channels=30, self_condition=False, seperate_all=True,
                  merge_bbox=True, objectness_dim=0, class_dim=22, translation_dim=3,
                  size_dim=3, angle_dim=2, objfeat_dim=0, context_dim=0, instanclass_dim=0,
                  text_condition=False, resnet_block_groups=8, learned_variance=False)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 16, 30), torch.tensor([0.02, 0.05])), {"context": None}

    note = ("config: dim_mults [1, 2] -> [1, 1] (the up path concatenates dim_in + dim_in "
            "where it expects dim_out + dim_in: only equal widths build, as in the repo's "
            "configs); scene_synthesis.networks __init__ bypassed (training code)")  # fmt: skip
    return Build(lambda: mod.Unet1D(**config), inputs, note=note)


def _sdfusion(root: Path) -> Build:
    (mod,) = _import(root, "models.networks.diffusion_networks.openai_model_3d")
    config = dict(image_size=8, in_channels=3, out_channels=3, model_channels=32,
                  num_res_blocks=1, attention_resolutions=[2], channel_mult=[1, 2], num_heads=2,
                  dims=3, use_spatial_transformer=True, transformer_depth=1, context_dim=32,
                  use_checkpoint=False, legacy=False)  # fmt: skip

    def inputs() -> Inputs:
        return (_randn(2, 3, 8, 8, 8), _steps()), {"context": _randn(2, 8, 32)}

    return Build(lambda: mod.UNet3DModel(**config), inputs)


BUILDERS = {
    "DiT-3D/DiT-3D": _dit3d,
    "openai/point-e": _point_e,
    "1zb/3DShape2VecSet": _shape2vecset,
    "Tencent/Hunyuan3D-2": _hunyuan3d,
    "VAST-AI-Research/TripoSG": _triposg,
    "microsoft/TRELLIS": _trellis,
    "nv-tlabs/LION": _lion,
    "wyysf-98/CraftsMan3D": _craftsman,
    "DreamTechAI/Direct3D": _direct3d,
    "NeuralCarver/Michelangelo": _michelangelo,
    "stepfun-ai/Step1X-3D": _step1x3d,
    "luost26/diffusion-point-cloud": _point_cloud,
    "princeton-computational-imaging/Diffusion-SDF": _diffusion_sdf,
    "tangjiapeng/DiffuScene": _diffuscene,
    "yccyenchicheng/SDFusion": _sdfusion,
}
