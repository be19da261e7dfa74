"""Register tokens joined to the image tokens by a leaf function (einops ``pack``).

``x, ps = pack([x, registers], "b * d")`` builds the stream the blocks see, as
``torch.cat([x, registers], 1)`` does, but inside one opaque leaf call. The trace compares the
leaf's output with its tensor inputs laid out along each dim
(``tread_fx/passes/trace/concats.py``): the
values show a concatenation, so the registers (not computed from the main input) are a
never-routed suffix (behind) or prefix (in front), exactly as for ``torch.cat``. No function
name decides: a leaf whose output is not such a concatenation records nothing.
"""

from __future__ import annotations

import pytest
import torch
from einops import pack, repeat, unpack
from stream_models import SelfBlock
from third_party_checks import INVARIANTS, Case, capture_block_inputs, train_forward
from torch import nn

import tread_fx
from tread_fx.passes.trace.concats import concatenation_sizes

B, N, R, D = 2, 16, 4, 32  # batch, image tokens, registers, width (stream_models' D)


class RegisterViT(nn.Module):
    """Patch tokens plus learned registers behind (or in front), blocks, registers dropped."""

    def __init__(self, join: str = "pack", front: bool = False, depth: int = 4) -> None:
        super().__init__()
        self.join, self.front = join, front
        self.embed = nn.Linear(6, D)
        self.registers = nn.Parameter(torch.randn(R, D))
        self.blocks = nn.ModuleList(SelfBlock() for _ in range(depth))
        self.out = nn.Linear(D, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        r = repeat(self.registers, "n d -> b n d", b=x.shape[0])
        parts = [r, h] if self.front else [h, r]
        if self.join == "pack":
            h, shapes = pack(parts, "b * d")
        else:
            h = torch.cat(parts, dim=1)
        for block in self.blocks:
            h = block(h)
        if self.join == "pack":
            first, second = unpack(h, shapes, "b * d")
            h = second if self.front else first
        else:
            h = h[:, R:] if self.front else h[:, :N]
        return self.out(h)


def _inputs():
    return (torch.randn(B, N, 6, generator=torch.Generator().manual_seed(4)),), {}


PACK = Case("pack-behind", RegisterViT, _inputs)
PACK_FRONT = Case("pack-in-front", lambda: RegisterViT(front=True), _inputs)
CAT = Case("cat-behind", lambda: RegisterViT(join="cat"), _inputs)
CAT_FRONT = Case("cat-in-front", lambda: RegisterViT(join="cat", front=True), _inputs)
CASES = [PACK, PACK_FRONT, CAT, CAT_FRONT]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_registers_are_never_routed(case):
    model = case.route(case.model())
    train_forward(model, case)
    (info,) = tread_fx.route_info(model)
    prefix, suffix = (R, 0) if case.model().front else (0, R)
    assert (info.num_tokens, info.prefix, info.suffix) == (N + R, prefix, suffix)
    assert info.kept.shape[1] == R + N // 2
    registers = list(range(R)) if prefix else list(range(N, N + R))
    assert not info.routed_mask[:, registers].any()
    assert info.routed_mask.sum(1).tolist() == [N // 2] * B


@pytest.mark.parametrize("case", [PACK, PACK_FRONT], ids=lambda c: c.name)
def test_routed_blocks_see_the_registers_in_place(case):
    """Each routed block gets every register row, exactly the unrouted model's, in place."""
    model = case.model()
    with capture_block_inputs(model.blocks[1]) as calls:
        train_forward(model, case)
    reference = calls[0][0][0]
    case.route(model)
    train_forward(model, case)
    with capture_block_inputs(model.blocks[1]) as calls:
        train_forward(model, case)
    seen = calls[-1][0][0]
    assert seen.shape[1] == R + N // 2
    rows = slice(0, R) if case.model().front else slice(-R, None)
    assert torch.equal(seen[:, rows], reference[:, rows])


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", [PACK, PACK_FRONT], ids=lambda c: c.name)
def test_invariants(case, check):
    check(case)


def test_pack_and_cat_route_alike():
    """Same weights, same seed: the pack model's routed output is the cat model's."""
    outputs = []
    for case in (PACK, CAT):
        model = case.route(case.model())
        train_forward(model, case)
        outputs.append(train_forward(model, case))
    torch.testing.assert_close(outputs[0], outputs[1])


def test_the_values_decide_not_the_function():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    assert concatenation_sizes(torch.cat([a, b], 1), [a, b]) == [(1, [3, 5])]
    grid = torch.randn(2, 2, 2, 4)  # [B, H, W, D] fills [B, H * W, D] in order
    assert concatenation_sizes(torch.cat([grid.flatten(1, 2), b], 1), [grid, b]) == [(1, [4, 5])]
    assert concatenation_sizes(torch.cat([b, a], 1), [a, b]) == []  # other order
    assert concatenation_sizes(a[:, :2] + 1, [a[:, :1], a[:, 1:2]]) == []  # not the values
