"""Plain-PyTorch stand-ins for the CUDA-only kernels research model files import.

A research builder uses these where the listed ``edits`` say a kernel must become plain
PyTorch of the same math: the attention kernels (flash-attn, xformers) become
``F.scaled_dot_product_attention``; a package that is imported at the top of a model file but
only exists with CUDA is provided as a module holding those stand-ins.

Example:
    >>> import torch
    >>> q = torch.randn(2, 16, 4, 8)
    >>> flash_attn_func(q, q, q).shape
    torch.Size([2, 16, 4, 8])
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["flash_attn_func", "provide_module", "xformers_attention"]


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **_: Any,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_func`` (``[B, N, H, D]`` in and out) as SDPA."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=dropout_p, is_causal=causal, scale=softmax_scale,
    )  # fmt: skip
    return out.transpose(1, 2)


def xformers_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: Any = None, p: float = 0.0,
    scale: float | None = None, **_: Any,
) -> torch.Tensor:  # fmt: skip
    """xformers' ``memory_efficient_attention`` (``[B, N, H, D]``, no block-diagonal bias)."""
    if attn_bias is not None and not isinstance(attn_bias, torch.Tensor):
        raise NotImplementedError(f"xformers bias {type(attn_bias).__name__} has no stand-in")
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_bias,
        dropout_p=p, scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2)


def provide_module(name: str, **attrs: Any) -> types.ModuleType:
    """Register module ``name`` (and its parents) holding ``attrs`` in ``sys.modules``,
    for a CUDA-only package a model file imports at its top."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        dotted = ".".join(parts[:i])
        module = sys.modules.get(dotted) or types.ModuleType(dotted)
        sys.modules[dotted] = module
        if i > 1:
            setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)
    for key, value in attrs.items():
        setattr(sys.modules[name], key, value)
    return sys.modules[name]
