"""Runtime ops that the rewrite pass inserts into routed graphs.

They are plain functions of tensors (no Python-level randomness, no data-dependent Python),
so ``torch.compile(fullgraph=True)`` compiles them without graph breaks.

Example:
    >>> import torch
    >>> from tread_fx.runtime.ops import gather_tokens, scatter_tokens
    >>> x = torch.arange(12.0).view(1, 6, 2)
    >>> idx = torch.tensor([[1, 4]])
    >>> gather_tokens(x, idx)[0, :, 0].tolist()
    [2.0, 8.0]
    >>> scatter_tokens(x, torch.zeros(1, 2, 2), idx)[0, :, 0].tolist()
    [0.0, 0.0, 4.0, 6.0, 0.0, 10.0]
"""

from __future__ import annotations

import torch

from tread_fx.errors import TokenStreamError

__all__ = [
    "gather_tokens",
    "scatter_tokens",
    "scatter_after_prefix",
    "kept_positions",
    "blend_tokens",
    "routed_mask",
    "call_in_fp32",
    "token_index",
]


def token_index(
    idx: torch.Tensor, like: torch.Tensor, token_dim: int, batch_dim: int | None = None
) -> torch.Tensor:
    """Lay ``idx`` [B, k] out along the batch and token dims of ``like`` (the batch dim is
    the other of dims 0 and 1 unless given) and expand the rest: a ``gather`` index."""
    if batch_dim is None:
        if token_dim not in (0, 1):
            raise TokenStreamError(
                f"token_dim={token_dim} was given without batch_dim: pass it (0 and 1 imply it)"
            )
        batch_dim = 1 - token_dim
    view = [1] * like.dim()
    view[batch_dim], view[token_dim] = idx.shape
    shape = list(like.shape)
    shape[token_dim] = idx.shape[1]
    ordered = idx if batch_dim < token_dim else idx.transpose(0, 1)
    return ordered.reshape(view).expand(shape)


def gather_tokens(x: torch.Tensor, idx: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
    """Keep the tokens ``idx`` [B, k] of ``x`` [B, N, ...] (or [N, B, ...] with token_dim 0).

    Keeping every token (rate 0) keeps them all in ascending order, so ``x`` itself is the
    result: the routed blocks see the stream with its own strides and compute bitwise as
    the unrouted model does (a transposed stream copied contiguous sums in another order).
    """
    if idx.shape[1] == x.shape[token_dim]:
        return x
    return torch.gather(x, token_dim, token_index(idx, x, token_dim))


def scatter_tokens(
    base: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, token_dim: int = 1
) -> torch.Tensor:
    """Write ``src`` [B, k, ...] into a copy of ``base`` [B, N, ...] at tokens ``idx``.

    Out of place: the routed-around tokens of the result are ``base``'s and get gradient
    through it (the identity skip); the dtype is the promotion of both.
    """
    dtype = torch.promote_types(base.dtype, src.dtype)
    index = token_index(idx, src, token_dim)
    # Every token written back (rate 0): keep base's strides, so that later reductions sum
    # alike and the result is bitwise the unrouted one. Otherwise take the contiguous layout,
    # as gather gives the routed blocks: a stream that the model keeps transposed (timm's
    # PatchEmbed does) costs every later block ~6% (benchmarks/, docs/performance.md).
    full = src.shape[token_dim] == base.shape[token_dim]
    layout = torch.preserve_format if full else torch.contiguous_format
    out = torch.empty_like(base, dtype=dtype, memory_format=layout)
    out.copy_(base)
    return out.scatter_(token_dim, index, src.to(dtype))


def scatter_after_prefix(
    base: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, prefix: int, token_dim: int = 1
) -> torch.Tensor:
    """Like :func:`scatter_tokens` for a stream that gained ``prefix`` other tokens in front
    inside the route (text concatenated before the image tokens): ``src`` is
    ``[other | kept]``, ``base`` the image stream at the route start; returns
    ``[other | base with the kept tokens written back]``.

    Example:
        >>> base, src = torch.zeros(1, 4, 1), torch.ones(1, 3, 1)
        >>> scatter_after_prefix(base, src, torch.tensor([[1, 3]]), 1)[0, :, 0].tolist()
        [1.0, 0.0, 1.0, 0.0, 1.0]
    """
    other, kept = src.split([prefix, src.shape[token_dim] - prefix], dim=token_dim)
    image = scatter_tokens(base, kept, idx, token_dim)
    return torch.cat([other.to(image.dtype), image], dim=token_dim)


def kept_positions(
    idx: torch.Tensor, positions: torch.Tensor, others: torch.Tensor
) -> torch.Tensor:
    """Places of the kept tokens ``idx`` [B, k] and of all other tokens after a form change.

    Example:
        >>> idx = torch.tensor([[0, 2]])
        >>> kept_positions(idx, torch.tensor([[2, 3, 4]]), torch.tensor([[0, 1, 5]])).tolist()
        [[0, 1, 2, 4, 5]]
    """
    moved = torch.gather(positions.to(idx.device), 1, idx)
    both = torch.cat([moved, others.to(idx.device).expand(idx.shape[0], -1)], dim=1)
    return both.sort(dim=1).values


def blend_tokens(
    base: torch.Tensor,
    src: torch.Tensor,
    idx: torch.Tensor,
    embedded: torch.Tensor,
    base_weight: float,
    embedded_weight: float,
    token_dim: int = 1,
) -> torch.Tensor:
    """Like :func:`scatter_tokens`, but routed-around tokens re-enter as a blend.

    Routed-around tokens become ``base_weight * base + embedded_weight * embedded`` (the
    paper's first-release re-entry; ``embedded`` is the stream as the patch embedding left
    it); processed tokens are ``src``.
    """
    return scatter_tokens(base_weight * base + embedded_weight * embedded, src, idx, token_dim)


def routed_mask(idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Return a bool [B, N] mask, True for tokens NOT in ``idx`` (the routed-around ones)."""
    mask = torch.ones(idx.shape[0], num_tokens, dtype=torch.bool, device=idx.device)
    return mask.scatter(1, idx, False)


def call_in_fp32(module: torch.nn.Module, *args, **kwargs):
    """Call ``module`` outside autocast with floating tensor arguments in float32.

    The authors run the first block after a route this way for stability under bf16.
    """
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    to32 = lambda a: a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
    with torch.autocast(device_type=device, enabled=False):
        return module(*map(to32, args), **{k: to32(v) for k, v in kwargs.items()})
