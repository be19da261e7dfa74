"""A key mask over a text context exactly as long as the routed stream (generator seed 473).

Blocks cross-attend from the image tokens to a padded text context and hand
``scaled_dot_product_attention`` the prompt's key-padding mask, ``[B, T]`` broadcast to
``[B, 1, 1, T]``. When the prompt happens to have as many tokens as the stream (``T == N``),
the mask's last dim has the token count, but it indexes the *context's* keys: the keys of that
attention are not computed from the stream, so the mask has no dim of stream tokens and is
passed unchanged; a mask with one row per query token (``[B, N, T]``) is cut on its query rows
only. A mask over a self-attention's keys is still cut (tests/test_joint_key_mask.py).
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
    gather_rows,
    scatter_rows,
)
from torch import nn

import tread_fx

B, N, D, H = 2, 16, 32, 2


class CrossBlock(nn.Module):
    """Self-attention over the stream, then cross-attention to the context under its mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.q, self.kv, self.out = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)

    def forward(self, x, context, context_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, H, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        q = self.q(x).reshape(b, n, H, -1).transpose(1, 2)
        k, v = self.kv(context).reshape(b, context.shape[1], 2, H, -1).permute(2, 0, 3, 1, 4)
        per_query = context_mask.dim() == 3  # one mask row per query token: [B, N, T]
        mask = context_mask[:, None] if per_query else context_mask[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(a.transpose(1, 2).flatten(2))


class PromptDiT(nn.Module):
    def __init__(self, depth: int = 4, per_query: bool = False) -> None:
        super().__init__()
        self.x_in, self.text_in = nn.Linear(4, D), nn.Linear(8, D)
        self.blocks = nn.ModuleList(CrossBlock() for _ in range(depth))
        self.head = nn.Linear(D, 4)
        self.per_query = per_query

    def forward(self, x, text, text_mask):
        x, text = self.x_in(x), self.text_in(text)
        if self.per_query:
            text_mask = text_mask[:, None, :].expand(-1, x.shape[1], -1)
        for block in self.blocks:
            x = block(x, text, text_mask)
        return self.head(x)


def _inputs(text_len: int = N):
    gen = torch.Generator().manual_seed(4)
    mask = torch.zeros(B, text_len)
    mask[0, -3:] = -1e4  # the first prompt is padded
    return (torch.randn(B, N, 4, generator=gen), torch.randn(B, text_len, 8, generator=gen),
            mask), {}  # fmt: skip


CASE = Case("prompt-as-long-as-stream", PromptDiT, _inputs, routes=[(1, 3)])


@pytest.mark.parametrize("per_query", [False, True])
def test_the_context_mask_is_passed_and_the_route_equals_a_hand_routed_twin(per_query):
    torch.manual_seed(0)
    model = PromptDiT(per_query=per_query)
    twin = PromptDiT(per_query=per_query)
    twin.load_state_dict(model.state_dict())
    (args, _) = _inputs()
    tread_fx.route(model, routes=[(1, 3)], rate=0.25, seed=0)
    with capture_block_inputs(model.blocks[1]) as calls:
        out = model.train()(*args)
    *_, (block_args, block_kwargs) = calls
    seen = block_args[2] if len(block_args) > 2 else block_kwargs["context_mask"]
    (info,) = tread_fx.route_info(model)
    mask = args[2]
    if per_query:  # the query rows are the stream's tokens: cut to the kept ones
        mask = mask[:, None, :].expand(-1, N, -1)
        assert torch.equal(seen, gather_rows(mask, info.kept))
    else:
        assert torch.equal(seen, mask)  # the context's mask, untouched
    x, text = twin.x_in(args[0]), twin.text_in(args[1])
    x = twin.blocks[0](x, text, mask)
    full = x
    x = gather_rows(x, info.kept)
    for block in twin.blocks[1:3]:
        x = block(x, text, gather_rows(mask, info.kept) if per_query else mask)
    x = twin.blocks[3](scatter_rows(full, info.kept, x), text, mask)
    torch.testing.assert_close(out, twin.head(x), rtol=1e-5, atol=1e-5)


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
