"""Snapshot of the routed graph's code for one small DiT (regenerate: UPDATE_SNAPSHOTS=1)."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import dit_inputs, tiny_dit

import tread_fx

SNAPSHOT = Path(__file__).parent / "snapshots" / "dit_depth4_route_1_3.py.txt"


def test_routed_dit_graph_code_matches_the_snapshot():
    model = tread_fx.route(tiny_dit(depth=4), routes=[(1, 3)], rate=0.5, seed=0)
    model.train()(*dit_inputs())
    code = tread_fx.routed_graphs(model)[0].gm.code.strip() + "\n"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(code)
    assert code == SNAPSHOT.read_text()
    for inserted in ("select_random", "gather_tokens", "scatter_tokens", "tread_noise_0"):
        assert inserted in code
