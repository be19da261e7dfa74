"""A rotary table handed to attention as a tuple ``(freqs, scale)`` and sliced inside it.

The model computes its rotary table once (``[1, N, d]`` angles and a ``scale`` that is
``None``, a float or a ``[1, N, d]`` tensor) and hands the tuple to every attention layer,
which slices the last ``seq_len`` positions (``freqs[:, -seq_len:]``, ``seq_len`` read from
the stream's shape), rearranges it with einops and rotates q and k with it. The layers are
``ModuleList([norm, attention-or-feed-forward, residual])`` members (the member's first call,
the norm, stands for the block), so the table enters the routed region at the attention, a
module call that is no block of the stack (``tread_fx/passes/plan/region_uses.py``); the attention's
``default(context, x)`` helper asks ``callable(x)`` of a traced tensor
(``tread_fx/passes/trace/support.py``). The table's use decides: rotated with q/k along the token
dim,
it is gathered at the kept tokens; routing equals a hand-written routed forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from third_party_checks import INVARIANTS, Case, train_forward
from torch import nn

import tread_fx
from tread_fx.passes.trace.tracer import trace_call

B, N, D, H = 2, 16, 32, 2  # batch, tokens, width, heads
HEAD = D // H


def default(value, fallback):
    """``value`` unless it is None; a callable fallback is called (a common helper)."""
    if value is not None:
        return value
    return fallback() if callable(fallback) else fallback


class Rotary(nn.Module):
    """``(freqs, scale)`` for ``n`` positions: angles ``[1, n, d]`` and None, 1.0 or a table."""

    def __init__(self, scale: str) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, HEAD, 2) / HEAD))
        self.scale_kind = scale
        self.register_buffer("base", (torch.arange(0, HEAD, 2) + 0.4 * HEAD) / (1.4 * HEAD))

    def forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor | float | None]:
        t = torch.arange(n, device=self.inv_freq.device).float()
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        freqs = torch.cat([freqs, freqs], dim=-1)[None]
        if self.scale_kind == "none":
            return freqs, None
        if self.scale_kind == "float":
            return freqs, 1.0
        scale = self.base ** ((t - n // 2) / 8)[:, None]
        return freqs, torch.cat([scale, scale], dim=-1)[None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor, scale) -> torch.Tensor:
    seq_len = t.shape[-2]
    freqs = rearrange(freqs[:, -seq_len:], "b n d -> b 1 n d")
    if torch.is_tensor(scale):
        scale = rearrange(scale[:, -seq_len:], "b n d -> b 1 n d")
    scale = 1.0 if scale is None else scale
    return t * freqs.cos() * scale + _rotate_half(t) * freqs.sin() * scale


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_kv, self.to_out = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, context=None, rotary=None) -> torch.Tensor:
        kv_input = default(context, x)
        q = rearrange(self.to_q(x), "b n (h d) -> b h n d", h=H)
        k, v = rearrange(self.to_kv(kv_input), "b n (two h d) -> two b h n d", two=2, h=H)
        if rotary is not None:
            freqs, scale = rotary
            q, k = apply_rotary(q, freqs, scale), apply_rotary(k, freqs, scale)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Residual(nn.Module):
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x + residual


class Block(nn.Module):
    """Attention and feed-forward in one module (the plain twin of a member pair)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.ff = Attention(), FeedForward()

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary=rotary)
        return x + self.ff(self.norm2(x))


class RotaryEncoder(nn.Module):
    """Rotary table computed once, handed as a tuple to every attention layer."""

    def __init__(self, depth: int = 4, scale: str = "none", nested: bool = True) -> None:
        super().__init__()
        self.nested = nested
        self.proj_in, self.proj_out = nn.Linear(6, D), nn.Linear(D, 6)
        self.rotary = Rotary(scale)
        if nested:
            self.kinds = ["a", "f"] * depth
            self.layers = nn.ModuleList(
                nn.ModuleList([nn.LayerNorm(D), Attention() if k == "a" else FeedForward(),
                               Residual()])
                for k in self.kinds
            )  # fmt: skip
        else:
            self.layers = nn.ModuleList(Block() for _ in range(depth))

    def layer(self, i: int, h: torch.Tensor, rotary) -> torch.Tensor:
        if not self.nested:
            return self.layers[i](h, rotary=rotary)
        norm, block, residual = self.layers[i]
        out = block(norm(h), rotary=rotary) if self.kinds[i] == "a" else block(norm(h))
        return residual(out, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        rotary = self.rotary(h.shape[1])
        for i in range(len(self.layers)):
            h = self.layer(i, h, rotary)
        return self.proj_out(h)


def _inputs():
    return (torch.randn(B, N, 6, generator=torch.Generator().manual_seed(5)),), {}


CASES = [
    Case("members-scale-none", RotaryEncoder, _inputs, routes=[(2, 6)]),
    Case("members-scale-float", lambda: RotaryEncoder(scale="float"), _inputs, routes=[(2, 6)]),
    Case("members-scale-table", lambda: RotaryEncoder(scale="table"), _inputs, routes=[(2, 6)]),
    Case("blocks-scale-table", lambda: RotaryEncoder(scale="table", nested=False), _inputs),
]


def _reference(model: RotaryEncoder, x: torch.Tensor, idx: torch.Tensor, start: int, end: int):
    """The routed forward written out: tokens ``idx`` (and their table rows) through blocks
    ``start .. end - 1``, written back in place."""
    h = model.proj_in(x)
    rotary = model.rotary(h.shape[1])
    freqs, scale = rotary
    cut = (freqs[:, idx], scale[:, idx] if torch.is_tensor(scale) else scale)
    for i in range(start):
        h = model.layer(i, h, rotary)
    kept = h[:, idx]
    for i in range(start, end):
        kept = model.layer(i, kept, cut)
    h = h.clone()
    h[:, idx] = kept
    for i in range(end, len(model.layers)):
        h = model.layer(i, h, rotary)
    return model.proj_out(h)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_equals_the_hand_written_routed_forward(case):
    model = case.route(case.model())
    out = train_forward(model, case)
    (info,) = tread_fx.route_info(model)
    assert info.kept.shape == (B, N // 2)
    assert torch.equal(info.kept[0], info.kept[1])  # a batch-shared table shares the subset
    start, end = case.routes[0]
    with torch.no_grad():
        expected = _reference(model, case.inputs()[0][0], info.kept[0], start, end)
    torch.testing.assert_close(out.detach(), expected)


def test_the_tables_are_gathered_by_their_use():
    """The plan says what it does with the angle and scale tables: rows taken, by use."""
    case = CASES[2]
    exp = tread_fx.explain(case.model(), case.routes, 0.5, case.inputs(), flops=False)
    assert exp.refusal is None
    tables = [
        s
        for s in exp.routes[0].side_inputs
        if s.direction == "in" and tuple(s.shape) == (1, N, HEAD)
    ]
    assert len(tables) == 2
    assert all(s.treatment not in ("passed through", "refused") for s in tables)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def test_callable_answers_by_the_traced_value():
    """``default(context, x)`` with a traced tensor: the tensor itself, not a call of it."""

    class Fallback(nn.Module):
        def forward(self, x: torch.Tensor, context=None) -> torch.Tensor:
            return default(context, x) * 2

    traced = trace_call(Fallback(), (torch.ones(2, 3),), {}, leaf_paths=set())
    assert [n.op for n in traced.gm.graph.nodes] == ["placeholder", "call_function", "output"]
    assert "callable" not in globals()  # the patch of this module is gone after the trace
