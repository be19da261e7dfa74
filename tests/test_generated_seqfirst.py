"""The generator's sequence-first round and its samples-apart check (issue 55).

Generator-side checks, independent of what ``route()`` answers: sequence-first models
(``[T, B, C]`` in and out) are drawn in every form, written as the form says, say
``BATCH_DIM = 1``, compile, and their twin keeping every token is the unrouted model. Then
fixed seeds of each form route and equal their twin, and the check's batch-independence
oracle: a route forced across the samples (``batch_dim=0`` on a sequence-first stream) is
``wrong`` for mixing them, and a module whose ``BATCH_DIM`` is not where its samples are is
a generator error.
"""

from __future__ import annotations

import importlib
import tempfile

import pytest
import torch
from test_generated_grammar import _loaded

from benchmarks.generated import check, draw, module_source
from benchmarks.generated.grammar_seqfirst import FORMS

CHECK = importlib.import_module("benchmarks.generated.check")  # the package names check()
SEEDS = range(0, 800)  # drawing is cheap; about one seed in sixteen is sequence-first

# form -> a text its written source must contain
FORM_TEXT = {
    "encoder": "nn.TransformerEncoder(nn.TransformerEncoderLayer(",
    "encoder_list": "nn.ModuleList([nn.TransformerEncoderLayer(",
    "decoder": "nn.TransformerDecoder(nn.TransformerDecoderLayer(",
    "decoder_list": "nn.ModuleList([nn.TransformerDecoderLayer(",
    "dim0": "count, batch, width = x.shape",
    "permuted": "batch, count, width = x.shape",
}


def _seeds(**want) -> list[int]:
    return [s for s in SEEDS if draw(s).seq and all(f(draw(s)) for f in want.values())]


def _form(form: str) -> list[int]:
    return _seeds(form=lambda d: d.seq.form == form)


def test_sequence_first_is_drawn_in_every_form_and_written_as_drawn():
    seeds = _seeds()
    assert 0.03 * len(SEEDS) <= len(seeds) <= 0.1 * len(SEEDS)
    assert {draw(s).seq.form for s in seeds} == set(FORMS)
    for seed in seeds:
        d = draw(seed)
        text = module_source(d)
        compile(text, f"generated_{seed}.py", "exec")
        assert d.routable and d.batch_dim == 1 and "\nBATCH_DIM = 1 " in text
        assert FORM_TEXT[d.seq.form] in text, seed
        if d.seq.torch_layers:
            assert "batch_first=False" in text and "dropout=0.0" in text
        assert "self.blocks" not in text
    assert "\nBATCH_DIM = 0 " in module_source(draw(next(s for s in SEEDS if not draw(s).seq)))


@pytest.mark.parametrize("form", FORMS)
def test_twin_keeping_every_token_is_the_model(form):
    seed = _form(form)[0]
    d = draw(seed)
    with tempfile.TemporaryDirectory() as tmp:
        module, model, args, kwargs, reference = _loaded(seed, tmp)
        assert reference.shape == (d.num_patches, 2, d.channels)  # [T, B, C] out
        every = torch.arange(d.num_patches).expand(2, -1)
        with torch.no_grad():
            full = module.twin(model, args, kwargs, every, checks=False)
    torch.testing.assert_close(full, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_fixed_seeds_of_each_form_route_and_equal_their_twin(form):
    for seed in _form(form)[:2]:
        result = check(seed)
        assert result.outcome == "routed", result


def test_a_perturbed_twin_of_a_sequence_first_model_is_wrong():
    result = check(_form("encoder")[0], perturb_kept=True)
    assert result.outcome == "wrong" and "differs from the twin" in result.message, result


@pytest.mark.parametrize("form", ["encoder", "dim0"])
def test_a_route_forced_across_samples_is_wrong_for_mixing_them(form):
    # the blocks attend over dim 0; batch_dim=0 keeps some samples of each position, so
    # the kept tokens of one sample attend to another's (with the conditioning added to
    # the tokens: adaLN rows [B, D] would make the route keep one subset of samples)
    seed = _seeds(form=lambda d: d.seq.form == form, added=lambda d: not d.adaln)[0]
    result = check(seed, route_options={"batch_dim": 0})
    assert result.outcome == "wrong", result
    assert result.message.startswith("the routed training forward mixes samples"), result


def test_a_batch_dim_constant_not_where_the_samples_are_is_a_generator_error(monkeypatch):
    seed = _form("encoder")[0]
    text = module_source(draw(seed)).replace("\nBATCH_DIM = 1 ", "\nBATCH_DIM = 0 ")
    monkeypatch.setattr(CHECK, "module_source", lambda _d: text)
    result = check(seed)
    assert result.outcome == "generator error", result
    assert "the unrouted training forward mixes them" in result.message
