"""Blocks told a token count of their stream as a plain number.

A video model with history frames in front of the noisy frames builds its stream by nested
concatenations (``cat([history, cat([memory, image])])``) and tells every block how many
image tokens there are; the block splits the stream with that number. After routing, the
blocks must be told the kept count (the history is a never-routed prefix, its length is
unchanged); a number that could count two different things is refused.
"""

from __future__ import annotations

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
)
from torch import nn

import tread_fx
from tread_fx.errors import SideInputError

B, IMAGE, HISTORY, MEMORY, D = 2, 16, 8, 2, 32
PREFIX = HISTORY + MEMORY


class _Mixer(nn.Module):
    """Self-attention over the whole stream."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class ContextBlock(_Mixer):
    """Told the image token count; history and image tokens get different MLPs."""

    def __init__(self) -> None:
        super().__init__()
        self.history_mlp, self.image_mlp = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, context_len: int) -> torch.Tensor:
        history, image = torch.split(x, [x.shape[1] - context_len, context_len], dim=1)
        x = torch.cat([history + self.history_mlp(history), image + self.image_mlp(image)], 1)
        return super().forward(x)


class HistoryBlock(_Mixer):
    """Told the history (prefix) length; the history is scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.history_scale = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor, history_len: int) -> torch.Tensor:
        x = torch.cat([x[:, :history_len] * self.history_scale, x[:, history_len:]], dim=1)
        return super().forward(x)


class TotalBlock(_Mixer):
    """Told the whole stream's length; reshapes to it."""

    def forward(self, x: torch.Tensor, total: int) -> torch.Tensor:
        return super().forward(x.reshape(-1, total, D))


class HistoryStack(nn.Module):
    """History, learned memory tokens and image tokens, concatenated in two steps."""

    def __init__(self, block: type[nn.Module] = ContextBlock, history: int = HISTORY) -> None:
        super().__init__()
        self.kind, self.history = block, history
        self.embed, self.embed_history = nn.Linear(4, D), nn.Linear(4, D)
        self.memory = nn.Parameter(torch.randn(1, MEMORY, D))
        self.blocks = nn.ModuleList(block() for _ in range(5))
        self.out = nn.Linear(D, 4)

    def forward(self, image: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        x = self.embed(image)
        context_len = x.shape[1]
        memory = self.memory.expand(x.shape[0], -1, -1)
        x = torch.cat([self.embed_history(history), torch.cat([memory, x], dim=1)], dim=1)
        number = {
            ContextBlock: context_len,
            HistoryBlock: self.history + MEMORY,  # a plain Python int, not from a shape
            TotalBlock: x.shape[1],
        }[self.kind]
        for block in self.blocks:
            x = block(x, number)
        return self.out(x[:, -context_len:])


def _inputs(history: int = HISTORY):
    gen = torch.Generator().manual_seed(1)
    args = torch.randn(B, IMAGE, 4, generator=gen), torch.randn(B, history, 4, generator=gen)
    return args, {}


CASES = {
    kind.__name__: Case(kind.__name__, lambda kind=kind: HistoryStack(kind), _inputs, [(1, 4)])
    for kind in (ContextBlock, HistoryBlock, TotalBlock)
}
KEPT = IMAGE // 2


@pytest.mark.parametrize(
    ("name", "told"),
    [("ContextBlock", KEPT), ("HistoryBlock", PREFIX), ("TotalBlock", PREFIX + KEPT)],
)
def test_the_blocks_are_told_the_kept_count(name, told):
    case = CASES[name]
    model = case.route(case.model()).train()
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*_inputs()[0])
    *_, (args, _) = calls  # the first call may be the tracing one
    assert args[0].shape[1] == PREFIX + KEPT
    assert args[1] == told


def test_the_nested_prefix_is_never_routed():
    case = CASES["ContextBlock"]
    model = case.route(case.model()).train()
    model(*_inputs()[0])
    (info,) = tread_fx.route_info(model)
    assert info.prefix == PREFIX and info.num_tokens == PREFIX + IMAGE
    assert (info.kept[:, :PREFIX] == torch.arange(PREFIX)).all()  # the routed part: image only
    assert (info.kept[:, PREFIX:] >= PREFIX).all()


def test_a_number_that_counts_two_things_is_refused():
    history = IMAGE - MEMORY  # the prefix is as long as the image part: 16 and 16
    model = HistoryStack(ContextBlock, history).train()
    tread_fx.route(model, routes=[(1, 4)], rate=0.5, seed=0)
    with pytest.raises(
        SideInputError, match=r"(?s)number 16 as its argument 'context_len'.*routed part.*prefix"
    ):
        model(*_inputs(history)[0])


class TextBlock(ContextBlock):
    """Also carries a joint text stream from block to block."""

    def forward(self, x: torch.Tensor, text: torch.Tensor, context_len: int) -> tuple:
        x = super().forward(x, context_len)
        return x + self.attn(x, text, text, need_weights=False)[0], text + x.mean(1, True)


class TextStack(HistoryStack):
    def __init__(self) -> None:
        super().__init__(ContextBlock)
        self.blocks = nn.ModuleList(TextBlock() for _ in range(5))

    def forward(self, image: torch.Tensor, history: torch.Tensor, prompt: torch.Tensor):
        x, text = self.embed(image), self.embed(prompt)
        context_len = x.shape[1]
        x = torch.cat([self.embed_history(history), x], dim=1)
        for block in self.blocks:
            x, text = block(x, text, context_len)
        return self.out(x[:, -context_len:])


def test_a_number_that_splits_the_stream_counts_it_even_when_a_text_is_as_long():
    """The block splits its stream with the number (traced through): it counts the stream's
    tokens, not the text's, though both are 16 long."""
    model = tread_fx.route(TextStack().train(), routes=[(1, 4)], rate=0.5, seed=0)
    prompt = torch.randn(B, IMAGE, 4)  # as many text tokens as image tokens
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*_inputs()[0], prompt)
    *_, (args, _) = calls
    assert args[1].shape[1] == IMAGE and args[2] == KEPT


@pytest.mark.parametrize("name", sorted(CASES))
def test_invariants(name):
    case = CASES[name]
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    check_routed_shape_count_and_change(case)
    check_gradients(case)


@pytest.mark.slow
def test_compiled():
    check_compiled(CASES["ContextBlock"])
