"""The package-index cases of the coverage sweep's community population.

One function per source yields its :class:`~benchmarks.coverage_checks.Case` objects at a tiny
size (depth 4-6, width 32-64, 16-64 tokens), each with the verdict expected where it is known.
The packages are the ``community`` extra of pyproject.toml (see
``benchmarks/coverage_community.py``).

Example:
    >>> from benchmarks.coverage_community_cases import PACKAGE_CASES
    >>> [c.name for c in PACKAGE_CASES["torchvision"]()]
    ['torchvision: VisionTransformer', 'torchvision: SwinTransformer']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.coverage_checks import Case

__all__ = ["PACKAGE_CASES", "REFUSE_UNET", "REFUSE_STAGES", "REFUSE_LATENTS"]

REFUSE_UNET = "refuse: conv U-Net (feature maps, no token stack)"
REFUSE_STAGES = "refuse: hierarchical windowed stages"
REFUSE_LATENTS = "refuse: perceiver latents (the blocks process learned latents)"

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


def _case(
    source: str,
    name: str,
    make: Callable,
    inputs: Callable,
    expected: str = "route",
    note: str = "",
    noisy: Any = 0,
) -> Case:
    return Case(
        f"{source}: {name}", "community", make, inputs, note=note, noisy=noisy, expected=expected
    )


# -- packages -----------------------------------------------------------------------------

_VIT = dict(image_size=32, patch_size=8, num_classes=10, dim=64, heads=2, mlp_dim=128, dim_head=32)


def _vit_pytorch() -> Iterator[Case]:
    from vit_pytorch import SimpleViT, ViT
    from vit_pytorch.cait import CaiT
    from vit_pytorch.cross_vit import CrossViT
    from vit_pytorch.deepvit import DeepViT
    from vit_pytorch.max_vit import MaxViT
    from vit_pytorch.simple_uvit import SimpleUViT
    from vit_pytorch.simple_vit_with_register_tokens import SimpleViT as RegisterViT

    src, img = "vit-pytorch", _image()
    yield _case(src, "ViT", lambda: ViT(depth=4, **_VIT), img, note="cls token, 16 patches")
    yield _case(src, "SimpleViT", lambda: SimpleViT(depth=4, **_VIT), img)
    yield _case(
        src,
        "SimpleViT (4 registers)",
        lambda: RegisterViT(depth=4, num_register_tokens=4, **_VIT),
        img,
    )
    yield _case(src, "DeepViT", lambda: DeepViT(depth=4, **_VIT), img)
    yield _case(
        src,
        "CaiT",
        lambda: CaiT(depth=4, cls_depth=2, **_VIT),
        img,
        note="patch layers, then class-attention layers (cls over patch context)",
    )
    yield _case(
        src,
        "SimpleUViT",
        lambda: SimpleUViT(depth=6, **_VIT),
        img,
        note="layers of [skip proj | None, attn, ff] triples, long skips",
    )
    yield _case(
        src,
        "MaxViT",
        lambda: MaxViT(
            num_classes=10,
            dim_conv_stem=32,
            dim=32,
            dim_head=16,
            depth=(2, 2),
            window_size=2,
            mbconv_expansion_rate=2,
        ),
        img,
        expected=REFUSE_STAGES,
        note="MBConv + block/grid window attention, 2 stages",
    )
    yield _case(
        src,
        "CrossViT",
        lambda: CrossViT(
            image_size=32,
            num_classes=10,
            sm_dim=32,
            lg_dim=64,
            sm_patch_size=4,
            lg_patch_size=8,
            sm_enc_depth=1,
            lg_enc_depth=1,
            cross_attn_depth=1,
            depth=4,
            sm_enc_heads=2,
            lg_enc_heads=2,
            cross_attn_heads=2,
            sm_enc_mlp_dim=64,
            lg_enc_mlp_dim=128,
            sm_enc_dim_head=16,
            lg_enc_dim_head=16,
            cross_attn_dim_head=16,
        ),
        img,
        expected="refuse: blocks carry two streams at two scales (issue 29 class 8)",
        note="two token streams (64 and 16 patches) exchanging cls tokens",
    )


def _x_transformers() -> Iterator[Case]:
    from x_transformers import ContinuousTransformerWrapper, Encoder, ViTransformerWrapper

    src = "x-transformers"
    enc = dict(dim=64, depth=4, heads=2, attn_dim_head=32)
    seq = lambda: ((torch.randn(2, 32, 16, generator=_gen()),), {})  # noqa: E731
    yield _case(
        src,
        "ContinuousTransformerWrapper(Encoder)",
        lambda: ContinuousTransformerWrapper(
            dim_in=16, dim_out=16, max_seq_len=64, attn_layers=Encoder(**enc)
        ),
        seq,
        note="layers: [norms, block, residual] triples, attention and feed-forward alternate",
    )
    yield _case(
        src,
        "ContinuousTransformerWrapper(Encoder, rotary)",
        lambda: ContinuousTransformerWrapper(
            dim_in=16,
            dim_out=16,
            max_seq_len=64,
            use_abs_pos_emb=False,
            attn_layers=Encoder(rotary_pos_emb=True, **enc),
        ),
        seq,
        note="a rotary module's frequencies handed to every attention layer",
    )
    yield _case(
        src,
        "ViTransformerWrapper",
        lambda: ViTransformerWrapper(
            image_size=32, patch_size=8, num_classes=10, attn_layers=Encoder(**enc)
        ),
        _image(),
    )


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
    yield _case(
        "mmdit",
        "MMDiT",
        lambda: MMDiT(**kw),
        inputs,
        noisy="image_tokens",
        note="default: 4 hyper-connection residual streams",
    )
    yield _case(
        "mmdit",
        "MMDiT (1 residual stream)",
        lambda: MMDiT(num_residual_streams=1, **kw),
        inputs,
        noisy="image_tokens",
    )


def _perceiver() -> Iterator[Case]:
    from perceiver_pytorch import Perceiver

    yield _case(
        "perceiver-pytorch",
        "Perceiver",
        lambda: Perceiver(
            num_freq_bands=4,
            depth=4,
            max_freq=10.0,
            input_channels=3,
            input_axis=2,
            num_latents=16,
            latent_dim=64,
            cross_heads=1,
            latent_heads=2,
            cross_dim_head=32,
            latent_dim_head=32,
            num_classes=10,
        ),
        lambda: ((torch.randn(2, 8, 8, 3, generator=_gen()),), {}),
        expected=REFUSE_LATENTS,
    )


def _denoising_diffusion() -> Iterator[Case]:
    from denoising_diffusion_pytorch import Unet
    from denoising_diffusion_pytorch.karras_unet import KarrasUnet
    from denoising_diffusion_pytorch.simple_diffusion import UViT

    src = "denoising-diffusion-pytorch"
    yield _case(
        src,
        "Unet",
        lambda: Unet(dim=32, dim_mults=(1, 2), attn_dim_head=16, attn_heads=2),
        _unet_inputs(),
        expected=REFUSE_UNET,
    )
    yield _case(
        src,
        "KarrasUnet",
        lambda: KarrasUnet(
            image_size=16,
            dim=32,
            dim_max=64,
            channels=3,
            num_downsamples=2,
            num_blocks_per_stage=1,
            attn_res=(8,),
            attn_dim_head=16,
        ),
        _unet_inputs(t=torch.tensor([0.1, 0.5])),
        expected=REFUSE_UNET,
    )
    yield _case(
        src,
        "UViT (simple diffusion)",
        lambda: UViT(dim=32, dim_mults=(1, 2), vit_depth=4, attn_dim_head=16, attn_heads=2),
        _unet_inputs(size=32, t=torch.tensor([0.1, 0.5])),
        note="conv U-Net with a 4-block transformer over the 8x8 bottleneck",
    )


def _torchvision() -> Iterator[Case]:
    from torchvision.models import SwinTransformer, VisionTransformer

    yield _case(
        "torchvision",
        "VisionTransformer",
        lambda: VisionTransformer(
            image_size=32,
            patch_size=8,
            num_layers=4,
            num_heads=2,
            hidden_dim=64,
            mlp_dim=128,
            num_classes=10,
        ),
        _image(),
        note="encoder.layers: nn.Sequential",
    )
    yield _case(
        "torchvision",
        "SwinTransformer",
        lambda: SwinTransformer(
            patch_size=[4, 4],
            embed_dim=32,
            depths=[2, 2],
            num_heads=[2, 4],
            window_size=[4, 4],
            num_classes=10,
        ),
        _image(),
        expected=REFUSE_STAGES,
    )


def _monai() -> Iterator[Case]:
    from monai.networks.nets import DiffusionModelUNet, ViT

    yield _case(
        "monai",
        "ViT",
        lambda: ViT(
            in_channels=1,
            img_size=(32, 32),
            patch_size=(8, 8),
            hidden_size=64,
            mlp_dim=128,
            num_layers=4,
            num_heads=2,
            spatial_dims=2,
        ),
        _image(channels=1),
        note="returns (x, every block's output)",
    )
    yield _case(
        "monai",
        "DiffusionModelUNet",
        lambda: DiffusionModelUNet(
            spatial_dims=2,
            in_channels=1,
            out_channels=1,
            channels=(32, 32),
            attention_levels=(False, True),
            num_res_blocks=1,
            num_head_channels=16,
            norm_num_groups=8,
        ),
        _unet_inputs(channels=1),
        expected=REFUSE_UNET,
    )


def _open_clip() -> Iterator[Case]:
    from open_clip.transformer import TextTransformer, VisionTransformer

    yield _case(
        "open-clip",
        "VisionTransformer",
        lambda: VisionTransformer(
            image_size=32, patch_size=8, width=64, layers=4, heads=2, mlp_ratio=2.0, output_dim=32
        ),
        _image(),
    )
    yield _case(
        "open-clip",
        "TextTransformer",
        lambda: TextTransformer(
            context_length=16, vocab_size=64, width=64, heads=2, layers=4, output_dim=32
        ),
        lambda: ((torch.randint(1, 64, (2, 16), generator=_gen()),), {}),
        note="causal mask [16, 16] built in __init__",
    )


PACKAGE_CASES = {
    "vit-pytorch": _vit_pytorch,
    "x-transformers": _x_transformers,
    "mmdit": _mmdit,
    "perceiver-pytorch": _perceiver,
    "denoising-diffusion-pytorch": _denoising_diffusion,
    "torchvision": _torchvision,
    "monai": _monai,
    "open-clip": _open_clip,
}
