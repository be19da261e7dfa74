"""The generator's second grammar round (benchmarks/generated/grammar_more.py, issue 42).

Generator-side checks, independent of what ``route()`` answers: every new family is drawn,
every drawn module compiles, the twin keeping every token is the unrouted model (for seeds
of each family), and the twin's by-construction facts hold it to whole rows where the
blocks reshape to the grid. The must-refuse structures of the round are refused.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.coverage_checks import randomize_zero_init
from benchmarks.generated import check, draw, module_source
from benchmarks.generated.check import load_module

SEEDS = range(0, 300)
FAMILIES = (
    "wrap=checkpoint", "wrap=checkpoint_train", "wrap=partial", "wrap=partial_checkpoint",
    "hook=scale", "hook=record", "return=list", "return=tuple3", "int=count", "int=grid",
    "int=grid_tuple", "int=coincident", "predicate=is_tensor", "predicate=isinstance",
    "predicate=dim_block", "predicate=ndim_model", "predicate=data_branch", "einops.heads",
    "einops.repeat", "text=prefix", "text=suffix", "text=context", "text_mask=bool",
    "text_mask=additive", "input=video_conv", "input=video_linear", "refuse=fold",
    "refuse=latents",
)  # fmt: skip


def _first(label: str) -> int:
    """The first routable seed with ``label`` (factorised video models have their own
    checks: tests/test_generated_video.py)."""
    return next(
        s for s in SEEDS if label in draw(s).features() and draw(s).routable and not draw(s).video
    )


def _first_any(label: str) -> int:
    return next(s for s in SEEDS if label in draw(s).features())


def test_every_family_is_drawn_and_compiles():
    seen = set()
    for seed in SEEDS:
        d = draw(seed)
        compile(module_source(d), f"generated_{seed}.py", "exec")
        seen.update(d.features())
    assert not [label for label in FAMILIES if label not in seen]


def _loaded(seed: int, tmp: str):
    module = load_module(seed, Path(tmp))
    model = module.build()
    randomize_zero_init(model)
    args, kwargs = module.inputs()
    with torch.no_grad():
        reference = model.eval()(*args, **kwargs)
    return module, model.train(), args, kwargs, reference


@pytest.mark.parametrize("label", [f for f in FAMILIES if not f.startswith("refuse")])
def test_twin_keeping_every_token_is_the_model(label):
    seed = _first(label)
    with tempfile.TemporaryDirectory() as tmp:
        module, model, args, kwargs, reference = _loaded(seed, tmp)
        every = torch.arange(draw(seed).stream_tokens).expand(reference.shape[0], -1)
        with torch.no_grad():
            full = module.twin(model, args, kwargs, every, checks=False)
    torch.testing.assert_close(full, reference, rtol=1e-5, atol=1e-5)


def test_grid_twin_holds_the_kept_tokens_to_whole_rows():
    seed = _first("int=grid")
    d = draw(seed)
    width = d.grid[-1]
    with tempfile.TemporaryDirectory() as tmp:
        module, model, args, kwargs, _ = _loaded(seed, tmp)
        rows = d.grid[-2] - int(d.grid[-2] * d.rate)
        frames = d.grid[0] if len(d.grid) == 3 else 1
        ids = torch.arange(rows * width * frames) + 1  # whole count, rows shifted by one
        with pytest.raises(AssertionError, match="rows"):
            module.twin(model, args, kwargs, ids.expand(2, -1))


@pytest.mark.parametrize("label", ["refuse=fold", "refuse=latents"])
def test_new_must_refuse_structures_are_refused(label):
    result = check(_first_any(label))
    assert result.outcome == "refused", result
