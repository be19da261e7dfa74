"""Every user mistake raises a TreadFxError subclass saying what was asked, found and to do."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import dit_inputs, tiny_dit

import tread_fx
from tread_fx import errors


def _route(routes, rate=0.5, model=None, **kwargs):
    model = tiny_dit() if model is None else model
    return tread_fx.route(model, routes=routes, rate=rate, **kwargs)


@pytest.mark.parametrize(
    ("routes", "fragment"),
    [
        ([(4, 2)], "start >= end"),
        ([(3, 3)], "start >= end"),
        ([(2, 9)], "outside the 6 blocks"),
        ([(-9, 4)], "outside the 6 blocks"),
        ([(1, 4), (3, 5)], "overlap"),
        ([(1.0, 4)], "non-integer"),
        ([(True, 4)], "non-integer"),
        ([("1", 4)], "non-integer"),
        ([(1, 2, 3, 4)], "not understood"),
        ([], "at least one route"),
        ("2:9", "not a list of routes"),
        ([{"start_layer_idx": 1}], "missing keys"),
        ([{"start_layer_idx": 1, "end_layer_idx": 2, "ratio": 0.5}], "unknown keys"),
        ([{"start_layer_idx": 4, "end_layer_idx": 2}], "must not come after"),
        ([(-2, 3)], "start 4 >= end 3"),
    ],
)
def test_bad_routes_are_refused_up_front(routes, fragment):
    with pytest.raises(errors.InvalidRouteError, match=fragment) as caught:
        _route(routes)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("rate", [1.0, 1.5, -0.1, "0.5", None, True])
def test_rates_outside_zero_one_are_refused(rate):
    with pytest.raises(errors.InvalidRateError, match="rate"):
        _route([(1, 3)], rate=rate)


def test_a_per_route_rate_is_validated_too():
    with pytest.raises(errors.InvalidRateError, match="route rate"):
        _route([(1, 3, 1.0)])
    with pytest.raises(errors.InvalidRateError, match="selection_ratio"):
        _route([{"start_layer_idx": 1, "end_layer_idx": 2, "selection_ratio": 2.0}])


def test_a_kept_count_of_zero_is_refused():
    class AllPrefix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    # rate < 1 always keeps a token of a non-empty set; with every token a prefix token
    # there is nothing to select from
    model = _route([(0, 2)], model=AllPrefix(), keep_prefix=4).train()
    with pytest.raises(errors.TokenStreamError, match="keep_prefix=4 leaves no token to route"):
        model(torch.randn(2, 4, 4))
    assert model(torch.randn(2, 8, 4)).shape == (2, 8, 4)  # the model stays usable


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_keep_prefix_must_be_a_count(bad):
    with pytest.raises(errors.TokenStreamError, match=f"keep_prefix={bad!r} was given"):
        _route([(1, 3)], keep_prefix=bad)


def test_no_block_stack_lists_candidates_and_suggests_blocks():
    with pytest.raises(errors.BlockStackNotFoundError, match="blocks="):
        _route([(0, 1)], model=torch.nn.Linear(4, 4))


def test_blocks_naming_a_missing_attribute():
    with pytest.raises(errors.BlockStackNotFoundError, match="no submodule.*candidates") as e:
        _route([(1, 3)], blocks="layers")
    assert "blocks" in str(e.value) and isinstance(e.value, AttributeError)


def test_blocks_naming_something_that_is_not_a_block_container():
    with pytest.raises(errors.BlockStackNotFoundError, match="not a non-empty"):
        _route([(1, 3)], blocks="final_layer")


class _TwoStacks(torch.nn.Module):
    """Two same-length stacks, both fed by the main input: auto-detection cannot choose.

    (A stack that never sees the main input is not a candidate: tests/test_stack_choice.py.)
    """

    def __init__(self):
        super().__init__()
        self.left = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.right = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, a, b):
        b = b + a
        for block in self.left:
            a = block(a)
        for block in self.right:
            b = block(b)
        return a + b


def test_ambiguous_stacks_ask_for_blocks():
    model = _route([(0, 2)], model=_TwoStacks()).train()
    with pytest.raises(errors.AmbiguousBlockStackError, match="left.*right|right.*left"):
        model(torch.randn(2, 8, 4), torch.randn(2, 8, 4))
    model = _route([(0, 2)], model=_TwoStacks(), blocks="right", reroute=True).train()
    assert model(torch.randn(2, 8, 4), torch.randn(2, 8, 4)).shape == (2, 8, 4)


def test_wrapped_models_are_refused_with_the_unwrapping_hint():
    compiled = torch.compile(tiny_dit())
    with pytest.raises(
        errors.WrappedModelError, match="(?s)given an OptimizedModule wrapper.*_orig_mod"
    ):
        _route([(1, 3)], model=compiled)
    with pytest.raises(
        errors.WrappedModelError, match="(?s)given a DataParallel wrapper.*model.module"
    ):
        _route([(1, 3)], model=torch.nn.DataParallel(tiny_dit()))
    with pytest.raises(errors.WrappedModelError, match="nn.Module"):
        tread_fx.route("model", routes=[(1, 3)])


def test_a_model_compiled_in_place_is_refused_naming_the_order():
    model = tiny_dit()
    model.compile()  # lazy: nothing is compiled until the first call
    with pytest.raises(errors.WrappedModelError, match=r"model.compile\(\) was already called"):
        _route([(1, 3)], model=model)


def test_routing_twice_needs_reroute():
    model = _route([(1, 3)])
    with pytest.raises(errors.AlreadyRoutedError, match="reroute=True"):
        tread_fx.route(model, routes=[(1, 4)])
    tread_fx.route(model, routes=[(1, 4)], reroute=True)
    model.train()(*dit_inputs())
    assert tread_fx.route_info(model)[0].route.end == 4


def test_unroute_and_route_info_on_a_model_never_routed():
    with pytest.raises(errors.NotRoutedError, match="route\\(model"):
        tread_fx.unroute(tiny_dit())
    with pytest.raises(errors.NotRoutedError):
        tread_fx.route_info(tiny_dit())


def test_unknown_selection_strategy():
    with pytest.raises(errors.SelectionError, match="random"):
        _route([(1, 3)], selection="best")


def test_rows_without_a_discoverable_grid():
    class NoGrid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = _route([(0, 2)], model=NoGrid(), selection="rows").train()
    with pytest.raises(errors.SelectionError, match="grid=\\(H, W\\)"):
        model(torch.randn(2, 6, 4))
    bad = _route([(0, 2)], model=NoGrid(), selection="rows", grid=(4, 4)).train()
    with pytest.raises(errors.SelectionError, match="H \\* W must equal"):
        bad(torch.randn(2, 6, 4))


class _DataDependentForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        if random.random() < 0.5:  # Python randomness in the model's own forward
            x = -x
        for block in self.blocks:
            x = block(x)
        return x


def test_untraceable_forward_names_file_and_line_and_suggests_the_registry():
    model = _route([(0, 2)], model=_DataDependentForward()).train()
    with pytest.raises(errors.UntraceableModelError) as caught:
        model(torch.randn(2, 8, 4))
    message = str(caught.value)
    assert "test_route_errors.py:" in message and "register_leaf_module" in message
    assert "random.random" in message


class _OpaqueAdd(torch.nn.Module):
    def forward(self, x, bias):
        return x + bias


def test_token_aligned_side_input_without_a_rule_is_refused_in_strict_mode():
    """A token-aligned value handed to an op tread_fx cannot see into (a registered leaf),
    under a name that hints nothing: no rule can tell what it is."""
    tread_fx.register_leaf_module(_OpaqueAdd)

    class PerTokenBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.add = torch.nn.Linear(4, 4), _OpaqueAdd()

        def forward(self, x, bias):
            return self.add(self.l(x), bias)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(PerTokenBias() for _ in range(3))

        def forward(self, x, bias):
            for block in self.blocks:
                x = block(x, bias)
            return x

    model = _route([(0, 2)], model=Model()).train()
    x, bias = torch.randn(2, 8, 4), torch.randn(2, 8, 4)
    with pytest.raises(errors.SideInputError, match="(?s)'t1'.*Adapter") as caught:
        model(x, bias)
    assert "strict=False" in str(caught.value)
    lenient = _route([(0, 2)], model=Model(), strict=False, reroute=True).train()
    with pytest.warns(UserWarning, match="looks token-aligned"):
        assert lenient(x, bias).shape == (2, 8, 4)


def test_a_route_that_would_save_nothing_is_an_error():
    model = _route([(1, 3)], rate=0.05).train()  # floor(16 * 0.05) = 0 tokens routed around
    with pytest.raises(errors.InvalidRateError, match="save nothing"):
        model(*dit_inputs())
