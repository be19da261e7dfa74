"""Per-layer containers with roles, the layout of configurable transformer libraries: a
``ModuleList`` of ``ModuleList([norm, block, residual])`` triples, the forward looping over them
with a parallel list of layer kinds (attention and feed-forward alternate) and calling the
three in turn. The norm slot may itself be a list (``[pre_norm, None]``); attention returns a
tuple, the feed-forward a tensor. The block boundary is the first call into member ``i``, at
any depth."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import INVARIANTS, Case
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class SelfAttention(nn.Module):
    """Returns ``(out, intermediates)`` like libraries that expose attention maps."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(h), q.detach().abs().mean()


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ScaledResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((D,), 0.5))

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x

    def forward(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return out * self.scale + residual


class RoleLayers(nn.Module):
    """``layers[i] = [norm, block, residual]`` with ``kinds[i]`` saying what ``block`` is."""

    def __init__(self, depth: int = 3, nested_norms: bool = False, post_norm: bool = False):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.kinds = ("attn", "ff") * depth
        self.nested_norms, self.post_norm = nested_norms, post_norm
        triple = lambda kind: [self._norms(), self._block(kind), ScaledResidual()]
        # post-norm layers list the block first: ``[block, norm, residual]``
        order = (lambda t: [t[1], t[0], t[2]]) if post_norm else (lambda t: t)
        self.layers = nn.ModuleList(nn.ModuleList(order(triple(kind))) for kind in self.kinds)
        self.head = nn.Linear(D, 3)

    def _norms(self) -> nn.Module:
        return nn.ModuleList([RMSNorm(), None]) if self.nested_norms else RMSNorm()

    @staticmethod
    def _block(kind: str) -> nn.Module:
        return SelfAttention() if kind == "attn" else FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if self.post_norm:
            for kind, (block, norm, residual_fn) in zip(self.kinds, self.layers):
                out = block(x)
                out = out[0] if kind == "attn" else out
                x = norm(residual_fn(out, x))
            return self.head(x)
        for kind, (norm, block, residual_fn) in zip(self.kinds, self.layers):
            x, residual = residual_fn.prepare(x)
            post_norm = None
            if self.nested_norms:
                norm, post_norm = norm
            out = block(norm(x))
            if kind == "attn":
                out, _ = out
            if post_norm is not None:
                out = post_norm(out)
            x = residual_fn(out, residual)
        return self.head(x)


def _inputs():
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(3)),), {}


CASES = [
    Case("triples", RoleLayers, _inputs, routes=[(1, -1)]),
    Case("nested-norms", lambda: RoleLayers(nested_norms=True), _inputs, routes=[(1, -1)]),
    Case("to-the-end", lambda: RoleLayers(nested_norms=True), _inputs, routes=[(2, 6)]),
    Case("post-norm", lambda: RoleLayers(post_norm=True), _inputs, routes=[(1, 5)]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_triple_is_one_block(case):
    exp = tread_fx.explain(case.model(), case.routes, 0.5, _inputs(), flops=False)
    assert exp.stacks[0]["path"] == "layers" and exp.stacks[0]["count"] == 6
    start, end = case.routes[0]
    end = end % 6 if end < 0 else end
    expected = [N // 2 if start <= i < end else N for i in range(6)]
    assert [b.tokens_routed for b in exp.blocks] == expected
    # the boundary is the first call into member i, inside a nested norm list too
    first = "0.0" if case.model().nested_norms else "0"
    assert [b.path for b in exp.blocks] == [f"layers.{i}.{first}" for i in range(6)]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)
