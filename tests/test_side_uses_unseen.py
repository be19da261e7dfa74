"""Side values whose use is hard to see are still decided by data, never by their names.

- Blocks run under gradient checkpointing, called as ``checkpoint(block.forward, ...)``
  (directly, or through a partial binding the side values): the checkpointed function is the
  block, traced through like a plain call. A rotary table, a key mask and position ids under
  meaningless argument names route exactly as under conventional ones.
- A key mask that meets the stream only inside a leaf module (one tread_fx cannot trace
  into), or a per-token weight handed to a block that cannot be traced through (its forward
  draws a Python random number): one value per token and sample (``[B, N]``), decided by
  its shape against the stream (``per-token-by-shape``), with a warning naming the value
  and the override,
  whatever its name. A mask with two token-sized dims into a leaf cannot be told from its
  shape: refused, whatever its name.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from test_side_uses import (
    _SETTINGS,
    BLOCK_ARGS,
    HEAD_DIM,
    KINDS,
    MODEL_ARGS,
    SIDE,
    SideBlock,
    SideModel,
    _assert_same,
    _inputs,
    _names,
    _parameters,
    layer_dropped,
    renamed,
)
from third_party_checks import Case, capture_block_inputs
from torch import nn
from torch.utils.checkpoint import checkpoint

import tread_fx

B, N, D = 2, 16, 32


def _checkpointed(block_class: type, how: str) -> type:
    """SideModel whose blocks run through ``checkpoint(block.forward, ...)``."""

    class Checkpointed(SideModel):
        def forward(self, image, text, keep):
            x, context = self.embed(image), self.embed_text(text)
            tags = torch.arange(x.shape[1]) % KINDS
            values = ((self.cos, self.sin), keep, tags, context, x.shape[1], HEAD_DIM)
            for block in self.blocks:
                if how == "forward":
                    x = checkpoint(block.forward, x, *values, use_reentrant=False)
                else:  # a partial of the block's forward binding the side values
                    bound = dict(zip(_parameters(self.block_class)[1:], values))
                    x = checkpoint(functools.partial(block.forward, **bound), x)
            return self.head(x)

    return type("Checkpointed", (Checkpointed,), {"block_class": block_class})


def _checkpoint_case(how: str, names: tuple[str, ...] = BLOCK_ARGS) -> Case:
    model = _checkpointed(renamed(SideBlock, names), how)
    return Case(f"checkpointed-{how}", model, _inputs, SIDE.routes)


@pytest.mark.parametrize("how", ["forward", "partial"])
def test_checkpointed_blocks_are_traced_through_and_checkpointed_again(how):
    case = _checkpoint_case(how)
    _assert_same(SIDE, case)  # the same routing as the model calling its blocks plainly
    model = case.route(case.model()).train()
    model(*_inputs()[0])
    graph = tread_fx.routed_graphs(model)[0].gm.graph
    assert any(n.target is checkpoint for n in graph.nodes)  # the blocks are checkpointed


@_SETTINGS
@given(block_names=_names(len(BLOCK_ARGS)), model_names=_names(len(MODEL_ARGS)))
def test_renaming_a_checkpointed_models_arguments_changes_nothing(block_names, model_names):
    conventional = _checkpoint_case("forward")
    model = renamed(
        _checkpointed(renamed(SideBlock, tuple(block_names)), "forward"), tuple(model_names)
    )
    _assert_same(conventional, Case("renamed", model, _inputs, SIDE.routes))


class Opaque(nn.Module):
    """Masked mixing over the tokens that branches on the mask's data: tread_fx cannot
    trace into it (it stays one call, a leaf), so the mask's use inside is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x, keep):
        h = self.proj(x)
        if bool(keep.all()):  # a branch on tensor data
            return h
        weights = keep.to(h.dtype)
        if weights.dim() == 3:  # a [B, N, N] mask: a masked token mixing
            return weights @ h / keep.shape[-1]
        return h * weights.unsqueeze(-1) + (h * weights.unsqueeze(-1)).cumsum(1) / 4


class LeafBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mixer = nn.LayerNorm(D), Opaque()

    def forward(self, x, keep):
        return x + self.mixer(self.norm(x), keep)


class LeafModel(nn.Module):
    block_class: type = LeafBlock

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(self.block_class() for _ in range(4))

    def forward(self, x, keep):
        for block in self.blocks:
            x = block(x, keep)
        return x


def _leaf_inputs(square: bool = False):
    gen = torch.Generator().manual_seed(2)
    keep = torch.rand(B, N, N if square else 1, generator=gen) > 0.3
    return (torch.randn(B, N, D, generator=gen), keep if square else keep[..., 0]), {}


def _leaf_case(name: str, square: bool = False) -> Case:
    model = renamed(LeafModel, ("x", "keep"), block_class=renamed(LeafBlock, ("x", name)))
    return Case(name, model, lambda: _leaf_inputs(square), [(1, 3)])


@pytest.mark.parametrize("name", ["attention_mask", "zq"])
def test_a_key_mask_inside_a_leaf_module_is_decided_by_its_shape(name):
    case = _leaf_case(name)
    model = case.route(case.model()).train()
    expected = r"'per-token-by-shape'.*register a tread_fx\.adapters"
    with pytest.warns(UserWarning, match=expected), capture_block_inputs(model.blocks[1]) as calls:
        model(*_leaf_inputs()[0])
    (info,) = tread_fx.route_info(model)
    assert torch.equal(calls[-1][0][1], _leaf_inputs()[0][1].gather(1, info.kept))
    if name == "zq":
        with pytest.warns(UserWarning, match="per-token-by-shape"):
            _assert_same(_leaf_case("attention_mask"), case)  # the name changes nothing


@pytest.mark.parametrize("name", ["attention_mask", "zq"])
def test_a_square_mask_inside_a_leaf_module_is_refused_whatever_its_name(name):
    case = _leaf_case(name, square=True)
    model = case.route(case.model()).train()
    with pytest.raises(tread_fx.SideInputError, match=r"(?s)enters the routed blocks.*Adapter"):
        model(*_leaf_inputs(square=True)[0])


class LayerDropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, x, zq):
        if layer_dropped(self):
            return x
        return x + self.mix(x) * zq[..., None]


def test_a_per_token_weight_an_untraceable_block_receives_is_decided_by_its_shape():
    model = LeafModel()
    model.blocks = nn.ModuleList(LayerDropBlock() for _ in range(4))
    routed = tread_fx.route(model, routes=[(1, 3)], seed=0).train()
    x, weight = torch.randn(B, N, D), torch.rand(B, N)
    warned = pytest.warns(UserWarning, match=r"(?s)'per-token-by-shape'.*traced through.*'pass'")
    with warned, capture_block_inputs(routed.blocks[1]) as calls:
        routed(x, weight)
    assert torch.equal(calls[-1][0][1], weight.gather(1, tread_fx.route_info(routed)[0].kept))


class MixedLayer(nn.Module):
    """One class for a hybrid stack: attention layers get a mask, the others ``None``."""

    def __init__(self, attends: bool) -> None:
        super().__init__()
        self.attends = attends
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, zq=None):
        if zq is None:
            return x + self.out(torch.tanh(self.qkv(x)[..., :D]))
        q, k, v = (t.unflatten(-1, (2, D // 2)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=zq)
        return x + self.out(h.transpose(1, 2).flatten(2))


class MixedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MixedLayer(i % 2 == 1) for i in range(4))

    def forward(self, x, keep):
        mask = keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()
        for block in self.blocks:
            x = block(x, mask if block.attends else None)
        return x


def test_a_mask_only_the_later_layers_of_a_class_get_is_decided_by_its_use():
    """The class's first call (no mask) is not the attention layers' call: they are traced
    through on their own first call, and the mask is one by use, under any name."""
    model = tread_fx.route(MixedModel(), routes=[(1, 4)], seed=0).train()
    x, keep = _leaf_inputs()[0]
    with capture_block_inputs(model.blocks[1]) as calls:
        model(x, keep)
    plan = tread_fx.routed_graphs(model)[0].plans[0]
    assert "adapter 'attention-mask'" in [c.reason for c in plan.entering]
    kept = tread_fx.route_info(model)[0].kept
    mask = keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()
    expected = torch.stack([mask[b][:, kept[b]][:, :, kept[b]] for b in range(B)])
    assert torch.equal(calls[-1][0][1], expected)
