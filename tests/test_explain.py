"""tread_fx.explain: report content, FLOPs against a direct count, JSON schema, graph diff."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import networkx as nx
import pytest
import torch
from conftest import dit_inputs, tiny_dit
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import tread_fx
from tread_fx.inspection.flops import FLOP_FORMULAS, flop_counter
from tread_fx.inspection.inputs import example_inputs
from tread_fx.inspection.render import to_dot
from tread_fx.inspection.report import SCHEMA
from tread_fx.models.mamba import Mamba_S_2

MAMBA = dict(input_size=8, in_channels=1, num_classes=10, depth=4, hidden_size=32)


def _direct_flops(model: nn.Module, args: tuple) -> int:
    """FLOPs of one real training step, counted by the project's FlopCounterMode."""
    with flop_counter() as counter:
        model.train()(*args).sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def _routed_direct_flops(model: nn.Module, routes, args: tuple) -> int:
    routed = tread_fx.route(copy.deepcopy(model), routes, 0.5, seed=0)
    routed.train()(*args)  # the first call traces (and runs eagerly once): not counted
    return _direct_flops(routed, args)


@pytest.fixture(scope="module")
def dit_case():
    model, args = tiny_dit(depth=6), dit_inputs(batch=2)
    return model, args, tread_fx.explain(model, [(1, 4)], 0.5, args)


@pytest.fixture(scope="module")
def mamba_case():
    torch.manual_seed(0)
    model = Mamba_S_2(**MAMBA, skip=True)  # block 2 gets block 1's output as its skip
    args = dit_inputs(batch=2)
    return model, args, tread_fx.explain(model, [(1, 2)], 0.5, args)


# -- DiT ---------------------------------------------------------------------------------------


def test_dit_report_finds_the_stack_the_stream_and_the_route(dit_case):
    _, _, exp = dit_case
    assert exp.stacks == [{"path": "blocks", "class": "DiTBlock", "count": 6}]
    assert exp.stream["shape"] == [2, 16, 32] and exp.stream["token_dim"] == 1
    assert exp.stream["num_tokens"] == 16 and exp.stream["prefix"] == 0
    (route,) = exp.routes
    assert (route.start, route.end, route.num_tokens, route.kept_tokens) == (1, 4, 16, 8)
    assert sorted(n.role for n in route.inserted) == ["gather", "noise", "scatter", "select"]
    assert [(b.tokens_original, b.tokens_routed) for b in exp.blocks] == [
        (16, 16),
        (16, 8),
        (16, 8),
        (16, 8),
        (16, 16),
        (16, 16),
    ]
    assert [b.route for b in exp.blocks] == [None, 0, 0, 0, None, None]


def test_dit_side_inputs_say_what_happens_to_each_value(dit_case):
    _, _, exp = dit_case
    treated = {(v.direction, v.treatment, tuple(v.received_as)) for v in exp.routes[0].side_inputs}
    assert ("in", "gathered", ("x",)) in treated  # the token stream
    assert ("in", "passed through", ("c",)) in treated  # the adaLN conditioning [B, D]
    assert ("out", "scattered back", ("x",)) in treated
    assert exp.refusal is None


def test_dit_text_report_mentions_every_section(dit_case):
    _, _, exp = dit_case
    text = str(exp)
    for expected in (
        "blocks: 6 x DiTBlock",
        "16 -> 8 tokens",
        "gather_tokens",
        "scatter_tokens",
        "scattered back",
        "passed through",
        "Predicted speed-up",
        "Graph diff",
        "Guards",
        "route 0 keeps",
        "Tensor[2, 1, 8, 8]",
    ):
        assert expected in text, expected
    assert "\033[" not in text and "\033[" in exp.report(color=True)


def test_dit_flops_match_a_direct_count_of_both_graphs(dit_case):
    model, args, exp = dit_case
    assert exp.flops.original.flops == _direct_flops(model, args)
    assert exp.flops.routed.flops == _routed_direct_flops(model, [(1, 4)], args)
    blocks = [b.original.flops for b in exp.blocks]
    assert len(set(blocks)) == 1 and blocks[0] > 0
    routed = {b.route: b.routed.flops for b in exp.blocks}
    assert routed[0] < routed[None] / 2 + 1  # half the tokens: at most half the block FLOPs
    assert exp.flops.speedup == pytest.approx(exp.flops.original.flops / exp.flops.routed.flops)
    assert 1.2 < exp.flops.speedup < 2.0


def test_aten_view_has_per_block_graphs_and_the_inserted_ops(dit_case):
    _, _, exp = dit_case
    block = exp.profiles[1].blocks[2]
    ops = {str(n.target) for n in block.aten_forward.graph.nodes if n.op == "call_function"}
    assert "aten.addmm.default" in ops
    delta = exp.flops.aten_delta()
    assert delta.get("aten.gather.default", 0) >= 1 and delta.get("aten.sort.default", 0) >= 1
    assert all(b.original.forward.num_ops == b.routed.forward.num_ops for b in exp.blocks)


def test_graph_diff_is_structural(dit_case):
    _, _, exp = dit_case
    diff = exp.diff
    assert isinstance(diff.original, nx.DiGraph) and isinstance(diff.routed, nx.DiGraph)
    inserted = {n.name for n in exp.routes[0].inserted}
    assert set(diff.added) == inserted and not diff.removed
    rewired = {r.name for r in diff.rewired}
    assert {exp.blocks[1].node_routed, exp.blocks[4].node_routed, "output"} == rewired
    assert set(diff.resized) == {exp.blocks[2].node_routed, exp.blocks[3].node_routed}
    for original, routed in diff.matches.items():
        assert diff.original.nodes[original]["key"] == diff.routed.nodes[routed]["key"]


def test_guards_list_the_signature_and_the_resolved_shapes(dit_case):
    _, _, exp = dit_case
    kinds = {(g.kind, g.what) for g in exp.guards}
    assert {("input", "x"), ("input", "t"), ("input", "y")} <= kinds
    # x.shape is traced size by size (no Python constant); the adaLN chunk count is resolved
    assert any(g.kind == "shape" and ".chunk(" in g.what for g in exp.guards)
    assert any(g.kind == "route" and g.value == "8 of 16 tokens" for g in exp.guards)


# -- Mamba -------------------------------------------------------------------------------------


def test_mamba_report_gathers_both_streams_and_scatters_the_skip(mamba_case):
    _, _, exp = mamba_case
    assert exp.stacks == [{"path": "blocks", "class": "MambaBlock", "count": 4}]
    (route,) = exp.routes
    assert (route.num_tokens, route.kept_tokens) == (16, 8)
    ins = {(v.treatment, v.reason) for v in route.side_inputs if v.direction == "in"}
    assert ("gathered", "token stream") in ins
    assert any(t == "gathered" and r.startswith("carried token stream") for t, r in ins)
    out = [v for v in route.side_inputs if v.direction == "out"]
    assert all(v.treatment == "scattered back" for v in out)
    assert any("skip" in v.received_as for v in out)  # U-ViT skip from block 1 to block 2
    assert [b.tokens_routed for b in exp.blocks] == [16, 8, 16, 16]


def test_mamba_flops_match_a_direct_count(mamba_case):
    model, args, exp = mamba_case
    assert exp.flops.original.flops == _direct_flops(model, args)
    assert exp.flops.routed.flops == _routed_direct_flops(model, [(1, 2)], args)
    assert exp.flops.speedup > 1.05
    routed, original = exp.blocks[1].routed.forward, exp.blocks[1].original.forward
    assert routed.flops < 0.55 * original.flops  # half the tokens (adaLN is per sample)
    # the scan is one custom op per direction (its loop is not unrolled into the count)
    assert routed.ops["tread_fx.selective_scan_forward.default"] == 2
    assert original.ops["tread_fx.selective_scan_forward.default"] == 2


# -- contracts -----------------------------------------------------------------------------------


def test_explain_never_modifies_the_model():
    model, args = tiny_dit(depth=4), dit_inputs(batch=2)
    model.eval()
    with torch.no_grad():
        before_out = model(*args)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    rng = torch.get_rng_state()
    tread_fx.explain(model, [(1, 3)], 0.5, args)
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training and not any(m.training for m in model.modules())
    assert not tread_fx.is_routed(model) and "forward" not in model.__dict__
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(*args), before_out)


@tread_fx.register_leaf_module
class _Opaque(nn.Module):
    """A leaf: tread_fx cannot see how it uses the table."""

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x * table


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.opaque = nn.Linear(8, 8), _Opaque()

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.opaque(x, table))


class _TableModel(nn.Module):
    """Blocks hand a token-aligned table to an op tread_fx cannot see into, under a name
    that hints nothing: strict refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, table)
        return x


def test_a_strict_refusal_is_reported_with_the_refused_value():
    model, args = _TableModel(), (torch.randn(2, 16, 8), torch.randn(2, 16, 8))
    with pytest.raises(tread_fx.SideInputError):
        tread_fx.route(model, [(1, 3)], example_inputs=args)
    tread_fx.unroute(model) if tread_fx.is_routed(model) else None
    exp = tread_fx.explain(model, [(1, 3)], 0.5, args, flops=False)
    assert exp.refusal is not None and "table" in exp.refusal
    refused = [v for v in exp.routes[0].side_inputs if v.treatment == "refused"]
    assert [v.received_as for v in refused] == [["table"]]
    assert "refuses" in str(exp) and exp.flops is None


def test_json_matches_the_schema(dit_case, mamba_case):
    for _, _, exp in (dit_case, mamba_case):
        data = json.loads(exp.to_json())
        _validate(data, SCHEMA)
        assert data["flops"]["speedup"] == pytest.approx(exp.flops.speedup)


def test_json_without_flops_matches_the_schema():
    exp = tread_fx.explain(tiny_dit(depth=4), [(1, 3)], 0.5, dit_inputs(batch=1), flops=False)
    data = json.loads(exp.to_json())
    _validate(data, SCHEMA)
    assert data["flops"] is None and data["blocks"][1]["flops"] is None


def test_dot_text_has_both_graphs_and_the_inserted_nodes(dit_case):
    _, _, exp = dit_case
    dot = to_dot(exp)
    assert dot.startswith("digraph") and dot.count("{") == dot.count("}")
    for name in ("routed:gather_tokens", "routed:scatter_tokens", "original:model_blocks_1"):
        assert f'"{name}"' in dot
    assert "cluster_routed_route0" in dot
    binary = shutil.which("dot")
    if binary is None:
        return  # test_render_browser.py renders it with Graphviz
    parsed = json.loads(
        subprocess.run(
            [binary, "-Tjson"], input=dot, capture_output=True, text=True, check=True, timeout=120
        ).stdout
    )
    names = {o.get("name") for o in parsed.get("objects", [])}
    assert {"routed:gather_tokens", "routed:select_random"} <= names


def test_example_inputs_from_the_signature_and_a_clear_error_otherwise():
    model = tiny_dit(depth=2)
    (x, t, y), kwargs = example_inputs(model, batch=3)
    assert x.shape == (3, 1, 8, 8) and t.shape == (3,) and y.dtype == torch.int64 and not kwargs
    with pytest.raises(tread_fx.ExampleInputError, match="table"):
        example_inputs(_TableModel(), input_shape=(2, 16, 8))


# -- a small JSON Schema validator (the subset SCHEMA uses) ----------------------------------------

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "null": type(None),
    "boolean": bool,
}


def _validate(value, schema, where="$"):
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        ok = any(
            isinstance(value, _TYPES[t])
            and not (t in ("integer", "number") and isinstance(value, bool))
            for t in names
        )
        assert ok, f"{where}: {value!r} is not {names}"
    if "const" in schema:
        assert value == schema["const"], where
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{where}: missing {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _validate(value[key], sub, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _validate(item, schema["items"], f"{where}[{i}]")


@pytest.mark.parametrize("groups, transposed", [(1, False), (1, True), (4, False)])
def test_convolution_backward_flops_are_groups_aware(groups, transposed):
    conv = (nn.ConvTranspose2d if transposed else nn.Conv2d)(4, 8, 3, groups=groups)
    x = torch.randn(2, 4, 10, 10, requires_grad=True)
    counts = []
    for mapping in ({}, FLOP_FORMULAS):
        y = conv(x)
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            y.sum().backward()
        counts.append(counter.get_total_flops())
    with FlopCounterMode(display=False) as forward:
        conv(x)
    assert counts[1] == 2 * forward.get_total_flops()  # grad_input + grad_weight
    if groups == 1:
        assert counts[0] == counts[1]  # torch's formula is right for dense convolutions


# -- data-dependent leaves (explain wherever route() works) ----------------------------------


class _CheckedLabels(nn.Module):
    """A label embedder that checks its input with data and drops labels at random."""

    def __init__(self, classes: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(classes + 1, dim)
        self.classes = classes

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        assert y.max() <= self.classes - 1, "label out of range"  # reads tensor data
        if self.training:
            drop = torch.rand(y.shape[0], device=y.device) < 0.1
            y = torch.where(drop, torch.full_like(y, self.classes), y)
        return self.table(y)


def test_explain_runs_a_data_dependent_leaf_on_real_values():
    model, args = tiny_dit(depth=4), dit_inputs(batch=2)
    model.y_embedder = _CheckedLabels(10, 32)
    exp = tread_fx.explain(model, [(1, 3)], 0.5, args)
    assert "y_embedder" in exp.auto_leaves  # route() makes it a leaf: explain runs it too
    assert exp.flops.routed.flops == _routed_direct_flops(model, [(1, 3)], args)
    assert exp.flops.original.flops == _direct_flops(model, args)
    tread_fx.route(model, [(1, 3)], 0.5, seed=0)
    assert model.train()(*args).shape == (2, 2, 8, 8)


def test_a_failed_flop_count_still_prints_the_report(monkeypatch):
    import importlib

    explain_module = importlib.import_module("tread_fx.inspection.explain")

    def broken(*args, **kwargs):
        raise RuntimeError("no formula for this op")

    monkeypatch.setattr(explain_module, "profile_graph", broken)
    with pytest.warns(UserWarning, match="FLOP counting failed.*no formula"):
        exp = tread_fx.explain(tiny_dit(depth=4), [(1, 3)], 0.5, dit_inputs(batch=2))
    assert exp.flops is None and exp.routes[0].kept_tokens == 8
    assert "Routes" in str(exp) and exp.to_json()
