"""benchmarks/: the entry point on tiny models, and hand-written == route() for the same ids.

No timing is asserted anywhere: times on a shared CI machine prove nothing. What is asserted
is deterministic: the output structure, equal outputs for equal ids, and equal FLOPs and
saved-activation bytes for route() and the hand-written forward.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import randomize_zero_init

import tread_fx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import measure, report, step_time  # noqa: E402
from benchmarks.handwritten import forward_for  # noqa: E402
from benchmarks.specs import SPECS, get_spec, make_inputs, model_available  # noqa: E402

FAMILIES = [
    n for n in ("dit-s2", "mamba", "mamba-rows", "rwkv", "rwkv-random") if model_available(SPECS[n])
]


def _tiny_model(name: str) -> tuple:
    spec = get_spec(name, tiny=True)
    model = spec.build(seed=0)
    randomize_zero_init(model)  # adaLN-Zero blocks start as identities: give them signal
    return spec, model, make_inputs(spec, batch=3)


@pytest.mark.parametrize("name", FAMILIES)
def test_handwritten_forward_equals_route_for_the_same_ids(name):
    spec, model, (x, t, y, target) = _tiny_model(name)
    tread_fx.route(model, routes=[spec.route], rate=spec.rate, selection=spec.selection, seed=3)
    with torch.random.fork_rng():  # label dropout draws from the global RNG in both
        torch.manual_seed(7)
        routed = model.train()(x, t, y)
    ids = tread_fx.route_info(model)[0].kept
    assert ids.shape == (3, spec.kept_tokens(model))
    with torch.random.fork_rng():
        torch.manual_seed(7)
        hand = forward_for(model)(model, x, t, y, ids, *spec.route)
    torch.testing.assert_close(hand, routed, rtol=0, atol=0)
    grads = []
    for out in (routed, hand):
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(out, target).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", FAMILIES)
def test_route_costs_the_same_flops_and_saved_bytes_as_the_handwritten_forward(name):
    spec = get_spec(name, tiny=True)
    inputs = make_inputs(spec, batch=2)
    setup = measure.build_setup(spec, "eager", inputs, torch.device("cpu"))
    setup.variants[1].forward()  # the lazy trace is not part of a step
    none = contextlib.nullcontext
    flops = {v.name: measure.count_flops(v.forward, inputs[3], none) for v in setup.variants}
    saved = {
        v.name: measure.saved_activation_bytes(setup.model, v.forward, none) for v in setup.variants
    }
    assert flops["route()"] == flops["hand-written"] < flops["unrouted"]
    assert saved["route()"] == saved["hand-written"] < saved["unrouted"]


class _AttentionOnly(torch.nn.Module):
    """Self-attention with no projection: every FLOP is in F.scaled_dot_product_attention."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.unflatten(-1, (2, -1)).transpose(1, 2)  # [B, heads=2, N, head_dim]
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return out.transpose(1, 2).flatten(2)


def test_count_flops_counts_cpu_attention_forward_and_backward():
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    x = torch.randn(2, 16, 8, requires_grad=True)  # [B, N, D]: 2 heads of width 4
    target = torch.randn(2, 16, 8)
    flops = measure.count_flops(lambda: _AttentionOnly()(x), target, contextlib.nullcontext)
    shape = (2, 2, 16, 4)
    expected = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(
        shape, shape, shape, shape
    )
    assert flops == expected > 0  # torch's stock counter has no CPU attention formula


def test_count_flops_of_a_dit_includes_its_attention(monkeypatch):
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    spec = get_spec("dit-s2", tiny=True)
    model = spec.build(seed=0)
    x, t, y, target = make_inputs(spec, batch=2)
    none = contextlib.nullcontext
    counted = measure.count_flops(lambda: model(x, t, y), target, none)
    no_flops = lambda q, k, v, **kwargs: v * q.sigmoid() * k.sigmoid()  # noqa: E731
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_flops)
    without = measure.count_flops(lambda: model(x, t, y), target, none)
    heads, width = spec.kwargs["num_heads"], spec.kwargs["hidden_size"]
    shape = (2, heads, model.grid_size[0] * model.grid_size[1], width // heads)
    per_block = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(
        shape, shape, shape, shape
    )
    assert counted - without == len(model.blocks) * per_block > 0


def _check_results(out: Path, models: list[str], modes: list[str]) -> None:
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["clock"] in measure.CLOCKS and data["meta"]["tiny"] is True
    assert [e["model"] for e in data["models"]] == models
    for entry in data["models"]:
        assert set(entry["flops"]) == set(measure.VARIANTS)
        assert list(entry["modes"]) == modes
        for by_clock in entry["modes"].values():
            assert set(by_clock) == set(measure.CLOCKS)
            for s in by_clock.values():
                assert set(s["median_s"]) == set(measure.VARIANTS)
                for key in ("flop_ratio", "speedup_route", "efficiency_route", "route_vs_hand"):
                    assert s[key] > 0
                assert s["flop_ratio"] == pytest.approx(s["flop_ratio_hand"])
                assert s["optimizer_s"] > 0 and s["efficiency_route_fwd_bwd"] != 0
    first = data["first_call"]
    assert set(first["cpu"]) == {"plain_s", "first_routed_s", "second_routed_s", "overhead_s",
                                 "pipeline_s"}  # fmt: skip
    assert set(first["stages"]) == {"tracing", "locating", "planning", "rewriting", "checking"}
    assert sum(first["stages"].values()) <= first["wall"]["first_routed_s"]
    assert all(t["met"] in (True, False, None) for t in data["targets"])
    md = out.with_suffix(".md").read_text()
    assert "| model | mode | batch | unrouted s/step |" in md
    assert "First routed call" in md and "Targets:" in md and "Method:" in md
    assert "| tracing |" in md
    for entry in data["models"]:  # the DiT's attention kernel is named; the SSMs have none
        assert bool(entry["attention"]) == entry["model"].startswith("dit")
    for entry in data["models"]:
        assert entry["label"] in md


def test_entry_point_on_tiny_models_writes_json_and_markdown(tmp_path):
    out = tmp_path / "bench"
    models = FAMILIES
    argv = ["--tiny", "--models", ",".join(models), "--modes", "eager", "--repeats", "1",
            "--warmup", "1", "--out", str(out), "--quiet"]  # fmt: skip
    assert step_time.main(argv) == 0
    _check_results(out, models, ["eager"])
    before = json.loads(out.with_suffix(".json").read_text())
    assert report.main([str(out.with_suffix(".json"))]) == 0  # re-rendered from the raw times
    _check_results(out, models, ["eager"])
    after = json.loads(out.with_suffix(".json").read_text())
    assert after["models"] == before["models"] and after["targets"] == before["targets"]


def test_runs_of_different_models_merge_into_one_table(tmp_path):
    common = ["--tiny", "--modes", "eager", "--repeats", "1", "--warmup", "1", "--quiet"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert step_time.main([*common, "--models", "dit-s2", "--out", str(first)]) == 0
    assert step_time.main([*common, "--models", "rwkv", "--first-call", "none",
                           "--out", str(second)]) == 0  # fmt: skip
    merged = tmp_path / "merged"
    argv = [str(first.with_suffix(".json")), str(second.with_suffix(".json")), "--out", str(merged)]
    assert report.main(argv) == 0
    _check_results(merged, ["dit-s2", "rwkv"], ["eager"])
    data = json.loads(merged.with_suffix(".json").read_text())
    assert data["first_call"]["model"] == "dit-xl2" and "; " in data["meta"]["command"]


def test_presets_fill_unset_options_and_keep_explicit_ones():
    cpu = step_time.parse_args(["--repeats", "3"])
    assert cpu.repeats == 3 and cpu.clock == "cpu" and cpu.models.startswith("dit-s2")
    gpu = step_time.parse_args(["--device", "cuda", "--dtype", "bf16"])
    assert (gpu.models, gpu.batch, gpu.clock, gpu.preset) == ("dit-xl2", 64, "wall", "gpu")
    assert "compiled" in gpu.modes and gpu.first_call == "dit-xl2"


@pytest.mark.slow
def test_entry_point_compiled_mode_on_a_tiny_dit(tmp_path):
    out = tmp_path / "bench"
    argv = ["--tiny", "--models", "dit-s2", "--modes", "eager,compiled", "--repeats", "1",
            "--warmup", "1", "--first-call", "none", "--out", str(out), "--quiet"]  # fmt: skip
    assert step_time.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert list(data["models"][0]["modes"]) == ["eager", "compiled"]
    assert data["first_call"] is None
    checked = {(t["target"], t["where"]) for t in data["targets"]}
    assert ("efficiency >= 0.97", "DiT-S/2 (tiny) compiled") in checked
    assert ("efficiency >= 0.95", "DiT-S/2 (tiny) eager") in checked


def test_scatter_re_enters_contiguous_unless_every_token_is_written_back():
    base = torch.randn(2, 8, 6).transpose(1, 2)  # [2, 6, 8], a transposed stream like timm's
    some = torch.tensor([[0, 2, 5], [1, 3, 4]])
    out = tread_fx.runtime.ops.scatter_tokens(base, torch.randn(2, 3, 8), some)
    assert out.is_contiguous()
    every = torch.arange(6).expand(2, 6)
    kept_all = tread_fx.runtime.ops.scatter_tokens(base, base.clone(), every)
    assert kept_all.stride() == base.stride() and torch.equal(kept_all, base)


def test_gpu_preset_code_path_runs_on_cpu_with_tiny_sizes(tmp_path):
    out = tmp_path / "gpu"
    argv = ["--preset", "gpu", "--device", "cpu", "--tiny", "--modes", "eager", "--batch", "4",
            "--first-call-batch", "2", "--repeats", "1", "--warmup", "1", "--out", str(out),
            "--quiet"]  # fmt: skip
    assert step_time.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["dtype"] == "bf16" and data["meta"]["clock"] == "wall"
    assert [e["model"] for e in data["models"]] == ["dit-xl2"]
    assert "Paper (one A100" not in out.with_suffix(".md").read_text()  # CUDA runs only
    data["meta"]["device"] = "cuda"  # the CUDA-only lines of the report
    md = report.to_markdown(data)
    assert "Paper (one A100, DiT-XL/2, batch 64): TREAD 7.1 it/s" in md and "it/s vs unrouted" in md


def test_profile_step_shows_route_and_handwritten_run_the_same_aten_ops():
    from benchmarks import profile_step

    profiles = profile_step.profile_variants("dit-s2", ["route()", "hand-written"], 1, tiny=True)
    route_ops, hand_ops = profiles["route()"], profiles["hand-written"]
    heavy = [op for op in hand_ops if op.endswith(("mm", "attention", "gelu", "layer_norm"))]
    assert "aten::addmm" in heavy
    for op in heavy:  # same compute; only the selection ops differ (topk vs argsort, ...)
        assert route_ops.get(op, (0, 0))[0] == hand_ops[op][0], op
    calls = [
        sum(c for op, (c, _) in ops.items() if op != profile_step.STEP) for ops in profiles.values()
    ]
    assert abs(calls[0] - calls[1]) <= 0.01 * calls[1]
    table = profile_step.op_table(profiles, top=3)
    assert "| all aten ops |" in table and "| outside those |" in table


@pytest.mark.slow
def test_compiled_route_launches_the_kernels_a_compiled_hand_edit_does():
    """The compiled routed graph is what a hand edit compiles to: the same generated kernels
    and the same matmul and attention calls; only the selection's few ops differ."""
    from benchmarks import profile_step

    profiles = profile_step.profile_variants(
        "dit-s2", ["route()", "hand-written"], 1, tiny=True, mode="compiled"
    )
    route_ops, hand_ops = profiles["route()"], profiles["hand-written"]
    heavy = [op for op in hand_ops if op.endswith(("mm", "attention_for_cpu", "_backward"))]
    assert "aten::mm" in heavy and "aten::_scaled_dot_product_flash_attention_for_cpu" in heavy
    for op in heavy:
        assert route_ops.get(op, (0, 0))[0] == hand_ops[op][0], op
    kernels = [
        sum(c for op, (c, _) in ops.items() if op.startswith("cpp_fused"))
        for ops in profiles.values()
    ]
    assert kernels[0] > 10 and abs(kernels[0] - kernels[1]) <= 1, kernels
    assert "| all aten ops and kernels |" in profile_step.op_table(profiles, top=3)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_have_every_variant_follow_every_other_equally_often(n):
    rows = measure.balanced_orders(n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    follows = Counter((row[i], row[i + 1]) for row in rows for i in range(n - 1))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1


def test_round_order_runs_modes_as_blocks_and_no_step_always_follows_the_same_one():
    names = [f"{mode}/{v}" for mode in ("eager", "compiled") for v in ("U", "R", "H")]
    rounds = [measure.round_order(names, r) for r in range(12)]
    assert all(sorted(order) == sorted(names) for order in rounds)
    for order in rounds:  # one mode's steps together
        assert len({n.split("/")[0] for n in order[:3]}) == 1
    before = Counter((a, b) for order in rounds for a, b in zip(order, order[1:]) if
                     a.split("/")[0] == b.split("/")[0])  # fmt: skip
    assert set(before.values()) == {4} and len(before) == 12
    assert {order[0].split("/")[0] for order in rounds} == {"eager", "compiled"}


def test_median_interval_narrows_with_more_rounds_and_is_reproducible():
    noisy = [1.0 + 0.1 * ((7 * i) % 11 - 5) / 5 for i in range(12)]
    lo, hi = measure.median_interval(noisy)
    assert lo <= measure.median(noisy) <= hi and hi - lo > 0.02
    assert measure.median_interval(noisy) == [lo, hi]
    lo4, hi4 = measure.median_interval(noisy * 4)
    assert hi4 - lo4 < hi - lo


def test_a_target_inside_the_noise_says_so():
    checked = report._check("x <= 1.02", "here", 1.03, 1.02, upper=True, ci=[0.99, 1.06])
    assert checked["met"] is False and checked["resolved"] is False
    clear = report._check("x <= 1.02", "here", 0.97, 1.02, upper=True, ci=[0.95, 0.99])
    assert clear["met"] is True and clear["resolved"] is True
    lines = report._target_lines([checked, clear])
    assert "**no** (within noise)" in lines[2] and "0.990-1.060" in lines[2]
    assert lines[3].endswith("| yes |")
