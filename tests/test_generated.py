"""The generated-backbone differential check (benchmarks/generated, issue 42).

A fixed slice of seeds must give no wrong result, no foreign exception and no generator
error; and the check must be able to fail: a twin fed perturbed kept ids is ``wrong``.
"""

from __future__ import annotations

import pytest

from benchmarks.generated import check, draw, module_source

CI_SLICE = range(0, 200)


def test_sources_compile_and_names_are_random():
    for seed in range(20):
        text = module_source(draw(seed))
        compile(text, f"generated_{seed}.py", "exec")
        assert "self.blocks" not in text and "x_embedder" not in text


@pytest.mark.parametrize("seed", CI_SLICE)
def test_slice_has_no_wrong_foreign_or_generator_error(seed):
    result = check(seed)
    assert result.outcome not in ("wrong", "foreign", "generator error"), result


def _first_routed(seeds: range) -> int:
    for seed in seeds:
        if check(seed).outcome == "routed":
            return seed
    raise AssertionError("no routed seed to sabotage")


def test_a_perturbed_twin_is_reported_wrong():
    seed = _first_routed(range(1, 40))
    result = check(seed, perturb_kept=True)
    assert result.outcome == "wrong", result
