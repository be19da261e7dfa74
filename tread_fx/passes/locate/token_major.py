"""Token streams that are not [B, N, C]: 4-D token-major streams whose last dim is the channel.

A 4-D value is a token stream with its tokens on dim 1 when the blocks treat its last dim as
the channel: a channels-last patch grid ``[B, H, W, C]`` (blocks that read ``H, W`` from the
shape, window or globally attend, and run their MLP over ``C``) or a head-split stream
``[B, N, heads, d]``. The routed unit is then a whole dim-1 slice: for a grid a whole row,
so the kept rows form a smaller ``r x W`` grid the blocks see natively (the ``"rows"``
selection without telling the blocks anything). A channels-first feature map
``[B, C, H, W]`` (convolutions over dim 1) is not a token stream and stays refused.

Example:
    >>> import torch
    >>> block = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    >>> channels_last(block, (2, 4, 4, 8)), channels_last(block, (2, 8, 4, 4))
    (True, False)
"""

from __future__ import annotations

from torch import nn

from tread_fx.errors import TokenStreamError, shown
from tread_fx.runtime.selection import Strategy, select_random

__all__ = ["channels_last", "check_stream_rank", "GRID_ROWS", "is_token_major", "token_major_unit"]

# every selection on a 4-D token-major stream keeps whole dim-1 slices (rows of a grid)
GRID_ROWS = Strategy("rows", False, lambda n, grid: n, select_random)


def _feature_sizes(block: nn.Module) -> tuple[set[int], set[int]]:
    """(sizes read as the last dim: Linear inputs, norms; channels read on dim 1: convs)."""
    last, first = set(), set()
    for module in block.modules():
        if isinstance(module, nn.Linear):
            last.add(module.in_features)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.normalized_shape:
            last.add(module.normalized_shape[-1])
        elif isinstance(module, nn.modules.conv._ConvNd):
            first.add(module.in_channels)
        elif isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):
            first.add(getattr(module, "num_features", getattr(module, "num_channels", 0)))
    return last, first


def channels_last(block: nn.Module, shape: tuple[int, ...]) -> bool:
    """Whether ``block`` reads the last dim of a 4-D input as its channels (and not dim 1)."""
    last, first = _feature_sizes(block)
    return shape[-1] in last and (shape[1] not in first or shape[1] == shape[-1])


def is_token_major(shape: tuple[int, ...]) -> bool:
    """A located stream of rank 4: tokens on dim 1, whole dim-1 slices routed."""
    return len(shape) == 4


def check_stream_rank(block: nn.Module, block_path: str, lists: list[str], shape) -> None:
    """Refuse a stream that is neither [B, N, C] / [N, B, C] nor 4-D channels-last."""
    shape = tuple(shape)
    if len(shape) == 3 or (len(shape) == 4 and channels_last(block, shape)):
        return
    if len(shape) == 4:
        why = (
            "a feature map such as [B, C, H, W]: block's convolutions or norms read dim 1 "
            f"({shape[1]}) as channels, or nothing in it reads the last dim ({shape[-1]}) as "
            "channels, so its axes are not tokens"
        )
    elif len(shape) == 2:
        why = (
            "a [rows, dim] value whose rows are the batch (per-sample vectors), and nothing "
            "marks it as a packed stream (samples' tokens concatenated along one axis): a "
            "packed stream is routed when its rows are not the batch or when the blocks "
            "receive its segment boundaries beside it (cu_seqlens, segment or position ids "
            "as integer tensors)"
        )
    else:
        why = f"a {len(shape)}-D value has no [batch, tokens, ...] layout tread_fx can route"
    raise TokenStreamError(
        f"no token sequence flows through {', '.join(map(shown, lists))}: the value entering block "
        f"{block_path} is a {len(shape)}-D tensor of shape {list(shape)}, not a 3-D [batch, "
        "tokens, dim] (or [tokens, batch, dim]) tensor nor a channels-last 4-D stream "
        f"([B, H, W, C] or [B, N, heads, d]); it is {why}. tread_fx routes token sequences "
        "only: pass blocks= naming a container whose blocks take token sequences, or route "
        "a token-based backbone."
    )


def token_major_unit(shape) -> str | None:
    """What one routed unit of a 4-D stream is, for ``explain`` (``None``: a single token)."""
    if not is_token_major(tuple(shape)):
        return None
    _, n, w, c = shape
    return (
        f"a whole dim-1 slice [{w}, {c}] of the 4-D stream (a row of a channels-last "
        f"[B, H, W, C] grid, or a token of [B, N, heads, d]): the kept rows form a smaller "
        f"r x {w} grid the blocks see natively, so every selection= keeps whole rows; a block "
        "that pads its input to a window size computes on the padded window either way"
    )
