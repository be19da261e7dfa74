"""Forwards as real models write them: item assignment, in-place ops, torch.finfo, einops.

Each model here is self-written and does exactly one of the things that stopped the tracer
in the diffusers-suite sweep; each is checked against docs/design.md#invariants.
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import (
    Case,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx
from tread_fx.runtime.guards import check_traced_value

einops = pytest.importorskip("einops")

B, C, S, P, D = 2, 3, 8, 2, 32  # batch, channels, image side, patch, width: 16 tokens


class Block(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class Backbone(nn.Module):
    """Patchify -> 4 blocks -> unpatchify; subclasses change only how the tokens are made."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(C * P * P, D)
        self.pos = nn.Linear(2, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, C * P * P)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        x = x.reshape(b, c, h // P, P, w // P, P).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // P) * (w // P), c * P * P)

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b = x.shape[0]
        x = x.reshape(b, h // P, w // P, C, P, P).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, C, h, w)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(self.patchify(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x)
        for block in self.blocks:
            h = block(h)
        return self.unpatchify(self.head(h), x.shape[2], x.shape[3])


class ItemAssignment(Backbone):
    """Position ids written into a zeros table item by item (HiDream, Lumina 2, OmniGen)."""

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape[2] // P, x.shape[3] // P
        ids = torch.zeros(rows, cols, 2)
        ids[..., 0] = ids[..., 0] + torch.arange(rows)[:, None]
        ids[..., 1] = ids[..., 1] + torch.arange(cols)[None, :]
        mask = torch.zeros(x.shape[0], rows * cols)
        mask[:, : rows * cols // 2] = 1.0
        h = self.embed(self.patchify(x)) + self.pos(ids.reshape(rows * cols, 2) / rows)
        return h * (1 + mask[..., None])


class InPlace(Backbone):
    """In-place updates of the stream before the blocks (``mul_``, ``add_``)."""

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(self.patchify(x))
        scale = torch.ones(h.shape[1], 1)
        scale.mul_(0.5).add_(0.25)
        return h * scale


class Finfo(Backbone):
    """``torch.finfo(x.dtype)`` on a traced value (a masked minimum, ACE-Step)."""

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(self.patchify(x))
        low = torch.finfo(h.dtype).min
        return h.clamp(min=low) + torch.zeros(1, dtype=h.dtype, device=h.device)


class Einops(Backbone):
    """Patchify and unpatchify with einops, the idiom of community DiT/ViT code."""

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        return einops.rearrange(x, "b c (h p1) (w p2) -> b (h w) (c p1 p2)", p1=P, p2=P)

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return einops.rearrange(
            x, "b (h w) (c p1 p2) -> b c (h p1) (w p2)", h=h // P, p1=P, p2=P, c=C
        )


class ExpandedTable(Backbone):
    """A constant table expanded to the traced batch size (``t.expand(batch, -1, -1)``)."""

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(self.patchify(x))
        coords = torch.stack([torch.arange(16.0), torch.ones(16)], dim=-1) / 16
        return h + self.pos(coords.unsqueeze(0).expand(x.shape[0], -1, -1))


class TransposedStream(Backbone):
    """A conv patch embedding whose stream stays transposed in memory (timm's PatchEmbed)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, D, P, P)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).flatten(2).transpose(1, 2)


def _inputs():
    return (torch.randn(B, C, S, S, generator=torch.Generator().manual_seed(1)),), {}


CASES = [
    Case(cls.__name__, cls, _inputs, routes=[(1, 3)])
    for cls in (ItemAssignment, InPlace, Finfo, Einops, ExpandedTable, TransposedStream)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_eval_is_bitwise_unrouted(case):
    check_eval_is_bitwise_unrouted(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rate_zero_equals_training(case):
    check_rate_zero_equals_training(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_and_gradients(case):
    infos = check_routed_shape_count_and_change(case)
    assert infos[0].kept.shape[1] == 8
    check_gradients(case)


def test_item_assignment_is_one_out_of_place_node_per_write():
    model = ItemAssignment()
    tread_fx.route(model, routes=[(1, 3)], seed=0)
    model.train()(*_inputs()[0])
    gm = tread_fx.routed_graphs(model)[0].gm
    writes = [
        n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "functional_setitem"
    ]
    assert len(writes) == 3


def test_einops_functions_become_leaf_calls_without_registration():
    model = Einops()
    tread_fx.route(model, routes=[(1, 3)], seed=0)
    model.train()(*_inputs()[0])
    gm = tread_fx.routed_graphs(model)[0].gm
    assert sum(n.target is einops.rearrange for n in gm.graph.nodes) == 2


def test_in_place_mutation_is_seen_by_later_readers():
    from tread_fx.passes.trace.mutation import is_inplace_method

    model = InPlace()
    tread_fx.route(model, routes=[(1, 3)], seed=0)
    model.train()(*_inputs()[0])
    gm = tread_fx.routed_graphs(model)[0].gm
    add = next(n for n in gm.graph.nodes if is_inplace_method(n) and n.target == "add_")
    ones = add.args[0].args[0]  # add_(mul_(ones))
    assert [u.target for u in ones.users] == ["mul_"], "later readers must read the mutation"


def test_rate_zero_blocks_see_the_stream_with_its_own_strides():
    """At rate 0 every token is kept: the routed blocks get the stream itself, not a
    contiguous copy (a transposed stream summed in another order is not bitwise equal)."""
    from third_party_checks import capture_block_inputs

    model = TransposedStream()
    with capture_block_inputs(model.blocks[1]) as calls:
        model.train()(*_inputs()[0])
        tread_fx.route(model, routes=[(1, 3)], rate=0.0, seed=0)
        model.train()(*_inputs()[0])  # traces (one real call), then runs the routed graph
    unrouted, routed = calls[0][0][0], calls[-1][0][0]
    assert not unrouted.is_contiguous() and routed.stride() == unrouted.stride()


class DataDependent(Backbone):
    """Python that reads tensor data in the model's own forward: a branch on ``mask.any()``
    and a count read with ``.item()`` (HunyuanVideo 1.5, Wan-Animate)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x)
        if mask.any():  # a guard: checked again on every routed call
            h = h * 2
        shift = mask.sum().item()
        h = h + shift
        for block in self.blocks:
            h = block(h)
        return self.unpatchify(self.head(h), x.shape[2], x.shape[3])


def _masked(on: bool):
    x = _inputs()[0][0]
    return (x, torch.full((B, 3), on)), {}


DATA_CASE = Case("data-dependent", DataDependent, lambda: _masked(True), routes=[(1, 3)])


def test_data_dependent_python_routes_with_guards():
    check_eval_is_bitwise_unrouted(DATA_CASE)
    check_rate_zero_equals_training(DATA_CASE)
    check_routed_shape_count_and_change(DATA_CASE)
    check_gradients(DATA_CASE)
    model = DATA_CASE.route(DATA_CASE.model())
    model.train()(*_masked(True)[0])
    gm = tread_fx.routed_graphs(model)[0].gm
    assert sum(n.target is check_traced_value for n in gm.graph.nodes) == 2


def test_a_changed_data_dependent_value_traces_again_in_eager():
    model = DATA_CASE.model()
    with torch.no_grad():
        expected = model.train()(*_masked(False)[0])
    DATA_CASE.route(model, rate=0.0)
    model.train()(*_masked(True)[0])
    with torch.no_grad():
        out = model.train()(*_masked(False)[0])  # the guard fails: traced again, not wrong
    assert torch.equal(out, expected)


@pytest.mark.slow
def test_a_changed_data_dependent_value_is_a_clear_error_when_compiled():
    import torch._dynamo

    torch._dynamo.reset()
    model = DATA_CASE.route(DATA_CASE.model(), compile={"backend": "aot_eager"})
    model.train()(*_masked(True)[0])  # fullgraph=True: the guards add no graph break
    with pytest.raises(tread_fx.RoutedGraphError, match="test_trace_real_forwards.py"):
        model.train()(*_masked(False)[0])


class OneTimeRescale(Backbone):
    """Rescales a weight in place under no_grad on its first training call, then flips a flag
    (a one-time side effect, as some transformers models do when the training flag flips)."""

    def __init__(self) -> None:
        super().__init__()
        self.rescaled = False

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rescaled:
            with torch.no_grad():
                self.embed.weight.mul_(0.5)
            self.rescaled = True
        return super().tokens(x)


class EveryCallRescale(Backbone):
    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.embed.weight.mul_(0.999)  # changes the module on every call
        return super().tokens(x)


def test_a_one_time_side_effect_happens_once_and_is_never_replayed():
    import copy

    model = OneTimeRescale()
    eager = copy.deepcopy(model)
    with torch.no_grad():
        eager.train()(*_inputs()[0])  # rescales once
    tread_fx.route(model, routes=[(1, 3)], rate=0.0, seed=0)
    for _ in range(2):
        out = model.train()(*_inputs()[0])  # traced twice (after the flip), then replayed
        out.square().mean().backward()  # no in-place write on a leaf in the graph
    assert torch.equal(model.embed.weight, eager.embed.weight)  # rescaled exactly once
    gm = tread_fx.routed_graphs(model)[0].gm
    assert not any(n.op == "call_method" and n.target == "mul_" for n in gm.graph.nodes)


def test_a_side_effect_on_every_call_is_refused_with_file_and_line():
    model = tread_fx.route(EveryCallRescale(), routes=[(1, 3)], seed=0)
    with pytest.raises(
        tread_fx.UntraceableModelError,
        match=r"embed\.weight\.mul_\(\) at .*test_trace_real_forwards\.py:\d+",
    ):
        model.train()(*_inputs()[0])
