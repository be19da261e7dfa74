"""The stream's batch dim is told by what the blocks mix, never by a convention (issue 55).

Sequence-first models (``x`` given as ``[T, B, C]``, torch's transformer containers with
``batch_first=False``, attention written over dim 0) route their tokens, never their samples;
each is compared with a hand-written route, and the routed training forward keeps the samples
apart. Where no block shows the batch dim, the route is refused and ``batch_dim=`` decides.
"""

from __future__ import annotations

import pytest
import torch
from conftest import dit_inputs, tiny_dit
from stream_models import SelfBlock
from torch import nn

import tread_fx
from tread_fx.api import routed_graphs
from tread_fx.errors import StreamChoiceWarning, TokenStreamError

T, B, C = 16, 3, 32


class EncoderSeqFirst(nn.Module):
    """``x: [T, B, C]`` and per-frame noise levels ``[T, B]`` through torch's own
    ``nn.TransformerEncoder`` (``batch_first=False``)."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.inp, self.level = nn.Linear(C, C), nn.Linear(1, C)
        layer = nn.TransformerEncoderLayer(C, 2, 2 * C, dropout=0.0, batch_first=False)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.out = nn.Linear(C, C)

    def embed(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        return self.inp(x) + self.level(level[..., None])

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder(self.embed(x, level)))

    def layers(self) -> nn.ModuleList:
        return self.encoder.layers


class DimZeroAttention(nn.Module):
    """Self-attention written by hand over dim 0 of a ``[T, B, C]`` stream."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj, self.mlp = nn.Linear(C, 3 * C), nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)  # [T, B, C] each
        scores = torch.einsum("tbc,sbc->bts", q, k) / C**0.5
        mixed = torch.einsum("bts,sbc->tbc", scores.softmax(-1), v)
        h = h + self.proj(mixed)
        return h + self.mlp(torch.tanh(h))


class HandSeqFirst(nn.Module):
    """``[T, B, C]`` in, blocks attending over dim 0 in a plain ModuleList."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.inp, self.level = nn.Linear(C, C), nn.Linear(1, C)
        self.blocks = nn.ModuleList(DimZeroAttention() for _ in range(depth))
        self.out = nn.Linear(C, C)

    def embed(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        return self.inp(x) + self.level(level[..., None])

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        h = self.embed(x, level)
        for block in self.blocks:
            h = block(h)
        return self.out(h)

    def layers(self) -> nn.ModuleList:
        return self.blocks


class BatchFirstInside(HandSeqFirst):
    """``[T, B, C]`` in, permuted to ``[B, T, C]`` for batch-first blocks."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__(depth)
        self.blocks = nn.ModuleList(SelfBlock() for _ in range(depth))  # width D == C

    def forward(self, x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        h = self.embed(x, level).permute(1, 0, 2)
        for block in self.blocks:
            h = block(h)
        return self.out(h.permute(1, 0, 2))


class TokenwiseBlocks(nn.Module):
    """Blocks that never mix positions along any dim: nothing tells the batch dim."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(C, C), nn.GELU()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, B, C, generator=gen), torch.rand(T, B, generator=gen)


def _hand_routed(model: nn.Module, x, level, kept: torch.Tensor, start: int, end: int):
    """The route written by hand: blocks ``start .. end-1`` see each sample's kept frames."""
    layers = list(model.layers())
    h = model.embed(x, level)
    seq_first = not isinstance(model, BatchFirstInside)
    h = h if seq_first else h.permute(1, 0, 2)
    h = h.transpose(0, 1) if seq_first else h  # [B, T, C] for the gather
    for layer in layers[:start]:
        h = _as_model(layer, h, seq_first)
    idx = kept[..., None].expand(-1, -1, C)
    sub = torch.gather(h, 1, idx)
    for layer in layers[start:end]:
        sub = _as_model(layer, sub, seq_first)
    h = h.scatter(1, idx, sub)
    for layer in layers[end:]:
        h = _as_model(layer, h, seq_first)
    h = h.transpose(0, 1) if seq_first else h.permute(1, 0, 2)
    return model.out(h)


def _as_model(layer: nn.Module, h: torch.Tensor, seq_first: bool) -> torch.Tensor:
    """Run ``layer`` on batch-first ``h`` in the layout the model hands it."""
    return layer(h.transpose(0, 1)).transpose(0, 1) if seq_first else layer(h)


@pytest.mark.parametrize("cls", [EncoderSeqFirst, HandSeqFirst, BatchFirstInside])
def test_sequence_first_models_route_their_tokens_like_a_hand_written_route(cls) -> None:
    torch.manual_seed(0)
    model = cls()
    x, level = _inputs()
    tread_fx.route(model, [(1, 3)], 0.5, seed=0)
    out = model.train()(x, level)
    info = tread_fx.route_info(model)[0]
    assert info.kept.shape == (B, T // 2) and info.num_tokens == T
    layout = routed_graphs(model)[0].plans[0].layout
    assert layout.batch_size == B and layout.num_tokens == T
    expected = _hand_routed(model, x, level, info.kept, 1, 3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert "mixes dim" in routed_graphs(model)[0].info.batch_reason


@pytest.mark.parametrize("cls", [EncoderSeqFirst, HandSeqFirst, BatchFirstInside])
def test_the_routed_forward_keeps_samples_apart(cls) -> None:
    torch.manual_seed(0)
    model = tread_fx.route(cls(), [(1, 3)], 0.5).train()  # selections from the global RNG
    x, level = _inputs()
    model(x, level)  # the first call traces
    torch.manual_seed(5)
    first = model(x, level)
    other = x.clone()
    other[:, 0] = torch.randn(T, C)  # sample 0 changes, along dim 1 of the input
    torch.manual_seed(5)
    second = model(other, level)
    assert not torch.equal(first[:, 0], second[:, 0])
    torch.testing.assert_close(first[:, 1:], second[:, 1:], rtol=0, atol=0)


def test_a_batch_as_large_as_the_token_count_is_told_by_the_blocks() -> None:
    model = tread_fx.route(tiny_dit(depth=4), [(1, 3)], 0.5)
    x, t, y = dit_inputs(batch=16)  # 16 samples of 16 tokens
    model.train()(x, t, y)
    built = routed_graphs(model)[0]
    assert built.plans[0].layout.batch_dim == 0 and built.plans[0].layout.batch_size == 16
    assert "never dim 0" in built.info.batch_reason


def test_blocks_that_mix_nothing_take_dim_0_with_a_warning_naming_batch_dim() -> None:
    x = torch.randn(4, 6, C)
    model = tread_fx.route(TokenwiseBlocks(), [(1, 3)], 0.5)
    with pytest.warns(StreamChoiceWarning, match="batch_dim=0 to route") as caught:
        model.train()(x)
    assert "samples stay apart either way" in str(caught[0].message)
    assert tread_fx.route_info(model)[0].kept.shape == (4, 3)


class BothDims(nn.Module):
    """A block that mixes along dim 0 and dim 1 of its input: no reading keeps samples apart."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + h.mean(dim=(0, 1), keepdim=True)


def test_blocks_that_mix_both_dims_are_refused_naming_batch_dim() -> None:
    model = nn.Sequential(*(BothDims() for _ in range(4)))
    with pytest.raises(TokenStreamError, match="batch_dim=0 or batch_dim=1") as caught:
        tread_fx.route(model, [(1, 3)], example_inputs=(torch.randn(4, 6, C),))
    assert "mixes all of them" in str(caught.value)


def test_batch_dim_decides_where_the_blocks_do_not() -> None:
    x = torch.randn(4, 6, C)
    model = tread_fx.route(TokenwiseBlocks(), [(1, 3)], 0.5, batch_dim=0)
    model.train()(x)
    assert tread_fx.route_info(model)[0].kept.shape == (4, 3)
    assert routed_graphs(model)[0].info.batch_reason == "batch_dim=0 was given"


@pytest.mark.parametrize("bad", [2, -1, True, "0", 0.0])
def test_a_bad_batch_dim_is_refused_at_route(bad) -> None:
    with pytest.raises(TokenStreamError, match=f"batch_dim={bad!r} was given"):
        tread_fx.route(TokenwiseBlocks(), [(1, 3)], batch_dim=bad)


def test_the_coverage_oracle_scores_a_route_across_samples_as_mixing_them() -> None:
    from benchmarks.coverage import totals
    from benchmarks.coverage_checks import Case, judge

    case = Case("seq-first", "test", EncoderSeqFirst, lambda: (_inputs(), {}), batch_dim=1)
    assert judge(case).verdict == "routes"

    def across_samples(model, **kwargs):
        return tread_fx.route(model, batch_dim=0, **kwargs)  # frames read as the batch

    verdict = judge(case, route_fn=across_samples)
    assert verdict.verdict == "mixes samples" and verdict.stage == "samples apart"
    assert totals([verdict.to_dict()])["broken"] == 1
