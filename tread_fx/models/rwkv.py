"""Diffusion-RWKV: a class-conditional diffusion backbone built from bidirectional RWKV blocks.

After Fei et al., "Diffusion-RWKV: Scaling RWKV-like Architectures for Diffusion Models" (2024)
and the Bi-WKV of Vision-RWKV (Duan et al., 2024). The latent is patchified, every block mixes
tokens with a 2-D "q-shift" (four channel groups read their left/right/up/down neighbour) and a
bidirectional RWKV-4 WKV (one decay and one bonus per channel), conditioned with adaLN-Zero on
``timestep + class``; optional U-ViT long skips join mirrored blocks.

The grid WIDTH is fixed at construction; the grid HEIGHT is read from the token count at run
time (``N // W``). A block therefore accepts any ``r`` whole rows of the patch grid (``N = r*W``),
which is what TREAD's "rows" selection hands it. The WKV decay is divided by the current length,
as in Diffusion-RWKV, so a routed subset sees a larger per-step decay. The embedders, the final
layer, the sin-cos table (here the start of a learned position embedding) and ``unpatchify`` are
DiT's, from :mod:`tread_fx.models.layers`; ``forward_with_cfg`` follows DiT's contract (the
caller doubles the batch).

Example:
    >>> import torch
    >>> from tread_fx.models.rwkv import RWKV_S_2
    >>> model = RWKV_S_2(input_size=8, in_channels=1, num_classes=10, depth=4, hidden_size=32)
    >>> x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([10, 500]), torch.tensor([3, 7])
    >>> model(x, t, y).shape  # learn_sigma: noise and variance channels
    torch.Size([2, 2, 8, 8])
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from timm.layers import PatchEmbed
from torch import Tensor, nn

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

__all__ = ["DiffusionRWKV", "RWKVBlock", "SpatialMix", "ChannelMix", "bi_wkv", "q_shift"]
__all__ += ["RWKV_S_2", "RWKV_B_2", "RWKV_models"]

_LOG2E = 1.4426950408889634  # exponentials are taken as exp2 of log2-scaled values (see _scan)


def q_shift(x: Tensor, grid_width: int, shift_pixel: int = 1) -> Tensor:
    """2-D token shift: four channel groups take the value of a neighbouring token.

    ``x`` is read as an ``(N // grid_width) x grid_width`` row-major grid. With ``g = C // 4``,
    channels ``[0, g)`` come from the left neighbour, ``[g, 2g)`` from the right, ``[2g, 3g)``
    from the one above and ``[3g, 4g)`` from the one below (``shift_pixel`` tokens away; zeros
    beyond the border); the remaining ``C - 4g`` channels are passed through.

    Args:
        x: Tokens ``[B, N, C]`` in row-major grid order.
        grid_width: Tokens per grid row ``W``; the height is ``N // W``.
        shift_pixel: Neighbour distance in tokens.

    Returns:
        The shifted tokens ``[B, N, C]``.

    Raises:
        ValueError: If ``N`` is not a multiple of ``grid_width``.

    Example:
        >>> x = torch.arange(6.0).view(1, 6, 1).expand(1, 6, 4)  # a 2 x 3 grid of token ids
        >>> q_shift(x, grid_width=3)[0, 4].tolist()  # left, right, up, down of token 4
        [3.0, 5.0, 1.0, 0.0]
    """
    b, n, c = x.shape
    if grid_width < 1 or n % grid_width:
        raise ValueError(
            f"q_shift: got {n} tokens for a grid {grid_width} tokens wide; the token count must "
            "be a whole number of grid rows (route with 'rows' selection for RWKV blocks)."
        )
    h, w, g = n // grid_width, grid_width, c // 4
    sh, sw = min(shift_pixel, h), min(shift_pixel, w)  # a shift past the border leaves zeros
    grid = x.reshape(b, h, w, c)
    # F.pad lists (channel, width, height) pads as (before, after) pairs
    left = F.pad(grid[:, :, : w - sw, :g], (0, 0, sw, 0))
    right = F.pad(grid[:, :, sw:, g : 2 * g], (0, 0, 0, sw))
    up = F.pad(grid[:, : h - sh, :, 2 * g : 3 * g], (0, 0, 0, 0, sh, 0))
    down = F.pad(grid[:, sh:, :, 3 * g : 4 * g], (0, 0, 0, 0, 0, sh))
    return torch.cat([left, right, up, down, grid[..., 4 * g :]], dim=-1).reshape(b, n, c)


def _pair(x: Tensor, dim: int) -> Tensor:
    """Time axis ``dim`` of length T -> axes (direction 2, T); direction 1 is time-reversed."""
    ar = torch.arange(x.shape[dim], device=x.device)
    return x.index_select(dim, torch.cat([ar, ar.flip(0)])).unflatten(dim, (2, len(ar)))


def _unpair(z: Tensor, dim: int) -> Tensor:
    """Inverse of :func:`_pair` on axes (``dim``, ``dim + 1``): both directions in true time."""
    ar = torch.arange(z.shape[dim + 1], device=z.device)
    idx = torch.cat([ar, 2 * len(ar) - 1 - ar])
    return z.flatten(dim, dim + 1).index_select(dim, idx).unflatten(dim, (2, len(ar)))


def _scan(
    logw: Tensor,
    val: Tensor,
    d: Tensor,
    reverse: bool = False,
    moment: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Decayed sums over STRICTLY earlier positions (in scan order) of a paired sequence.

    For position j: ``sum_{i before j} 2**(logw_i - (dist(i, j) - 1) * d) * val_i``, kept as a
    scale ``p_j`` (log2) and a mantissa ``a_j`` with ``sum = 2**p_j * a_j``. ``p`` is a running
    max of the log-weights, so every exponential taken is ``2**(<= 0)``: nothing overflows, and
    what underflows (or is flushed as a denormal) is negligible next to the term that is 1.
    With ``moment`` the sums weighted by ``dist - 1`` (for the decay gradient) come along.

    Shapes: logw ``[B, 2, T, C]``, val ``[ch, B, 2, T, C]``, d ``[C]`` (all log2 units).
    """
    logws, vals = logw.unbind(2), val.unbind(3)
    p = torch.full_like(logws[0], float("-inf"))
    a = torch.zeros_like(vals[0])
    h = torch.zeros_like(a)
    ps, as_, hs = [], [], []
    for j in reversed(range(len(logws))) if reverse else range(len(logws)):
        ps.append(p)
        as_.append(a)
        hs.append(h)
        pd = p - d
        q = torch.maximum(pd, logws[j])
        e_old, e_new = torch.exp2(pd - q), torch.exp2(logws[j] - q)
        if moment:  # H_{j+1} = decay * (H_j + A_j): every earlier term one step further away
            h = (h + a) * e_old
        a = torch.addcmul(a * e_old, vals[j], e_new)
        p = q
    if reverse:
        ps, as_, hs = ps[::-1], as_[::-1], hs[::-1]
    return torch.stack(ps, 2), torch.stack(as_, 3), (torch.stack(hs, 3) if moment else None)


@torch.library.custom_op("tread_fx::bi_wkv_forward", mutates_args=())
def _wkv_forward(
    d: Tensor, u: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Bi-WKV forward ``(y, m, den, e_s)``: the output and what the backward needs.

    A custom op (with :func:`_wkv_backward` as its gradient), so ``torch.compile`` calls each
    linear-time scan as one opaque kernel instead of unrolling its loop over tokens.
    """
    d, u, k = d * _LOG2E, u * _LOG2E, k * _LOG2E
    val = _pair(torch.stack([v, torch.ones_like(v)]), 2)  # [num/den, B, dir, T, C]
    p, a, _ = _scan(_pair(k, 1), val, d)
    p, a = _unpair(p, 1), _unpair(a, 2)  # dir 0: tokens before t, dir 1: tokens after t
    s = u + k  # the token itself, weighted by the bonus
    m = torch.maximum(torch.maximum(p[:, 0], p[:, 1]), s)
    e_f, e_b, e_s = torch.exp2(p[:, 0] - m), torch.exp2(p[:, 1] - m), torch.exp2(s - m)
    num = e_f * a[0, :, 0] + e_b * a[0, :, 1] + e_s * v
    den = e_f * a[1, :, 0] + e_b * a[1, :, 1] + e_s  # >= 1: the largest term is exactly 1
    return num / den, m, den, e_s


@_wkv_forward.register_fake
def _(d: Tensor, u: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(torch.empty_like(v) for _ in range(4))


@torch.library.custom_op("tread_fx::bi_wkv_backward", mutates_args=())
def _wkv_backward(
    gy: Tensor, d: Tensor, k: Tensor, v: Tensor, y: Tensor, m: Tensor, den: Tensor, e_s: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(gd, gu, gk, gv)`` of :func:`_wkv_forward` from ``d loss / d y``."""
    d, k = d * _LOG2E, k * _LOG2E
    g = gy / den  # d loss / d numerator, in units of 2**-m
    gy_y = g * y  # minus d loss / d denominator, same units
    g_self = e_s * (g * v - gy_y)
    # Token i reaches the outputs t after it (dir 0) or before it (dir 1): a reverse scan
    # of the output-side terms with log-weights -m (so that k_i + scale <= 0 below).
    r, rho, kappa = _scan(
        _pair(-m, 1), _pair(torch.stack([g, gy_y]), 2), d, reverse=True, moment=True
    )
    kk, vv = _pair(k, 1), _pair(v, 1)
    e_k = torch.exp2(kk + r)
    gv_pair = e_k * rho[0]
    gv = e_s * g + _unpair(gv_pair, 1).sum(1)
    gk = g_self + _unpair(gv_pair * vv - e_k * rho[1], 1).sum(1)
    gd = -(e_k * (vv * kappa[0] - kappa[1])).sum((0, 1, 2))
    return gd, g_self.sum((0, 1)), gk, gv


@_wkv_backward.register_fake
def _(gy: Tensor, d: Tensor, k: Tensor, v: Tensor, *saved: Tensor):
    return torch.empty_like(d), torch.empty_like(d), torch.empty_like(k), torch.empty_like(v)


def _save_for_wkv_backward(ctx, inputs: tuple[Tensor, ...], output: tuple[Tensor, ...]) -> None:
    d, _u, k, v = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(d, k, v, *output)


def _wkv_gradients(ctx, gy: Tensor, *_unused: Tensor | None) -> tuple[Tensor, ...]:
    return _wkv_backward(gy.contiguous(), *ctx.saved_tensors)


_wkv_forward.register_autograd(_wkv_gradients, setup_context=_save_for_wkv_backward)


def bi_wkv(w: Tensor, u: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Bidirectional RWKV-4 WKV (Vision-RWKV's Bi-WKV) over a sequence of length T.

    ``out_t = (sum_{i != t} e^{-(|t-i|-1) w / T + k_i} v_i + e^{u + k_t} v_t) / (same, v = 1)``.
    Computed in float32 (float64 if given) with two linear-time scans in log space, so large
    ``|w|`` or ``|k|`` neither overflow nor lose accuracy (also with flushed denormals).
    Wrapped with ``torch.fx.wrap`` (one node in a traced graph); the scans are custom ops, so
    ``torch.compile`` calls them as opaque kernels instead of unrolling them.

    Args:
        w: Decay per channel ``[C]``, divided by the current length ``T``.
        u: Bonus of the token itself per channel ``[C]``.
        k: Keys ``[B, T, C]``.
        v: Values ``[B, T, C]``.

    Returns:
        ``[B, T, C]`` in the dtype of ``v``.

    Example:
        >>> k, v = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
        >>> bi_wkv(torch.ones(3), torch.zeros(3), k, v).shape
        torch.Size([2, 5, 3])
    """
    dtype = torch.promote_types(v.dtype, torch.float32)
    t = k.shape[1]
    y = _wkv_forward(w.to(dtype) / t, u.to(dtype), k.to(dtype), v.to(dtype))[0]
    return y.to(v.dtype)


# traced as one call_function node by torch.fx tracers (not unrolled), like timm's
# register_notrace_function
torch.fx.wrap("bi_wkv")


def _mix(x: Tensor, shifted: Tensor, ratio: Tensor) -> Tensor:
    """Learned per-channel blend ``ratio * x + (1 - ratio) * shifted``."""
    return shifted + (x - shifted) * ratio


class SpatialMix(nn.Module):
    """Token mixing: q-shift, key/value/receptance projections, Bi-WKV, sigmoid gate.

    Args:
        dim, grid_width, layer_id, depth, shift_pixel: As for :class:`RWKVBlock`.

    Example:
        >>> SpatialMix(8, grid_width=4)(torch.randn(2, 12, 8)).shape
        torch.Size([2, 12, 8])
    """

    def __init__(
        self, dim: int, grid_width: int, layer_id: int = 0, depth: int = 1, shift_pixel: int = 1
    ) -> None:
        super().__init__()
        self.grid_width, self.shift_pixel = grid_width, shift_pixel
        # Decays range over channels from slightly negative (global) to 7 (local: the far end
        # of the sequence weighs e^-7); deeper blocks push more channels towards local.
        ramp = torch.linspace(0.0, 1.0, dim) ** (0.7 + 1.3 * layer_id / max(depth - 1, 1))
        self.decay = nn.Parameter(-1.0 + 8.0 * ramp)
        self.bonus = nn.Parameter(torch.zeros(dim))  # the token counts like a direct neighbour
        self.mix_k, self.mix_v, self.mix_r = (nn.Parameter(torch.full((dim,), 0.5)) for _ in "kvr")
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim, bias=False)
        self.receptance = nn.Linear(dim, dim, bias=False)
        self.output = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Mixes tokens ``[B, N, D]`` (``N`` a multiple of the grid width)."""
        xx = q_shift(x, self.grid_width, self.shift_pixel)
        k = self.key(_mix(x, xx, self.mix_k))
        v = self.value(_mix(x, xx, self.mix_v))
        r = self.receptance(_mix(x, xx, self.mix_r))
        return self.output(torch.sigmoid(r) * bi_wkv(self.decay, self.bonus, k, v))


class ChannelMix(nn.Module):
    """Channel mixing: q-shift, squared-ReLU key, value, sigmoid receptance gate.

    Args:
        dim, grid_width, shift_pixel: As for :class:`RWKVBlock`.
        hidden_ratio: Hidden width of the key as a multiple of ``D``.

    Example:
        >>> ChannelMix(8, grid_width=4)(torch.randn(2, 12, 8)).shape
        torch.Size([2, 12, 8])
    """

    def __init__(
        self, dim: int, grid_width: int, hidden_ratio: float = 4.0, shift_pixel: int = 1
    ) -> None:
        super().__init__()
        self.grid_width, self.shift_pixel = grid_width, shift_pixel
        hidden = int(dim * hidden_ratio)
        self.mix_k, self.mix_r = (nn.Parameter(torch.full((dim,), 0.5)) for _ in "kr")
        self.key = nn.Linear(dim, hidden, bias=False)
        self.value = nn.Linear(hidden, dim, bias=False)
        self.receptance = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Mixes channels of tokens ``[B, N, D]`` (``N`` a multiple of the grid width)."""
        xx = q_shift(x, self.grid_width, self.shift_pixel)
        k = torch.square(torch.relu(self.key(_mix(x, xx, self.mix_k))))
        return torch.sigmoid(self.receptance(_mix(x, xx, self.mix_r))) * self.value(k)


class RWKVBlock(nn.Module):
    """Diffusion-RWKV block: (optional skip fusion,) adaLN-Zero spatial mix and channel mix.

    Args:
        dim: Token width ``D``.
        grid_width: Patch-grid width ``W``; any ``N = r * W`` tokens are accepted.
        layer_id: Index of this block in the stack.
        depth: Number of blocks in the stack.
        mlp_ratio: Channel-mix hidden width as a multiple of ``D``.
        shift_pixel: q-shift distance.
        skip: Build ``skip_linear`` (``2D -> D``) for a U-ViT long skip; ``forward`` then
            requires ``skip=`` and fuses ``Linear(concat([x, skip]))`` before the mixes.

    Example:
        >>> block = RWKVBlock(16, grid_width=4)
        >>> block(torch.randn(2, 8, 16), torch.randn(2, 16)).shape  # 2 rows of 4 tokens
        torch.Size([2, 8, 16])
    """

    def __init__(
        self,
        dim: int,
        grid_width: int,
        layer_id: int = 0,
        depth: int = 1,
        mlp_ratio: float = 4.0,
        shift_pixel: int = 1,
        skip: bool = False,
    ) -> None:
        super().__init__()
        self.skip_linear = nn.Linear(2 * dim, dim) if skip else None
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.spatial_mix = SpatialMix(dim, grid_width, layer_id, depth, shift_pixel)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.channel_mix = ChannelMix(dim, grid_width, mlp_ratio, shift_pixel)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        nn.init.zeros_(self.adaLN_modulation[-1].weight)  # adaLN-Zero: starts as the identity
        nn.init.zeros_(self.adaLN_modulation[-1].bias)

    def forward(self, x: Tensor, c: Tensor, skip: Tensor | None = None) -> Tensor:
        """Updates tokens ``x`` ``[B, N, D]`` under conditioning ``c`` ``[B, D]``.

        Raises:
            ValueError: On a ``skip`` mismatch, or if ``N`` is not a multiple of the grid width.
        """
        if (skip is None) != (self.skip_linear is None):
            raise ValueError(
                f"RWKVBlock: built with skip={self.skip_linear is not None} but called with"
                f"{'out' if skip is None else ''} skip=; pass it exactly to skip=True blocks."
            )
        if self.skip_linear is not None:
            x = self.skip_linear(torch.cat([x, skip], dim=-1))
        mod = self.adaLN_modulation(c).chunk(6, dim=1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod
        x = x + gate1.unsqueeze(1) * self.spatial_mix(modulate(self.norm1(x), shift1, scale1))
        return x + gate2.unsqueeze(1) * self.channel_mix(modulate(self.norm2(x), shift2, scale2))


class DiffusionRWKV(nn.Module):
    """Class-conditional Diffusion-RWKV over a patchified latent.

    U-ViT long skips (``skip=True``): with ``n = depth // 2``, block ``depth - 1 - j`` receives
    the output of block ``j`` for ``j < n`` (the first half mirrored onto the second half; with
    an odd depth the middle block has no skip). ``skip_pairs`` maps receiver -> source.

    Args:
        input_size: Latent height and width (int for square, or ``(H, W)``).
        patch_size: Patch side; must divide both latent sides.
        in_channels: Latent channels.
        hidden_size: Token width ``D``.
        depth: Number of blocks.
        mlp_ratio: Channel-mix hidden width as a multiple of ``D``.
        class_dropout_prob: Label dropout probability in training.
        num_classes: Number of classes (index ``num_classes`` is the null class).
        learn_sigma: Also predict the variance, doubling the output channels.
        skip: Add U-ViT long skips.
        shift_pixel: q-shift distance.

    Raises:
        ValueError: If the sizes are inconsistent.

    Example:
        >>> model = DiffusionRWKV(input_size=8, in_channels=1, hidden_size=32, depth=4, skip=True)
        >>> model.skip_pairs
        {3: 0, 2: 1}
    """

    def __init__(
        self,
        input_size: int | tuple[int, int] = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 384,
        depth: int = 12,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        skip: bool = False,
        shift_pixel: int = 1,
    ) -> None:
        super().__init__()
        size = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
        bad_size = patch_size < 1 or any(s < 1 or s % patch_size for s in size)
        if bad_size or depth < 1 or hidden_size < 4 or shift_pixel < 0:
            raise ValueError(
                f"DiffusionRWKV: got input_size={input_size}, patch_size={patch_size}, "
                f"depth={depth}, hidden_size={hidden_size}, shift_pixel={shift_pixel}; need a "
                "patch size dividing both latent sides, depth >= 1, hidden_size >= 4 and "
                "shift_pixel >= 0."
            )
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size, self.num_classes, self.learn_sigma = patch_size, num_classes, learn_sigma
        self.x_embedder = PatchEmbed(size, patch_size, in_channels, hidden_size, bias=True)
        self.grid_size: tuple[int, int] = tuple(self.x_embedder.grid_size)
        # Learned, starting from DiT's fixed sin-cos table (DiT keeps it fixed, as a buffer).
        self.pos_embed = nn.Parameter(get_2d_sincos_pos_embed(hidden_size, self.grid_size))
        self.t_embedder = TimestepEmbedder(hidden_size, match_weight_dtype=True)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob, True)
        n = depth // 2 if skip else 0
        self.skip_pairs: dict[int, int] = {depth - 1 - j: j for j in range(n)}
        width = self.grid_size[1]
        self.blocks = nn.ModuleList(
            RWKVBlock(hidden_size, width, i, depth, mlp_ratio, shift_pixel, i in self.skip_pairs)
            for i in range(depth)
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Xavier linears, normal embedders, zeroed adaLN modulation and output layer.

        DiT's scheme: see :func:`~tread_fx.models.layers.initialize_dit_weights`.
        """
        initialize_dit_weights(self)

    def unpatchify(self, x: Tensor) -> Tensor:
        """Maps per-patch outputs ``[B, H*W, p*p*C]`` back to images ``[B, C, H*p, W*p]``."""
        return unpatchify(x, self.grid_size, self.patch_size, self.out_channels)

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        """Noise (and variance) ``[B, out_channels, H, W]`` for latents ``x``, timesteps ``t``
        ``[B]`` and class labels ``y`` ``[B]`` (``num_classes`` is the null class)."""
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        sources, saved = set(self.skip_pairs.values()), {}
        for i, block in enumerate(self.blocks):
            if i in self.skip_pairs:
                x = block(x, c, skip=saved.pop(self.skip_pairs[i]))
            else:
                x = block(x, c)
            if i in sources:
                saved[i] = x
        return self.unpatchify(self.final_layer(x, c))

    def forward_with_cfg(
        self,
        x: Tensor,
        t: Tensor,
        y: Tensor,
        cfg_scale: float,
        guidance_channels: int | None = None,
    ) -> Tensor:
        """Classifier-free guidance over a ``2B`` batch doubled by the caller (DiT's contract).

        Rows ``[:B]`` conditional, rows ``[B:]`` with the null class ``num_classes``; only
        ``x[:B]`` is read. Both halves of the ``[2B, out_channels, H, W]`` result carry the guided
        noise ``uncond + cfg_scale * (cond - uncond)``; variance channels stay per half (see
        :func:`~tread_fx.models.layers.guided_forward`).
        """
        return guided_forward(self, x, t, y, cfg_scale, guidance_channels)


def RWKV_S_2(**kwargs) -> DiffusionRWKV:
    """Diffusion-RWKV at DiT-S/2 size (12 x 384); keyword arguments override the configuration."""
    return DiffusionRWKV(**{"depth": 12, "hidden_size": 384, "patch_size": 2, **kwargs})


def RWKV_B_2(**kwargs) -> DiffusionRWKV:
    """Diffusion-RWKV at DiT-B/2 size (12 x 768); keyword arguments override the configuration."""
    return DiffusionRWKV(**{"depth": 12, "hidden_size": 768, "patch_size": 2, **kwargs})


#: Reference names to factories.
RWKV_models = {"RWKV-S/2": RWKV_S_2, "RWKV-B/2": RWKV_B_2}
