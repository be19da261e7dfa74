"""A block traced only in part still has its side values classified (issue 41, bullet 3).

A routed block whose own ``forward`` holds a line no leaf can get past (a numpy round trip
written in the block itself, not in a helper function) runs whole on the kept tokens. How it
uses a side value is read from the part of its code traced before that line: a table used
there with the tokens is cut to the kept tokens, with a warning naming the block and the
line (a use after the line is not seen). A value the block uses only after the line is
still refused, naming the line (before, both were refused).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import tread_fx
from tread_fx.errors import SideInputError

B, N, D = 2, 16, 32


class TableFirst(nn.Module):
    """Uses its table before the numpy line."""

    def __init__(self) -> None:
        super().__init__()
        self.mix, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(x * table)
        gate = torch.from_numpy(np.tanh(x.detach().numpy())).to(x)  # stops the trace
        return x + self.out(x) * gate


class TableAfter(TableFirst):
    """Uses its table only after the numpy line."""

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        gate = torch.from_numpy(np.tanh(x.detach().numpy())).to(x)  # stops the trace
        return x + self.mix(x * table) * gate


class Model(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, D), nn.Linear(D, 8)
        self.register_buffer("table", torch.randn(N, D))
        self.blocks = nn.ModuleList(block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, self.table)
        return self.head(h)


def _reference(model: Model, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Route (1, 3) written out: tokens ``idx`` (per sample) with their table rows."""
    h = model.blocks[0](model.inp(x), model.table)
    rows = idx[..., None].expand(-1, -1, D)
    kept = h.gather(1, rows)
    kept_table = model.table.expand(B, -1, -1).gather(1, rows)
    for block in model.blocks[1:3]:
        kept = block(kept, kept_table)
    h = h.scatter(1, rows, kept)
    return model.head(model.blocks[3](h, model.table))


def test_a_table_used_before_the_line_is_cut_to_the_kept_tokens():
    torch.manual_seed(0)
    model, x = Model(TableFirst), torch.randn(B, N, 8)
    reference = Model(TableFirst)
    reference.load_state_dict(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
        out = model.train()(x)
    (info,) = tread_fx.route_info(model)
    torch.testing.assert_close(out, _reference(reference, x, info.kept))
    partial = [str(w.message) for w in caught if "traced before that line" in str(w.message)]
    assert partial, [str(w.message) for w in caught]
    line = TableFirst.forward.__code__.co_firstlineno + 2
    assert f"test_partial_block_trace.py:{line}" in partial[0]
    assert "blocks.1" in partial[0] and "table" in partial[0]


def test_explain_says_the_tables_use_was_read_from_part_of_the_block():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = tread_fx.explain(
            Model(TableFirst), [(1, 3)], 0.5, torch.randn(B, N, 8), flops=False
        )
    (route,) = explained.to_dict()["routes"]
    tables = [s for s in route["side_inputs"] if s["source"] == "table"]
    assert tables and all(s["treatment"].startswith("adapted") for s in tables)
    assert all("traced in part" in s["reason"] for s in tables)


def test_a_table_used_only_after_the_line_is_refused_naming_it():
    torch.manual_seed(0)
    model = Model(TableAfter)
    with pytest.raises(SideInputError) as raised:
        tread_fx.route(model, routes=[(1, 3)], rate=0.5)
        model.train()(torch.randn(B, N, 8))
    line = TableAfter.forward.__code__.co_firstlineno + 1
    assert f"test_partial_block_trace.py:{line}" in str(raised.value)
    assert "traced through only up to the line that stopped it" in str(raised.value)
