"""A key mask over the image tokens *and* the text tokens, sized by a sum of two lengths.

Video and image DiTs with a padded text prompt build one boolean key mask for the joint
attention: ``torch.ones(B, image_len + text_len)`` with the padded text positions switched
off, handed to every block, which concatenates ``[image, text]`` for attention. The mask's
token dim has ``N + T`` rows and no concatenation built it: the graph only adds the two
lengths. The image rows come first because the sum does (``image_len + text_len``); the
route gathers those and keeps the text rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import (
    Case,
    capture_block_inputs,
    check_eval_is_bitwise_unrouted,
    check_gradients,
    check_rate_zero_equals_training,
    check_routed_shape_count_and_change,
)
from torch import nn

import tread_fx

B, T, N, D, H = 2, 6, 16, 32, 2


class ImageTextBlock(nn.Module):
    """Joint attention over ``[image, text]`` with a key mask; each stream keeps its MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.image_mlp, self.text_mlp = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, image, text, attention_mask):
        both = torch.cat([image, text], dim=1)
        q, k, v = self.qkv(both).unflatten(-1, (3, H, D // H)).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        mixed = self.proj(mixed.transpose(1, 2).flatten(2))
        image, text = image + mixed[:, : image.shape[1]], text + mixed[:, image.shape[1] :]
        return image + self.image_mlp(image), text + self.text_mlp(text)


class PaddedPromptDiT(nn.Module):
    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.image_in, self.text_in = nn.Linear(4, D), nn.Linear(8, D)
        self.blocks = nn.ModuleList(ImageTextBlock() for _ in range(depth))
        self.out = nn.Linear(D, 4)

    def forward(self, image, text, text_mask):
        image, text = self.image_in(image), self.text_in(text)
        image_len, text_len = image.shape[1], text.shape[1]
        mask = torch.ones(image.shape[0], image_len + text_len, dtype=torch.bool)
        valid = image_len + text_mask.sum(dim=1)
        mask = mask.masked_fill(torch.arange(image_len + text_len)[None] >= valid[:, None], False)
        mask = mask[:, None, None, :]
        for block in self.blocks:
            image, text = block(image, text, mask)
        return self.out(image)


def _inputs():
    gen = torch.Generator().manual_seed(3)
    text_mask = torch.ones(B, T, dtype=torch.long)
    text_mask[1, 4:] = 0  # the second prompt is padded
    return (torch.randn(B, N, 4, generator=gen), torch.randn(B, T, 8, generator=gen),
            text_mask), {}  # fmt: skip


CASE = Case("padded-prompt", PaddedPromptDiT, _inputs, routes=[(1, 4)])


def test_the_mask_keeps_the_text_columns_and_the_kept_image_columns():
    model = CASE.route(CASE.model()).train()
    with capture_block_inputs(model.blocks[2]) as calls:
        model(*_inputs()[0])
    *_, (args, kwargs) = calls  # the first call may be the tracing one
    seen = [args[2] if len(args) > 2 else kwargs["attention_mask"]]
    (info,) = tread_fx.route_info(model)
    kept = info.kept[0]
    full = torch.ones(B, N + T, dtype=torch.bool)
    full[1, N + 4 :] = False
    expected = torch.cat([full[:, kept], full[:, N:]], dim=1)[:, None, None, :]
    assert seen[0].shape == (B, 1, 1, N // 2 + T)
    assert torch.equal(seen[0], expected)


def test_explain_names_the_rule():
    exp = tread_fx.explain(CASE.model(), CASE.routes, 0.5, _inputs())
    assert "adapted (take_rows)  adapter 'attention-mask'" in str(exp)
    assert exp.flops.speedup > 1.05


@pytest.mark.parametrize(
    "check",
    [
        check_eval_is_bitwise_unrouted,
        check_rate_zero_equals_training,
        check_routed_shape_count_and_change,
        check_gradients,
    ],  # fmt: skip
)
def test_invariants(check):
    check(CASE)
