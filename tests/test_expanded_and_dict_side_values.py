"""Two forms of side values handed to every block (found routing ErnieImage / NucleusMoE):

- per-sample modulation expanded over the tokens (``t[:, None].expand(-1, N, -1)``) under a
  conditioning name (``temb``): token-aligned although it is conditioning, with all rows
  equal, so it is gathered like the stream (rule ``broadcast-over-tokens``);
- an attention mask passed inside a dict argument (``attention_kwargs={"attention_mask":
  mask}``): known by its key, so the mask rules apply.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_checks import (
    INVARIANTS,
    Case,
)
from torch import nn

import tread_fx

B, N, D = 2, 16, 32


class ModulatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x) + temb)  # temb: [B, N, D], equal over the tokens


class ExpandedModulation(nn.Module):
    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.ada = nn.Linear(1, D)
        self.blocks = nn.ModuleList(ModulatedBlock() for _ in range(depth))
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        temb = self.ada(t[:, None])[:, None].expand(-1, x.shape[1], -1).contiguous()
        for block in self.blocks:
            x = block(x, temb)
        return self.out(x)


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, attention_kwargs: dict | None = None) -> torch.Tensor:
        mask = attention_kwargs["attention_mask"]  # [B, N] key mask
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, :])
        return x + self.proj(out)


class DictMask(nn.Module):
    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(depth))
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        mask = valid > 0  # [B, N]
        for block in self.blocks:
            x = block(x, attention_kwargs={"attention_mask": mask})
        return self.out(x)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(B, N, 4, generator=gen), torch.tensor([0.3, 0.7])), {}


def _masked_inputs():
    gen = torch.Generator().manual_seed(1)
    valid = torch.ones(B, N)
    valid[1, -3:] = 0  # the second sample's last keys are padding
    return (torch.randn(B, N, 4, generator=gen), valid), {}


CASES = {
    "expanded": Case("expanded", ExpandedModulation, _inputs, routes=[(1, 4)]),
    "dict-mask": Case("dict-mask", DictMask, _masked_inputs, routes=[(1, 4)]),
}
RULES = {"expanded": "broadcast-over-tokens", "dict-mask": "attention-mask"}


@pytest.mark.parametrize("name", list(CASES))
def test_explain_names_the_rule(name):
    case = CASES[name]
    exp = str(tread_fx.explain(case.model(), case.routes, 0.5, case.inputs(), flops=False))
    assert f"adapter '{RULES[name]}'" in exp


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(CASES))
def test_invariants(check, name):
    check(CASES[name])
