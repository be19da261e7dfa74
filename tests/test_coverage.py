"""The coverage sweep's verdict cannot be gamed, and the timm sweep does not regress."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import dit_inputs, tiny_dit
from stream_models import JointInputs, N, joint_inputs

from benchmarks.coverage import main as coverage_main
from benchmarks.coverage import totals, write_markdown
from benchmarks.coverage_checks import Case, judge
from benchmarks.coverage_sources import raise_layer_counts

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "results" / "coverage.json"


def _dit_case(make=tiny_dit) -> Case:
    return Case("tiny-dit", "test", make, lambda: (dit_inputs(), {}))


def test_a_routed_dit_routes():
    verdict = judge(_dit_case())
    assert verdict.verdict == "routes", verdict
    assert verdict.flop_ratio is not None and verdict.flop_ratio < 1
    assert verdict.tokens == "16->8"


def test_a_no_op_route_scores_zero():
    def no_op(model, **kwargs):
        return model

    verdict = judge(_dit_case(), route_fn=no_op)
    assert verdict.verdict == "broken" and verdict.stage == "route info"


def test_a_route_that_changes_eval_is_broken():
    def eval_breaking(model, **kwargs):
        import tread_fx

        tread_fx.route(model, **kwargs)
        with torch.no_grad():
            model.final_layer.linear.bias.add_(1.0)  # inference no longer equals the original
        return model

    verdict = judge(_dit_case(), route_fn=eval_breaking)
    assert verdict.verdict == "broken" and verdict.stage == "eval output"


def test_a_router_that_routes_the_wrong_stream_scores_wrong_stream():
    """Every other check passes when the context positions of a joint stream are routed."""
    import tread_fx

    def wrong_stream(model, **kwargs):
        return tread_fx.route(model, stream="context", **kwargs)  # the text, not the image

    case = Case("joint", "test", JointInputs, joint_inputs, noisy="x")
    assert judge(case).verdict == "routes"
    verdict = judge(case, route_fn=wrong_stream)
    assert verdict.verdict == "wrong stream" and verdict.stage == "stream provenance"
    assert f"positions {N}..{2 * N}" in verdict.reason and f"0..{N}" in verdict.reason
    assert totals([verdict.to_dict()])["broken"] == 1


class _SparseGrid(torch.nn.Module):
    """Points scattered into a grid of 16 cells, half of them left empty (DiT-3D's voxels):
    the empty cells are tokens no input reaches, not another input's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(32, 2, 64, 0.0, batch_first=True) for _ in range(4)
        )
        self.head = torch.nn.Linear(32, 3)

    def forward(self, points, t):
        cells = torch.zeros(points.shape[0], 16, 3).index_copy(1, torch.arange(0, 16, 2), points)
        x = self.embed(cells)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * (1 + t[:, None, None])


def _sparse_grid_inputs() -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, 8, 3, generator=gen), torch.rand(2, generator=gen)), {}


def test_grid_cells_no_input_reaches_are_no_wrong_stream():
    assert judge(Case("sparse-grid", "test", _SparseGrid, _sparse_grid_inputs)).verdict == "routes"


def test_the_noisy_input_defaults_to_the_first_argument():
    case = Case("joint", "test", JointInputs, joint_inputs)
    assert judge(case).verdict == "routes"
    wrong = Case("joint", "test", JointInputs, joint_inputs, noisy="context")
    assert judge(wrong).verdict == "wrong stream"


def test_a_model_without_a_block_stack_is_refused():
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x)

    case = Case("plain", "test", Plain, lambda: ((torch.randn(2, 4, 8),), {}))
    verdict = judge(case)
    assert verdict.verdict == "refused" and verdict.stage == "route()"
    assert "BlockStackNotFoundError" in verdict.reason


def test_a_model_that_does_not_run_is_not_buildable():
    case = Case("bad", "test", tiny_dit, lambda: ((torch.randn(2, 3),), {}))
    assert judge(case).verdict == "not buildable"


SELF_COMPILED: list = []


def _counting_backend(gm, example_inputs):
    SELF_COMPILED.append(gm)
    return gm.forward


class _SelfCompiledBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU())
        self.out = torch.nn.Linear(64, 32)

    @torch.compile(backend=_counting_backend)
    def forward(self, x):
        return x + self.out(self.mlp(x))


class _SelfCompiledModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 32)
        self.blocks = torch.nn.ModuleList(_SelfCompiledBlock() for _ in range(4))
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_model_that_compiles_its_own_code_is_checked_with_that_off():
    """Its ``@torch.compile`` is off for the whole check (eager against eager; no compile on
    the sweep's CPUs), the note says so, and ``route()`` still traces the decorated code."""
    inputs = lambda: ((torch.randn(2, 16, 3, generator=torch.Generator().manual_seed(3)),), {})
    SELF_COMPILED.clear()
    verdict = judge(Case("self-compiled", "test", _SelfCompiledModel, inputs))
    assert verdict.verdict == "routes", verdict
    assert "_SelfCompiledBlock.forward" in verdict.note and "force_eager" in verdict.note
    assert SELF_COMPILED == []


def test_layer_counts_are_raised_to_four():
    init = {"num_layers": 2, "depth": 1, "num_attention_heads": 2, "patch_size": 1, "x": True}
    assert raise_layer_counts(init) == {**init, "num_layers": 4, "depth": 4}


def test_report_totals_and_markdown(tmp_path):
    rows = [
        {"name": "a", "verdict": "routes", "tokens": "16->8", "flop_ratio": 0.7},
        {"name": "b", "verdict": "refused", "stage": "route()", "reason": "X: no stack"},
    ]
    data = {"demo": {"meta": {"source": "test"}, "rows": rows, "date": "d", "seconds": 1}}
    write_markdown(data, tmp_path / "c.md")
    text = (tmp_path / "c.md").read_text()
    assert "| demo | 2 | 1 | 1 | 0 | 0 | 50% |" in text
    assert totals(rows)["buildable"] == 2


@pytest.mark.slow
def test_timm_per_architecture_sweep_does_not_regress():
    """The timm sweep (one model per architecture) against the committed table."""
    section = coverage_main(["timm", "--per-arch", "--no-write", "-j", "2"])
    now = {r["name"]: r["verdict"] for r in section["rows"]}
    committed = json.loads(COMMITTED.read_text())["timm (per architecture)"]["rows"]
    before = {r["name"]: r["verdict"] for r in committed}
    regressed = [n for n, v in before.items() if v == "routes" and now.get(n) != "routes"]
    assert not regressed, f"routed in the committed table, not now: {regressed}"
    assert totals(section["rows"])["broken"] <= totals(committed)["broken"]


def test_a_refusal_reason_is_its_first_line_and_the_details_are_kept():
    """A refusal states its reason on its first line (at most 150 characters): the verdict's
    reason is that line, and its detail keeps the rest."""

    class Unroutable(torch.nn.Module):  # one token: nothing can be routed around
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    verdict = judge(Case("one-token", "test", Unroutable, lambda: ((torch.randn(2, 1, 8),), {})))
    assert verdict.verdict == "refused", verdict
    first = verdict.reason.split(": ", 1)[1]
    assert "\n" not in verdict.reason and 0 < len(first) <= 150, verdict
    assert "routing would save nothing" in first and verdict.detail, verdict
