"""A routed model behaves like any nn.Module: it pickles, deep-copies, saves whole, sits inside
DataParallel, and its per-call checks do not walk the module tree."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import dit_inputs, tiny_dit
from torch import nn

import tread_fx
from tread_fx.errors import WrappedModelError
from tread_fx.runtime.guards import GUARD_MARK


def _routed(**kwargs):
    model = tiny_dit(depth=4, class_dropout_prob=0.0)
    return tread_fx.route(model, routes=[(1, 3)], seed=0, **kwargs)


def _kept(model, inputs):
    model.train()(*inputs)
    return tread_fx.route_info(model)[0].kept


def _train_steps(model, inputs, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model.train()(*inputs).square().mean().backward()
        optimizer.step()


def _torch_save_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # a whole pickled model, in this test only


@pytest.mark.parametrize(
    "round_trip",
    [lambda m: pickle.loads(pickle.dumps(m)), _torch_save_load, copy.deepcopy],
    ids=["pickle", "torch.save", "deepcopy"],
)
def test_a_routed_model_round_trips_and_continues_the_same_selections(round_trip):
    model, inputs = _routed(), dit_inputs()
    _kept(model, inputs)  # traced, one selection drawn
    loaded = round_trip(model)
    assert tread_fx.is_routed(loaded) and loaded.forward.__self__ is loaded
    assert tread_fx.routed_graphs(loaded) == [] and tread_fx.route_info(loaded) is None
    for _ in range(2):  # the generator state travelled: both draw the same next selections
        assert torch.equal(_kept(loaded, inputs), _kept(model, inputs))
        assert torch.allclose(loaded.train()(*inputs), model.train()(*inputs), atol=1e-6)
    pairs = zip(model.parameters(), loaded.parameters())
    assert all(p.data_ptr() != q.data_ptr() for p, q in pairs)


def test_a_loaded_routed_model_trains_routed_and_unroutes():
    model, inputs = _routed(), dit_inputs()
    loaded = _torch_save_load(model)  # never called before saving
    before = [p.detach().clone() for p in loaded.parameters()]
    _train_steps(loaded, inputs)
    assert tread_fx.route_info(loaded)[0].kept.shape == (3, 8)
    assert any(not torch.equal(a, p) for a, p in zip(before, loaded.parameters()))
    tread_fx.unroute(loaded)
    assert "forward" not in vars(loaded) and not tread_fx.is_routed(loaded)


def test_an_unseeded_routed_model_pickles_too():
    model, inputs = tread_fx.route(tiny_dit(depth=4), routes=[(1, 3)]), dit_inputs()
    _kept(model, inputs)
    loaded = pickle.loads(pickle.dumps(model))
    assert _kept(loaded, inputs).shape == (3, 8)


def test_data_parallel_without_several_gpus_calls_the_routed_model():
    model, inputs = _routed(), dit_inputs()
    expected = _kept(_routed(), inputs)
    wrapped = nn.DataParallel(model, device_ids=[]) if not torch.cuda.is_available() else None
    if wrapped is None:
        wrapped = nn.DataParallel(model.cuda(), device_ids=[0])
        inputs = tuple(t.cuda() for t in inputs)
    wrapped.train()(*inputs)
    assert torch.equal(tread_fx.route_info(wrapped)[0].kept.cpu(), expected)


def test_data_parallel_replication_of_a_routed_model_is_refused_clearly():
    model = _routed()
    # what DataParallel calls on every module when it copies the model onto several GPUs
    with pytest.raises(WrappedModelError, match="DataParallel tried to replicate a routed DiT"):
        model._replicate_for_data_parallel()
    model.blocks[0]._replicate_for_data_parallel()  # submodules are not refused themselves
    tread_fx.unroute(model)
    assert model._replicate_for_data_parallel() is not model  # a plain model replicates again


def test_the_per_call_check_does_not_walk_the_module_tree(monkeypatch):
    model, inputs = _routed(), dit_inputs()
    _kept(model, inputs)  # traced
    walks = []
    modules = nn.Module.modules

    def counting(self):
        walks.append(type(self).__name__)
        return modules(self)

    monkeypatch.setattr(nn.Module, "modules", counting)
    for _ in range(3):
        model.train()(*inputs)
    assert walks == []


def test_a_module_the_trace_went_through_switched_to_eval_traces_again():
    model, inputs = _routed(), dit_inputs()
    _kept(model, inputs)
    model.t_embedder.eval()  # its code is inlined in the routed graph: another signature
    model(*inputs)  # still in training mode but for t_embedder
    assert len(tread_fx.routed_graphs(model)) == 2


def test_a_called_block_switched_to_eval_runs_the_same_graph_in_its_own_mode():
    model, inputs = _routed(), dit_inputs()
    _kept(model, inputs)
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: seen.append(m.training))
    model.blocks[1].eval()  # the graph calls the block, which reads its own flag
    model(*inputs)
    assert seen == [False] and len(tread_fx.routed_graphs(model)) == 1


def test_a_hook_added_after_the_trace_makes_an_inlined_module_traced_again():
    model, inputs = _routed(), dit_inputs()
    _kept(model, inputs)
    calls = []
    model.blocks[1].attn.register_forward_pre_hook(lambda m, a: calls.append(1))
    model.train()(*inputs)
    assert calls, "the routed graph calls the hooked module (traced again)"


def test_a_guard_checks_on_the_host_and_never_asserts_on_the_device(monkeypatch):
    from tread_fx.runtime.guards import check_traced_value

    def device_assert(*args, **kwargs):
        raise AssertionError("a device-side assert was used")

    monkeypatch.setattr(torch, "_assert_async", device_assert)
    check_traced_value(torch.tensor([0, 1]).any(), True, "bool", "model.py:3")
    with pytest.raises(RuntimeError, match=GUARD_MARK):
        check_traced_value(torch.tensor(3), 2, "int", "model.py:4")
