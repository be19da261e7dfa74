"""Tables a block builds from its own token count, met through the elementwise and selection
family (issue 44, third class).

Four self-written families, each building a ``[T, T]`` table from the token count ``T``:

- a Vision-RWKV-style Bi-WKV written out as a matrix: the decay ``exp(-w * (|i - j| - 1) / T)``
  with the bonus ``exp(u)`` on the diagonal (``torch.where``), multiplied into the tokens
  (``A @ (e^k * v) / A @ e^k``), ``T`` read from ``x.shape[1]``;
- a causal decay: ``ones(T, T).tril()`` through ``masked_fill``, then multiplied into the
  tokens, ``T`` an int handed to every block;
- an attention over each token's strong links that always keeps the self link:
  ``torch.where(s > mean, exp(s), eye(T))``, the table a value of the selection;
- the RWKV decay table built by the model's own loop over role-container layers from the
  ints of ``patch_resolution`` (the trace folds it into a constant), added to the scores of
  each layer's attention.

Decision (see docs/design.md): a table built from the token count is built for all ``N``
tokens, as traced, and cut to the kept tokens (every token dim) where it meets them, so the
routed tokens keep their original distances: ``|i - j|`` between kept tokens is their
distance in the image, not in the shorter sequence. ``eye`` and ``tril`` come out the same
either way (the kept ids ascend); for a distance the two differ, and the references below
pin the cut. Before the op metadata classification each of these was refused or failed in
the routed graph (``[T, T] @ tokens`` was taken for an attended context, a value of
``where`` other than its condition was not read, the folded ``[T, T, 1]`` decay was a table
with no single token dim).
"""

from __future__ import annotations

import pytest
import torch
from third_party_checks import Case, check_eval_is_bitwise_unrouted, gather_rows, train_forward
from torch import nn

import tread_fx

B, N, D, H = 2, 16, 32, 2


def _distance(tokens: int) -> torch.Tensor:
    i = torch.arange(tokens)
    return (i[:, None] - i[None]).abs().float()


def _cut(table: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The reference's cut: the kept rows and columns of the last two (token) dims."""
    return table if keep is None else table[..., keep, :][..., keep]


class WkvBlock(nn.Module):
    """Vision-RWKV-like spatial mix: per-head decay and bonus, the WKV as a matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.kvr = nn.Linear(D, 3 * D)
        self.decay = nn.Parameter(torch.rand(H, 1, 1) + 0.5)
        self.bonus = nn.Parameter(torch.randn(H, 1, 1) * 0.1)
        self.out = nn.Linear(D, D)

    def table(self, tokens: int) -> torch.Tensor:
        dist = _distance(tokens)
        decay = torch.exp(-self.decay * (dist - 1) / tokens)
        return torch.where(dist == 0, self.bonus.exp(), decay)  # [H, T, T]

    def forward(self, x, keep=None):
        b, n, _ = x.shape
        k, v, r = self.kvr(self.norm(x)).chunk(3, dim=-1)
        k, v = (t.reshape(b, n, H, D // H).transpose(1, 2) for t in (k, v))
        k = k.clamp(max=10).exp()
        a = _cut(self.table(N if keep is not None else n), keep)
        wkv = (a @ (k * v)) / (a @ k)
        return x + self.out(torch.sigmoid(r) * wkv.transpose(1, 2).reshape(b, n, D))


class CausalDecayBlock(nn.Module):
    """A causal decay over the tokens: ``tril`` through ``masked_fill``; ``T`` handed in."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.v = nn.Linear(D, D)
        self.rate = nn.Parameter(torch.rand(()) + 0.2)
        self.out = nn.Linear(D, D)

    def table(self, tokens: int) -> torch.Tensor:
        mask = torch.ones(tokens, tokens).tril()
        decay = torch.exp(-self.rate * _distance(tokens)).masked_fill(mask == 0, 0.0)
        return decay / decay.sum(-1, keepdim=True)

    def forward(self, x, tokens: int, keep=None):
        a = _cut(self.table(tokens), keep)
        return x + self.out(a @ self.v(self.norm(x)))


class StrongLinksBlock(nn.Module):
    """Attention over each token's strong links (above its row's mean), the self link always
    kept: ``torch.where(strong, exp(s), eye)``, normalised."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x, keep=None):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        s = q @ k.transpose(-2, -1) * D**-0.5
        eye = _cut(torch.eye(N if keep is not None else x.shape[1]), keep)
        links = torch.where(s > s.mean(-1, keepdim=True), s.exp(), eye)
        return x + self.out(links / links.sum(-1, keepdim=True) @ v)


class Mix(nn.Module):
    """The attention of a role-container layer: scores plus a decay handed in per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.w = nn.Parameter(torch.rand(()) + 0.5)
        self.out = nn.Linear(D, D)

    def forward(self, x, dist):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = (q @ k.transpose(-2, -1) * D**-0.5)[..., None] - self.w * dist
        return self.out(s[..., 0].softmax(-1) @ v)


class Backbone(nn.Module):
    """Patch tokens through a stack of blocks (``tokens``: hand ``T`` to every block)."""

    def __init__(self, make_block, tokens: bool = False, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(make_block() for _ in range(depth))
        self.head = nn.Linear(D, 4)
        self.tokens = tokens

    def forward(self, x):
        x = self.embed(x)
        tokens = x.shape[1]
        for block in self.blocks:
            x = block(x, tokens) if self.tokens else block(x)
        return self.head(x)


class LoopBuilt(nn.Module):
    """Role-container layers ``(norm, mix)``; the loop builds each layer's decay table from
    the ints of ``patch_resolution`` (a constant of the trace)."""

    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.layers = nn.ModuleList(nn.ModuleList([nn.LayerNorm(D), Mix()]) for _ in range(depth))
        self.head = nn.Linear(D, 4)
        self.patch_resolution = (4, 4)

    def forward(self, x, keep=None, route=(1, 4)):
        x = self.embed(x)
        h, w = self.patch_resolution
        for i, (norm, mix) in enumerate(self.layers):
            dist = _distance(h * w)[..., None]  # [T, T, 1]
            routed = keep is not None and route[0] <= i < route[1]
            x = x + mix(norm(x), _cut(dist[..., 0], keep if routed else None)[..., None])
        return self.head(x)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(B, N, 4, generator=gen),), {}


CASES = {
    "wkv-where": Case("wkv-where", lambda: Backbone(WkvBlock), _inputs, [(1, -1)]),
    "tril-masked-fill": Case(
        "tril-masked-fill", lambda: Backbone(CausalDecayBlock, tokens=True), _inputs, [(1, -1)]
    ),
    "eye-where": Case("eye-where", lambda: Backbone(StrongLinksBlock), _inputs, [(1, -1)]),
}


def _by_hand(model: Backbone, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The routed forward written out: blocks 1..3 on the kept tokens, told the kept ids."""
    h = model.embed(x)
    extra = (N,) if model.tokens else ()
    h = model.blocks[0](h, *extra)
    ids = kept[:, :, None].expand(-1, -1, D)
    part = h.gather(1, ids)
    for block in model.blocks[1:-1]:
        part = block(part, *extra, keep=kept[0])
    h = h.scatter(1, ids, part)
    return model.head(model.blocks[-1](h, *extra))


@pytest.mark.parametrize("name", list(CASES))
def test_routed_blocks_see_their_tables_cut_to_the_kept_tokens(name):
    case = CASES[name]
    model = tread_fx.route(case.model(), [(1, -1)], 0.5, seed=0)  # the defaults
    out = train_forward(model, case)
    (info,) = tread_fx.route_info(model)
    assert torch.equal(info.kept[0], info.kept[1]), "tables without a batch dim share it"
    (x,), _ = case.inputs()
    with torch.no_grad():
        expected = _by_hand(model, x, info.kept)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_eval_is_the_unrouted_model(name):
    check_eval_is_bitwise_unrouted(CASES[name])


def test_a_decay_the_loop_folds_into_a_constant_is_cut_on_both_token_dims():
    torch.manual_seed(0)
    model = LoopBuilt()
    reference = model.eval()(*_inputs()[0])
    tread_fx.route(model, [(1, -1)], 0.5, seed=0)
    out = train_forward(model, Case("loop", lambda: model, _inputs))
    (info,) = tread_fx.route_info(model)
    (x,), _ = _inputs()
    with torch.no_grad():
        expected = _hand_routed_loop(model, x, info.kept)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), reference)


def _hand_routed_loop(model: LoopBuilt, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    h = model.embed(x)
    dist = _distance(N)[..., None]
    norm, mix = model.layers[0]
    h = h + mix(norm(h), dist)
    part = gather_rows(h, kept)
    for norm, mix in model.layers[1:-1]:
        part = part + mix(norm(part), _cut(dist[..., 0], kept[0])[..., None])
    h = h.scatter(1, kept[:, :, None].expand(-1, -1, D), part)
    norm, mix = model.layers[-1]
    return model.head(h + mix(norm(h), dist))


def test_the_wkv_distances_are_the_original_ones():
    """The decision pinned: cut distances differ from those of a table rebuilt for k tokens."""
    block = WkvBlock()
    keep = torch.tensor([0, 3, 4, 9, 15])
    cut = _cut(block.table(N), keep)
    rebuilt = block.table(len(keep))
    assert cut.shape == rebuilt.shape and not torch.allclose(cut, rebuilt)
