"""DiT: the class-conditional latent diffusion transformer of Peebles & Xie (2023).

Scalable Diffusion Models with Transformers, https://arxiv.org/abs/2212.09748. The network
patchifies a latent, adds a fixed 2-D sin-cos position embedding, runs a stack of adaLN-Zero
transformer blocks conditioned on ``timestep + class`` and maps the tokens back to a latent
holding the predicted noise (and, with ``learn_sigma``, the variance interpolation).

Every block is ``forward(x, c)`` with ``x`` of shape ``[B, N, D]`` for any token count ``N`` and
``c`` of shape ``[B, D]``, so token routing may hand a block any subset of the tokens. The
embedders, the final layer, the position table and ``unpatchify`` are the reference code's, kept
in :mod:`tread_fx.models.layers` because the Mamba and RWKV backbones use them too.

Example:
    >>> import torch
    >>> from tread_fx.models.dit import DiT_S_2
    >>> model = DiT_S_2(input_size=8, in_channels=4, num_classes=10)
    >>> x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.tensor([3, 7])
    >>> model(x, t, y).shape  # learn_sigma: noise and variance channels
    torch.Size([2, 8, 8, 8])
"""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import Attention, Mlp, PatchEmbed
from torch import nn

from tread_fx.models.layers import (
    FinalLayer,
    LabelEmbedder,
    TimestepEmbedder,
    get_2d_sincos_pos_embed,
    guided_forward,
    initialize_dit_weights,
    modulate,
    unpatchify,
)

try:  # optional fast kernel; chosen per call, only for CUDA fp16/bf16 inputs
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

__all__ = ["DiT", "DiTAttention", "DiTBlock", "DiT_models"]
__all__ += ["DiT_XL_2", "DiT_XL_4", "DiT_XL_8", "DiT_L_2", "DiT_L_4", "DiT_L_8"]
__all__ += ["DiT_B_2", "DiT_B_4", "DiT_B_8", "DiT_S_2", "DiT_S_4", "DiT_S_8"]


class DiTAttention(Attention):
    """timm multi-head self-attention that picks its kernel per call.

    FlashAttention (``flash_attn_func``) is used when the package is installed and the input is a
    CUDA fp16/bf16 tensor; everything else takes timm's fused path,
    ``F.scaled_dot_product_attention``.
    """

    def __init__(self, dim: int, num_heads: int, **kwargs) -> None:
        super().__init__(dim, num_heads=num_heads, **kwargs)
        self.fused_attn = True  # never timm's unfused softmax(q @ k^T) fallback

    @staticmethod
    def uses_flash(x: torch.Tensor) -> bool:
        """Whether a call on ``x`` runs FlashAttention (decided from device and dtype only)."""
        return (
            flash_attn_func is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
        )

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """Self-attention over tokens ``[B, N, D]``; a mask always takes timm's SDPA path."""
        if attn_mask is not None or not self.uses_flash(x):
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(2)  # each [B, N, H, head_dim], the layout flash-attn expects
        q, k = self.q_norm(q), self.k_norm(k)
        dropout_p = self.attn_drop.p if self.training else 0.0
        x = flash_attn_func(q, k, v, dropout_p, softmax_scale=self.scale, causal=is_causal)
        x = self.norm(x.reshape(B, N, self.attn_dim))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning.

    The conditioning ``c`` regresses shift, scale and a residual gate for the attention and MLP
    branches; the gates start at zero, so a freshly built block is the identity.

    Args:
        hidden_size: Token width ``D``.
        num_heads: Attention heads; must divide ``hidden_size``.
        mlp_ratio: MLP hidden width as a multiple of ``D``.
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = DiTAttention(hidden_size, num_heads=num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        gelu_tanh = partial(nn.GELU, approximate="tanh")
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio), act_layer=gelu_tanh)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Maps tokens ``x`` ``[B, N, D]`` (any ``N``) under conditioning ``c`` ``[B, D]``."""
        modulation = self.adaLN_modulation(c).chunk(6, dim=1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class DiT(nn.Module):
    """Diffusion transformer over a patchified latent, conditioned on timestep and class.

    Args:
        input_size: Latent height and width (int for square, or ``(H, W)``).
        patch_size: Patch side; must divide both latent sides.
        in_channels: Latent channels.
        hidden_size: Token width ``D``; divisible by ``num_heads`` and by 4.
        depth: Number of DiT blocks.
        num_heads: Attention heads per block.
        mlp_ratio: MLP hidden width as a multiple of ``D``.
        class_dropout_prob: Label dropout for classifier-free guidance (0 disables the null class).
        num_classes: Number of classes.
        learn_sigma: Also predict the variance, doubling the output channels.

    Raises:
        ValueError: If the sizes are inconsistent.
    """

    def __init__(
        self,
        input_size: int | tuple[int, int] = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
    ) -> None:
        super().__init__()
        size = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
        if patch_size < 1 or any(s < 1 or s % patch_size for s in size):
            raise ValueError(
                f"DiT: input_size={input_size} is not divisible by patch_size={patch_size}; "
                "choose a patch size that divides the latent height and width."
            )
        if num_heads < 1 or hidden_size % num_heads or hidden_size % 4:
            raise ValueError(
                f"DiT: hidden_size={hidden_size} must be divisible by num_heads={num_heads} "
                "and by 4 (for the 2-D sin-cos position embedding)."
            )
        if depth < 1 or not 0.0 <= class_dropout_prob <= 1.0:
            raise ValueError(
                f"DiT: got depth={depth}, class_dropout_prob={class_dropout_prob}; "
                "depth must be >= 1 and class_dropout_prob within [0, 1]."
            )
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.learn_sigma = learn_sigma

        self.x_embedder = PatchEmbed(size, patch_size, in_channels, hidden_size, bias=True)
        self.grid_size: tuple[int, int] = tuple(self.x_embedder.grid_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # Fixed, not trained: a buffer is in state_dict (reference key) but not in the optimizer.
        self.register_buffer("pos_embed", get_2d_sincos_pos_embed(hidden_size, self.grid_size))
        self.blocks = nn.ModuleList(
            DiTBlock(hidden_size, num_heads, mlp_ratio=mlp_ratio) for _ in range(depth)
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Xavier linears, normal embedders, zeroed adaLN modulation and output layer.

        The reference scheme, shared with Diffusion-RWKV: see
        :func:`~tread_fx.models.layers.initialize_dit_weights`.
        """
        initialize_dit_weights(self)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """Maps per-patch outputs ``[B, H*W, p*p*C]`` back to images ``[B, C, H*p, W*p]``."""
        return unpatchify(x, self.grid_size, self.patch_size, self.out_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Predicts noise (and variance) for latents ``x`` at timesteps ``t`` with labels ``y``.

        Args:
            x: Latents ``[B, in_channels, H, W]``.
            t: Timesteps ``[B]`` (integer or float).
            y: Class labels ``[B]``; ``num_classes`` is the null class.

        Returns:
            ``[B, out_channels, H, W]``.
        """
        # pos_embed first: the sum takes its contiguous [B, N, D] layout. timm's PatchEmbed
        # returns the tokens as a transposed view of the conv output (strides (N*D, 1, N)); as
        # the first operand it would keep the whole residual stream transposed, and every
        # LayerNorm and residual add of every block would pay for it (a few % of a CPU step).
        # The values are bitwise those of `x_embedder(x) + pos_embed`: addition commutes.
        x = self.pos_embed + self.x_embedder(x)
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        return self.unpatchify(self.final_layer(x, c))

    def forward_with_cfg(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor,
        cfg_scale: float,
        guidance_channels: int | None = None,
    ) -> torch.Tensor:
        """Classifier-free guided prediction; the caller doubles the batch (the DiT sampler's way).

        Contract (:func:`~tread_fx.models.layers.guided_forward`, the same for every backbone
        here): ``x``, ``t``, ``y`` hold ``2B`` rows, the conditional half first and the
        unconditional half second (``y[B:]`` the null class ``num_classes``); only ``x[:B]`` is
        used. Returns ``[2B, out_channels, H, W]`` with the guided
        ``uncond + cfg_scale * (cond - uncond)`` noise channels in both halves and each half's own
        variance channels. ``cfg_scale=1`` gives the conditional prediction;
        ``guidance_channels=3`` reproduces the reference DiT code, which guides 3 channels.
        """
        return guided_forward(self, x, t, y, cfg_scale, guidance_channels)


def DiT_XL_2(**kwargs) -> DiT:
    """DiT-XL/2; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 28, "hidden_size": 1152, "num_heads": 16, "patch_size": 2, **kwargs})


def DiT_XL_4(**kwargs) -> DiT:
    """DiT-XL/4; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 28, "hidden_size": 1152, "num_heads": 16, "patch_size": 4, **kwargs})


def DiT_XL_8(**kwargs) -> DiT:
    """DiT-XL/8; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 28, "hidden_size": 1152, "num_heads": 16, "patch_size": 8, **kwargs})


def DiT_L_2(**kwargs) -> DiT:
    """DiT-L/2; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 24, "hidden_size": 1024, "num_heads": 16, "patch_size": 2, **kwargs})


def DiT_L_4(**kwargs) -> DiT:
    """DiT-L/4; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 24, "hidden_size": 1024, "num_heads": 16, "patch_size": 4, **kwargs})


def DiT_L_8(**kwargs) -> DiT:
    """DiT-L/8; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 24, "hidden_size": 1024, "num_heads": 16, "patch_size": 8, **kwargs})


def DiT_B_2(**kwargs) -> DiT:
    """DiT-B/2; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 12, "hidden_size": 768, "num_heads": 12, "patch_size": 2, **kwargs})


def DiT_B_4(**kwargs) -> DiT:
    """DiT-B/4; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 12, "hidden_size": 768, "num_heads": 12, "patch_size": 4, **kwargs})


def DiT_B_8(**kwargs) -> DiT:
    """DiT-B/8; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 12, "hidden_size": 768, "num_heads": 12, "patch_size": 8, **kwargs})


def DiT_S_2(**kwargs) -> DiT:
    """DiT-S/2; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 12, "hidden_size": 384, "num_heads": 6, "patch_size": 2, **kwargs})


def DiT_S_4(**kwargs) -> DiT:
    """DiT-S/4; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 12, "hidden_size": 384, "num_heads": 6, "patch_size": 4, **kwargs})


def DiT_S_8(**kwargs) -> DiT:
    """DiT-S/8; keyword arguments override the configuration (see :class:`DiT`)."""
    return DiT(**{"depth": 12, "hidden_size": 384, "num_heads": 6, "patch_size": 8, **kwargs})


#: Reference names (``"DiT-XL/2"`` ...) to factories.
DiT_models = {
    "DiT-XL/2": DiT_XL_2,
    "DiT-XL/4": DiT_XL_4,
    "DiT-XL/8": DiT_XL_8,
    "DiT-L/2": DiT_L_2,
    "DiT-L/4": DiT_L_4,
    "DiT-L/8": DiT_L_8,
    "DiT-B/2": DiT_B_2,
    "DiT-B/4": DiT_B_4,
    "DiT-B/8": DiT_B_8,
    "DiT-S/2": DiT_S_2,
    "DiT-S/4": DiT_S_4,
    "DiT-S/8": DiT_S_8,
}
