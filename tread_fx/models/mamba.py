"""A class-conditional diffusion Mamba (DiS/Vim style) for image latents.

Read top to bottom: the selective scan, one scan direction, the bidirectional mixer, the block
(two streams ``hidden``/``residual`` between blocks, adaLN conditioning, optional U-ViT long
skips), the model and its factories. The embedders, the final layer, the sin-cos positions and
``unpatchify`` are DiT's, from :mod:`tread_fx.models.layers`; ``forward_with_cfg`` follows DiT's
contract (the caller doubles the batch).

Every block has the same call signature ``block(hidden, residual, c, skip=None)`` and works for
any token count, so TREAD routing can hand a block an ascending subset of the tokens. The scan is
wrapped with ``torch.fx.wrap``, so tracing records it as one node and never unrolls its loop, and
a ``torch.library`` custom op with a hand-written backward, so ``torch.compile`` calls it as one
opaque kernel.

Example:
    >>> import torch
    >>> from tread_fx.models.mamba import Mamba_S_2
    >>> model = Mamba_S_2(input_size=8, in_channels=1, num_classes=10, depth=4, hidden_size=32)
    >>> model(torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([3, 7])).shape
    torch.Size([2, 2, 8, 8])
"""

from __future__ import annotations

import math

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
    init_patch_embed,
    modulate,
    unpatchify,
)

try:  # the optional CUDA kernel; used only for CUDA tensors
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as _cuda_selective_scan
except (ImportError, OSError):
    _cuda_selective_scan = None

__all__ = ["selective_scan", "selective_scan_torch", "ScanDirection", "BiMambaMixer"]
__all__ += ["MambaBlock", "DiffusionMamba", "Mamba_S_2", "Mamba_B_2", "Mamba_models"]


@torch.library.custom_op("tread_fx::selective_scan_forward", mutates_args=())
def _scan_forward(
    delta: Tensor, du: Tensor, A: Tensor, B: Tensor, C: Tensor
) -> tuple[Tensor, Tensor]:
    """``h_t = exp(delta_t A) h_{t-1} + du_t B_t``, ``y_t = h_t . C_t``; returns ``(y, H)``.

    Time-major inputs: ``delta``, ``du`` [L, B, D]; ``A`` [D, N]; ``B``, ``C`` [L, B, N].
    Each step works on one [B, D, N] state that stays in cache; the states ``H`` [L, B, D, N]
    are returned for the hand-written backward, which is several times faster on CPU than
    autograd through the loop. A custom op, so ``torch.compile`` calls it as one opaque kernel
    instead of unrolling the loop.
    """
    H = delta.new_empty(*delta.shape, A.shape[1])
    y = delta.new_empty(*delta.shape, 1)
    prev = None
    for d_t, du_t, B_t, C_t, h_t, y_t in zip(*(x.unbind(0) for x in (delta, du, B, C, H, y))):
        b_t = du_t.unsqueeze(-1) * B_t.unsqueeze(1)
        if prev is None:
            h_t.copy_(b_t)
        else:
            torch.addcmul(b_t, torch.exp(d_t.unsqueeze(-1) * A), prev, out=h_t)
        torch.bmm(h_t, C_t.unsqueeze(-1), out=y_t)
        prev = h_t
    return y.squeeze(-1), H


@_scan_forward.register_fake
def _(delta: Tensor, du: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor]:
    return delta.new_empty(delta.shape), delta.new_empty(*delta.shape, A.shape[1])


@torch.library.custom_op("tread_fx::selective_scan_backward", mutates_args=())
def _scan_backward(
    gy: Tensor, delta: Tensor, du: Tensor, A: Tensor, B: Tensor, C: Tensor, H: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(d_delta, d_du, dA, dB, dC)`` of :func:`_scan_forward` from ``d loss / d y``."""
    d_delta, d_du = torch.zeros_like(delta), torch.empty_like(du).unsqueeze(-1)
    dB, dC = torch.empty_like(B).unsqueeze(-1), torch.empty_like(C).unsqueeze(-1)
    dA = torch.zeros_like(A)
    gy = gy.unsqueeze(-1)
    g = a_next = None  # g: gradient w.r.t. h_t, carried backwards through the decays
    for t in reversed(range(delta.shape[0])):  # x[t]: a free view (no autograd in here)
        outer = gy[t] * C[t].unsqueeze(1)
        g = outer if g is None else torch.addcmul(outer, g, a_next)
        torch.bmm(H[t].transpose(1, 2), gy[t], out=dC[t])
        torch.bmm(g, B[t].unsqueeze(-1), out=d_du[t])
        torch.bmm(g.transpose(1, 2), du[t].unsqueeze(-1), out=dB[t])
        if t > 0:  # h_{-1} = 0: delta_0 and A get nothing from the first step
            a_next = torch.exp(delta[t].unsqueeze(-1) * A)
            s = g * H[t - 1] * a_next  # gradient w.r.t. delta_t * A
            torch.sum(s * A, dim=-1, out=d_delta[t])
            dA += torch.einsum("bdn,bd->dn", s, delta[t])
    return d_delta, d_du.squeeze(-1), dA, dB.squeeze(-1), dC.squeeze(-1)


@_scan_backward.register_fake
def _(gy: Tensor, delta: Tensor, du: Tensor, A: Tensor, B: Tensor, C: Tensor, H: Tensor):
    return tuple(torch.empty_like(x) for x in (delta, du, A, B, C))


def _save_for_scan_backward(ctx, inputs: tuple[Tensor, ...], output: tuple[Tensor, Tensor]):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(*inputs, output[1])


def _scan_gradients(ctx, gy: Tensor, _g_states: Tensor | None) -> tuple[Tensor, ...]:
    return _scan_backward(gy.contiguous(), *ctx.saved_tensors)


_scan_forward.register_autograd(_scan_gradients, setup_context=_save_for_scan_backward)


def selective_scan_torch(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
) -> Tensor:
    """Pure-PyTorch selective scan (any device, any length ``L``), computed in float32 or better.

    Same layout and meaning as ``mamba_ssm``'s ``selective_scan_fn`` (without ``z``): with
    ``delta = softplus(delta + delta_bias)`` when asked,
    ``h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t`` and ``y_t = C_t . h_t + D * u_t``.

    Args:
        u: Input [batch, D, L].
        delta: Step sizes [batch, D, L].
        A: Negative decay rates [D, N].
        B: Input matrix [batch, N, L].
        C: Output matrix [batch, N, L].
        D: Skip weight [D], optional.
        delta_bias: Added to ``delta`` [D], optional.
        delta_softplus: Apply softplus to ``delta`` (after the bias).

    Returns:
        ``y`` [batch, D, L] in ``u``'s dtype.

    Example:
        >>> u = torch.randn(2, 4, 5)
        >>> y = selective_scan_torch(u, torch.rand(2, 4, 5), -torch.rand(4, 3),
        ...                          torch.randn(2, 3, 5), torch.randn(2, 3, 5))
        >>> y.shape
        torch.Size([2, 4, 5])
    """
    dtype = torch.promote_types(u.dtype, torch.float32)
    with torch.autocast(u.device.type, enabled=False):
        # time-major [L, B, D] and contiguous from here on: the scan reads one step at a time,
        # and every elementwise op and its gradient then see one layout
        u_, delta_t = u.to(dtype), delta.to(dtype).permute(2, 0, 1).contiguous()
        if delta_bias is not None:
            delta_t = delta_t + delta_bias.to(dtype)
        if delta_softplus:
            delta_t = F.softplus(delta_t)
        y = _scan_forward(
            delta_t,
            delta_t * u_.permute(2, 0, 1),  # contiguous like delta_t, no extra copy
            A.to(dtype),
            B.to(dtype).permute(2, 0, 1).contiguous(),
            C.to(dtype).permute(2, 0, 1).contiguous(),
        )[0].permute(1, 2, 0)
        if D is not None:
            y = y + u_ * D.to(dtype).unsqueeze(-1)
    return y.to(u.dtype)


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
) -> Tensor:
    """Selective scan: ``mamba_ssm``'s CUDA kernel for CUDA tensors when installed, else PyTorch.

    Wrapped with ``torch.fx.wrap``: tracing records one node for it. Arguments and result are as in
    :func:`selective_scan_torch`.

    Example:
        >>> u = torch.randn(1, 4, 7)
        >>> selective_scan(u, torch.rand(1, 4, 7), -torch.rand(4, 3), torch.randn(1, 3, 7),
        ...                torch.randn(1, 3, 7), D=torch.ones(4)).shape
        torch.Size([1, 4, 7])
    """
    if _cuda_selective_scan is not None and u.is_cuda:
        return _cuda_selective_scan(
            u, delta, A, B, C, D, delta_bias=delta_bias, delta_softplus=delta_softplus
        )
    return selective_scan_torch(u, delta, A, B, C, D, delta_bias, delta_softplus)


# traced as one call_function node by torch.fx tracers (not unrolled), like timm's
# register_notrace_function
torch.fx.wrap("selective_scan")


class ScanDirection(nn.Module):
    """One scan direction: causal depthwise conv + SiLU, input-dependent Δ/B/C, selective scan.

    Causal: output position ``t`` depends only on input positions ``<= t``.

    Args:
        d_inner: Channels.
        d_state: State size ``N`` per channel.
        d_conv: Kernel size of the causal depthwise convolution.
        dt_rank: Rank of the Δ projection.

    Example:
        >>> ScanDirection(8, d_state=4, dt_rank=2)(torch.randn(2, 8, 5)).shape
        torch.Size([2, 8, 5])
    """

    def __init__(self, d_inner: int, d_state: int = 16, d_conv: int = 4, dt_rank: int = 1) -> None:
        super().__init__()
        self.d_state, self.d_conv, self.dt_rank = d_state, d_conv, dt_rank
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner)
        # Δ starts log-uniform in [1e-3, 0.1]: the bias is softplus^-1 of it.
        nn.init.uniform_(self.dt_proj.weight, -(dt_rank**-0.5), dt_rank**-0.5)
        dt = torch.exp(torch.rand(d_inner) * math.log(100.0) + math.log(1e-3))
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        # S4D-real: A[d, n] = -(n + 1), stored as a log so A stays negative.
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))

    def forward(self, x: Tensor) -> Tensor:
        """Scan ``x`` [batch, d_inner, L] from position 0 to L-1; returns the same shape."""
        x = F.silu(self.conv1d(F.pad(x, (self.d_conv - 1, 0))))
        dt, B, C = self.x_proj(x.transpose(1, 2)).split(
            [self.dt_rank, self.d_state, self.d_state], dim=-1
        )
        delta = F.linear(dt, self.dt_proj.weight).transpose(1, 2)
        A = -torch.exp(self.A_log.float())
        bias = self.dt_proj.bias
        return selective_scan(x, delta, A, B.mT, C.mT, self.D, bias, delta_softplus=True)


class BiMambaMixer(nn.Module):
    """Bidirectional Mamba mixer (Vim style): a forward and a backward scan, averaged, gated.

    ``in_proj`` to ``x, z`` (shared), one :class:`ScanDirection` per direction with its own
    conv, projections, ``A`` and ``D``; the mean of both directions is gated by ``SiLU(z)``.

    Args:
        dim: Token width.
        d_state: State size per channel.
        d_conv: Causal conv kernel size.
        expand: ``d_inner = expand * dim``.

    Example:
        >>> BiMambaMixer(16)(torch.randn(2, 7, 16)).shape
        torch.Size([2, 7, 16])
    """

    def __init__(self, dim: int, d_state: int = 16, d_conv: int = 4, expand: int = 2) -> None:
        super().__init__()
        self.d_inner = expand * dim
        dt_rank = math.ceil(dim / 16)
        self.in_proj = nn.Linear(dim, 2 * self.d_inner, bias=False)
        self.forward_scan = ScanDirection(self.d_inner, d_state, d_conv, dt_rank)
        self.backward_scan = ScanDirection(self.d_inner, d_state, d_conv, dt_rank)
        self.out_proj = nn.Linear(self.d_inner, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Mix tokens ``x`` [batch, L, dim] along the sequence; returns the same shape."""
        x, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)
        y = 0.5 * (self.forward_scan(x) + self.backward_scan(x.flip(-1)).flip(-1))
        return self.out_proj((y * F.silu(z)).transpose(1, 2))


class MambaBlock(nn.Module):
    """Prenorm Mamba block with two streams, adaLN conditioning and an optional long skip.

    ``residual = residual + hidden`` (after fusing ``skip`` into ``hidden`` with a linear on
    their concatenation, when the block has one), then ``hidden = gate * mixer(modulate(
    norm(residual), shift, scale))``, where shift/scale/gate come from a zero-initialised linear
    on ``SiLU(c)``. Works for any token count.

    Args:
        hidden_size: Token width.
        d_state: State size of the scans.
        d_conv: Causal conv kernel size.
        expand: Mixer expansion factor.
        use_skip: Whether this block fuses a U-ViT long skip.

    Example:
        >>> block = MambaBlock(16)
        >>> h = torch.randn(2, 7, 16)
        >>> hidden, residual = block(h, torch.zeros_like(h), torch.randn(2, 16))
        >>> hidden.shape, residual.shape
        (torch.Size([2, 7, 16]), torch.Size([2, 7, 16]))
    """

    def __init__(
        self,
        hidden_size: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        use_skip: bool = False,
    ) -> None:
        super().__init__()
        self.skip_linear = nn.Linear(2 * hidden_size, hidden_size) if use_skip else None
        if self.skip_linear is not None:
            nn.init.xavier_uniform_(self.skip_linear.weight)
            nn.init.zeros_(self.skip_linear.bias)
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mixer = BiMambaMixer(hidden_size, d_state, d_conv, expand)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 3 * hidden_size))
        nn.init.zeros_(self.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.adaLN_modulation[-1].bias)

    def forward(
        self, hidden: Tensor, residual: Tensor, c: Tensor, skip: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Run the block on ``hidden``/``residual`` [batch, L, dim] with conditioning ``c``."""
        has_skip = self.skip_linear is not None
        if has_skip == (skip is None) and (has_skip or isinstance(skip, Tensor)):
            raise ValueError(
                f"this MambaBlock was built with use_skip={has_skip} but got skip="
                f"{'a tensor' if skip is not None else 'None'}; pass skip= exactly to the blocks "
                "that fuse a long skip (see DiffusionMamba.skip_sources)"
            )
        if self.skip_linear is not None:
            hidden = self.skip_linear(torch.cat([hidden, skip], dim=-1))
        residual = residual + hidden
        shift, scale, gate = self.adaLN_modulation(c).chunk(3, dim=1)
        hidden = gate.unsqueeze(1) * self.mixer(modulate(self.norm(residual), shift, scale))
        return hidden, residual


class DiffusionMamba(nn.Module):
    """Class-conditional diffusion Mamba over patch tokens (DiS/Vim style).

    Patch embedding (timm ``PatchEmbed``) + fixed 2-D sin-cos positions, ``depth``
    :class:`MambaBlock` s in ``blocks`` fed two streams (``residual`` starts as zeros), adaLN
    conditioning on ``c = t_emb + y_emb``, and a final adaLN linear layer and unpatchify.

    Long skips (``skip=True``, U-ViT pairing): block ``i`` with ``i >= depth - depth // 2``
    receives ``skip=`` the hidden output of block ``depth - 1 - i`` (with an odd depth the middle
    block ``depth // 2`` has none). ``skip_sources[i]`` holds that source index, or ``None``.

    Args:
        input_size: Input height and width.
        patch_size: Patch size.
        in_channels: Input channels.
        hidden_size: Token width (a multiple of 4).
        depth: Number of blocks.
        d_state: State size of the scans.
        d_conv: Causal conv kernel size.
        expand: Mixer expansion factor (``d_inner = expand * hidden_size``).
        class_dropout_prob: Label dropout in training (for classifier-free guidance).
        num_classes: Number of classes; label ``num_classes`` is the null class.
        learn_sigma: Predict a variance too: ``out_channels = 2 * in_channels``.
        skip: Add U-ViT long skips.

    Example:
        >>> model = DiffusionMamba(input_size=8, in_channels=1, hidden_size=32, depth=5,
        ...                        num_classes=10, skip=True)
        >>> model.skip_sources
        (None, None, None, 1, 0)
        >>> model(torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([0, 9])).shape
        torch.Size([2, 2, 8, 8])
    """

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 384,
        depth: int = 24,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        skip: bool = False,
    ) -> None:
        super().__init__()
        if hidden_size % 4 or depth < 1:
            raise ValueError(
                "DiffusionMamba needs hidden_size a multiple of 4 and depth >= 1 "
                f"(got hidden_size={hidden_size}, depth={depth})"
            )
        self.in_channels, self.num_classes = in_channels, num_classes
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.patch_size = patch_size
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.grid_size: tuple[int, int] = tuple(self.x_embedder.grid_size)
        init_patch_embed(self.x_embedder.proj)
        self.register_buffer("pos_embed", get_2d_sincos_pos_embed(hidden_size, self.grid_size))
        # layers are initialised as built; the null class exists even without label dropout
        self.t_embedder = TimestepEmbedder(hidden_size, match_weight_dtype=True)
        self.t_embedder.initialize_weights()
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob, True)
        self.y_embedder.initialize_weights()
        self.skip_sources: tuple[int | None, ...] = tuple(
            depth - 1 - i if skip and i >= depth - depth // 2 else None for i in range(depth)
        )
        self.blocks = nn.ModuleList(
            MambaBlock(hidden_size, d_state, d_conv, expand, use_skip=src is not None)
            for src in self.skip_sources
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.final_layer.initialize_weights()

    def unpatchify(self, x: Tensor) -> Tensor:
        """Patch values [batch, N, p * p * C] to images [batch, C, H, W]."""
        return unpatchify(x, self.grid_size, self.patch_size, self.out_channels)

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        """Predict from images ``x`` [B, C, H, W], timesteps ``t`` [B] and labels ``y`` [B].

        Returns:
            [B, out_channels, H, W].
        """
        hidden = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        residual = torch.zeros_like(hidden)
        outputs: list[Tensor] = []
        for block, src in zip(self.blocks, self.skip_sources):
            skip = None if src is None else outputs[src]
            hidden, residual = block(hidden, residual, c, skip=skip)
            outputs.append(hidden)
        return self.unpatchify(self.final_layer(residual + hidden, c))

    def forward_with_cfg(
        self,
        x: Tensor,
        t: Tensor,
        y: Tensor,
        cfg_scale: float,
        guidance_channels: int | None = None,
    ) -> Tensor:
        """Classifier-free guidance in one pass over a batch the caller doubled, as for DiT.

        ``2B`` rows, conditional first, then the null class ``num_classes``; only ``x[:B]`` is
        read. Both halves of the ``[2B, out_channels, H, W]`` result hold the guided noise
        ``uncond + cfg_scale * (cond - uncond)``, the learned sigma stays per half (see
        :func:`~tread_fx.models.layers.guided_forward`).
        """
        return guided_forward(self, x, t, y, cfg_scale, guidance_channels)


def Mamba_S_2(**kwargs) -> DiffusionMamba:
    """Mamba-S/2: width 384, depth 24, patch 2 (~37M parameters at 32x32x4, 1000 classes).

    Args:
        **kwargs: :class:`DiffusionMamba` arguments; they override the defaults above.

    Returns:
        A new :class:`DiffusionMamba`.

    Example:
        >>> len(Mamba_S_2(input_size=8, in_channels=1, depth=2, hidden_size=32).blocks)
        2
    """
    return DiffusionMamba(**{"hidden_size": 384, "depth": 24, "patch_size": 2, **kwargs})


def Mamba_B_2(**kwargs) -> DiffusionMamba:
    """Mamba-B/2: width 768, depth 24, patch 2 (~141M parameters at 32x32x4, 1000 classes).

    Args:
        **kwargs: :class:`DiffusionMamba` arguments; they override the defaults above.

    Returns:
        A new :class:`DiffusionMamba`.

    Example:
        >>> Mamba_B_2(input_size=8, in_channels=1, depth=2, hidden_size=32).patch_size
        2
    """
    return DiffusionMamba(**{"hidden_size": 768, "depth": 24, "patch_size": 2, **kwargs})


Mamba_models = {"Mamba-S/2": Mamba_S_2, "Mamba-B/2": Mamba_B_2}
