"""Tracing is invisible to other threads: no function object changes identity while a trace
runs, except the names :data:`~tread_fx.passes.trace.thread_patch.STILL_PATCHED` lists.

A bystander thread, run while the trace is held mid-forward, snapshots the globals of every
loaded module and the attributes of ``torch.Tensor``, ``nn.Module`` and the custom autograd
Functions (:mod:`identity_snapshot`), and compares them with a snapshot taken before the
first routed call. The model uses what the tracer handles: factories and size methods with
traced sizes, ``torch.arange``/``tensor``, ``math``, ``torch.is_tensor``, ``isinstance``,
``callable``, ``type``, activation checkpointing. Every changed name must fall under a listed
reason, and the reasons this model meets are asserted, so the list cannot grow unnoticed. A
``torch.compile(fullgraph=True)`` in the bystander reaches ``torch.ones``, ``Tensor.expand``
and ``random.random`` (a dispatcher in their place broke its graph).
"""

from __future__ import annotations

import math
import random
import sys

import identity_snapshot
import torch
import torch.fx._symbolic_trace as fx_trace
import torch.utils.checkpoint as ckpt
from bystander import run_beside_a_trace
from test_module_threads import Gate
from torch import nn

import tread_fx
from tread_fx.passes.trace.thread_patch import STILL_PATCHED

B, N, D = 2, 16, 16
# the reasons the list gives; a new one is a new name other threads see changed
LISTED = {
    "torch.nn.Module.__call__",
    "torch.nn.Module.__getattr__",
    "torch.fx.wrap",
    "math",
    "torch.utils.checkpoint.checkpoint",
    "callable",
    "type",
    "torch.autograd.Function.apply",
    "leaf function attributes",
}
# those this model meets (Function and held leaf functions: other models)
MET = LISTED - {"torch.autograd.Function.apply", "leaf function attributes"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[0], x.shape[1]  # routed: n is the kept token count
        gate = torch.ones(b, n, 1) / math.sqrt(n)
        pos = torch.arange(n, dtype=x.dtype)[None, :, None] * torch.tensor([1.0 / n])
        return x + torch.tanh(self.lin(self.norm(x))) * gate + pos


class TokenModel(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = Gate(D)  # runs ``hook()`` once, while traced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if torch.is_tensor(h) and isinstance(h, torch.Tensor) and not callable(h):
            h = h if type(h) is torch.Tensor else h * 2
            h = h + self.cls.expand(x.shape[0], -1, -1)
        for block in self.blocks:
            h = ckpt.checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def _reason(space: str, name: str, old: object, wrapped: set[tuple[int, str]]) -> str | None:
    """The :data:`STILL_PATCHED` reason a changed ``space: name`` falls under, or ``None``."""
    module = space.removeprefix("module ")
    if space.startswith("class torch.nn.modules.module.Module") and name in (
        "__call__",
        "__getattr__",
    ):
        return f"torch.nn.Module.{name}"
    if space.startswith("module ") and (id(vars(sys.modules[module])), name) in wrapped:
        return "torch.fx.wrap"
    if space == "module math" or getattr(old, "__module__", None) == "math":
        return "math"
    if old is ckpt.checkpoint:
        return "torch.utils.checkpoint.checkpoint"
    if module in (__name__, Gate.__module__) and name in ("callable", "type"):  # the model's
        return name
    return None


def _inputs() -> torch.Tensor:
    return torch.randn(B, N, 3, generator=torch.Generator().manual_seed(1))


def _compiled_in_bystander() -> list:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(2, 3) + torch.zeros(1, 3).expand(2, -1) * random.random()

    return torch.compile(step, backend="eager", fullgraph=True)(torch.zeros(2, 3)).shape


def _trace_with_a_bystander() -> tuple[dict, dict, list, nn.Module]:
    # what a first torch.compile patches once per process (dynamo's own), done before
    torch.compile(lambda x: x + 1, backend="eager", fullgraph=True)(torch.zeros(1))
    torch.manual_seed(0)
    model = tread_fx.route(TokenModel(), routes=[(1, 3)], seed=0)
    before = identity_snapshot.snapshot(*model.modules())
    seen: dict = {}

    def look() -> None:
        seen["after"] = identity_snapshot.snapshot(*model.modules())
        seen["compiled"] = _compiled_in_bystander()

    _, errors = run_beside_a_trace(model, _inputs(), look)
    return before, seen, errors, model


def test_only_listed_names_change_identity_while_a_trace_runs():
    assert set(STILL_PATCHED) == LISTED
    before, seen, errors, model = _trace_with_a_bystander()
    assert not errors, errors
    wrapped = {(id(space), name) for (_, name), space in fx_trace._wrapped_fns_to_patch.items()}
    reasons: dict[str, str | None] = {}
    for entry in identity_snapshot.changed(before, seen["after"]):
        space, name = entry.split(": ", 1)
        reasons[entry] = _reason(space, name, before[space].get(name), wrapped)
    unlisted = sorted(entry for entry, reason in reasons.items() if reason is None)
    assert unlisted == [], unlisted
    assert set(reasons.values()) == MET, reasons
    assert seen["compiled"] == (2, 3)
    after = identity_snapshot.changed(before, identity_snapshot.snapshot(*model.modules()))
    assert [entry for entry in after if entry in reasons] == []  # restored after the trace


def test_the_traced_model_routes_with_its_traced_sizes():
    torch.manual_seed(0)
    model = tread_fx.route(TokenModel(), routes=[(1, 3)], seed=0)
    out = model.train()(_inputs())
    assert out.shape == (B, N, 1)
    assert tread_fx.route_info(model)[0].kept.shape == (B, N // 2)


def test_a_c_profiler_of_the_tracing_thread_keeps_counting_after_the_trace():
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        model = tread_fx.route(TokenModel(), routes=[(1, 3)], seed=0)
        model.train()(_inputs())  # traces: the profiler is paused, then enabled again
        assert sys.getprofile() is profiler
        model.train()(_inputs())  # a later call must not raise "'Profile' is not callable"
    finally:
        profiler.disable()
    names = [getattr(entry.code, "co_name", "") for entry in profiler.getstats()]
    assert "forward" in names, "the profiler counted none of the model's forward calls"
