"""Sequence models from transformers and mambapy routed by tread_fx (tiny random configs)."""

from __future__ import annotations

import warnings

import pytest
import torch
from third_party_checks import (
    Case,
    capture_block_inputs,
    check_compiled,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
    train_forward,
)

import tread_fx

transformers = pytest.importorskip("transformers")
mambapy = pytest.importorskip("mambapy.mamba")


def _hf_mamba() -> torch.nn.Module:
    config = transformers.MambaConfig(
        vocab_size=50, hidden_size=32, state_size=8, num_hidden_layers=4, expand=2,
        conv_kernel=4, use_mambapy=False,
    )  # fmt: skip
    return transformers.MambaModel(config)


def _mambapy() -> torch.nn.Module:
    config = mambapy.MambaConfig(d_model=32, n_layers=4, d_state=8, expand_factor=2, d_conv=4)
    return mambapy.Mamba(config)


def _embeds():
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))


def _ids():
    return torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))


CASES = {
    "hf-mamba-embeds": Case("hf-mamba", _hf_mamba, lambda: ((), {"inputs_embeds": _embeds()})),
    "hf-mamba-ids": Case("hf-mamba-ids", _hf_mamba, lambda: ((_ids(),), {})),
    "mambapy": Case("mambapy", _mambapy, lambda: ((_embeds(),), {})),
}
IDS = list(CASES)


@pytest.mark.parametrize("name", IDS)
def test_eval_is_bitwise_the_unrouted_model(name):
    check_eval_is_bitwise_unrouted(CASES[name])


@pytest.mark.parametrize("name", IDS)
def test_rate_zero_training_equals_the_original_training_forward(name):
    check_rate_zero_equals_training(CASES[name])


@pytest.mark.parametrize("name", IDS)
def test_routed_training_keeps_shape_and_sorted_token_order(name):
    (info,) = check_routed_shape_count_and_change(CASES[name])  # asserts ascending ids
    assert info.num_tokens == 16 and info.kept.shape == (2, 8)


@pytest.mark.parametrize("name", IDS)
def test_every_learning_parameter_gets_a_gradient(name):
    check_gradients(CASES[name])


def test_scan_sees_the_kept_tokens_in_their_original_order():
    case = CASES["mambapy"]
    model = case.route(case.model())
    outputs = []
    handle = model.layers[0].register_forward_hook(lambda m, a, out: outputs.append(out))
    with capture_block_inputs(model.layers[1]) as calls:
        train_forward(model, case)
    handle.remove()
    kept = tread_fx.route_info(model)[0].kept
    assert (kept.diff(dim=1) > 0).all()
    stream = outputs[-1]  # layers[0] output: the stream at the route start
    expected = torch.stack([stream[b, kept[b]] for b in range(kept.shape[0])])
    assert torch.equal(calls[-1][0][0], expected)


def test_key_padding_mask_is_gathered_per_sample():
    case = CASES["hf-mamba-embeds"]
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    model = case.route(case.model())
    # transformers >= 5.25 holds the mixer's kernels as stateless global modules, which the
    # trace follows: the mask is seen multiplying the tokens inside the mixer, so its use (not
    # its shape, as when the mixer was one call) decides, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with capture_block_inputs(model.layers[1]) as calls:
            model.train()(inputs_embeds=_embeds(), attention_mask=mask)
    (info,) = tread_fx.route_info(model)
    plan = tread_fx.routed_graphs(model)[0].plans[0]
    (crossing,) = [c for c in plan.entering if c.node.name == "t1"]
    assert crossing.reason.startswith("adapter") and "by its shape" not in crossing.reason
    assert not plan.shared_selection
    seen = calls[-1][1]["attention_mask"]
    assert torch.equal(seen, mask.gather(1, info.kept))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-mamba-embeds", "mambapy"])
def test_compiled_routed_graph(name):
    check_compiled(CASES[name])
