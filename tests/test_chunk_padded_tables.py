"""A block that pads its tokens to a multiple of a chunk length and builds chunk-sized tables,
as Mamba-2's SSD does (``pad`` by ``(chunk - n % chunk) % chunk``, ``reshape`` into chunks, a
``tril`` mask of ``x.size(-1)``): when the chunk length equals the token count, the mask looks
like a token table. It was cut to the kept tokens while the block, run on them, padded them
back to the chunk length: the routed graph failed on its first call (transformers' Mamba2,
Bamba and NemotronH at 16 tokens with ``chunk_size=16``). A table that meets values padded by a
computed amount is no token table: the block runs on the kept tokens as one call, with a
warning naming the table.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import INVARIANTS, Case, gather_rows, scatter_rows, train_forward
from torch import nn

import tread_fx

B, N, D, CHUNK = 2, 16, 32, 16


def chunked_scan(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """A causal mean within chunks: pad to a chunk multiple, mask with a chunk-sized tril."""
    b, n, d = x.shape
    pad = (chunk - n % chunk) % chunk
    padded = F.pad(x, (0, 0, 0, pad))
    chunks = padded.reshape(b, -1, chunk, d)
    size = chunks.size(-2)
    mask = torch.tril(torch.ones(size, size, dtype=x.dtype))
    mixed = mask @ chunks / mask.sum(-1, keepdim=True)
    return mixed.reshape(b, -1, d)[:, :n]


class ChunkBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.inp = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.chunk = CHUNK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(chunked_scan(self.inp(self.norm(x)), self.chunk))


class ChunkModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(ChunkBlock() for _ in range(4))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _inputs() -> tuple[tuple, dict]:
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(5)),), {}


CASE = Case("chunk-padded-table", ChunkModel, _inputs, routes=[(1, 3)])


def test_routes_with_the_block_run_on_the_kept_tokens():
    model = CASE.route(CASE.model())
    with pytest.warns(UserWarning, match=r"(?s)padded by an amount it computes"):
        out = train_forward(model, CASE)
    (info,) = tread_fx.route_info(model)
    with torch.no_grad():
        h = model.blocks[0](model.embed(_inputs()[0][0]))
        kept = gather_rows(h, info.kept)
        for block in model.blocks[1:3]:
            kept = block(kept)
        expected = model.head(model.blocks[3](scatter_rows(h, info.kept, kept)))
    torch.testing.assert_close(out.detach(), expected)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
def test_invariants(check):
    check(CASE)
