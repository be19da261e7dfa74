"""The generator's factorised video round (benchmarks/generated/grammar_video.py, issue 42).

Generator-side checks, independent of what ``route()`` answers: factorised models are drawn
(routable ones, the temporal stack winning a tie of equal token counts by the hop count,
and the must-refuse ties), their sources compile, the
twin keeping every position of every frame is the unrouted model (inner route ends and
``end == depth``, both conditionings), and the twin holds the kept ids to one subset shared
by every folded row. Then one differential check of each outcome.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from test_generated_grammar import _loaded

from benchmarks.generated import check, draw, module_source

SEEDS = range(0, 800)  # drawing is cheap; about one seed in twelve is factorised


def _seeds(**want) -> list[int]:
    out = []
    for seed in SEEDS:
        d = draw(seed)
        if d.video and all(f(d) for f in want.values()):
            out.append(seed)
    return out


def _first(**want) -> int:
    return _seeds(**want)[0]


def test_factorised_video_is_drawn_both_ways_and_compiles():
    seeds = _seeds()
    assert len(seeds) >= 10
    labels = set()
    for seed in seeds:
        d = draw(seed)
        compile(module_source(d), f"generated_{seed}.py", "exec")
        labels.update(d.features())
        frames, h, w = d.grid
        tie = d.refuse in ("stacks_tie", "folded_tie") or d.video.stack == "temporal"
        assert (frames == h * w) == tie and d.routable == (not d.refuse)
        # the temporal stack wins a tie only by the frame embedding's extra op
        assert (d.video.stack == "temporal") == (frames == h * w and d.video.frame_pos)
    for label in ("video=factorised", "video_fold=reshape", "video_fold=einops", "cond=adaln",
                  "cond=added", "video_loop=zip", "video_loop=index", "video_frame_pos",
                  "refuse=stacks_tie", "refuse=folded_tie", "video_stack=temporal",
                  "route_end=depth", "route_end=inner"):  # fmt: skip
        assert label in labels, label


CASES = {
    "inner-adaln": dict(end=lambda d: d.end < d.depth, ada=lambda d: d.adaln),
    "depth-adaln": dict(end=lambda d: d.end == d.depth, ada=lambda d: d.adaln),
    "inner-added": dict(end=lambda d: d.end < d.depth, ada=lambda d: not d.adaln),
    "temporal": dict(stack=lambda d: d.video.stack == "temporal"),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_twin_keeping_every_position_is_the_model(case):
    seed = _first(routable=lambda d: d.routable, **CASES[case])
    d = draw(seed)
    frames, positions = d.grid[0], d.grid[1] * d.grid[2]
    if d.video.stack == "temporal":  # the positions are folded into the batch
        frames, positions = positions, frames
    with tempfile.TemporaryDirectory() as tmp:
        module, model, args, kwargs, reference = _loaded(seed, tmp)
        every = torch.arange(positions).expand(reference.shape[0] * frames, -1)
        with torch.no_grad():
            full = module.twin(model, args, kwargs, every, checks=False)
    torch.testing.assert_close(full, reference, rtol=1e-5, atol=1e-5)


def test_twin_holds_the_kept_ids_to_one_subset_for_every_folded_row():
    seed = _first(routable=lambda d: d.routable)
    d = draw(seed)
    frames, h, w = d.grid
    count = h * w - int(h * w * d.rate)
    kept = torch.stack([torch.arange(count) + (row % 2) for row in range(2 * frames)])
    with tempfile.TemporaryDirectory() as tmp:
        module, model, args, kwargs, _ = _loaded(seed, tmp)
        with pytest.raises(AssertionError, match="one kept subset"):
            module.twin(model, args, kwargs, kept)


def test_a_routable_factorised_model_routes_and_a_tie_is_refused():
    routed = check(_first(routable=lambda d: d.routable))
    assert routed.outcome == "routed", routed
    for refuse in ("stacks_tie", "folded_tie"):
        tie = check(_first(tie=lambda d, r=refuse: d.refuse == r))
        assert tie.outcome == "refused", tie
