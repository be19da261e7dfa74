"""The gather index the routed graph builds (``runtime.ops.token_index``), checked by hand."""

from __future__ import annotations

import pytest
import torch

from tread_fx.errors import TokenStreamError
from tread_fx.runtime.ops import gather_tokens, token_index

B, N, D, K = 2, 8, 4, 3


def test_gather_tokens_keeps_each_samples_ids_on_either_token_dim():
    x = torch.randn(B, N, D)
    idx = torch.stack([torch.randperm(N)[:K] for _ in range(B)])
    by_hand = torch.stack([x[b, idx[b]] for b in range(B)])
    assert torch.equal(gather_tokens(x, idx, token_dim=1), by_hand)
    tokens_first = x.transpose(0, 1).contiguous()
    assert torch.equal(gather_tokens(tokens_first, idx, token_dim=0), by_hand.transpose(0, 1))


def test_token_index_lays_ids_out_on_a_given_batch_dim():
    like = torch.randn(D, B, N)
    idx = torch.stack([torch.randperm(N)[:K] for _ in range(B)])
    index = token_index(idx, like, token_dim=2, batch_dim=1)
    assert index.shape == (D, B, K) and torch.equal(index[0], idx)


def test_token_index_refuses_a_token_dim_whose_batch_dim_is_not_implied():
    with pytest.raises(TokenStreamError, match="without batch_dim"):
        token_index(torch.zeros(B, K, dtype=torch.long), torch.randn(B, D, N), token_dim=2)
