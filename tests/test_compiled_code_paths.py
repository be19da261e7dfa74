"""Compiled code reached by any path runs as its original Python while tracing: a helper
decorated with ``@torch.compile``, a decorated ``forward``, a wrapper object that compiles its
function on the first call (and caches it), ``torch.compile`` called inside ``forward``, a
submodule compiled in place (``module.compile()``) and one stored as ``torch.compile(module)``
(an ``OptimizedModule`` inside the model). Each block rotates its tokens by a position table
the model's forward makes and hands every block, so the router must see how the blocks use it
(a block it cannot trace through would leave the table unclassified). The trace records the
original operations and compiles nothing (a counting backend sees no graph); dynamo's switch is
on for the tracing thread only (``tread_fx/passes/trace/support.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from third_party_checks import (
    Case,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    gather_rows,
    scatter_rows,
    train_forward,
)
from torch import nn

import tread_fx
from tread_fx.passes.trace.support import dynamo_wrappers_call_through
from tread_fx.passes.trace.tracer import trace_call

B, N, D, DEPTH = 2, 16, 32, 4
COMPILED: list[torch.fx.GraphModule] = []


def _counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """A dynamo backend that compiles nothing and counts what it is handed."""
    COMPILED.append(gm)
    return gm.forward


def _rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return x * pos.cos() + x.roll(1, dims=-1) * pos.sin()


rotate_decorated = torch.compile(_rotate, backend=_counting_backend)


class LazyCompiled:
    """Compiles ``fn`` on its first call and keeps the compiled function."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.compiled = fn, None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, backend=_counting_backend)
        return self.compiled(*args)


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.lin(_rotate(x, pos))


class Block(nn.Module):
    """``how``: the path by which the block reaches compiled code."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.norm = nn.LayerNorm(D)
        self.mixer = Mixer()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.rotate = LazyCompiled(_rotate) if how == "lazy-wrapper" else None
        if how == "compiled-in-place":
            self.mixer.compile(backend=_counting_backend)
        elif how == "compiled-submodule":
            self.mixer = torch.compile(Mixer(), backend=_counting_backend)

    def mix(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.how == "decorated-helper":
            return self.mixer.lin(rotate_decorated(h, pos))
        if self.how == "lazy-wrapper":
            return self.mixer.lin(self.rotate(h, pos))
        if self.how == "compile-in-forward":
            return self.mixer.lin(torch.compile(_rotate, backend=_counting_backend)(h, pos))
        if self.how == "module-compiled-in-forward":
            return torch.compile(self.mixer, backend=_counting_backend)(h, pos)
        return self.mixer(h, pos)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm(x), pos)
        return x + self.mlp(x)


class DecoratedBlock(Block):
    @torch.compile(backend=_counting_backend)
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return super().forward(x, pos)


class PositionNet(nn.Module):
    """Patch tokens, a position table shared by the batch, a stack of ``DEPTH`` blocks."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj_in = nn.Linear(3, D)
        self.freqs = nn.Parameter(torch.rand(D))
        block = DecoratedBlock if how == "decorated-forward" else Block
        self.blocks = nn.ModuleList(block(how) for _ in range(DEPTH))
        self.head = nn.Linear(D, 3)

    def positions(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=self.freqs.dtype)[:, None] * self.freqs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.positions(x.shape[1])
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x, pos)
        return self.head(x)


def _inputs() -> tuple[tuple, dict]:
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(7)),), {}


PATHS = [
    "decorated-helper",
    "decorated-forward",
    "lazy-wrapper",
    "compile-in-forward",
    "module-compiled-in-forward",
    "compiled-in-place",
    "compiled-submodule",
]
CASES = [Case(how, lambda how=how: PositionNet(how), _inputs, routes=[(1, -1)]) for how in PATHS]


def _by_hand(model: PositionNet, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """TREAD by hand over blocks 1..2: the tokens and their position rows gathered at the
    start, scattered back before the last block; every block runs its original code."""
    pos = model.positions(x.shape[1]).expand(x.shape[0], -1, -1)
    x = model.proj_in(x)
    x = Block.forward(model.blocks[0], x, pos)
    kept, kept_pos = gather_rows(x, ids), gather_rows(pos, ids)
    for block in model.blocks[1:-1]:
        kept = Block.forward(block, kept, kept_pos)
    x = Block.forward(model.blocks[-1], scatter_rows(x, ids, kept), pos)
    return model.head(x)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_trace_records_the_original_code_and_compiles_nothing(case):
    COMPILED.clear()
    traced = trace_call(case.model(), _inputs()[0], {}, leaf_paths=set())
    assert traced.auto_leaves == {}, "every block is traced through"
    methods = [n.target for n in traced.gm.graph.nodes if n.op == "call_method"]
    assert methods.count("cos") == methods.count("sin") == DEPTH
    assert COMPILED == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_output_is_tread_by_hand(case):
    model = case.route(case.model())
    COMPILED.clear()
    out = train_forward(model, case)
    assert COMPILED == [], "the uncompiled routed graph runs the original code"
    (info,) = tread_fx.route_info(model)
    assert (info.route.start, info.route.end) == (1, DEPTH - 1)
    with torch.no_grad():
        expected = _by_hand(model, _inputs()[0][0], info.kept)
    torch.testing.assert_close(out.detach(), expected)


@pytest.mark.parametrize("check", [check_eval_is_bitwise_unrouted, check_gradients])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.name)
def test_explain_runs_the_original_code(case):
    """explain's shape pass runs the blocks on fake tensors: compiled code runs as its
    original Python there too (compiled on fakes, an inductor kernel crashed the process)."""
    COMPILED.clear()
    exp = tread_fx.explain(case.model(), case.routes, 0.5, _inputs(), flops=False)
    assert [b.tokens_routed for b in exp.blocks] == [N, N // 2, N // 2, N]
    assert COMPILED == []


def test_the_switch_is_for_the_tracing_thread_only():
    """Another thread keeps dynamo's default while this one traces (a config patch is per
    thread; ``torch.compiler.set_stance`` would be seen by every thread)."""
    import torch._dynamo

    seen: list[bool] = []
    with dynamo_wrappers_call_through():
        assert not torch._dynamo.config.error_on_nested_fx_trace
        reader = threading.Thread(
            target=lambda: seen.append(torch._dynamo.config.error_on_nested_fx_trace)
        )
        reader.start()
        reader.join()
    assert seen == [True] and torch._dynamo.config.error_on_nested_fx_trace


_FRESH = """
    import sys
    import torch
    from torch import nn

    import tread_fx
    from tread_fx.passes.trace.tracer import trace_call

    class LazyCompiled:
        def __init__(self, fn):
            self.fn, self.compiled = fn, None

        def __call__(self, *args):
            if self.compiled is None:
                self.compiled = torch.compile(self.fn)
            return self.compiled(*args)

    rotate = LazyCompiled(lambda x, pos: x * pos.cos() + x.flip(-1) * pos.sin())

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x, pos):
            return x + self.lin(rotate(x, pos))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj_in, self.head = nn.Linear(3, 32), nn.Linear(32, 3)
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x):
            pos = torch.linspace(0, 1, x.shape[1])[None, :, None].expand(x.shape[0], -1, 32)
            x = self.proj_in(x)
            for block in self.blocks:
                x = block(x, pos)
            return self.head(x)

    assert "torch._dynamo" not in sys.modules, "dynamo must not be imported before the trace"
    x = torch.randn(2, 16, 3)
    traced = trace_call(Net(), (x,), {}, leaf_paths=set())
    exp = tread_fx.explain(Net(), [(0, -1)], 0.5, ((x,), {}), flops=False)
    print([b.tokens_routed for b in exp.blocks], sorted(traced.auto_leaves))
"""


def test_a_first_compile_during_the_trace_is_traced_through():
    """In a process that has not imported dynamo yet, the wrapper's first ``torch.compile``
    (inside the trace) imports it: that call too runs its original code (it made block 0 a
    leaf). explain then runs the blocks on fake tensors with the default backend: nothing is
    compiled there (an inductor kernel run on fakes crashed the process)."""
    code = textwrap.dedent(_FRESH)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[8, 8, 8, 16] []"


@pytest.mark.slow
def test_code_compiled_after_route_still_compiles():
    """Tracing leaves dynamo as it found it: a compile after ``route`` compiles."""
    import torch._dynamo

    model = CASES[0].route(CASES[0].model())
    train_forward(model, CASES[0])
    assert torch._dynamo.config.error_on_nested_fx_trace
    assert torch._dynamo.eval_frame._stance.stance == "default"
    COMPILED.clear()
    torch.compile(lambda x: x.sin() + 1, backend=_counting_backend)(torch.ones(3))
    assert len(COMPILED) == 1
