"""Losses for TREAD training: full-token (default), masked per route, MaskDiT reconstruction.

The authors' final code uses the ordinary diffusion loss on all output tokens
(:func:`full_token_loss`); their first release used, per route, the loss on the tokens the
route processed, averaged over routes (:func:`masked_denoising_loss`), plus an optional
MaskDiT-style term on the routed-around tokens (:func:`reconstruction_loss`).
:func:`tread_loss` combines them; token-level losses pool a per-pixel loss through the patch
size (:func:`patch_loss`), in timm ``PatchEmbed``'s row-major token order.

Example:
    >>> import torch, tread_fx
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> _ = tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    >>> x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    >>> pred = model.train()(x, t, y)[:, :1]
    >>> per_pixel = (pred - x) ** 2
    >>> loss = tread_fx.losses.tread_loss(per_pixel, tread_fx.route_info(model), patch_size=2,
    ...                                   mode="masked", reconstruction_weight=0.1)
    >>> loss.shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tread_fx.api import RouteInfo
from tread_fx.errors import TreadFxError

__all__ = [
    "LossShapeError",
    "full_token_loss",
    "patch_loss",
    "masked_denoising_loss",
    "reconstruction_loss",
    "tread_loss",
]


class LossShapeError(TreadFxError, ValueError):
    """A loss got tensors whose shapes do not match the route info."""


def full_token_loss(per_element: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of a per-element loss over everything (the authors' final objective).

    Args:
        per_element: Unreduced loss, e.g. ``(pred - target) ** 2``, [B, ...].
        weight: Optional per-sample weight [B] (EDM's lambda(sigma)).
    """
    return _mean(per_element.flatten(1).mean(1), weight)


def _mean(per_sample: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return (per_sample * weight).mean() if weight is not None else per_sample.mean()


def patch_loss(per_pixel: torch.Tensor, patch_size: int | tuple[int, int]) -> torch.Tensor:
    """Pool a per-pixel loss [B, C, H, W] to per-token [B, (H/p) * (W/p)], row-major.

    Example:
        >>> patch_loss(torch.ones(2, 3, 8, 8), 2).shape
        torch.Size([2, 16])
    """
    ph, pw = (patch_size, patch_size) if isinstance(patch_size, int) else patch_size
    if per_pixel.dim() != 4 or per_pixel.shape[-2] % ph or per_pixel.shape[-1] % pw:
        raise LossShapeError(
            f"patch_loss expects a per-pixel loss [B, C, H, W] with H, W divisible by the "
            f"patch size {(ph, pw)}; got shape {tuple(per_pixel.shape)}."
        )
    pooled = F.avg_pool2d(per_pixel.mean(1, keepdim=True), (ph, pw))
    return pooled.flatten(1)


def _per_route(per_token: torch.Tensor, infos, weight: torch.Tensor | None, processed: bool):
    """Per route, the mean loss over its processed (or routed-around) tokens; over routes."""
    if not infos:
        raise LossShapeError(
            "no route info: call the routed model in training mode first and pass "
            "tread_fx.route_info(model); for unrouted steps use full_token_loss."
        )
    losses = []
    for info in infos:
        routed_around = info.routed_mask[:, info.prefix : info.num_tokens - info.suffix]
        if routed_around.shape != per_token.shape:
            raise LossShapeError(
                f"per-token loss has shape {tuple(per_token.shape)}, but route "
                f"({info.route.start}, {info.route.end}) covers {routed_around.shape[1]} image "
                f"tokens (batch {routed_around.shape[0]}); pool with patch_loss(per_pixel, "
                "patch_size)."
            )
        mask = (~routed_around if processed else routed_around).to(per_token.dtype)
        losses.append(_mean((per_token * mask).sum(1) / mask.sum(1).clamp_min(1), weight))
    return torch.stack(losses).mean()


def masked_denoising_loss(
    per_token: torch.Tensor, infos: Sequence[RouteInfo], weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Per route, the mean loss over the tokens it processed; averaged over routes."""
    return _per_route(per_token, infos, weight, processed=True)


def reconstruction_loss(
    per_token: torch.Tensor, infos: Sequence[RouteInfo], weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Per route, the mean loss over the routed-around tokens (MaskDiT's MAE term)."""
    return _per_route(per_token, infos, weight, processed=False)


def tread_loss(
    per_pixel: torch.Tensor,
    infos: Sequence[RouteInfo] | None,
    patch_size: int | tuple[int, int],
    mode: str = "full",
    reconstruction_weight: float = 0.0,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The training loss from a per-pixel loss and the route info of the same step.

    Args:
        per_pixel: Unreduced loss [B, C, H, W].
        infos: ``tread_fx.route_info(model)`` of the step (``None`` for an unrouted step).
        patch_size: The model's patch size.
        mode: ``"full"`` (all tokens) or ``"masked"`` (processed tokens per route).
        reconstruction_weight: Coefficient of the reconstruction term on routed-around
            tokens (MaskDiT used 0.1); only with routing.
        weight: Optional per-sample weight [B].
    """
    if mode not in ("full", "masked"):
        raise LossShapeError(f"mode={mode!r} is not a loss mode; use 'full' or 'masked'.")
    if mode == "full" or not infos:
        loss = full_token_loss(per_pixel, weight)
    else:
        loss = masked_denoising_loss(patch_loss(per_pixel, patch_size), infos, weight)
    if reconstruction_weight and infos:
        rec = reconstruction_loss(patch_loss(per_pixel, patch_size), infos, weight)
        loss = loss + reconstruction_weight * rec
    return loss
