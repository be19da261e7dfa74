"""Packed [tokens, dim] streams: samples concatenated along one token axis, no batch dim.

The blocks learn the segment boundaries from cumulative offsets (``cu_seqlens``) or one
segment id per token, mask their attention per segment and build RoPE from per-token
position ids. A route selects per segment: every segment keeps its own share of tokens,
in order, and no token moves to another segment.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import (
    INVARIANTS,
    Case,
    capture_block_inputs,
    check_compiled,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx
from tread_fx.errors import SelectionError, TokenStreamError

D, HEADS, LENGTHS = 32, 2, (8, 24, 13)
T = sum(LENGTHS)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, d] by per-token positions [T]."""
    half = x.shape[-1] // 2
    freqs = 1.0 / 100 ** (torch.arange(half, dtype=torch.float32) / half)
    angle = positions.float()[:, None, None] * freqs
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


class PackedBlock(nn.Module):
    """Attention within each segment (a mask from the segment ids), RoPE, MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def attend(self, x: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor):
        q, k, v = self.qkv(self.norm1(x)).view(x.shape[0], 3, HEADS, -1).unbind(1)
        q, k = _rope(q, positions), _rope(k, positions)
        mask = segments[:, None] == segments[None, :]
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), mask)
        return x + self.proj(out.transpose(0, 1).reshape(x.shape))


class OffsetsBlock(PackedBlock):
    def forward(self, x, cu_seqlens, max_seqlen: int, position_ids):
        assert int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) <= max_seqlen
        segments = torch.repeat_interleave(
            torch.arange(len(cu_seqlens) - 1), cu_seqlens[1:] - cu_seqlens[:-1]
        )
        x = self.attend(x, segments, position_ids)
        return x + self.mlp(self.norm2(x))


class SegmentIdsBlock(PackedBlock):
    def forward(self, x, segment_ids, position_ids):
        x = self.attend(x, segment_ids, position_ids)
        return x + self.mlp(self.norm2(x))


class PackedModel(nn.Module):
    """A NaViT-like backbone over one packed sequence of several samples."""

    def __init__(self, block: type = OffsetsBlock, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, position_ids: torch.Tensor):
        h = self.embed(x)
        if isinstance(self.blocks[0], OffsetsBlock):
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            for block in self.blocks:
                h = block(h, cu_seqlens, int(lengths.max()), position_ids)
        else:
            segments = torch.searchsorted(cu_seqlens[1:], torch.arange(x.shape[0]), right=True)
            for block in self.blocks:
                h = block(h, segments, position_ids)
        return self.out(h)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return (torch.randn(T, 4, generator=gen), cu, positions), {}


CASES = [
    Case("packed-cu-seqlens", PackedModel, _inputs, routes=[(1, 4)]),
    Case("packed-segment-ids", lambda: PackedModel(SegmentIdsBlock), _inputs, routes=[(1, 4)]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case):
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    check_routed_shape_count_and_change(case)
    check_gradients(case)


def _routed_call(case: Case, block_index: int = 2):
    model = case.route(case.model()).train()
    with capture_block_inputs(model.blocks[block_index]) as calls:
        model(*_inputs()[0])
    *_, (args, _) = calls  # the first call may be the tracing one
    (info,) = tread_fx.route_info(model)
    return info.kept[0], args


def _segment_of(ids: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(_inputs()[0][1][1:].long(), ids, right=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_segment_keeps_its_own_share_and_tokens_stay_in_it(case):
    kept, args = _routed_call(case)
    assert kept.shape[0] == T - T // 2
    counts = torch.bincount(_segment_of(kept), minlength=len(LENGTHS))
    for count, length in zip(counts.tolist(), LENGTHS):
        assert abs(count - length * kept.shape[0] / T) <= 1, (counts, LENGTHS)
    positions = _inputs()[0][2]
    assert torch.equal(args[-1], positions[kept]), "kept tokens keep their positions"
    if case.name == "packed-cu-seqlens":
        cu = torch.tensor([0, *counts.cumsum(0).tolist()], dtype=torch.int32)
        assert torch.equal(args[1], cu) and args[1].dtype == torch.int32
        assert args[2] == max(LENGTHS), "max_seqlen stays an upper bound"
    else:
        assert torch.equal(args[1], _segment_of(kept)), "kept tokens keep their segment"


def test_selection_is_random_within_each_segment():
    model = CASES[0].route(CASES[0].model()).train()
    seen = set()
    for _ in range(4):
        model(*_inputs()[0])
        seen.add(tuple(tread_fx.route_info(model)[0].kept[0].tolist()))
    assert len(seen) > 1


def test_explain_names_the_rules():
    args, _ = _inputs()
    exp = str(tread_fx.explain(CASES[0].model(), CASES[0].routes, 0.5, args, flops=False))
    assert "packed-offsets" in exp and "rope-batch-shared" in exp  # positions make a rotary


def test_a_grid_selection_is_refused():
    model = CASES[0].route(CASES[0].model(), selection="rows", grid=(T, 1)).train()
    with pytest.raises(SelectionError, match="packed"):
        model(*_inputs()[0])


class BatchOfOneBlock(OffsetsBlock):
    def forward(self, x, cu_seqlens, max_seqlen: int, position_ids):
        return super().forward(x[0], cu_seqlens, max_seqlen, position_ids[0])[None]


def _batch_of_one():
    (x, cu, positions), _ = _inputs()
    return (x[None], cu, positions[None]), {}


BATCH_OF_ONE = Case(
    "packed-batch-of-one", lambda: PackedModel(BatchOfOneBlock), _batch_of_one, routes=[(1, 4)]
)


def test_a_batch_of_one_packed_sequence_selects_per_segment():
    """[1, T, dim] with cu_seqlens: the offsets follow the kept tokens too."""
    check_eval_is_bitwise_unrouted(BATCH_OF_ONE)
    check_rate_zero_equals_training(BATCH_OF_ONE)
    check_routed_shape_count_and_change(BATCH_OF_ONE)
    model = BATCH_OF_ONE.route(BATCH_OF_ONE.model()).train()
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*_batch_of_one()[0])
    *_, (args, _) = calls
    kept = tread_fx.route_info(model)[0].kept[0]
    counts = torch.bincount(_segment_of(kept), minlength=len(LENGTHS))
    assert args[1].tolist() == [0, *counts.cumsum(0).tolist()]
    assert torch.equal(args[3], _inputs()[0][2][kept][None])


PROMPT = 6


class PromptedModel(PackedModel):
    """Prompt tokens concatenated in front of the packed samples: one more segment that data
    flow shows is not from the noisy input, so it is never routed."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt = nn.Parameter(torch.randn(PROMPT, D))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, position_ids: torch.Tensor):
        h = torch.cat([self.prompt, self.embed(x)])
        cu = torch.cat([cu_seqlens[:1], cu_seqlens + PROMPT])
        positions = torch.cat([torch.arange(PROMPT), position_ids])
        longest = int((cu[1:] - cu[:-1]).max())
        for block in self.blocks:
            h = block(h, cu, longest, positions)
        return self.out(h[PROMPT:])


PROMPTED = Case("packed-prompt", PromptedModel, _inputs, routes=[(1, 4)])


def test_a_prompt_segment_in_front_is_never_routed():
    check_eval_is_bitwise_unrouted(PROMPTED)
    check_rate_zero_equals_training(PROMPTED)
    check_gradients(PROMPTED)
    check_routed_shape_count_and_change(PROMPTED)
    kept, args = _routed_call(PROMPTED)
    assert torch.equal(kept[:PROMPT], torch.arange(PROMPT))
    noisy = kept[PROMPT:] - PROMPT
    assert noisy.shape[0] == T - T // 2
    counts = torch.bincount(_segment_of(noisy), minlength=len(LENGTHS))
    for count, length in zip(counts.tolist(), LENGTHS):
        assert abs(count - length * noisy.shape[0] / T) <= 1, (counts, LENGTHS)
    assert args[1].tolist() == [0, PROMPT, *(PROMPT + counts.cumsum(0)).tolist()]


class TwoPathwayBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, text, noisy, position_ids):
        joint = torch.cat([text, noisy]).mean(0)
        return text + self.a(text) + joint, noisy + self.b(noisy) + joint


class JointBuffer(nn.Module):
    """Writes text and noisy tokens into one buffer by index, then hands out slices."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.embed = nn.Embedding(8, D), nn.Linear(4, D)
        self.blocks = nn.ModuleList(TwoPathwayBlock() for _ in range(4))
        self.out = nn.Linear(D, 4)

    def forward(self, ids, text_index, x, noisy_index, position_ids):
        buf = x.new_zeros(ids.shape[0] + x.shape[0], D)
        buf[text_index] = self.text(ids)
        buf[noisy_index] = self.embed(x)
        text, noisy = buf[: ids.shape[0]], buf[ids.shape[0] :]
        for block in self.blocks:
            text, noisy = block(text, noisy, position_ids)
        return self.out(noisy)


def test_several_packed_streams_from_a_joint_buffer_are_refused_by_name():
    args = (
        torch.arange(6),
        torch.arange(6),
        torch.randn(10, 4),
        torch.arange(6, 16),
        torch.arange(16),
    )
    model = tread_fx.route(JointBuffer(), [(1, 3)]).train()
    with pytest.raises(TokenStreamError, match=r"(?s)2 packed token streams.*index"):
        model(*args)


class VectorBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h, t):
        return h + self.fc(h) * t[:, None]


class VectorStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(VectorBlock() for _ in range(4))

    def forward(self, x, t):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, t)
        return h


def test_per_sample_vectors_are_not_taken_for_a_packed_stream():
    model = tread_fx.route(VectorStack(), [(1, 3)]).train()
    with pytest.raises(TokenStreamError, match="rows are the batch"):
        model(torch.randn(6, 4), torch.rand(6))


@pytest.mark.slow
def test_compiled():
    check_compiled(CASES[1])  # the offsets model reads max_seqlen from data (int(...))


def test_a_packed_stream_of_one_token_is_refused():
    from tread_fx.passes.locate.dims import packed_layout

    with pytest.raises(TokenStreamError, match="1 token, so routing would save nothing"):
        packed_layout((1, D))


class PromptBehindModel(PackedModel):
    """Prompt tokens concatenated *behind* the packed samples (one more segment id): a
    never-routed suffix of the packed stream, selected per segment before it."""

    def __init__(self) -> None:
        super().__init__(SegmentIdsBlock)
        self.prompt = nn.Parameter(torch.randn(PROMPT, D))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, position_ids: torch.Tensor):
        h = torch.cat([self.embed(x), self.prompt])
        segments = torch.searchsorted(cu_seqlens[1:], torch.arange(x.shape[0]), right=True)
        segments = torch.cat([segments, torch.full((PROMPT,), len(LENGTHS))])
        positions = torch.cat([position_ids, torch.arange(PROMPT)])
        for block in self.blocks:
            h = block(h, segments, positions)
        return self.out(h[: x.shape[0]])


PROMPT_BEHIND = Case("packed-prompt-behind", PromptBehindModel, _inputs, routes=[(1, 4)])


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda c: c.__name__)
def test_a_prompt_segment_behind_is_never_routed(check):
    check(PROMPT_BEHIND)


def test_a_prompt_segment_behind_is_kept_last():
    kept, _ = _routed_call(PROMPT_BEHIND)
    assert torch.equal(kept[-PROMPT:], torch.arange(T, T + PROMPT))
    noisy = kept[:-PROMPT]
    assert noisy.shape[0] == T - T // 2
    counts = torch.bincount(_segment_of(noisy), minlength=len(LENGTHS))
    for count, length in zip(counts.tolist(), LENGTHS):
        assert abs(count - length * noisy.shape[0] / T) <= 1, (counts, LENGTHS)


def test_a_user_adapter_that_holds_the_boundaries_makes_the_selection_per_segment():
    """The packed pass reads what the deciding rule says (``Adapter.segments``), never a rule
    name: a user rule for the offsets, under any name, selects per segment like the built-in."""
    from tread_fx.adapters import Adapter, register_adapter, unregister_adapter
    from tread_fx.runtime.packed import kept_offsets

    def offsets(side) -> bool:
        meta = side.meta
        return getattr(meta, "dtype", None) == torch.int32 and meta.shape == (len(LENGTHS) + 1,)

    def kept_with(segments):
        mine = register_adapter(Adapter("zq", offsets, kept_offsets, segments=segments))
        try:
            return _routed_call(CASES[0])
        finally:
            unregister_adapter(mine)

    (kept, args), (plain, _) = kept_with("offsets"), kept_with(None)
    assert torch.equal(kept, _routed_call(CASES[0])[0])  # as the built-in rule selects
    assert not torch.equal(plain, kept)  # without it: one random selection over all tokens
    counts = torch.bincount(_segment_of(kept), minlength=len(LENGTHS))
    assert torch.equal(args[1], torch.tensor([0, *counts.cumsum(0).tolist()], dtype=torch.int32))
