"""Models that decorate their own code with ``@torch.compile`` (research training code does:
the forward, a modulate helper, an embedder, blocks compiled one by one). The trace records the
original functions; the routed graph is compiled as a whole as usual, and eval still calls
the decorated code. ``backend="eager"`` keeps the decorators cheap on CPU."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from third_party_checks import INVARIANTS, Case, check_compiled
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


@torch.compile(backend="eager")
def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimeEmbedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # a same-class list outside the stack (the blocks' class must not be the wrapper's)
        self.layers = nn.ModuleList([nn.Linear(8, D), nn.Linear(D, D)])

    @torch.compile(backend="eager")
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(4, dtype=t.dtype, device=t.device))
        angles = t[:, None] * freqs[None]
        h = self.layers[0](torch.cat([angles.sin(), angles.cos()], dim=-1))
        return self.layers[1](nn.functional.silu(h))


class ModulatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D, elementwise_affine=False)
        self.ada = nn.Linear(D, 2 * D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada(c).chunk(2, dim=-1)
        return x + self.mlp(modulate(self.norm(x), shift, scale))


class CompiledDiT(nn.Module):
    """``compiled_blocks``: how many blocks are wrapped by ``torch.compile`` one by one."""

    def __init__(self, depth: int = 4, compiled_blocks: int = 0) -> None:
        super().__init__()
        self.proj_in = nn.Linear(3, D)
        self.t_embed = TimeEmbedder()
        blocks = [ModulatedBlock() for _ in range(depth)]
        for i in range(compiled_blocks):
            blocks[i] = torch.compile(blocks[i], backend="eager")
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, 3)

    @torch.compile(backend="eager")
    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        c = self.t_embed(t)
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x, c)
        return self.head(x)


def _inputs():
    g = torch.Generator().manual_seed(4)
    return (torch.randn(B, N, 3, generator=g), torch.rand(B, generator=g)), {}


CASES = [
    Case("decorated", CompiledDiT, _inputs, routes=[(1, 3)]),
    Case("blocks-compiled", lambda: CompiledDiT(compiled_blocks=4), _inputs, routes=[(1, 3)]),
    Case("some-compiled", lambda: CompiledDiT(compiled_blocks=2), _inputs, routes=[(1, 3)]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_blocks_are_the_stack(case):
    exp = tread_fx.explain(case.model(), case.routes, 0.5, _inputs(), flops=False)
    assert exp.stacks[0]["path"] == "blocks" and exp.stacks[0]["count"] == 4
    assert [b.tokens_routed for b in exp.blocks] == [N, N // 2, N // 2, N]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


COMPILED: list[torch.fx.GraphModule] = []


def _counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """A dynamo backend that compiles nothing and counts what it is handed."""
    COMPILED.append(gm)
    return gm.forward


class BlockCompiledDiT(nn.Module):
    """Blocks wrapped one by one by ``torch.compile`` (the forward around them is not)."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.proj_in = nn.Linear(3, D)
        self.t_embed = nn.Linear(1, D)
        blocks = [torch.compile(ModulatedBlock(), backend=_counting_backend) for _ in range(depth)]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        c, x = self.t_embed(t[:, None]), self.proj_in(x)
        for block in self.blocks:
            x = block(x, c)
        return self.head(x)


def test_the_routed_graph_runs_the_original_code():
    """Uncompiled (no ``compile=``), a routed training call runs the compiled blocks' original
    code, as traced: nothing is compiled for the routed token counts; eval still calls the
    compiled blocks."""
    torch.manual_seed(0)
    model = tread_fx.route(BlockCompiledDiT(), routes=[(1, 3)], rate=0.5, seed=0)
    (x, t), _ = _inputs()
    COMPILED.clear()
    model.train()(x, t).square().mean().backward()
    assert COMPILED == []
    with torch.no_grad():
        model.eval()(x, t)
    assert COMPILED  # the decorators are still in place


def test_explain_counts_the_flops_of_the_original_code():
    """explain's FLOP count traces each block call with ``make_fx``: the compiled blocks are
    counted as their original code (no "FX ... dynamo-optimized function" failure), and
    nothing is compiled."""
    torch.manual_seed(0)
    COMPILED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed count is a warning
        # token-wise blocks do not show the batch dim (they would warn): batch_dim=0 says it
        exp = tread_fx.explain(BlockCompiledDiT(), [(1, 3)], 0.5, _inputs(), batch_dim=0)
    assert COMPILED == []
    flops = json.loads(exp.to_json())["flops"]
    assert flops["routed"]["forward"] < flops["original"]["forward"]


@pytest.mark.slow
def test_the_routed_graph_compiles_as_a_whole():
    check_compiled(CASES[0])
