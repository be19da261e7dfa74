"""Tracing is invisible to other threads: what it no longer patches keeps its identity.

Grad mode is thread-local torch state, so the trace sets it instead of patching
``torch.is_grad_enabled``: traced code runs in the caller's grad mode and the tracer computes
its values under ``no_grad``. ``torch.arange``/``tensor``/``as_tensor`` of traced sizes are
recorded by a ``TorchFunctionMode`` (per thread) instead of a patch of the name. A bystander
thread, run while the trace is held mid-forward, finds each of these the very function it
saved, and a ``torch.compile``'d function (``fullgraph=True``) reading grad mode compiles
there (dynamo knows the function by identity; the dispatcher it met before broke the graph).
A model reading grad mode inside its own ``no_grad`` block sees what it sees eagerly, and
routes as written by hand.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from bystander import run_beside_a_trace
from torch import nn

import tread_fx

B, N, D = 2, 16, 32
# what the trace no longer replaces (it sets thread-local state instead): (namespace, name)
IDENTITY_KEPT = (
    (torch, "is_grad_enabled"),  # grad mode: thread-local state, set instead
    (torch, "arange"),  # recorded by a TorchFunctionMode of the tracing thread
    (torch, "tensor"),
    (torch, "as_tensor"),
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]  # routed: the kept token count, so arange must stay a graph call
        pos = torch.arange(n, dtype=x.dtype)[None, :, None] / torch.as_tensor(float(N))
        return x + torch.tanh(self.lin(self.norm(x))) + pos * torch.tensor([n])[0] / N


class Head(nn.Module):
    """Runs ``hook()`` once (while traced); reads grad mode inside its own ``no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 3)
        self.hook: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        with torch.no_grad():
            scale = 3.0 if torch.is_grad_enabled() else 1.0  # eagerly always 1.0 here
        return self.lin(x) * scale


class TokenModel(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _inputs() -> torch.Tensor:
    return torch.randn(B, N, 3, generator=torch.Generator().manual_seed(1))


def _routed_by_hand(model: TokenModel, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Blocks 1 and 2 on the ``kept`` tokens of each sample, written back in place; the
    blocks' position table (``arange`` over the stream's length) is the full stream's,
    taken at the kept tokens (an in-block token table)."""
    h = model.blocks[0](model.embed(x))
    index = kept[..., None].expand(-1, -1, D)
    part = h.gather(1, index)
    table = kept[..., None].to(h.dtype) / N  # arange(N) / N * N / N at the kept tokens
    for block in model.blocks[1:3]:
        part = part + torch.tanh(block.lin(block.norm(part))) + table
    h = h.scatter(1, index, part)
    return model.head(model.blocks[3](h))


def _bystander(report: dict, saved: dict) -> None:
    """Identity of what the trace no longer patches, and behaviour, seen from another thread."""
    report["identity"] = {name: getattr(ns, name) is saved[name] for ns, name in IDENTITY_KEPT}

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x + torch.ones(2, 3) + torch.arange(3) + torch.as_tensor(0.0)
        return y * 2 if torch.is_grad_enabled() else y

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    with torch.no_grad():
        report["compiled"] = compiled(torch.zeros(2, 3)).tolist()
    report["random"] = [random.random() for _ in range(20)]


def _trace_with_a_bystander() -> tuple[dict, list, torch.Tensor, tread_fx.RouteInfo, nn.Module]:
    torch.manual_seed(0)
    model = tread_fx.route(TokenModel(), routes=[(1, 3)], seed=0)
    saved = {name: getattr(ns, name) for ns, name in IDENTITY_KEPT}
    report: dict = {}
    out, errors = run_beside_a_trace(model, _inputs(), lambda: _bystander(report, saved))
    return report, errors, out, tread_fx.route_info(model)[0], model


def test_a_bystander_thread_sees_the_same_functions_while_a_trace_runs():
    report, errors, _, _, _ = _trace_with_a_bystander()
    assert all(report["identity"].values()), report["identity"]  # set before the rest ran
    assert not errors, errors
    assert report["compiled"] == [[1.0, 2.0, 3.0]] * 2  # no_grad: not doubled, compiled fullgraph
    assert all(isinstance(v, float) and 0.0 <= v < 1.0 for v in report["random"])
    assert len(set(report["random"])) == 20


def test_traced_code_reads_grad_mode_as_it_does_eagerly_and_routes_as_by_hand():
    _, _, out, info, model = _trace_with_a_bystander()
    assert info.kept.shape == (B, N // 2)
    with torch.no_grad():
        expected = _routed_by_hand(model, _inputs(), info.kept)
    torch.testing.assert_close(out.detach(), expected)
    with torch.no_grad():  # a second signature: grad mode off throughout
        out_eval = model.train()(_inputs())
        expected = _routed_by_hand(model, _inputs(), tread_fx.route_info(model)[0].kept)
    torch.testing.assert_close(out_eval, expected)
