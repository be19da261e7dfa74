"""Every plan is checked before its first call (issue 56): the routed graph runs on fake
tensors when it is built, and a graph that cannot run is refused there, naming the route, the
block and the model's line, instead of failing inside the first training call.

- a block that resizes its tokens to a fixed length inside a route: refused when built, by
  ``explain`` as by the first call, with the model unchanged;
- the check draws no random numbers and leaves no fake tensor in a module that caches on
  itself (the route is still compared with a hand-written one);
- code fake tensors cannot run (``.item()`` in a block) leaves the decision to the first
  call, which routes it, or, where the routed graph fails there, names the node and the line
  as the check does (the graph is run again node by node on the same values);
- learning-to-cache: a forward that keeps values it computes on the module for a later call
  (``self.reuse_feature[i] = x``) is refused, since a routed graph returns only the outputs
  and would leave them stale; nothing of the trace is left on the module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import gather_rows, scatter_rows
from torch import nn

import tread_fx
from tread_fx.config import resolve_config
from tread_fx.passes.rewrite.check import check_routed_graph
from tread_fx.pipeline import build

B, N, D = 2, 16, 32


class FixedLengthBlock(nn.Module):
    """Resamples its tokens to the length it was built for: it needs every token."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        resampled = F.interpolate(x.transpose(1, 2), size=N).transpose(1, 2)
        return x + self.fc(resampled)  # the failing line


class CachingBlock(nn.Module):
    """Keeps its last input on itself, and reads tensor data (``.item()``) to scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.last = None

    def forward(self, x):
        self.last = x
        scale = 1.0 + 0.0 * x.detach().abs().max().item()
        return x + scale * self.fc(x)


class ReadingFixedLengthBlock(FixedLengthBlock):
    """Reads tensor data (fake tensors cannot) and then needs every token."""

    def forward(self, x):
        return super().forward(x) * (1.0 + 0.0 * x.detach().abs().max().item())


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(block() for _ in range(4))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _inputs() -> torch.Tensor:
    return torch.randn(B, N, 4, generator=torch.Generator().manual_seed(1))


def _failing_line() -> str:
    lines = Path(__file__).read_text().splitlines()
    at = lines.index("        return x + self.fc(resampled)  # the failing line")
    return f"test_plan_check.py:{at + 1}"


def test_a_block_that_needs_every_token_is_refused_when_the_graph_is_built() -> None:
    model = Stack(FixedLengthBlock)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tread_fx.route(model, routes=[(1, 3)], rate=0.5)
    with pytest.raises(tread_fx.RouteCheckError) as caught:
        model.train()(_inputs())
    first, *rest = str(caught.value).splitlines()
    assert first.startswith("route (1, 3) cannot run: blocks.1 (FixedLengthBlock")
    assert len(first) <= 150 and _failing_line() in "\n".join(rest)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(tread_fx.RouteCheckError, match="blocks.1"):
        tread_fx.explain(Stack(FixedLengthBlock), [(1, 3)], 0.5, ((_inputs(),), {}))


def test_a_route_before_the_block_that_needs_every_token_passes_the_check() -> None:
    model = Stack(FixedLengthBlock)
    model.blocks[1] = CachingBlock()
    model.blocks[2] = CachingBlock()
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    assert model.train()(_inputs()).shape == (B, N, 4)


def test_the_check_draws_no_random_numbers_and_building_leaves_no_proxy_on_the_model() -> None:
    torch.manual_seed(0)
    model = Stack(CachingBlock)
    x = _inputs()
    built = build(model, (x,), {}, resolve_config(model, [(1, 3)], 0.5))
    state = torch.get_rng_state()
    check_routed_graph(built, model, (x,), {})
    assert torch.equal(torch.get_rng_state(), state)
    # a real value (the trace runs the forward once, as an eager first call) or the value
    # from before, never a traced proxy or a fake tensor
    assert all(type(block.last) in (torch.Tensor, type(None)) for block in model.blocks)


def test_code_fake_tensors_cannot_run_is_left_to_the_first_call_which_routes_it() -> None:
    torch.manual_seed(0)
    model = Stack(CachingBlock)
    x = _inputs()
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept
    assert type(model.blocks[2].last) is torch.Tensor and model.blocks[2].last.shape == (B, 8, D)
    with torch.no_grad():
        h = model.blocks[0](model.embed(x))
        kept = model.blocks[2](model.blocks[1](gather_rows(h, ids)))
        expected = model.head(model.blocks[3](scatter_rows(h, ids, kept)))
    torch.testing.assert_close(routed.detach(), expected)


class KeepsFeatures(Stack):
    """Keeps every block's output on itself for a later call (a feature cache)."""

    def __init__(self) -> None:
        super().__init__(CachingBlock)
        self.reuse_feature = [None] * 4

    def forward(self, x):
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            self.reuse_feature[i] = x
        return self.head(x)


def test_a_forward_keeping_values_on_the_module_is_refused_and_left_as_it_was() -> None:
    model = tread_fx.route(KeepsFeatures(), routes=[(1, 3)], rate=0.5)
    with pytest.raises(tread_fx.UntraceableModelError, match=r"reuse_feature\[0\]"):
        model.train()(_inputs())
    assert model.reuse_feature == [None] * 4
    assert all(type(block.last) in (torch.Tensor, type(None)) for block in model.blocks)


def test_where_fake_tensors_cannot_tell_the_first_call_names_the_failing_block() -> None:
    model = tread_fx.route(Stack(ReadingFixedLengthBlock), routes=[(1, 3)], rate=0.5)
    with pytest.raises(tread_fx.RouteCheckError, match="first call's values") as caught:
        model.train()(_inputs())
    assert str(caught.value).startswith("route (1, 3) cannot run: blocks.1 (ReadingFixedLengthB")
    assert _failing_line() in str(caught.value)
    with pytest.raises(tread_fx.RouteCheckError, match="blocks.1"):  # explain runs it once
        tread_fx.explain(Stack(ReadingFixedLengthBlock), [(1, 3)], 0.5, ((_inputs(),), {}))
