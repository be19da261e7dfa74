"""The generator's scan and containers rounds (benchmarks/generated/grammar_scan.py,
grammar_containers.py; issue 42).

For every new family, the first seed that draws it is checked against its twin: the outcome
must not be ``wrong``, ``foreign`` or a generator error. Generator-side facts, independent of
``route()``: the family is in the written source (not only a label), every module compiles
and draws are deterministic, a zigzag index order is marked must-refuse, a transposed-rows
order makes the twin demand whole rows (a twin fed perturbed ids is then ``wrong``).
"""

from __future__ import annotations

import pytest

from benchmarks.generated import check, draw, module_source
from benchmarks.generated.source import kept_count

SEEDS = range(0, 400)

# family label prefix -> a text the written source must contain
FAMILIES = {
    "shift=pad": "F.pad(h, (0, 0, 1, -1))",
    "shift=roll": "torch.roll(h, 1, dims=1)",
    "conv1d=same": "nn.Conv1d(din, din, 3, padding=1, groups=din)",
    "conv1d=causal": "[..., : h.shape[1]]",
    "scan=cumsum": "torch.cumsum(g * u, dim=1)",
    "scan=loop": "for t in range(u.shape[1]):",
    "scan=selective": "decay = torch.exp(-dt * torch.exp(bias))",
    "scan=cumsum-bi": ".flip(1)",
    "scan_order=transpose": ".transpose(1, 2)",
    "scan_order=zigzag_index": "torch.argsort(",
    "container=moduledict": "nn.ModuleDict({",
    "container=stages": "nn.ModuleList([nn.ModuleList([",
    "text_join=pack": "einops.pack([",
}


def _first(label: str) -> int:
    for seed in SEEDS:
        features = draw(seed).features()
        if label in features or any(f.startswith(label + "-") for f in features):
            return seed
    raise AssertionError(f"no seed in {SEEDS} draws {label}")


@pytest.mark.parametrize("label", sorted(FAMILIES))
def test_family_is_drawn_written_and_checked(label):
    seed = _first(label)
    text = module_source(draw(seed))
    assert FAMILIES[label] in text, (seed, label)
    compile(text, f"generated_{seed}.py", "exec")
    result = check(seed)
    assert result.outcome not in ("wrong", "foreign", "generator error"), result


def test_draws_are_deterministic_and_compile():
    for seed in range(0, 120):
        assert module_source(draw(seed)) == module_source(draw(seed))
        compile(module_source(draw(seed)), f"generated_{seed}.py", "exec")


def test_a_zigzag_index_order_is_must_refuse():
    d = draw(_first("scan_order=zigzag_index"))
    assert not d.routable and d.refuse == "scan_index"
    assert not d.company and d.text not in ("prefix", "suffix")


def test_a_transposed_order_keeps_whole_rows_and_a_perturbed_twin_is_wrong():
    seeds = [s for s in SEEDS if "scan_order=transpose" in draw(s).features()]
    alone = [s for s in seeds if not any(kind.startswith("grid") for kind in draw(s).ints)]
    for seed in alone[:4]:  # the order alone reshapes to the grid: the twin demands rows
        d = draw(seed)
        rows, cols = d.grid
        assert kept_count(d) == (rows - int(rows * d.rate)) * cols
        assert "the kept tokens must be whole rows" in module_source(d), seed
    routed = next(seed for seed in seeds[:8] if check(seed).outcome == "routed")
    assert check(routed, perturb_kept=True).outcome == "wrong"
