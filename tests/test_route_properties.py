"""Property test: any valid route, rate and token count keeps the stated tokens and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import dit_inputs, tiny_dit
from hypothesis import given, settings
from hypothesis import strategies as st

import tread_fx


@st.composite
def routing_cases(draw):
    depth = draw(st.integers(4, 6))
    start = draw(st.integers(0, depth - 1))
    end = draw(st.integers(start + 1, depth))
    rate = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99]))
    size = draw(st.sampled_from([4, 6, 8, 10]))  # 4, 9, 16, 25 tokens at patch 2
    batch = draw(st.integers(1, 3))
    negative = draw(st.booleans())
    return depth, start, end, rate, size, batch, negative


@settings(max_examples=30, deadline=None)
@given(routing_cases())
def test_any_valid_route_keeps_n_minus_floor_n_rate_and_preserves_eval(case):
    depth, start, end, rate, size, batch, negative = case
    model = tiny_dit(depth=depth, input_size=size, class_dropout_prob=0.0)
    inputs = dit_inputs(batch=batch, input_size=size)
    reference_eval = model.eval()(*inputs)
    reference_train = model.train()(*inputs)
    route = (start - depth, end - depth if end < depth else end) if negative else (start, end)
    tread_fx.route(model, routes=[route], rate=rate, seed=0)
    tokens = (size // 2) ** 2
    if rate > 0 and math.floor(tokens * rate) == 0:  # would keep every token: saves nothing
        with pytest.raises(tread_fx.InvalidRateError, match="save nothing"):
            model.train()(*inputs)
        return
    out = model.train()(*inputs)
    (info,) = tread_fx.route_info(model)
    assert (info.route.start, info.route.end) == (start, end)
    assert info.kept.shape == (batch, tokens - math.floor(tokens * rate))
    assert bool((info.kept.diff(dim=1) > 0).all()) and int(info.kept.max()) < tokens
    assert out.shape == reference_train.shape and torch.isfinite(out).all()
    if rate == 0.0 or info.kept.shape[1] == tokens:
        assert torch.equal(out, reference_train)
    assert torch.equal(model.eval()(*inputs), reference_eval)
