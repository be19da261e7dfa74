"""docs/design.md#invariants: route()/unroute() on the reference DiT and timm's ViT."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import dit_inputs, randomize_zero_init, tiny_dit
from timm.models.vision_transformer import VisionTransformer

import tread_fx


def _train_forward(model, *args, rng_seed=123):
    """One training forward with the global RNG fixed (label dropout draws from it)."""
    with torch.random.fork_rng():
        torch.manual_seed(rng_seed)
        return model.train()(*args)


def test_eval_output_is_bitwise_the_unrouted_model(dit, inputs):
    reference = dit.eval()(*inputs)
    tread_fx.route(dit, routes=[(1, 4)], rate=0.5, seed=0)
    _train_forward(dit, *inputs)  # a routed step first: it must leave nothing behind
    assert torch.equal(dit.eval()(*inputs), reference)


def test_rate_zero_training_equals_the_original_training_forward(inputs):
    model = tiny_dit(class_dropout_prob=0.1)  # label dropout draws in-forward random numbers
    reference = _train_forward(model, *inputs)
    tread_fx.route(model, routes=[(1, 3), (3, 5)], rate=0.0, seed=0)
    assert torch.equal(_train_forward(model, *inputs), reference)


def test_routing_changes_the_training_output_and_keeps_the_stated_count(dit, inputs):
    reference = _train_forward(dit, *inputs)
    tread_fx.route(dit, routes=[(1, 5)], rate=0.5, seed=0)
    routed = _train_forward(dit, *inputs)
    assert routed.shape == reference.shape
    assert not torch.allclose(routed, reference)
    (info,) = tread_fx.route_info(dit)
    assert info.kept.shape == (3, 16 - 8)
    assert (info.kept.diff(dim=1) > 0).all(), "kept ids must be ascending and unique"
    assert info.routed_mask.sum(dim=1).tolist() == [8, 8, 8]


def test_class_methods_parameters_and_state_dict_are_unchanged(dit, inputs):
    before_params = list(dit.parameters())
    before_keys = list(dit.state_dict())
    before_dict = set(dit.__dict__)
    cls = type(dit)
    tread_fx.route(dit, routes=[(1, 4)])
    assert type(dit) is cls and isinstance(dit, tread_fx.models.DiT)
    assert hasattr(dit, "forward_with_cfg")
    assert all(a is b for a, b in zip(dit.parameters(), before_params))
    assert list(dit.state_dict()) == before_keys
    assert len(list(dit.parameters())) == len(before_params)
    _train_forward(dit, *inputs)
    assert list(dit.state_dict()) == before_keys, "traces must never enter the state_dict"
    tread_fx.unroute(dit)
    assert set(dit.__dict__) == before_dict
    assert "forward" not in dit.__dict__


def test_forward_with_cfg_runs_routed_in_training_and_original_in_eval(dit, inputs):
    x, t, y = inputs
    x2, t2, y2 = torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, 10)])
    reference = dit.eval().forward_with_cfg(x2, t2, y2, 2.0)
    tread_fx.route(dit, routes=[(1, 4)], seed=0)
    assert torch.equal(dit.eval().forward_with_cfg(x2, t2, y2, 2.0), reference)
    dit.train().forward_with_cfg(x2, t2, y2, 2.0)
    assert tread_fx.route_info(dit) is not None


def test_every_parameter_gets_a_gradient_in_routed_training(dit, inputs):
    tread_fx.route(dit, routes=[(1, 5)], rate=0.5, seed=0)
    _train_forward(dit, *inputs).square().mean().backward()
    missing = [n for n, p in dit.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert not missing


class _TokenModel(torch.nn.Module):
    """Tokens in, tokens out: the routed-around tokens' path is the identity skip."""

    def __init__(self, depth: int = 4, width: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_routed_around_tokens_get_gradient_through_the_skip():
    torch.manual_seed(0)
    model = tread_fx.route(_TokenModel(), routes=[(0, 4)], rate=0.5, seed=0).train()
    x = torch.randn(2, 16, 16, requires_grad=True)
    weights = torch.randn(2, 16, 16)
    (model(x) * weights).sum().backward()
    mask = tread_fx.route_info(model)[0].routed_mask
    # routed around every block: output == input for those tokens, so d out/d x == identity
    assert torch.equal(x.grad[mask], weights[mask])
    assert not torch.equal(x.grad[~mask], weights[~mask])


def test_deepcopy_gives_an_ema_copy_that_routes_its_own_weights(dit, inputs):
    tread_fx.route(dit, routes=[(1, 4)], seed=0)
    _train_forward(dit, *inputs)  # the original has a cached trace
    ema = copy.deepcopy(dit)
    assert tread_fx.is_routed(ema)
    with torch.no_grad():
        for p in ema.final_layer.parameters():
            p.zero_()
    assert _train_forward(ema, *inputs).abs().max() == 0
    assert _train_forward(dit, *inputs).abs().max() > 0
    assert all(a is not b for a, b in zip(ema.parameters(), dit.parameters()))


def test_state_dict_of_a_routed_model_loads_exactly_into_a_fresh_unrouted_one(dit, inputs):
    tread_fx.route(dit, routes=[(1, 4)], seed=0)
    optimizer = torch.optim.SGD(dit.parameters(), lr=0.1)
    _train_forward(dit, *inputs).square().mean().backward()
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(dit.state_dict(), buffer)
    buffer.seek(0)
    fresh = tiny_dit(seed=5)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(fresh.eval()(*inputs), dit.eval()(*inputs))


def test_unroute_restores_the_exact_training_forward(dit, inputs):
    reference = _train_forward(dit, *inputs)
    tread_fx.route(dit, routes=[(1, 4)], seed=0)
    _train_forward(dit, *inputs)
    tread_fx.unroute(dit)
    assert not tread_fx.is_routed(dit)
    assert torch.equal(_train_forward(dit, *inputs), reference)


def test_seeded_selection_is_reproducible_and_seed_dependent(inputs):
    kept = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        model = tread_fx.route(tiny_dit(), routes=[(1, 4)], seed=seed)
        steps = []
        for _ in range(3):
            model.train()(*inputs)
            steps.append(tread_fx.route_info(model)[0].kept)
        kept[name] = torch.stack(steps)
    assert torch.equal(kept["a"], kept["b"])
    assert not torch.equal(kept["a"], kept["c"])
    assert not torch.equal(kept["a"][0], kept["a"][1]), "a fresh subset every step"


def test_selection_differs_per_sample(inputs):
    model = tread_fx.route(tiny_dit(), routes=[(1, 4)], seed=0).train()
    model(*inputs)
    kept = tread_fx.route_info(model)[0].kept
    assert not (torch.equal(kept[0], kept[1]) and torch.equal(kept[1], kept[2]))


def test_negative_and_dict_routes_equal_their_positive_form(inputs):
    outputs = []
    for routes in ([(2, 5)], [(-4, -1)], [{"start_layer_idx": 2, "end_layer_idx": 4}]):
        model = tread_fx.route(tiny_dit(), routes=routes, rate=0.5, seed=0)
        outputs.append(_train_forward(model, *inputs))
        (info,) = tread_fx.route_info(model)
        assert (info.route.start, info.route.end) == (2, 5)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_multiple_routes_and_end_equal_depth(inputs):
    model = tread_fx.route(tiny_dit(), routes=[(0, 2, 0.25), (3, 6)], rate=0.5, seed=0)
    out = _train_forward(model, *inputs)
    first, second = tread_fx.route_info(model)
    assert (first.route.start, first.route.end, first.route.rate) == (0, 2, 0.25)
    assert first.kept.shape[1] == 16 - 4 and second.kept.shape[1] == 8
    assert (second.route.end, out.shape) == (6, (3, 2, 8, 8))


def test_a_new_input_signature_gets_its_own_trace(dit):
    tread_fx.route(dit, routes=[(1, 4)], seed=0)
    dit.train()
    for batch, size in ((2, 8), (3, 8), (2, 12), (2, 8)):
        x, t, y = dit_inputs(batch=batch, input_size=size)
        if size != 8:
            with pytest.raises(AssertionError):  # timm PatchEmbed checks the image size
                dit(x, t, y)
            continue
        assert dit(x, t, y).shape == (batch, 2, size, size)
    assert len(tread_fx.routed_graphs(dit)) == 2


def test_non_tensor_arguments_are_part_of_the_signature():
    class Scaled(_TokenModel):
        def forward(self, x, scale: float = 1.0, flip: bool = False):
            x = super().forward(x) * scale
            return x.flip(1) if flip else x

    torch.manual_seed(0)
    model = tread_fx.route(Scaled(), routes=[(1, 3)], seed=0).train()
    x = torch.randn(2, 16, 16)
    a, b = model(x, scale=1.0), model(x, scale=2.0, flip=True)
    assert len(tread_fx.routed_graphs(model)) == 2
    assert not torch.allclose(a, b.flip(1) / 2)  # different selections, but both ran
    assert b.shape == a.shape


def test_timm_vit_routes_without_touching_cls_and_register_tokens():
    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=5, reg_tokens=2
    )
    randomize_zero_init(vit)
    x = torch.randn(3, 3, 16, 16)
    reference_eval = vit.eval()(x)
    reference_train = _train_forward(vit, x)
    tread_fx.route(vit, routes=[(1, 3)], rate=0.5, seed=0)
    out = _train_forward(vit, x)
    (info,) = tread_fx.route_info(vit)
    assert info.prefix == 3 and info.num_tokens == 19
    assert (info.kept[:, :3] == torch.arange(3)).all(), "cls + 2 registers always kept"
    assert info.kept.shape[1] == 3 + 16 - 8
    assert out.shape == reference_train.shape and not torch.allclose(out, reference_train)
    assert torch.equal(vit.eval()(x), reference_eval)
    tread_fx.route(vit, routes=[(1, 3)], rate=0.0, reroute=True)
    assert torch.equal(_train_forward(vit, x), reference_train)
    vit.zero_grad()
    tread_fx.route(vit, routes=[(1, 3)], rate=0.5, reroute=True)
    _train_forward(vit, x).square().sum().backward()
    assert all(p.grad is not None for p in vit.parameters())


def test_example_inputs_trace_at_route_time(dit, inputs):
    tread_fx.route(dit, routes=[(1, 4)], example_inputs=inputs)
    assert len(tread_fx.routed_graphs(dit)) == 1
    dit.eval()
    tread_fx.route(dit, routes=[(1, 4)], example_inputs=(inputs, {}), reroute=True)
    assert not dit.training, "tracing at route() time must restore the module's mode"
