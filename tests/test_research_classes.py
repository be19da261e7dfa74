"""Failure classes the research population (issue 58) found in real code, each as a small
self-written model compared with a hand-written route:

- DiS: a ``mid_block`` attribute of the lists' block class between ``in_blocks`` and
  ``out_blocks`` is a block of the stack (a one-member run), and what it hands on (a
  ``(hidden, residual)`` pair, the first block taking ``residual=None``) is read from the
  block after it;
- DiS with its CUDA kernels replaced: a kernel closure bound to a name of the model's module,
  calling einops, runs as one call between the blocks;
- e2-tts: an attribute probe (``hasattr``, ``inspect.signature``) on a traced tensor finds
  what the tensor has (nothing), as eagerly;
- Diffusion-RWKV: blocks handed the patch grid as a tuple of ints reshape to it and build a
  distance table ``[N, N, C]`` from ``arange(N)`` inside, at a width ``C`` equal to the token
  count: rows selection by default, the kept grid in the reshape, the table cut on its token
  dims only (the last one meets the keys' features), so kept tokens keep their original
  distances. A block inlined for its tables runs at the traced sizes, so the count it reads
  (``decay / T``) stays the full count ``N`` (docs/design.md).
- milmor/diffusion-transformer (Linformer attention): keys and values projected along the
  tokens by a parameter sliced to the token count inside the block (``k^T @ E[:n]``). Before,
  the block ran on the kept tokens as one call and took ``E``'s *first* ``k`` rows, silently;
  now ``E[:n]`` is a table built from the count, cut at the kept ids (shared across the
  batch); with ``E`` on the left (``E[:n]^T @ k``, the tokens on its last dim) it is refused.
- Chroma (lodestone-rock/flow): the forward hands each block a dataclass of modulation tensors
  it computed (``ModulationOut(shift, scale, gate)``), and the block calls einops. Before, the
  block run on real values while tracing got the dataclass with traced values in it and einops
  rejected them; now such a dataclass is one graph call building it from its fields.

(Stream classes from the same population: tests/test_research_streams.py.)
"""

from __future__ import annotations

import dataclasses

import einops
import pytest
import torch
from stand_in_kernels import make_head_scale
from third_party_checks import gather_rows, scatter_rows
from torch import nn

import tread_fx

B, D = 2, 32

# -- DiS: in, mid and out blocks handing a (hidden, residual) pair, long skips -------------


class PairBlock(nn.Module):
    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.skip_linear = nn.Linear(2 * D, D) if skip else None
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, hidden, residual=None, skip=None):
        if self.skip_linear is not None:
            hidden = self.skip_linear(torch.cat([hidden, skip], dim=-1))
        residual = hidden if residual is None else residual + hidden
        h = self.norm(residual)
        return self.attn(h, h, h, need_weights=False)[0], residual


HEAD_SCALE = make_head_scale(2, 0.5)


class InMidOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.in_blocks = nn.ModuleList(PairBlock() for _ in range(2))
        self.mid_block = PairBlock()
        self.out_blocks = nn.ModuleList(PairBlock(skip=True) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        hidden, residual, skips = self.embed(x), None, []
        for block in self.in_blocks:
            hidden, residual = block(hidden, residual)
            skips.append(hidden)
        hidden, residual = self.mid_block(HEAD_SCALE(hidden), residual)
        for block in self.out_blocks:
            hidden, residual = block(hidden, residual, skip=skips.pop())
        return self.head(residual + hidden)


def test_a_mid_block_is_a_block_of_the_stack_and_hands_on_the_pair() -> None:
    torch.manual_seed(0)
    model = InMidOut()
    x = torch.randn(B, 16, 3)
    exp = tread_fx.explain(model, [(1, 4)], 0.5, ((x,), {}), flops=False)
    assert [s["path"] for s in exp.stacks] == ["in_blocks", "{mid_block}", "out_blocks"]
    tread_fx.route(model, routes=[(1, 4)], rate=0.5, seed=0)
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        h0, r0 = model.in_blocks[0](model.embed(x))
        h1, r1 = model.in_blocks[1](gather_rows(h0, ids), gather_rows(r0, ids))
        hm, rm = model.mid_block(HEAD_SCALE(h1), r1)
        ho, ro = model.out_blocks[0](hm, rm, skip=h1)
        h, r = scatter_rows(h0, ids, ho), scatter_rows(r0, ids, ro)
        h, r = model.out_blocks[1](h, r, skip=h0)
        expected = model.head(r + h)
    torch.testing.assert_close(routed.detach(), expected)


# -- Diffusion-RWKV: a grid tuple handed to the blocks, an [N, N, C] table at C == N ---------


class ShiftDecayBlock(nn.Module):
    """Shift each token's features from the token above it in the grid, then mix the tokens
    by a decay over their distance (per channel, normalised by the count)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.key, self.value = nn.Linear(width, width), nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.decay = nn.Parameter(torch.linspace(0.5, 4.0, width))

    def forward(self, x, c, grid):
        b, t, w = x.shape
        maps = x.transpose(1, 2).reshape(b, w, grid[0], grid[1])
        shifted = torch.zeros_like(maps)
        shifted[:, :, 1:] = maps[:, :, :-1]
        xx = shifted.flatten(2).transpose(1, 2)
        k, v = self.key((x + xx) / 2), self.value(x)
        pos = torch.arange(t)
        dist = (pos[:, None] - pos[None, :]).abs()
        logits = -dist[..., None].float() * (self.decay / t) + k[:, None]  # [B, T, T, C]
        mixed = (logits.softmax(dim=2) * v[:, None]).sum(2)
        return x + self.out(mixed) * (1 + c[:, None])


class GridDecayNet(nn.Module):
    def __init__(self, side: int = 4) -> None:
        super().__init__()
        width = side * side  # the width equals the token count
        self.grid = (side, side)
        self.patch = nn.Conv2d(3, width, 1)
        self.time = nn.Linear(1, width)
        self.blocks = nn.ModuleList(ShiftDecayBlock(width) for _ in range(4))
        self.head = nn.Linear(width, 3)

    def forward(self, x, t):
        h = self.patch(x).flatten(2).transpose(1, 2)
        c = self.time(t[:, None])
        for block in self.blocks:
            h = block(h, c, grid=self.grid)
        return self.head(h)


def _kept_block(block: ShiftDecayBlock, x, c, ids, grid):
    """The block on the kept rows ``ids`` [B, k]: the kept grid, distances between original
    positions, normalised by the full count."""
    b, t, w = x.shape
    full = grid[0] * grid[1]
    maps = x.transpose(1, 2).reshape(b, w, t // grid[1], grid[1])
    shifted = torch.zeros_like(maps)
    shifted[:, :, 1:] = maps[:, :, :-1]
    xx = shifted.flatten(2).transpose(1, 2)
    k, v = block.key((x + xx) / 2), block.value(x)
    dist = (ids[:, :, None] - ids[:, None, :]).abs()  # [B, k, k]
    logits = -dist[..., None].float() * (block.decay / full) + k[:, None]
    mixed = (logits.softmax(dim=2) * v[:, None]).sum(2)
    return x + block.out(mixed) * (1 + c[:, None])


def test_a_handed_grid_and_a_table_at_width_equal_to_tokens_route_by_rows() -> None:
    torch.manual_seed(0)
    model = GridDecayNet()
    x, t = torch.randn(B, 3, 4, 4), torch.tensor([0.1, 0.7])
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=3)
    routed = model.train()(x, t)
    info = tread_fx.route_info(model)[0]
    ids = info.kept
    assert info.selection == "rows" and ids.shape == (B, 8)
    assert ids[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # rows 0 and 3: distances count
    with torch.no_grad():
        h = model.patch(x).flatten(2).transpose(1, 2)
        c = model.time(t[:, None])
        h = model.blocks[0](h, c, grid=model.grid)
        k = gather_rows(h, ids)
        for block in model.blocks[1:3]:
            k = _kept_block(block, k, c, ids, model.grid)
        h = model.blocks[3](scatter_rows(h, ids, k), c, grid=model.grid)
        expected = model.head(h)
    torch.testing.assert_close(routed.detach(), expected)


# -- e2-tts (einx): an attribute probe on a traced tensor sees what the tensor has ----------


class ProbingNet(nn.Module):
    """Scales the tokens when they look callable (``inspect.signature`` asks for
    ``__signature__``, as einx does with its arguments); a tensor never does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(PairBlock() for _ in range(4))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.embed(x)
        h = h * (2.0 if hasattr(h, "__signature__") else 1.0)
        for block in self.blocks:
            h = h + block(h)[0]
        return self.head(h)


def test_an_attribute_the_tensor_lacks_is_missing_while_tracing_too() -> None:
    torch.manual_seed(0)
    model = ProbingNet()
    x = torch.randn(B, 16, 3)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        h = model.embed(x)
        h = h + model.blocks[0](h)[0]
        k = gather_rows(h, ids)
        for block in model.blocks[1:3]:
            k = k + block(k)[0]
        h = scatter_rows(h, ids, k)
        expected = model.head(h + model.blocks[3](h)[0])
    torch.testing.assert_close(routed.detach(), expected)


# -- Open-Sora: the class defines no forward, the instance is given one --------------------


class InstanceForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PairBlock() for _ in range(4))
        self.forward = self.forward_plain  # what Open-Sora's MMDiTModel does in __init__

    def forward_plain(self, x):
        for block in self.blocks:
            x = x + block(x)[0]
        return x


def test_a_forward_set_on_the_instance_only_is_refused_at_route() -> None:
    import pytest

    model = InstanceForward()
    with pytest.raises(tread_fx.UntraceableModelError, match="class defines no forward") as err:
        tread_fx.route(model)
    assert "self.forward = ..." in str(err.value).splitlines()[0]
    assert model(torch.randn(B, 8, D)).shape == (B, 8, D)  # the model is left as it was


# -- milmor: a Linformer projection sliced to the token count inside the block ---------------


class LowRankAttention(nn.Module):
    def __init__(self, max_len: int = 16, rank: int = 8, left: bool = False) -> None:
        super().__init__()
        self.left = left
        self.qkv = nn.Linear(D, 3 * D)
        self.E = nn.Parameter(torch.randn(max_len, rank) / 4)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, -1).permute(2, 0, 3, 1, 4)  # [b, h, n, dh]
        if self.left:
            k, v = self.E[:n].T @ k, self.E[:n].T @ v  # [b, h, rank, dh]
        else:
            k = (k.transpose(-1, -2) @ self.E[:n]).transpose(-1, -2)
            v = (v.transpose(-1, -2) @ self.E[:n]).transpose(-1, -2)
        att = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, n, d))


class Linformer(nn.Module):
    def __init__(self, left: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(LowRankAttention(left=left) for _ in range(4))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_a_projection_sliced_to_the_token_count_is_cut_at_the_kept_ids() -> None:
    torch.manual_seed(0)
    model, x = Linformer(), torch.randn(B, 16, 3)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    routed = model.train()(x)
    ids = tread_fx.route_info(model)[0].kept
    assert torch.equal(ids[0], ids[1])  # the table has no batch dim: one selection for all
    with torch.no_grad():
        h = model.embed(x)
        h = h + model.blocks[0](h)
        kept = gather_rows(h, ids)
        for block in model.blocks[1:3]:
            n = kept.shape[1]
            q, k, v = block.qkv(kept).reshape(B, n, 3, 2, -1).permute(2, 0, 3, 1, 4)
            table = block.E[ids[0]]  # the kept tokens' own rows, not the first n
            k = (k.transpose(-1, -2) @ table).transpose(-1, -2)
            v = (v.transpose(-1, -2) @ table).transpose(-1, -2)
            att = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
            kept = kept + block.out((att @ v).transpose(1, 2).reshape(B, n, D))
        h = scatter_rows(h, ids, kept)
        expected = model.head(h + model.blocks[3](h))
    torch.testing.assert_close(routed.detach(), expected)


def test_a_projection_holding_the_tokens_on_its_last_dim_is_refused() -> None:
    model = tread_fx.route(Linformer(left=True), routes=[(1, 3)], rate=0.5)
    with pytest.raises(tread_fx.SideInputError, match="blocks.1"):
        model.train()(torch.randn(B, 16, 3))


# -- Chroma: a dataclass of modulation tensors handed to each block ---------------------------


@dataclasses.dataclass
class Modulation:
    shift: torch.Tensor
    scale: torch.Tensor


class ModulatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, mod: Modulation):
        h = x * (1 + mod.scale) + mod.shift
        q, k, v = einops.rearrange(self.qkv(h), "b n (k h d) -> k b h n d", k=3, h=2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(einops.rearrange(a, "b h n d -> b n (h d)"))


class HandsDataclasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cond = nn.Linear(3, D), nn.Linear(1, 2 * D * 4)
        self.blocks = nn.ModuleList(ModulatedBlock() for _ in range(4))
        self.head = nn.Linear(D, 3)

    def mods(self, t):
        parts = self.cond(t[:, None, None]).chunk(8, dim=-1)
        return [Modulation(parts[2 * i], parts[2 * i + 1]) for i in range(4)]

    def forward(self, x, t):
        x, mods = self.embed(x), self.mods(t)
        for block, mod in zip(self.blocks, mods):
            x = block(x, mod)
        return self.head(x)


def test_a_dataclass_of_traced_tensors_handed_to_blocks_is_built_in_the_graph() -> None:
    torch.manual_seed(0)
    model, x, t = HandsDataclasses(), torch.randn(B, 16, 3), torch.rand(B)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    routed = model.train()(x, t)
    ids = tread_fx.route_info(model)[0].kept
    with torch.no_grad():
        mods, h = model.mods(t), model.embed(x)
        h = model.blocks[0](h, mods[0])
        kept = model.blocks[2](model.blocks[1](gather_rows(h, ids), mods[1]), mods[2])
        expected = model.head(model.blocks[3](scatter_rows(h, ids, kept), mods[3]))
    torch.testing.assert_close(routed.detach(), expected)
