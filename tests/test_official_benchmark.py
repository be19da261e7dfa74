"""benchmarks/official.py: loading the authors' files from a path, the checks, the entry point.

The authors' code is never part of this repository. These tests write a stand-in with the same
interface into a temporary folder (a ``DiT`` with ``enable_routing``/``routes``/``router``,
``class_drop_prob`` and ``force_routing``, a ``Router`` in ``routing_module.py``, an
``@torch.compile`` on ``forward``). With ``TREAD_OFFICIAL=/path/to/CompVis/tread`` set, the
last test runs the entry point on the real files at test size. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import official  # noqa: E402

ROUTER = """
import torch

class Router:
    def get_mask(self, x, selection_rate=0.0):
        keep = x.shape[1] - int(x.shape[1] * selection_rate)
        return torch.rand(x.shape[0], x.shape[1], device=x.device).argsort(dim=1)[:, :keep]

    def start_route(self, x, ids):
        return x.gather(1, ids.unsqueeze(-1).expand(-1, -1, x.size(2)))

    def end_route(self, x, ids, original_x):
        return original_x.scatter(1, ids.unsqueeze(-1).expand(-1, -1, x.size(2)), x)
"""

STAND_IN = """
import torch
from routing_module import Router
from tread_fx.models.dit import DiT as _Reference


class DiT(_Reference):
    def __init__(self, cond_mode="adaln", enable_routing=False, routes=None, **kwargs):
        super().__init__(**kwargs)
        self.enable_routing, self.routes, self.router = enable_routing, routes, Router()

    @torch.compile
    def forward(self, x, t, y, class_drop_prob=0.0, force_routing=False):
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        route = self.routes[0]
        routing = (self.training and self.enable_routing) or force_routing
        for i, block in enumerate(self.blocks):
            if routing and i == route["start_layer_idx"]:
                saved = x.clone()
                ids = self.router.get_mask(x, selection_rate=route["selection_ratio"])
                x = self.router.start_route(x, ids)
            x = block(x, c)
            if routing and i == route["end_layer_idx"]:
                x = self.router.end_route(x, ids, original_x=saved)
        return self.unpatchify(self.final_layer(x, c))
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    (tmp_path / "routing_module.py").write_text(textwrap.dedent(ROUTER))
    (tmp_path / "dit.py").write_text(textwrap.dedent(STAND_IN))
    return tmp_path


def test_load_strips_torch_compile_and_leaves_no_module_behind(stand_in):
    before = set(sys.modules)
    module = official.load_official(stand_in)
    assert not hasattr(module.DiT.forward, "_torchdynamo_orig_callable")  # a plain function
    assert "routing_module" not in sys.modules or "routing_module" in before
    kept = official.load_official(stand_in / "dit.py", keep_compile=True)
    assert hasattr(kept.DiT.forward, "_torchdynamo_orig_callable")


def test_missing_files_and_missing_dependencies_exit_with_a_message(tmp_path, stand_in):
    with pytest.raises(SystemExit, match="dit.py, .*routing_module.py not found"):
        official.load_official(tmp_path / "nowhere")
    (stand_in / "dit.py").write_text("import not_installed_anywhere\n")
    with pytest.raises(SystemExit, match="'not_installed_anywhere', which is not installed"):
        official.load_official(stand_in)


def _check(out: Path) -> dict:
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["same_network"] == {"unrouted": 0.0, "routed": 0.0}
    flops = data["flops"]
    assert flops["authors unrouted"] == flops["ours unrouted"]
    assert flops["authors routed"] == flops["ours route()"] == flops["ours hand-written"]
    assert flops["ours route()"] < flops["ours unrouted"]
    summary = data["summary"]
    assert set(summary["median_s"]) == set(official.VARIANTS)
    assert summary["ours/authors routed"] > 0 and summary["ours/authors unrouted"] > 0
    assert set(summary["efficiency"]) == {"authors routed", "ours route()", "ours hand-written"}
    md = out.with_suffix(".md").read_text()
    assert "| authors routed |" in md and "ours/authors routed" in md
    return data


def test_entry_point_on_a_stand_in_checks_and_times_every_variant(stand_in, tmp_path):
    out = tmp_path / "side_by_side"
    argv = ["--official", str(stand_in), "--tiny", "--repeats", "1", "--warmup", "1",
            "--quiet", "--out", str(out)]  # fmt: skip
    assert official.main(argv) == 0
    data = _check(out)
    assert data["meta"]["route"] == [1, 3] and data["meta"]["rounds"] == 1


@pytest.mark.skipif(
    not os.environ.get("TREAD_OFFICIAL"), reason="set TREAD_OFFICIAL to a CompVis/tread checkout"
)
def test_entry_point_on_the_authors_files(tmp_path):
    out = tmp_path / "side_by_side"
    argv = ["--official", os.environ["TREAD_OFFICIAL"], "--tiny", "--repeats", "1", "--warmup",
            "1", "--quiet", "--out", str(out)]  # fmt: skip
    assert official.main(argv) == 0
    _check(out)
