"""The routed stream is the one that carries the noisy input to the prediction.

Two shapes fooled a choice made by shape alone (the input shaped like the first output):

* a joint-attention model ``forward(x, context)`` whose blocks see ``cat([embed(x),
  embed(context)])`` and whose prediction, read from the image positions, happens to have the
  shape of ``context``: the text positions were routed and every image token kept;
* blocks carrying the image and the text as separate arguments, the forward returning
  ``(text_out, image_out)``: the 5-token text stream was routed, not the 16-token image.

Data flow decides the first (the text positions are sliced off before the output); the second
cannot be decided by data (both streams reach an output), so a documented rule picks the
image (most tokens) and warns, and ``stream=`` picks either.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from stream_models import (
    B,
    IdsFluxLike,
    JointInputs,
    LateClassToken,
    N,
    RolePacked,
    T,
    TwoOutputs,
    ids_inputs,
    joint_inputs,
    role_inputs,
    two_inputs,
)
from third_party_checks import INVARIANTS, Case

import tread_fx
from tread_fx.errors import StreamChoiceWarning, TokenStreamError

JOINT = Case("joint", JointInputs, joint_inputs)
TWO = Case("two-outputs", TwoOutputs, two_inputs, route_kwargs={"stream": "x"})


def _route_and_call(model, inputs, **options):
    tread_fx.route(model, [(1, 3)], 0.5, seed=0, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.train()(*inputs()[0])
    return tread_fx.route_info(model)[0], [w for w in caught if w.category is StreamChoiceWarning]


def test_joint_stream_routes_the_image_positions_not_the_context_shaped_like_the_output():
    info, warned = _route_and_call(JointInputs(), joint_inputs)
    assert (info.num_tokens, info.prefix, info.suffix) == (2 * N, 0, N)
    routed = info.routed_mask
    assert routed[:, :N].sum(1).tolist() == [N // 2] * B  # half the image routed around
    assert not routed[:, N:].any()  # every context token kept
    assert not warned  # decided by data flow: the context positions never reach the output


def test_two_returned_streams_route_the_longer_image_and_warn():
    info, warned = _route_and_call(TwoOutputs(), two_inputs)
    assert info.num_tokens == N and info.kept.shape[1] == N // 2
    (warning,) = warned
    text = str(warning.message)
    assert "'x'" in text and "'context'" in text and "stream='context'" in text


@pytest.mark.parametrize("stream", ["context", 1])
def test_stream_option_picks_the_other_stream_without_warning(stream):
    info, warned = _route_and_call(TwoOutputs(), two_inputs, stream=stream)
    assert info.num_tokens == T and not warned


def test_stream_option_keeps_the_rule_choice_silently():
    info, warned = _route_and_call(TwoOutputs(), two_inputs, stream="x")
    assert info.num_tokens == N and not warned


@pytest.mark.parametrize("bad", ["image_tokens", 7, True, 1.5])
def test_a_bad_stream_option_is_refused_at_route(bad):
    with pytest.raises(TokenStreamError, match="stream="):
        tread_fx.route(TwoOutputs(), [(1, 3)], stream=bad)


def test_explain_shows_the_choice_and_the_option():
    exp = tread_fx.explain(TwoOutputs(), [(1, 3)], 0.5, two_inputs(), flops=False)
    choice = exp.stream["choice"]
    assert choice["guessed"] and "'x'" in choice["chosen"] and len(choice["candidates"]) == 2
    assert "stream='x'" in str(exp)
    joint = tread_fx.explain(JointInputs(), [(1, 3)], 0.5, joint_inputs(), flops=False)
    assert not joint.stream["choice"]["guessed"]
    assert "never reach" in joint.stream["choice"]["reason"]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", [JOINT, TWO], ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def test_position_ids_feeding_every_block_are_not_a_stream():
    """The single blocks' longer stream descends from the ids only through earlier blocks."""
    info, warned = _route_and_call(IdsFluxLike(), ids_inputs)
    assert info.num_tokens == N and not warned
    model = tread_fx.route(IdsFluxLike(), [(1, 3)], 0.5)
    model.train()(*ids_inputs()[0])
    assert tread_fx.routed_graphs(model)[0].info.list_paths == ["joint", "single"]


@pytest.mark.parametrize("by", ["mask", "index"])
def test_a_stream_whose_roles_data_decides_is_refused(by):
    model = tread_fx.route(RolePacked(by), [(1, 3)], 0.5)
    with pytest.raises(TokenStreamError, match="data, not the graph, decides") as caught:
        model.train()(*role_inputs(by)[0])
    assert len(str(caught.value).splitlines()[0]) <= 150


def test_a_padding_mask_alone_still_routes():
    info, warned = _route_and_call(RolePacked("padding"), lambda: role_inputs("padding"))
    assert info.num_tokens == N and not warned


def test_a_declared_prefix_counts_only_where_the_stream_is_concatenated():
    """Position 0 of the blocks' stream is an image token: routable, not a kept prefix."""
    info, _ = _route_and_call(LateClassToken(), lambda: ((torch.randn(B, N, 4),), {}))
    assert (info.num_tokens, info.prefix) == (N, 0)
