"""Inference with routing: forced routing in eval mode and sparse (self-)guidance.

Routing is for training; eval runs the original forward. A routed forward serves inference
in the authors' "TREAD guidance" (two routed passes at different rates combined like
classifier-free guidance) and in self-guidance (full forward vs a routed one). Both branches
get the same (conditional) inputs, as in the authors' later Sparse Guidance paper (in their
code both are unconditional, which looks like a bug).

Example:
    >>> import torch, tread_fx
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> _ = tread_fx.route(model, routes=[(1, 3)], seed=0)
    >>> x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    >>> with tread_fx.force_routing(model, rate=0.5):
    ...     routed = model.eval()(x, t, y)
    >>> guided = tread_fx.sparse_guidance(model, x, t, y, scale=1.5, rates=(0.0, 0.5))
    >>> guided.shape
    torch.Size([2, 2, 8, 8])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.api import _state
from tread_fx.errors import InvalidRateError
from tread_fx.routes import check_rate

__all__ = ["force_routing", "sparse_guidance"]


@contextlib.contextmanager
def force_routing(model: nn.Module, rate: float | None = None, routes: Any = None) -> Iterator:
    """Run the routed graph in eval mode too (and in training at a fixed config).

    Args:
        model: A routed model.
        rate: Rate to route at (default: the model's); ``0`` keeps every token.
        routes: Routes to use instead of the model's.

    Example:
        >>> import tread_fx
        >>> m = tread_fx.route(tread_fx.models.DiT_S_2(input_size=8, depth=4), [(1, 3)])
        >>> with tread_fx.force_routing(m, rate=0.3):
        ...     pass
    """
    state = _state(model, "force_routing")
    previous = state.forced
    state.forced = state.config.at_rate(rate, routes)
    try:
        yield model
    finally:
        state.forced = previous


def _predict(model: nn.Module, rate: float, args: tuple, kwargs: dict) -> Any:
    if rate == 0.0 and not model.training:  # the original forward, exactly
        return model(*args, **kwargs)
    with force_routing(model, rate=rate):
        return model(*args, **kwargs)


def sparse_guidance(
    model: nn.Module,
    *args: Any,
    scale: float,
    rates: tuple[float, float] = (0.0, 0.5),
    **kwargs: Any,
) -> Any:
    """Guide a prediction with a sparser (routed) prediction of the same, conditional inputs.

    Returns ``weak + scale * (strong - weak)`` where ``strong`` is the prediction at
    ``rates[0]`` (0: the full forward, i.e. self-guidance) and ``weak`` at ``rates[1]``;
    ``scale=1`` gives ``strong``. Works on tensors or any pytree of tensors the model returns.

    Args:
        model: A routed model (eval mode for sampling).
        *args: The model's positional inputs (conditional).
        scale: Guidance scale.
        rates: (strong rate, weak rate); the strong branch routes fewer tokens.
        **kwargs: The model's keyword inputs.
    """
    strong_rate, weak_rate = (check_rate(r, "guidance rate") for r in rates)
    _state(model, "sparse_guidance")  # raises NotRoutedError with the fix if not routed
    if weak_rate <= strong_rate:
        raise InvalidRateError(
            f"rates={rates} must route more tokens in the weak branch than in the strong one "
            "(e.g. (0.0, 0.5) for self-guidance, (0.3, 0.7) for the authors' TREAD guidance)."
        )
    strong = _predict(model, strong_rate, args, kwargs)
    weak = _predict(model, weak_rate, args, kwargs)
    return pytree.tree_map(lambda s, w: w + scale * (s - w), strong, weak)
