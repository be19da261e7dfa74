"""A joint stream with the text *behind* the image: ``x = cat([image, text], 1)``.

DiTs that run one stream of image and text tokens through every block (single-stream
MMDiTs) concatenate the text after the image before the first block and slice the image
part off at the end. Only the image tokens are routed: the text tokens are a never-routed
suffix (and cls/register tokens in front a never-routed prefix), kept by every route,
processed by the routed blocks and written back in place at the route end. Side values with
one row per joint token (a ``[N + T, d]`` RoPE table) keep the suffix rows too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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
from torch import nn

import tread_fx

B, T, R, D, H, P = 2, 6, 2, 32, 2, 2  # batch, text tokens, registers, width, heads, patch
N = (8 // P) ** 2  # 16 image tokens from an 8 x 8 latent


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    cos, sin = rope.cos(), rope.sin()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    """adaLN-modulated self-attention + MLP over the whole joint stream."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D, elementwise_affine=False)
        self.mod = nn.Linear(D, 2 * D)
        self.qkv, self.proj, self.mlp = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: torch.Tensor | None = None):
        shift, scale = self.mod(c).unsqueeze(1).chunk(2, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        q, k, v = self.qkv(h).unflatten(-1, (3, H, D // H)).permute(2, 0, 3, 1, 4)
        if rope is not None:  # [S, head_dim], broadcast over batch and heads
            q, k = _rotate(q, rope), _rotate(k, rope)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return x + self.mlp(x)


class TextBehindDiT(nn.Module):
    """``cat([registers?, patch_embed(img), text_proj(ctx)], 1)``, blocks, image part out."""

    def __init__(self, depth: int = 5, registers: int = 0, rope: bool = False) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(4, D, P, stride=P)
        self.text_proj, self.t_embed = nn.Linear(8, D), nn.Linear(1, D)
        self.registers = nn.Parameter(torch.randn(1, registers, D)) if registers else None
        self.use_rope = rope
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.out = nn.Linear(D, 4 * P * P)

    def _rope(self, tokens: int) -> torch.Tensor:
        freqs = 1.0 / 100 ** (torch.arange(D // H // 2) / (D // H // 2))
        angles = torch.arange(tokens, dtype=torch.float32)[:, None] * freqs
        return torch.cat([angles, angles], dim=-1)  # [S, head_dim]

    def forward(self, img: torch.Tensor, ctx: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        image = self.patch_embed(img).flatten(2).transpose(1, 2)
        parts = [image, self.text_proj(ctx)]
        if self.registers is not None:
            parts.insert(0, self.registers.expand(img.shape[0], -1, -1))
        x = torch.cat(parts, dim=1)
        c = self.t_embed(t[:, None])
        rope = self._rope(x.shape[1]) if self.use_rope else None
        for block in self.blocks:
            x = block(x, c, rope) if rope is not None else block(x, c)
        first = 0 if self.registers is None else self.registers.shape[1]
        return self.out(x[:, first : first + image.shape[1]])


def _inputs():
    gen = torch.Generator().manual_seed(3)
    img, ctx = torch.randn(B, 4, 8, 8, generator=gen), torch.randn(B, T, 8, generator=gen)
    return (img, ctx, torch.rand(B, generator=gen)), {}


SUFFIX = Case("suffix", TextBehindDiT, _inputs, routes=[(1, 4)])
BOTH = Case("prefix-and-suffix", lambda: TextBehindDiT(registers=R), _inputs, routes=[(1, 4)])
ROPE = Case("suffix-rope", lambda: TextBehindDiT(rope=True), _inputs, routes=[(1, 4)])
TO_END = Case("suffix-to-end", TextBehindDiT, _inputs, routes=[(2, 5)])
CASES = [SUFFIX, BOTH, ROPE, TO_END]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invariants(case):
    check_eval_is_bitwise_unrouted(case)
    check_rate_zero_equals_training(case)
    check_routed_shape_count_and_change(case)
    check_gradients(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [BOTH, ROPE], ids=lambda c: c.name)
def test_compiled(case):
    check_compiled(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_only_image_tokens_are_routed(case):
    prefix = R if case is BOTH else 0
    model = case.route(case.model())
    train_forward(model, case)
    (info,) = tread_fx.route_info(model)
    assert (info.num_tokens, info.prefix, info.suffix) == (prefix + N + T, prefix, T)
    assert info.kept.shape[1] == prefix + N // 2 + T
    never = list(range(prefix)) + list(range(prefix + N, prefix + N + T))
    assert not info.routed_mask[:, never].any()
    assert info.routed_mask.sum(1).tolist() == [N // 2] * B


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_routed_blocks_see_every_text_token_in_place(case):
    """Each routed block sees prefix + kept + T tokens; at the route start the text (and
    register) rows are exactly the unrouted model's, in the same places."""
    prefix = R if case is BOTH else 0
    model = case.model()
    start = case.routes[0][0]
    with capture_block_inputs(model.blocks[start]) as calls:
        train_forward(model, case)
    reference = calls[0][0][0]
    case.route(model)
    blocks = model.blocks[start : case.routes[0][1]]
    train_forward(model, case)  # the first routed call traces (the blocks run on all tokens)
    with capture_block_inputs(blocks[0]) as first, capture_block_inputs(blocks[-1]) as last:
        train_forward(model, case)
    for calls in (first, last):
        assert calls[-1][0][0].shape[1] == prefix + N // 2 + T
    seen = first[-1][0][0]
    assert torch.equal(seen[:, -T:], reference[:, -T:])
    assert torch.equal(seen[:, :prefix], reference[:, :prefix])


def test_rope_table_keeps_the_text_rows():
    """The batch-shared [N + T, d] table is cut with the stream: kept image rows, all text."""
    model = ROPE.route(ROPE.model())
    train_forward(model, ROPE)
    with capture_block_inputs(model.blocks[1]) as calls:
        train_forward(model, ROPE)
    (info,) = tread_fx.route_info(model)
    rope = calls[-1][0][2]
    assert torch.equal(rope, model._rope(N + T)[info.kept[0]])
    assert torch.equal(info.kept[0], info.kept[1])  # a batch-shared table shares the subset


def test_rows_selection_keeps_image_rows_and_all_text():
    model = SUFFIX.route(SUFFIX.model(), selection="rows", grid=(4, 4))
    train_forward(model, SUFFIX)
    (info,) = tread_fx.route_info(model)
    assert info.grid == (4, 4) and info.kept.shape[1] == 2 * 4 + T
    assert info.kept[:, -T:].tolist() == [list(range(N, N + T))] * B


def test_losses_cover_the_image_tokens_only():
    model = SUFFIX.route(SUFFIX.model())
    train_forward(model, SUFFIX)
    infos = tread_fx.route_info(model)
    per_token = torch.rand(B, N)
    processed = tread_fx.losses.masked_denoising_loss(per_token, infos)
    around = tread_fx.losses.reconstruction_loss(per_token, infos)
    mask = infos[0].routed_mask[:, :N].float()
    expected = ((per_token * (1 - mask)).sum(1) / (N // 2)).mean()
    torch.testing.assert_close(processed, expected)
    torch.testing.assert_close(around, ((per_token * mask).sum(1) / (N // 2)).mean())


def test_explain_names_the_suffix():
    exp = tread_fx.explain(BOTH.model(), BOTH.routes, 0.5, _inputs())
    assert exp.stream["prefix"] == R and exp.stream["suffix"] == T
    assert exp.routes[0].suffix == T and exp.routes[0].kept_tokens == R + N // 2 + T
    text = str(exp)
    assert f"{T} suffix token(s)" in text
    assert f"tokens {R + N}..{R + N + T - 1}" in text
    assert tread_fx.inspection.report.to_dict(exp)["stream"]["suffix"] == T


def test_one_image_token_between_prefix_and_suffix_is_refused_naming_them():
    """Registers, one image token (a 2 x 2 latent), text: nothing is left to route around."""
    model = tread_fx.route(TextBehindDiT(registers=R), [(1, 4)], 0.5)
    gen = torch.Generator().manual_seed(3)
    args = (torch.randn(B, 4, 2, 2, generator=gen), torch.randn(B, T, 8, generator=gen))
    with pytest.raises(
        tread_fx.TokenStreamError, match=r"(?s)only 1 routable token.*2 leading and 6 trailing"
    ):
        model.train()(*args, torch.rand(B, generator=gen))
