"""Every torch function, ``Tensor`` method and attribute whose answer for a real tensor is a
Python value read from metadata only (``tread_fx/passes/trace/torch_api.py`` sorts torch's
whole overridable API by running it) is answered while tracing, in a model's own forward and
inside a block, so a branch on it goes the way it goes eagerly.

The cases are generated over that enumeration: a function that falls through (refused as a
data read, or answered wrongly) fails its own case. The issue's model, a timestep embedding
outside the blocks asking ``torch.is_floating_point(t)``, routes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tread_fx
from tread_fx.passes.trace import torch_api
from tread_fx.passes.trace.tracer import trace_call

pytestmark = pytest.mark.filterwarnings("ignore:volatile was removed")
B, N, D = 2, 16, 32
CALLS = sorted(
    (access, name, torch_api.probed(fn, name.rsplit(".", 1)[-1]))
    for (access, name), fn in torch_api.enumerate_api().items()
    if torch_api.probed(fn, name.rsplit(".", 1)[-1])[0] in torch_api.ANSWERED_KINDS
)


def _read(access: str, name: str, slots: tuple, x: torch.Tensor):
    """The enumerated call on ``x`` (its tensor arguments all ``x``), as the probe made it."""
    rest = [x if s == "T" else s for s in slots[1:]]
    if access == "attribute":
        return getattr(x, name)
    if access == "method":
        return getattr(x, name)(*rest)
    return torch_api.enumerate_api()[(access, name)](x, *rest)


def _branch(calls, x: torch.Tensor, expected: list) -> torch.Tensor:
    """Scale ``x`` by a factor per call whose answer is the eager one: a wrong answer shows."""
    for i, ((access, name, (_, _, slots)), want) in enumerate(zip(calls, expected)):
        if _read(access, name, slots, x) == want:
            x = x * (1.0 + 0.01 * (i + 1))
    return x


def _expected(calls) -> list:
    return [_read(a, n, p[2], torch.zeros(B, N, D)) for a, n, p in calls]


class Block(nn.Module):
    def __init__(self, calls) -> None:
        super().__init__()
        self.calls, self.expected = calls, _expected(calls)
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.lin(x + pos)
        return x + _branch(self.calls, torch.tanh(h), self.expected)


class Model(nn.Module):
    """``calls`` read in the model's own forward (``own``) or inside each block."""

    def __init__(self, calls, own: bool, depth: int = 4) -> None:
        super().__init__()
        self.own, self.calls = own, calls
        self.expected = _expected(calls)
        self.proj = nn.Linear(3, D)
        self.pos = nn.Parameter(torch.randn(1, N, D) * 0.1)  # classified by tracing the blocks
        self.blocks = nn.ModuleList(Block(calls if not own else []) for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.own:
            h = _branch(self.calls, h, self.expected)
        for block in self.blocks:
            h = block(h, self.pos)
        return self.head(h)


def _input() -> torch.Tensor:
    return torch.randn(B, N, 3, generator=torch.Generator().manual_seed(3))


def test_the_enumeration_finds_the_metadata_reads():
    names = {name for _, name, _ in CALLS}
    for read in ("torch.is_floating_point", "is_contiguous", "is_inference", "element_size"):
        assert read in names
    kinds = {name: p[0] for _, name, p in CALLS}
    assert kinds["dim"] == "shape" and kinds["is_contiguous"] == "guarded"
    assert torch_api.kind_of_method("item") == "data"
    assert torch_api.kind_of_attribute("requires_grad") == "untraced"


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c[0]}:{c[1]}")
def test_each_metadata_read_is_answered(call):
    torch.manual_seed(0)
    x = _input()
    for where in ("forward", "block"):
        model = Model([call], own=where == "forward", depth=1)
        traced = trace_call(model, (x,), {}, leaf_paths=set())  # blocks traced through too
        assert not traced.auto_leaves, f"{where}: {traced.auto_leaves}"
        out = type(traced.gm).forward(traced.wrapper, x)
        assert torch.equal(out[0], model(x)), where
    block = model.blocks[0]
    h = torch.randn(B, N, D)
    traced = trace_call(block, (h, model.pos), {}, leaf_paths=set())  # as the planner does
    assert torch.equal(
        type(traced.gm).forward(traced.wrapper, h, model.pos)[0], block(h, model.pos)
    )


@pytest.mark.parametrize("own", [True, False], ids=["forward", "block"])
def test_all_reads_route(own):
    torch.manual_seed(0)
    model, x = Model(CALLS, own=own), _input()
    with torch.no_grad():
        reference = model.train()(x)
        unrouted_eval = model.eval()(x)
    tread_fx.route(model, routes=[(1, 3)], rate=0.0)
    with torch.no_grad():
        assert torch.equal(model.train()(x), reference)  # every branch as eagerly
        assert torch.equal(model.eval()(x), unrouted_eval)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, reroute=True)
    out = model.train()(x)
    out.sum().backward()
    assert out.shape == reference.shape and tread_fx.route_info(model)[0].kept.shape[1] == N // 2


def timestep_embedding(t: torch.Tensor) -> torch.Tensor:
    """The issue's embedding, called from the model's own forward: an integer timestep is
    made float before the sinusoids."""
    if not torch.is_floating_point(t):
        t = t.float()
    freqs = torch.exp(-math.log(100.0) * torch.arange(4, device=t.device) / 4)
    angles = t[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class IssueBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp, self.mod = nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x) * (1 + self.mod(emb)[:, None]))


class IssueDiT(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(3, D)
        self.t_embed = nn.Sequential(nn.Linear(8, D), nn.SiLU(), nn.Linear(D, D))
        self.blocks = nn.ModuleList(IssueBlock() for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb, h = self.t_embed(timestep_embedding(t)), self.proj(x)
        for block in self.blocks:
            h = block(h, emb)
        return self.head(h)


def _routed_by_hand(model: IssueDiT, x, t, kept: torch.Tensor) -> torch.Tensor:
    """Blocks 1 and 2 on the kept tokens, the others back at their block-1 value."""
    emb, h = model.t_embed(timestep_embedding(t)), model.proj(x)
    h = model.blocks[0](h, emb)
    index = kept[..., None].expand(-1, -1, D)
    part = h.gather(1, index)
    for block in model.blocks[1:3]:
        part = block(part, emb)
    h = h.scatter(1, index, part)
    return model.head(model.blocks[3](h, emb))


@pytest.mark.parametrize("t", [torch.tensor([3, 700]), torch.tensor([0.1, 0.9])], ids=str)
def test_is_floating_point_in_a_timestep_embedding(t):
    torch.manual_seed(0)
    model, x = IssueDiT(), _input()
    tread_fx.route(model, [(1, -1)], 0.5)
    out = model.train()(x, t)
    kept = tread_fx.route_info(model)[0].kept
    assert torch.allclose(out, _routed_by_hand(model, x, t, kept), atol=1e-6)
    model.eval()
    assert torch.equal(model(x, t), tread_fx.unroute(model)(x, t))


class StrideAware(IssueDiT):
    """Branches on its input's strides, which the call key does not hold."""

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if x.is_contiguous() else 0.5
        return super().forward(x * scale, t)


def test_an_answer_outside_the_call_key_is_checked_on_every_call():
    torch.manual_seed(0)
    model, x, t = StrideAware(), _input(), torch.tensor([0.1, 0.9])
    tread_fx.route(model, [(1, -1)], 0.0)
    transposed = x.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides
    for inputs in (x, transposed, x):
        with torch.no_grad():
            assert torch.equal(model.train()(inputs, t), type(model).forward(model, inputs, t))


class GradAware(IssueDiT):
    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if x.is_leaf:  # the trace's copies are always leaves: refused, not baked
            x = x * 2  # (requires_grad is answered: tests/test_requires_grad_reads.py)
        return super().forward(x, t)


def test_autograd_state_of_a_traced_value_is_refused():
    model = tread_fx.route(GradAware(), [(1, -1)], 0.5)
    with pytest.raises(tread_fx.errors.UntraceableModelError, match="autograd state"):
        model.train()(_input(), torch.tensor([0.1, 0.9]))


@pytest.mark.parametrize(
    "ambient",
    [lambda: torch.device("meta"), torch.inference_mode],
    ids=["meta-device-context", "inference-mode"],
)
def test_a_kind_does_not_depend_on_the_callers_thread_state(ambient):
    """The first question about a name caches its answer: asked under the caller's
    ``torch.device("meta")`` context or inference mode, it is the answer asked anywhere."""
    names = [("method", "__bool__"), ("method", "dim"), ("method", "is_contiguous")]
    names += [("method", "item"), ("attribute", "is_leaf"), ("method", "element_size")]
    api = torch_api.enumerate_api()
    torch_api.probed.cache_clear()
    with ambient():
        asked_there = [torch_api.classify(api[k], k[1]) for k in names]
    torch_api.probed.cache_clear()
    assert asked_there == [torch_api.classify(api[k], k[1]) for k in names]
    assert asked_there == ["data", "shape", "guarded", "data", "untraced", "metadata"]
