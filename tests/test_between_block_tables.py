"""A position table added to the stream *between* two routed stacks (a masked encoder/decoder
DiT: encoder blocks, then ``x = x + self.decoder_pos_embed`` with a ``[1, N, D]`` parameter,
then decoder blocks taking a long skip of the embedded input). No block receives the table;
the code between the blocks adds it to the stream along the token dim, which the traced
graph shows: a per-token table, its kept rows taken per sample from its expansion over the
batch, or indexed once when the route's selection is shared
(``tread_fx/passes/plan/region_uses.py``)."""

from __future__ import annotations

import pytest
import torch
from third_party_checks import INVARIANTS, Case, check_compiled, gather_rows, scatter_rows
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class Block(nn.Module):
    """adaLN-modulated attention block; ``skip=True`` takes ``cat([x, skip])`` first."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.skip_proj = nn.Linear(2 * D, D) if skip else None
        self.norm = nn.LayerNorm(D, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.modulation = nn.Linear(D, 2 * D)

    def forward(self, x: torch.Tensor, c: torch.Tensor, skip: torch.Tensor | None = None):
        if self.skip_proj is not None:
            x = self.skip_proj(torch.cat([x, skip], dim=-1))
        shift, scale = self.modulation(c)[:, None].chunk(2, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class EncoderDecoder(nn.Module):
    """Three encoder blocks, a decoder position table added, two decoder blocks each taking
    the embedded input as a long skip. ``table`` is the decoder table's shape."""

    def __init__(self, table: tuple[int, ...] = (1, N, D)) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.t_embed = nn.Linear(1, D)
        self.pos = nn.Parameter(torch.randn(1, N, D))
        self.encoder = nn.ModuleList(Block() for _ in range(3))
        self.decoder = nn.ModuleList(Block(skip=True) for _ in range(2))
        self.decoder_pos = nn.Parameter(torch.randn(*table))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) + self.pos
        c = self.t_embed(t[:, None])
        skip = x
        for block in self.encoder:
            x = block(x, c)
        x = x + self.decoder_pos
        for block in self.decoder:
            x = block(x, c, skip)
        return self.head(x)


def _inputs():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(B, N, 3, generator=g), torch.rand(B, generator=g)), {}


CASES = [
    Case("whole", EncoderDecoder, _inputs, routes=[(1, -1)]),
    Case("across-the-table", EncoderDecoder, _inputs, routes=[(2, 4)]),
    Case("ends-after-the-table", EncoderDecoder, _inputs, routes=[(1, 3)]),
    Case("to-the-end", EncoderDecoder, _inputs, routes=[(1, 5)]),
    Case(
        "shared-selection",
        EncoderDecoder,
        _inputs,
        routes=[(1, -1)],
        route_kwargs={"share_selection": True},
    ),
    Case("table-without-batch-dim", lambda: EncoderDecoder((N, D)), _inputs, routes=[(1, -1)]),
]


def _resolved(case: Case) -> tuple[int, int]:
    start, end = case.routes[0]
    return start, end % 5 if end < 0 else end


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_route_spans_both_stacks(case):
    exp = tread_fx.explain(case.model(), case.routes, 0.5, _inputs(), flops=False)
    assert [s["path"] for s in exp.stacks] == ["encoder", "decoder"]
    start, end = _resolved(case)
    assert [b.tokens_routed for b in exp.blocks] == [
        N // 2 if start <= i < end else N for i in range(5)
    ]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def _gather(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return gather_rows(x.expand(ids.shape[0], N, D), ids)


def _by_hand(model: EncoderDecoder, x, t, route: tuple[int, int], ids: torch.Tensor):
    """TREAD by hand: the code before block ``i`` runs on the kept tokens when the route
    covers that hand-off (``start < i <= end``), the table's kept rows with it; the long
    skip is gathered for the routed blocks."""
    start, end = route
    x = model.embed(x) + model.pos
    c = model.t_embed(t[:, None])
    skip, at_start = x, None
    blocks = [*model.encoder, *model.decoder]
    for i, block in enumerate(blocks):
        if i == len(model.encoder):
            inside = start < i <= end
            x = x + (_gather(model.decoder_pos, ids) if inside else model.decoder_pos)
        if i == start:
            at_start, x = x, _gather(x, ids)
        if i == end:
            x = scatter_rows(at_start, ids, x)
        args = (x, c) if i < len(model.encoder) else (x, c, skip)
        if start <= i < end and i >= len(model.encoder):
            args = (x, c, _gather(skip, ids))
        x = block(*args)
    if end == len(blocks):
        x = scatter_rows(at_start, ids, x)
    return model.head(x)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_output_is_tread_by_hand(case):
    model = case.model()
    case.route(model)
    (x, t), _ = _inputs()
    routed = model.train()(x, t)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        expected = _by_hand(model, x, t, _resolved(case), ids)
    torch.testing.assert_close(routed.detach(), expected)


@pytest.mark.parametrize(
    ("case", "per_sample"),
    [(CASES[0], True), (CASES[4], False), (CASES[5], False)],
    ids=["broadcast-table", "shared-asked", "no-batch-dim"],
)
def test_selection_is_per_sample_where_the_table_allows(case, per_sample):
    """A [1, N, D] table added between the blocks keeps the selection per sample; asked to
    share it, or a [N, D] table (its broadcast the rules do not take as seen), shares it."""
    model = case.model()
    case.route(model)
    model.train()(*_inputs()[0])
    kept = tread_fx.route_info(model)[0].kept
    assert (not torch.equal(kept[0], kept[1])) == per_sample


@pytest.mark.slow
def test_compiles_without_recompiling():
    check_compiled(CASES[0])
