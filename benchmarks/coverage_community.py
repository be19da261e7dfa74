"""The community population of the coverage sweep: model libraries and research code.

Two kinds of source, none of them diffusers, timm or transformers:

- **packages** from the package index that install without changing the installed torch,
  torchvision, transformers, diffusers or timm (the ``community`` extra of pyproject.toml,
  which ``scripts/setup.sh`` installs): lucidrains' ``vit-pytorch``, ``x-transformers``,
  ``mmdit``, ``perceiver-pytorch`` and ``denoising-diffusion-pytorch``, MONAI, OpenCLIP, and
  torchvision's own models;
- **research repositories**: the model files researchers train (DiT, SiT, U-ViT, MDT,
  LightningDiT, REPA, TREAD), brought in at run time from a snapshot (``--snapshots DIR``,
  one folder per repository holding its model files and a ``COMMIT`` file; never committed,
  see ``SNAPSHOT_FILES`` and docs/support.md) and imported by path.

Every case is built at a tiny size (depth 4-6, width 32-64, 16-64 tokens) and carries the
verdict expected where it is known (``expected``: ``route``, or ``refuse: <why>``).

Example:
    >>> from benchmarks.coverage_community import SOURCES, SNAPSHOT_FILES
    >>> len(SOURCES) >= 8 and "dit" in SNAPSHOT_FILES
    True
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from benchmarks.coverage_checks import Case

__all__ = [
    "PACKAGES",
    "SNAPSHOT_FILES",
    "SOURCES",
    "community_cases",
    "import_snapshot",
    "package_versions",
    "snapshot_commits",
]

REFUSE_UNET = "refuse: conv U-Net (feature maps, no token stack)"
REFUSE_STAGES = "refuse: hierarchical windowed stages"
REFUSE_LATENTS = "refuse: perceiver latents (the blocks process learned latents)"

# source -> distribution names whose versions the JSON records
PACKAGES = {
    "vit-pytorch": ["vit-pytorch"],
    "x-transformers": ["x-transformers"],
    "mmdit": ["mmdit", "hyper-connections"],
    "perceiver-pytorch": ["perceiver-pytorch"],
    "denoising-diffusion-pytorch": ["denoising-diffusion-pytorch"],
    "torchvision": ["torchvision"],
    "monai": ["monai"],
    "open-clip": ["open_clip_torch"],
}
# snapshot folder -> (repository, the files taken from it)
SNAPSHOT_FILES = {
    "dit": ("facebookresearch/DiT", ["models.py"]),
    "sit": ("willisma/SiT", ["models.py"]),
    "uvit": ("baofff/U-ViT", ["libs/uvit.py", "libs/uvit_t2i.py", "libs/timm.py"]),
    "mdt": ("sail-sg/MDT", ["masked_diffusion/models.py"]),
    "lightningdit": (
        "hustvl/LightningDiT",
        [f"models/{f}.py" for f in ("lightningdit", "pos_embed", "rmsnorm", "swiglu_ffn")],
    ),
    "repa": ("sihyun-yu/REPA", ["models/sit.py", "models/mmdit.py"]),
    "tread": ("CompVis/tread", ["dit.py", "routing_module.py"]),
}
SOURCES = [*PACKAGES, *SNAPSHOT_FILES]


def package_versions() -> dict[str, str]:
    """Installed version of every community package (``not installed`` where absent)."""
    out = {}
    for dists in PACKAGES.values():
        for dist in dists:
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                out[dist] = "not installed"
    return out


def snapshot_commits(snapshots: Path | None) -> dict[str, str]:
    """``repository@commit`` of every snapshot folder (its ``COMMIT`` file)."""
    out = {}
    for name, (repo, _files) in SNAPSHOT_FILES.items():
        commit_file = Path(snapshots or "/nonexistent") / name / "COMMIT"
        commit = commit_file.read_text().strip() if commit_file.exists() else "no snapshot"
        out[name] = f"{repo}@{commit}"
    return out


def import_snapshot(root: Path, *modules: str) -> list[Any]:
    """Import ``modules`` (dotted) from a snapshot folder, as its repository's scripts do.

    While importing, the folder is first on ``sys.path`` and no other entry that holds the
    same top-level name is on it (several repositories call theirs ``models``, as this
    project does); a module already imported under that name is dropped first.
    """
    tops = {m.split(".")[0] for m in modules}
    for name in [m for m in sys.modules if m.split(".")[0] in tops]:
        del sys.modules[name]

    def holds(entry: str) -> bool:
        where = Path(entry or ".")
        return any((where / t).exists() or (where / f"{t}.py").exists() for t in tops)

    saved = sys.path[:]
    sys.path[:] = [str(root), *(p for p in saved if not holds(p))]
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        sys.path[:] = saved


# -- inputs -------------------------------------------------------------------------------


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _image(channels: int = 3, size: int = 32) -> Callable[[], tuple[tuple, dict]]:
    return lambda: ((torch.randn(2, channels, size, size, generator=_gen()),), {})


def _dit_inputs(channels: int = 4, size: int = 8) -> Callable[[], tuple[tuple, dict]]:
    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, channels, size, size, generator=_gen())
        return (x, torch.tensor([10.0, 500.0]), torch.tensor([1, 2])), {}

    return inputs


def _unet_inputs(channels: int = 3, size: int = 16, t: Any = None) -> Callable:
    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, channels, size, size, generator=_gen())
        return (x, torch.tensor([10, 500]) if t is None else t), {}

    return inputs


def _case(source: str, name: str, make: Callable, inputs: Callable, expected: str = "route",
          note: str = "", noisy: Any = 0) -> Case:  # fmt: skip
    return Case(f"{source}: {name}", "community", make, inputs, note=note, noisy=noisy,
                expected=expected)  # fmt: skip


# -- packages -----------------------------------------------------------------------------

_VIT = dict(image_size=32, patch_size=8, num_classes=10, dim=64, heads=2, mlp_dim=128, dim_head=32)


def _vit_pytorch() -> Iterator[Case]:
    from vit_pytorch import ViT, SimpleViT
    from vit_pytorch.cait import CaiT
    from vit_pytorch.cross_vit import CrossViT
    from vit_pytorch.deepvit import DeepViT
    from vit_pytorch.max_vit import MaxViT
    from vit_pytorch.simple_uvit import SimpleUViT
    from vit_pytorch.simple_vit_with_register_tokens import SimpleViT as RegisterViT

    src, img = "vit-pytorch", _image()
    yield _case(src, "ViT", lambda: ViT(depth=4, **_VIT), img, note="cls token, 16 patches")
    yield _case(src, "SimpleViT", lambda: SimpleViT(depth=4, **_VIT), img)
    yield _case(src, "SimpleViT (4 registers)",
                lambda: RegisterViT(depth=4, num_register_tokens=4, **_VIT), img)  # fmt: skip
    yield _case(src, "DeepViT", lambda: DeepViT(depth=4, **_VIT), img)
    yield _case(src, "CaiT", lambda: CaiT(depth=4, cls_depth=2, **_VIT), img,
                note="patch layers, then class-attention layers (cls over patch context)")  # fmt: skip
    yield _case(src, "SimpleUViT", lambda: SimpleUViT(depth=6, **_VIT), img,
                note="layers of [skip proj | None, attn, ff] triples, long skips")  # fmt: skip
    yield _case(
        src, "MaxViT",
        lambda: MaxViT(num_classes=10, dim_conv_stem=32, dim=32, dim_head=16, depth=(2, 2),
                       window_size=2, mbconv_expansion_rate=2),
        img, expected=REFUSE_STAGES, note="MBConv + block/grid window attention, 2 stages",
    )  # fmt: skip
    yield _case(
        src, "CrossViT",
        lambda: CrossViT(image_size=32, num_classes=10, sm_dim=32, lg_dim=64, sm_patch_size=4,
                         lg_patch_size=8, sm_enc_depth=1, lg_enc_depth=1, cross_attn_depth=1,
                         depth=4, sm_enc_heads=2, lg_enc_heads=2, cross_attn_heads=2,
                         sm_enc_mlp_dim=64, lg_enc_mlp_dim=128, sm_enc_dim_head=16,
                         lg_enc_dim_head=16, cross_attn_dim_head=16),
        img, expected="refuse: blocks carry two streams at two scales (issue 29 class 8)",
        note="two token streams (64 and 16 patches) exchanging cls tokens",
    )  # fmt: skip


def _x_transformers() -> Iterator[Case]:
    from x_transformers import ContinuousTransformerWrapper, Encoder, ViTransformerWrapper

    src = "x-transformers"
    enc = dict(dim=64, depth=4, heads=2, attn_dim_head=32)
    seq = lambda: ((torch.randn(2, 32, 16, generator=_gen()),), {})  # noqa: E731
    yield _case(
        src, "ContinuousTransformerWrapper(Encoder)",
        lambda: ContinuousTransformerWrapper(dim_in=16, dim_out=16, max_seq_len=64,
                                             attn_layers=Encoder(**enc)),
        seq, note="layers: [norms, block, residual] triples, attention and feed-forward alternate",
    )  # fmt: skip
    yield _case(
        src, "ContinuousTransformerWrapper(Encoder, rotary)",
        lambda: ContinuousTransformerWrapper(dim_in=16, dim_out=16, max_seq_len=64,
                                             use_abs_pos_emb=False,
                                             attn_layers=Encoder(rotary_pos_emb=True, **enc)),
        seq, note="a rotary module's frequencies handed to every attention layer",
    )  # fmt: skip
    yield _case(
        src, "ViTransformerWrapper",
        lambda: ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10,
                                     attn_layers=Encoder(**enc)),
        _image(),
    )  # fmt: skip


def _mmdit() -> Iterator[Case]:
    from mmdit import MMDiT

    def inputs() -> tuple[tuple, dict]:
        g = _gen()
        return (), {
            "image_tokens": torch.randn(2, 16, 64, generator=g),
            "text_tokens": torch.randn(2, 8, 32, generator=g),
            "time_cond": torch.randn(2, 32, generator=g),
        }

    kw = dict(depth=4, dim_image=64, dim_text=32, dim_cond=32, heads=2, dim_head=32)
    yield _case("mmdit", "MMDiT", lambda: MMDiT(**kw), inputs, noisy="image_tokens",
                note="default: 4 hyper-connection residual streams")  # fmt: skip
    yield _case("mmdit", "MMDiT (1 residual stream)",
                lambda: MMDiT(num_residual_streams=1, **kw), inputs, noisy="image_tokens")  # fmt: skip


def _perceiver() -> Iterator[Case]:
    from perceiver_pytorch import Perceiver

    yield _case(
        "perceiver-pytorch", "Perceiver",
        lambda: Perceiver(num_freq_bands=4, depth=4, max_freq=10.0, input_channels=3,
                          input_axis=2, num_latents=16, latent_dim=64, cross_heads=1,
                          latent_heads=2, cross_dim_head=32, latent_dim_head=32, num_classes=10),
        lambda: ((torch.randn(2, 8, 8, 3, generator=_gen()),), {}), expected=REFUSE_LATENTS,
    )  # fmt: skip


def _denoising_diffusion() -> Iterator[Case]:
    from denoising_diffusion_pytorch import Unet
    from denoising_diffusion_pytorch.karras_unet import KarrasUnet
    from denoising_diffusion_pytorch.simple_diffusion import UViT

    src = "denoising-diffusion-pytorch"
    yield _case(src, "Unet", lambda: Unet(dim=32, dim_mults=(1, 2), attn_dim_head=16,
                                          attn_heads=2), _unet_inputs(), expected=REFUSE_UNET)  # fmt: skip
    yield _case(
        src, "KarrasUnet",
        lambda: KarrasUnet(image_size=16, dim=32, dim_max=64, channels=3, num_downsamples=2,
                           num_blocks_per_stage=1, attn_res=(8,), attn_dim_head=16),
        _unet_inputs(t=torch.tensor([0.1, 0.5])), expected=REFUSE_UNET,
    )  # fmt: skip
    yield _case(
        src, "UViT (simple diffusion)",
        lambda: UViT(dim=32, dim_mults=(1, 2), vit_depth=4, attn_dim_head=16, attn_heads=2),
        _unet_inputs(size=32, t=torch.tensor([0.1, 0.5])),
        note="conv U-Net with a 4-block transformer over the 8x8 bottleneck",
    )  # fmt: skip


def _torchvision() -> Iterator[Case]:
    from torchvision.models import SwinTransformer, VisionTransformer

    yield _case(
        "torchvision", "VisionTransformer",
        lambda: VisionTransformer(image_size=32, patch_size=8, num_layers=4, num_heads=2,
                                  hidden_dim=64, mlp_dim=128, num_classes=10),
        _image(), note="encoder.layers: nn.Sequential",
    )  # fmt: skip
    yield _case(
        "torchvision", "SwinTransformer",
        lambda: SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                window_size=[4, 4], num_classes=10),
        _image(), expected=REFUSE_STAGES,
    )  # fmt: skip


def _monai() -> Iterator[Case]:
    from monai.networks.nets import ViT, DiffusionModelUNet

    yield _case(
        "monai", "ViT",
        lambda: ViT(in_channels=1, img_size=(32, 32), patch_size=(8, 8), hidden_size=64,
                    mlp_dim=128, num_layers=4, num_heads=2, spatial_dims=2),
        _image(channels=1), note="returns (x, every block's output)",
    )  # fmt: skip
    yield _case(
        "monai", "DiffusionModelUNet",
        lambda: DiffusionModelUNet(spatial_dims=2, in_channels=1, out_channels=1,
                                   channels=(32, 32), attention_levels=(False, True),
                                   num_res_blocks=1, num_head_channels=16, norm_num_groups=8),
        _unet_inputs(channels=1), expected=REFUSE_UNET,
    )  # fmt: skip


def _open_clip() -> Iterator[Case]:
    from open_clip.transformer import TextTransformer, VisionTransformer

    yield _case(
        "open-clip", "VisionTransformer",
        lambda: VisionTransformer(image_size=32, patch_size=8, width=64, layers=4, heads=2,
                                  mlp_ratio=2.0, output_dim=32),
        _image(),
    )  # fmt: skip
    yield _case(
        "open-clip", "TextTransformer",
        lambda: TextTransformer(context_length=16, vocab_size=64, width=64, heads=2, layers=4,
                                output_dim=32),
        lambda: ((torch.randint(1, 64, (2, 16), generator=_gen()),), {}),
        note="causal mask [16, 16] built in __init__",
    )  # fmt: skip


# -- research repositories (snapshots) ----------------------------------------------------

_DIT = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, num_heads=2, num_classes=10)


def _repo_dit(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "models")
    yield _case("DiT", "DiT", lambda: mod.DiT(depth=4, **_DIT), _dit_inputs())


def _repo_sit(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "models")
    yield _case("SiT", "SiT", lambda: mod.SiT(depth=4, **_DIT), _dit_inputs())


def _repo_uvit(root: Path) -> Iterator[Case]:
    uvit, t2i = import_snapshot(root, "libs.uvit", "libs.uvit_t2i")
    kw = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=64, depth=5, num_heads=2)

    def t2i_inputs() -> tuple[tuple, dict]:
        g = _gen()
        x, t = torch.randn(2, 3, 16, 16, generator=g), torch.tensor([10.0, 500.0])
        return (x, t, torch.randn(2, 8, 32, generator=g)), {}

    yield _case("U-ViT", "UViT (class-conditional)",
                lambda: uvit.UViT(num_classes=10, **kw), _dit_inputs(3, 16),
                note="in_blocks, mid_block, out_blocks with cat([x, skip]) long skips; time "
                "and label tokens in front")  # fmt: skip
    yield _case("U-ViT", "UViT (text-to-image)",
                lambda: t2i.UViT(clip_dim=32, num_clip_token=8, **kw), t2i_inputs,
                note="time and 8 text tokens in front of 16 image tokens")  # fmt: skip


def _repo_mdt(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "masked_diffusion.models")
    yield _case("MDT", "MDTv2", lambda: mod.MDTv2(depth=6, decode_layer=2, **_DIT), _dit_inputs(),
                note="encoder blocks, side interpolater, decoder blocks with long skips; "
                "masking off (inference form)")  # fmt: skip


def _repo_lightningdit(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "models.lightningdit")
    paper = dict(use_qknorm=True, use_swiglu=True, use_rope=True, use_rmsnorm=True)
    yield _case("LightningDiT", "LightningDiT", lambda: mod.LightningDiT(depth=4, **paper, **_DIT),
                _dit_inputs(), note="the paper's config: RoPE module passed to every block, "
                "SwiGLU, RMSNorm, QK norm")  # fmt: skip


def _repo_repa(root: Path) -> Iterator[Case]:
    sit, mmdit = import_snapshot(root, "models.sit", "models.mmdit")

    def mmdit_inputs() -> tuple[tuple, dict]:
        g = _gen()
        x = torch.randn(2, 4, 8, 8, generator=g)
        return (x, torch.tensor([0.1, 0.5])), {"context": torch.randn(2, 8, 768, generator=g)}

    yield _case("REPA", "SiT", lambda: sit.SiT(depth=4, encoder_depth=2, z_dims=[32],
                                               projector_dim=64, qk_norm=False, **_DIT),
                _dit_inputs(), note="projector taps block 2's tokens (the REPA loss)")  # fmt: skip
    yield _case("REPA", "MMDiT",
                lambda: mmdit.MMDiT(input_size=8, patch_size=2, in_channels=4, depth=2,
                                    encoder_depth=1, z_dims=[32], projector_dim=64),
                mmdit_inputs, note="width is 32 x depth: depth 2 (width 64)")  # fmt: skip


def _repo_tread(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "dit")
    yield _case("TREAD", "DiT (its own routing off)", lambda: mod.DiT(depth=4, **_DIT),
                _dit_inputs(), note="the TREAD authors' DiT, enable_routing=False")  # fmt: skip


_PACKAGE_CASES = {
    "vit-pytorch": _vit_pytorch,
    "x-transformers": _x_transformers,
    "mmdit": _mmdit,
    "perceiver-pytorch": _perceiver,
    "denoising-diffusion-pytorch": _denoising_diffusion,
    "torchvision": _torchvision,
    "monai": _monai,
    "open-clip": _open_clip,
}
_REPO_CASES = {
    "dit": _repo_dit,
    "sit": _repo_sit,
    "uvit": _repo_uvit,
    "mdt": _repo_mdt,
    "lightningdit": _repo_lightningdit,
    "repa": _repo_repa,
    "tread": _repo_tread,
}


def community_cases(source: str, snapshots: Path | None = None) -> Iterator[Case | tuple]:
    """The cases of one source; ``(name, reason)`` where they cannot be made here.

    Args:
        source: A name in :data:`SOURCES`.
        snapshots: The folder holding one snapshot folder per research repository.
    """
    warnings.filterwarnings("ignore")
    if source in _PACKAGE_CASES:
        make, where = _PACKAGE_CASES[source], None
    else:
        make, where = _REPO_CASES[source], Path(snapshots or "/nonexistent") / source
        if not where.is_dir():
            yield source, f"no snapshot: run with --snapshots DIR holding {source}/ (docs/support.md)"
            return
    try:
        yield from make() if where is None else make(where)
    except Exception as err:  # noqa: BLE001 - an import failure is "not buildable here"
        yield source, f"import: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
