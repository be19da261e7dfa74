"""Layers shared by the reference backbones: conditioning, positions, output head, guidance.

DiT (Peebles & Xie), the diffusion Mamba and Diffusion-RWKV share everything around their blocks:
the latent is patchified and given a fixed 2-D sin-cos position table, ``timestep + class`` is
embedded into one conditioning vector ``c``, and an adaLN-modulated linear head maps the tokens
back to patches that :func:`unpatchify` reassembles. The definitions follow the reference DiT
code (``models.py``), so a DiT built from them keeps the reference ``state_dict`` keys and
outputs. Layers do not initialise themselves beyond PyTorch's defaults; each has an
``initialize_weights`` method for the DiT scheme, which a model calls (see
:func:`initialize_dit_weights`).

Example:
    >>> import torch
    >>> t_emb, y_emb = TimestepEmbedder(32), LabelEmbedder(10, 32, dropout_prob=0.1)
    >>> c = t_emb(torch.tensor([1, 500])) + y_emb(torch.tensor([3, 10]))  # 10: the null class
    >>> head = FinalLayer(32, patch_size=2, out_channels=4)
    >>> patches = head(torch.randn(2, 16, 32), c)  # 16 tokens: a 4 x 4 grid
    >>> unpatchify(patches, grid_size=(4, 4), patch_size=2, channels=4).shape
    torch.Size([2, 4, 8, 8])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FinalLayer",
    "LabelEmbedder",
    "TimestepEmbedder",
    "get_2d_sincos_pos_embed",
    "guided_forward",
    "init_patch_embed",
    "initialize_dit_weights",
    "modulate",
    "unpatchify",
]


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-sample affine modulation ``x * (1 + scale) + shift`` of tokens ``[B, N, D]``.

    Args:
        x: Tokens ``[B, N, D]``.
        shift: Per-sample shift ``[B, D]``.
        scale: Per-sample scale ``[B, D]``.

    Returns:
        The modulated tokens ``[B, N, D]``.

    Example:
        >>> modulate(torch.ones(2, 3, 4), torch.ones(2, 4), torch.ones(2, 4))[0, 0].tolist()
        [3.0, 3.0, 3.0, 3.0]
    """
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def get_2d_sincos_pos_embed(dim: int, grid_size: tuple[int, int]) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding, as in MAE and the reference DiT.

    The first half of the channels encodes the column index, the second half the row index;
    each half is ``[sin, cos]`` of the coordinate times geometric frequencies. When ``dim`` is not
    a multiple of 4 the last ``dim % 4`` channels are zero.

    Args:
        dim: Embedding width (at least 4).
        grid_size: Patch grid ``(H, W)``; tokens are laid out row-major.

    Returns:
        Float32 tensor of shape ``[1, H * W, dim]``.

    Example:
        >>> table = get_2d_sincos_pos_embed(8, (2, 3))
        >>> table.shape, table[0, 0].tolist()  # token (0, 0): sin 0 = 0, cos 0 = 1
        (torch.Size([1, 6, 8]), [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    """
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows = torch.arange(grid_size[0], dtype=torch.float64)
    cols = torch.arange(grid_size[1], dtype=torch.float64)
    row, col = torch.meshgrid(rows, cols, indexing="ij")

    def embed_1d(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega.reshape(1, -1)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    table = torch.cat([embed_1d(col), embed_1d(row)], dim=1)
    if dim % 4:
        table = F.pad(table, (0, dim % 4))
    return table.float().unsqueeze(0)


def unpatchify(
    x: torch.Tensor, grid_size: tuple[int, int], patch_size: int, channels: int
) -> torch.Tensor:
    """Maps per-patch outputs ``[B, H*W, p*p*C]`` back to images ``[B, C, H*p, W*p]``.

    Args:
        x: Per-patch values, channel last within a patch (the layout :class:`FinalLayer` emits).
        grid_size: Patch grid ``(H, W)``.
        patch_size: Patch side ``p``.
        channels: Image channels ``C``.

    Returns:
        Images ``[B, C, H * p, W * p]``.

    Example:
        >>> unpatchify(torch.randn(2, 6, 4 * 3), grid_size=(2, 3), patch_size=2, channels=3).shape
        torch.Size([2, 3, 4, 6])
    """
    (h, w), p, c = grid_size, patch_size, channels
    x = x.reshape(x.shape[0], h, w, p, p, c)
    x = x.permute(0, 5, 1, 3, 2, 4)  # [B, C, h, p, w, p]
    return x.reshape(x.shape[0], c, h * p, w * p)


def init_patch_embed(proj: nn.Conv2d) -> None:
    """Initialises a patch-embedding convolution like a linear map: Xavier weight, zero bias.

    Example:
        >>> conv = nn.Conv2d(3, 8, kernel_size=2, stride=2)
        >>> init_patch_embed(conv)
        >>> bool(conv.bias.any())
        False
    """
    nn.init.xavier_uniform_(proj.weight.data.view(proj.weight.shape[0], -1))
    nn.init.zeros_(proj.bias)


class TimestepEmbedder(nn.Module):
    """Embeds scalar diffusion timesteps: sinusoidal frequencies followed by a 2-layer MLP.

    Args:
        hidden_size: Output width ``D``.
        frequency_embedding_size: Width of the sinusoidal features fed to the MLP.
        match_weight_dtype: Cast the (float32) features to the MLP's dtype, so that a model cast
            to bf16 runs without autocast. Off in the reference DiT (its traced graph has no cast).

    Example:
        >>> TimestepEmbedder(32)(torch.tensor([1.0, 999.0])).shape
        torch.Size([2, 32])
    """

    def __init__(
        self,
        hidden_size: int,
        frequency_embedding_size: int = 256,
        match_weight_dtype: bool = False,
    ) -> None:
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.match_weight_dtype = match_weight_dtype
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        """Returns ``[cos, sin]`` features of shape ``[B, dim]`` for (possibly fractional) ``t``.

        Example:
            >>> TimestepEmbedder.timestep_embedding(torch.tensor([0.0]), 4).tolist()
            [[1.0, 1.0, 0.0, 0.0]]
        """
        half = dim // 2
        freqs = torch.exp(
            -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        )
        args = t.reshape(-1, 1).float() * freqs.reshape(1, -1)
        embedding = torch.cat([args.cos(), args.sin()], dim=-1)
        if dim % 2:
            embedding = F.pad(embedding, (0, 1))
        return embedding

    def initialize_weights(self) -> None:
        """Normal(0, 0.02) weights and zero biases, as in the reference DiT."""
        for linear in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """Maps timesteps ``[B]`` to embeddings ``[B, D]``."""
        features = self.timestep_embedding(t, self.frequency_embedding_size)
        if self.match_weight_dtype:
            features = features.to(self.mlp[0].weight.dtype)
        return self.mlp(features)


class LabelEmbedder(nn.Module):
    """Embeds class labels; owns the extra "null" class used for classifier-free guidance.

    In training mode each label is replaced by the null class (index ``num_classes``) with
    probability ``dropout_prob``. Eval mode never drops unless ``force_drop_ids`` asks for it.

    Args:
        num_classes: Number of real classes.
        hidden_size: Embedding width ``D``.
        dropout_prob: Label dropout probability.
        null_class: Whether the table has the null class. Default (``None``): only when
            ``dropout_prob > 0``, as in the reference DiT.

    Example:
        >>> LabelEmbedder(10, 32, dropout_prob=0.1).eval()(torch.tensor([3, 10])).shape
        torch.Size([2, 32])
        >>> LabelEmbedder(10, 32, dropout_prob=0.0).embedding_table.num_embeddings
        10
    """

    def __init__(
        self,
        num_classes: int,
        hidden_size: int,
        dropout_prob: float,
        null_class: bool | None = None,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        has_null = dropout_prob > 0 if null_class is None else null_class
        self.embedding_table = nn.Embedding(num_classes + int(has_null), hidden_size)

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

    def initialize_weights(self) -> None:
        """Normal(0, 0.02) embeddings, as in the reference DiT."""
        nn.init.normal_(self.embedding_table.weight, std=0.02)

    def forward(
        self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Maps labels ``[B]`` to embeddings ``[B, D]``, applying label dropout."""
        return self.embedding_table(self.drop_labels(labels, force_drop_ids))


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm and a linear map from tokens to ``patch**2 * out_channels``.

    Example:
        >>> head = FinalLayer(32, patch_size=2, out_channels=4)
        >>> head(torch.randn(2, 9, 32), torch.randn(2, 32)).shape
        torch.Size([2, 9, 16])
    """

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def initialize_weights(self) -> None:
        """adaLN-Zero: the modulation and the output linear start at zero (a zero prediction)."""
        for linear in (self.adaLN_modulation[-1], self.linear):
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Maps tokens ``[B, N, D]`` to per-patch outputs ``[B, N, patch**2 * out_channels]``."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def initialize_dit_weights(model: nn.Module) -> None:
    """The reference DiT initialisation, for a model with DiT's embedders, blocks and head.

    Xavier-uniform for every linear (zero bias) and for the patch embedding, Normal(0, 0.02) for
    the label table and the timestep MLP, and zeros for each block's ``adaLN_modulation`` output
    and the final layer (adaLN-Zero: blocks start as identities, the prediction as zeros).

    Args:
        model: A module with ``x_embedder`` (timm ``PatchEmbed``), ``t_embedder``,
            ``y_embedder``, ``blocks`` (each with ``adaLN_modulation``) and ``final_layer``.

    Example:
        >>> from tread_fx.models.dit import DiT_S_2
        >>> model = DiT_S_2(input_size=8, in_channels=1, depth=1, hidden_size=32, num_heads=4)
        >>> initialize_dit_weights(model)  # what DiT's constructor does
        >>> bool(model.final_layer.linear.weight.any())
        False
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    init_patch_embed(model.x_embedder.proj)
    model.y_embedder.initialize_weights()
    model.t_embedder.initialize_weights()
    for block in model.blocks:
        nn.init.zeros_(block.adaLN_modulation[-1].weight)
        nn.init.zeros_(block.adaLN_modulation[-1].bias)
    model.final_layer.initialize_weights()


def guided_forward(
    model: nn.Module,
    x: torch.Tensor,
    t: torch.Tensor,
    y: torch.Tensor,
    cfg_scale: float,
    guidance_channels: int | None = None,
) -> torch.Tensor:
    """Classifier-free guided prediction of ``model(x, t, y)``: the backbones' ``forward_with_cfg``.

    The contract of the reference DiT sampler, shared by every backbone here: the caller doubles
    the batch, conditional half first and unconditional half second. Only ``x[:B]`` is used (it is
    duplicated, so both halves see the same latents); ``y[:B]`` are the class labels and ``y[B:]``
    should be the null class ``model.num_classes``. The guided
    ``eps = uncond + cfg_scale * (cond - uncond)`` is returned in both halves; the channels after
    the guided ones (the learned variance) are not guided and keep each half's own prediction.

    Args:
        model: A backbone called as ``model(x, t, y)`` (through ``__call__``, so hooks and
            wrappers such as routing apply), with an ``in_channels`` attribute.
        x: Latents ``[2B, C, H, W]``.
        t: Timesteps ``[2B]``.
        y: Labels ``[2B]``, conditional then null.
        cfg_scale: Guidance scale; 1 gives the conditional prediction.
        guidance_channels: Leading output channels to guide. Default: all noise channels
            (``model.in_channels``). Pass 3 to reproduce the reference DiT code, which guides 3.

    Returns:
        ``[2B, out_channels, H, W]``.

    Example:
        >>> from tread_fx.models.dit import DiT_S_2
        >>> model = DiT_S_2(input_size=8, in_channels=1, depth=1, hidden_size=32, num_heads=4)
        >>> x, t = torch.randn(1, 1, 8, 8), torch.tensor([10])
        >>> x2, t2, y2 = torch.cat([x, x]), torch.cat([t, t]), torch.tensor([3, 1000])
        >>> guided_forward(model, x2, t2, y2, cfg_scale=4.0).shape
        torch.Size([2, 2, 8, 8])
    """
    half = x[: x.shape[0] // 2]
    out = model(torch.cat([half, half], dim=0), t, y)
    n = model.in_channels if guidance_channels is None else guidance_channels
    eps, rest = out[:, :n], out[:, n:]
    cond_eps, uncond_eps = eps.chunk(2, dim=0)
    guided = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
    return torch.cat([torch.cat([guided, guided], dim=0), rest], dim=1)
