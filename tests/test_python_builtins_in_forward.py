"""Python builtins on traced values in a model's own forward (issue 41).

``type(h) is torch.Tensor`` read the proxy class while tracing, so the trace took the other
branch, silently (the routed model trained another function); ``round(n / 2)``,
``divmod(n, w)`` and ``x.shape.numel()`` were refused ("type ValueProxy doesn't define
__round__"). Now ``type`` answers the traced value's class in the model's modules (for the
tracing thread only, ``STILL_PATCHED`` says why), and the others are recorded calls
(``tread_fx/passes/trace/python_protocols.py``).
"""

from __future__ import annotations

import torch
from idiom_models import B, IdiomModel, N, routed_by_hand, twins

import tread_fx


class Builtins(IdiomModel):
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if type(h) is not torch.Tensor:  # never eagerly: the proxy class took it
            h = h * 0
        half = round(h.shape[1] / 2)
        rows, rest = divmod(h.shape[1], 4)
        scale = h.shape.numel() / (h.shape[0] * h.shape[1] * h.shape[2])
        return h * scale + h[:, :half].mean(1, keepdim=True) + h[:, : rows + rest].mean(1, True)


class TypeOnly(IdiomModel):
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return h if type(h) is torch.Tensor else h * 0  # the proxy class: the zero branch


def test_builtins_on_traced_values_route_as_by_hand():
    (model, reference), x = twins(Builtins), torch.randn(B, N, 8)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    out = model.train()(x)
    (info,) = tread_fx.route_info(model)
    torch.testing.assert_close(out, routed_by_hand(reference, x, info.kept))


def test_type_of_a_traced_value_takes_the_eager_branch_at_rate_zero():
    """Before: routed training computed ``h * 0`` (the branch ``type`` of a proxy takes)."""
    (model, _), x = twins(TypeOnly), torch.randn(B, N, 8)
    original = type(model).forward(model, x)
    tread_fx.route(model, routes=[(1, 3)], rate=0.0)
    torch.testing.assert_close(model.train()(x), original, rtol=0, atol=0)
