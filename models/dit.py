"""DiT: the class-conditional latent diffusion transformer of Peebles & Xie (2023).

Scalable Diffusion Models with Transformers, https://arxiv.org/abs/2212.09748. The network
patchifies a latent, adds a fixed 2-D sin-cos position embedding, runs a stack of adaLN-Zero
transformer blocks conditioned on ``timestep + class`` and maps the tokens back to a latent
holding the predicted noise (and, with ``learn_sigma``, the variance interpolation).

Every block is ``forward(x, c)`` with ``x`` of shape ``[B, N, D]`` for any token count ``N`` and
``c`` of shape ``[B, D]``, so token routing may hand a block any subset of the tokens.

Example:
    >>> import torch
    >>> from tread_fx.models.dit import DiT_S_2
    >>> model = DiT_S_2(input_size=8, in_channels=4, num_classes=10)
    >>> x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.tensor([3, 7])
    >>> model(x, t, y).shape  # learn_sigma: noise and variance channels
    torch.Size([2, 8, 8, 8])
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import Attention, Mlp, PatchEmbed
from torch import nn

try:  # optional fast kernel; chosen per call, only for CUDA fp16/bf16 inputs
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

__all__ = ["DiT", "DiTAttention", "DiTBlock", "FinalLayer", "LabelEmbedder", "TimestepEmbedder"]
__all__ += ["DiT_models", "get_2d_sincos_pos_embed", "modulate"]
__all__ += ["DiT_XL_2", "DiT_XL_4", "DiT_XL_8", "DiT_L_2", "DiT_L_4", "DiT_L_8"]
__all__ += ["DiT_B_2", "DiT_B_4", "DiT_B_8", "DiT_S_2", "DiT_S_4", "DiT_S_8"]


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-sample affine modulation ``x * (1 + scale) + shift`` of tokens ``[B, N, D]``."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def get_2d_sincos_pos_embed(dim: int, grid_size: tuple[int, int]) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding, as in MAE and the reference DiT.

    The first half of the channels encodes the column index, the second half the row index;
    each half is ``[sin, cos]`` of the coordinate times geometric frequencies.

    Args:
        dim: Embedding width; must be divisible by 4.
        grid_size: Patch grid ``(H, W)``; tokens are laid out row-major.

    Returns:
        Float32 tensor of shape ``[1, H * W, dim]``.
    """
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows = torch.arange(grid_size[0], dtype=torch.float64)
    cols = torch.arange(grid_size[1], dtype=torch.float64)
    row, col = torch.meshgrid(rows, cols, indexing="ij")

    def embed_1d(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega.reshape(1, -1)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([embed_1d(col), embed_1d(row)], dim=1).float().unsqueeze(0)


class TimestepEmbedder(nn.Module):
    """Embeds scalar diffusion timesteps: sinusoidal frequencies followed by a 2-layer MLP.

    Args:
        hidden_size: Output width ``D``.
        frequency_embedding_size: Width of the sinusoidal features fed to the MLP.
    """

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256) -> None:
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        """Returns ``[cos, sin]`` features of shape ``[B, dim]`` for (possibly fractional) ``t``."""
        half = dim // 2
        freqs = torch.exp(
            -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        )
        args = t.reshape(-1, 1).float() * freqs.reshape(1, -1)
        embedding = torch.cat([args.cos(), args.sin()], dim=-1)
        if dim % 2:
            embedding = F.pad(embedding, (0, 1))
        return embedding

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """Maps timesteps ``[B]`` to embeddings ``[B, D]``."""
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class LabelEmbedder(nn.Module):
    """Embeds class labels; owns the extra "null" class used for classifier-free guidance.

    In training mode each label is replaced by the null class (index ``num_classes``) with
    probability ``dropout_prob``. Eval mode never drops unless ``force_drop_ids`` asks for it.

    Args:
        num_classes: Number of real classes.
        hidden_size: Embedding width ``D``.
        dropout_prob: Label dropout probability; ``0`` creates no null class.
    """

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def drop_labels(
        self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Returns ``labels`` with dropped entries set to the null class.

        Args:
            labels: Integer labels ``[B]``.
            force_drop_ids: Optional ``[B]`` mask; nonzero entries are dropped, the rest kept.
                When given it replaces random dropout (in both modes).
        """
        if force_drop_ids is not None:
            drop = force_drop_ids != 0
        elif self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            return labels
        return torch.where(drop, self.num_classes, labels)

    def forward(
        self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Maps labels ``[B]`` to embeddings ``[B, D]``, applying label dropout."""
        return self.embedding_table(self.drop_labels(labels, force_drop_ids))


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


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm and a linear map from tokens to ``patch**2 * out_channels``."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Maps tokens ``[B, N, D]`` to per-patch outputs ``[B, N, patch**2 * out_channels]``."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


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
        """Xavier linears, normal embedders, and zeroed adaLN modulation and output layer."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        proj = self.x_embedder.proj  # a conv applied per patch: initialise it like a linear
        nn.init.xavier_uniform_(proj.weight.data.view(proj.weight.shape[0], -1))
        nn.init.zeros_(proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        zeroed = [block.adaLN_modulation[-1] for block in self.blocks]
        zeroed += [self.final_layer.adaLN_modulation[-1], self.final_layer.linear]
        for linear in zeroed:  # adaLN-Zero: blocks start as identities, the output as zeros
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """Maps per-patch outputs ``[B, H*W, p*p*C]`` back to images ``[B, C, H*p, W*p]``."""
        (h, w), p, c = self.grid_size, self.patch_size, self.out_channels
        x = x.reshape(x.shape[0], h, w, p, p, c)
        x = x.permute(0, 5, 1, 3, 2, 4)  # [B, C, h, p, w, p]
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Predicts noise (and variance) for latents ``x`` at timesteps ``t`` with labels ``y``.

        Args:
            x: Latents ``[B, in_channels, H, W]``.
            t: Timesteps ``[B]`` (integer or float).
            y: Class labels ``[B]``; ``num_classes`` is the null class.

        Returns:
            ``[B, out_channels, H, W]``.
        """
        x = self.x_embedder(x) + self.pos_embed
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
        """Classifier-free guided prediction, batching conditional and unconditional passes.

        Shape contract (as in the paper's sampler): the batch of ``2B`` holds the conditional
        half first and the unconditional half second. Only ``x[:B]`` is used (it is duplicated);
        ``y[:B]`` are the class labels and ``y[B:]`` should be the null class ``num_classes``.
        The guided ``eps = uncond + cfg_scale * (cond - uncond)`` is returned in both halves.

        Args:
            x: Latents ``[2B, C, H, W]``.
            t: Timesteps ``[2B]``.
            y: Labels ``[2B]``, conditional then null.
            cfg_scale: Guidance scale; 1 gives the conditional prediction.
            guidance_channels: Leading output channels to guide. Default: all noise channels
                (``in_channels``); the variance channels are never guided and are returned per
                half. Pass 3 to reproduce the reference DiT code, which guides 3 channels.

        Returns:
            ``[2B, out_channels, H, W]``.
        """
        half = x[: x.shape[0] // 2]
        out = self(torch.cat([half, half], dim=0), t, y)  # via __call__: hooks and wrappers apply
        n = self.in_channels if guidance_channels is None else guidance_channels
        eps, rest = out[:, :n], out[:, n:]
        cond_eps, uncond_eps = eps.chunk(2, dim=0)
        guided = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        return torch.cat([torch.cat([guided, guided], dim=0), rest], dim=1)


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
