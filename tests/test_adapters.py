"""The side-input adapter registry: strict refusal, user adapters, RoPE/mask rules, token tables."""

from __future__ import annotations

import pytest
import torch

import tread_fx
from tread_fx.adapters import Adapter, adapters, register_adapter, unregister_adapter
from tread_fx.adapters.token_tables import take_rows
from tread_fx.errors import SideInputError

N, D = 16, 16


@tread_fx.register_leaf_module
class _Opaque(torch.nn.Module):
    """A leaf module: tread_fx cannot see what it does with the table."""

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + table


class _Block(torch.nn.Module):
    """A block that hands a token-aligned table to an op tread_fx cannot see into, under a
    name that hints nothing: no rule may guess."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.opaque = torch.nn.Linear(D, D), _Opaque()

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.opaque(x, table))


class _TableModel(torch.nn.Module):
    """Tokens plus a table with one row per token, handed to every block as ``table``."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.shared = shared
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, table)
        return x


def _inputs(shared: bool):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, N, D, generator=gen)
    table = torch.randn(*(() if shared else (2,)), N, D, generator=gen)
    return x, table


@pytest.fixture
def user_adapter():
    registered = []
    yield registered.append
    for adapter in registered:
        unregister_adapter(adapter)


@pytest.mark.parametrize("shared", [False, True])
def test_strict_mode_refuses_an_unknown_token_aligned_value_naming_it(shared):
    torch.manual_seed(0)
    model = tread_fx.route(_TableModel(shared), routes=[(1, 3)], seed=0).train()
    with pytest.raises(SideInputError, match=r"(?s)\['table'\].*looks token-aligned.*opaque"):
        model(*_inputs(shared))


def test_a_registered_per_sample_adapter_fixes_the_refusal(user_adapter):
    user_adapter(
        register_adapter(
            Adapter(
                name="my-table",
                matches=lambda side: side.arg_names == {"table"},
                action="gather",
                doc="table is [B, N, d], one row per token of the stream.",
            )
        )
    )
    torch.manual_seed(0)
    model = tread_fx.route(_TableModel(False), routes=[(1, 3)], seed=0).train()
    x, table = _inputs(False)
    seen = []
    handle = model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    model(x, table)
    handle.remove()
    kept = tread_fx.route_info(model)[0].kept
    assert torch.equal(seen[-1], torch.stack([table[b, kept[b]] for b in range(2)]))


def test_a_registered_batch_shared_adapter_uses_the_row_gather_and_a_shared_selection(
    user_adapter,
):
    user_adapter(
        register_adapter(
            Adapter(
                name="my-shared-table",
                matches=lambda side: side.arg_names == {"table"},
                action=take_rows,
                options=lambda side: dict(dims=(0,), lead=0, skip=0, trail=0, batch=None),
                shares_selection=True,
                doc="table is [N, d], shared by the batch.",
            )
        )
    )
    torch.manual_seed(0)
    model = tread_fx.route(_TableModel(True), routes=[(1, 3)], seed=0).train()
    x, table = _inputs(True)
    out = model(x, table)
    kept = tread_fx.route_info(model)[0].kept
    assert (kept == kept[:1]).all() and out.shape == x.shape


def test_non_strict_mode_warns_and_gathers_token_aligned_values():
    torch.manual_seed(0)
    model = tread_fx.route(_TableModel(False), routes=[(1, 3)], seed=0, strict=False).train()
    with pytest.warns(UserWarning, match="table"):
        assert model(*_inputs(False)).shape == (2, N, D)


def test_builtin_adapters_each_document_their_assumption():
    builtin = [a for a in adapters() if a.builtin]
    names = {a.name for a in builtin}
    assert {"rope-per-sample", "rope-batch-shared", "context", "attention-mask",
            "attention-mask-shared", "residual", "stream-derived"} <= names  # fmt: skip
    assert all(len(a.doc) > 40 for a in builtin)


class _MaskBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, x, x, attn_mask=attn_mask, need_weights=False)[0]


class _MaskModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MaskBlock() for _ in range(4))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, attn_mask)
        return x


@pytest.mark.parametrize("batched", [False, True])
def test_attention_masks_follow_the_kept_tokens_on_both_axes(batched):
    causal = torch.triu(torch.full((N, N), float("-inf")), diagonal=1)
    mask = causal.expand(4, N, N).clone() if batched else causal  # [B * heads, N, N] or [N, N]
    torch.manual_seed(0)
    model = tread_fx.route(_MaskModel(), routes=[(1, 3)], seed=0).train()
    seen = []
    handle = model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    model(torch.randn(2, N, D), mask)
    handle.remove()
    kept = tread_fx.route_info(model)[0].kept
    if batched:  # B * heads != B: not a per-sample mask, so it is treated as batch-shared
        assert (kept == kept[:1]).all()
    rows = kept[0]
    expected = mask[..., rows, :][..., rows]
    assert torch.equal(seen[-1], expected), "a sub-mask of a causal mask, still causal"


def test_take_rows_keeps_lead_and_trail_rows_and_skips_prefix_tokens():
    table = torch.arange(10.0)[:, None]  # 2 lead rows, 6 token rows, 2 trail rows
    idx = torch.tensor([[0, 1, 3, 6]])  # 1 prefix token (no row), then tokens 1, 3, 6
    out = take_rows(table, idx, dims=(0,), lead=2, skip=1, trail=2, batch=None)
    assert out[:, 0].tolist() == [0.0, 1.0, 2.0, 4.0, 7.0, 8.0, 9.0]
    per_sample = take_rows(table[None].expand(1, 10, 1), idx, dims=(1,), lead=2, skip=1,
                           trail=2, batch=0)  # fmt: skip
    assert torch.equal(per_sample[0], out)


def test_random_draws_in_a_traced_forward_are_graph_calls_not_constants():
    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + torch.randn(D)  # constant size: must still draw on every call
            for block in self.blocks:
                x = x + block(x)
            return x

    torch.manual_seed(0)
    model = tread_fx.route(Noisy(), routes=[(1, 3)], rate=0.0, seed=0).train()
    x = torch.zeros(2, N, D)
    assert not torch.equal(model(x), model(x))


class _NumpyRoundTrip(torch.nn.Module):
    """Code fx cannot record (a numpy round trip): the trace keeps it as one call."""

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + torch.from_numpy(table.detach().numpy().copy())


class _UntraceableBlock(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.opaque = _NumpyRoundTrip()


def test_a_refusal_says_why_a_call_could_not_be_seen_into():
    """The module a token-aligned value meets was made one call by the trace: the message
    names what tracing it raised, so the user sees which code to change."""
    model = _TableModel(shared=False)
    model.blocks = torch.nn.ModuleList(_UntraceableBlock() for _ in range(4))
    tread_fx.route(model, routes=[(1, 3)], seed=0).train()
    with pytest.raises(
        SideInputError,
        match=r"(?s)opaque \(kept as one call: tracing it raised .* at .*test_adapters.py:\d+",
    ):
        model(*_inputs(False))


class _NumpyInForwardBlock(_Block):
    """A block whose own forward takes its input out of torch (numpy): no submodule or helper
    function around it can become a leaf, so the block cannot be traced through."""

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        scale = torch.from_numpy(x.detach().numpy().std(axis=-1, keepdims=True))
        return super().forward(x, table) * scale


def test_a_refusal_says_why_a_block_could_not_be_traced_through():
    """No block receiving the value shows its use (each is traced only up to its first line):
    the message names what the block's trace raised and where (before: only that none
    could be)."""
    model = _TableModel(shared=False)
    model.blocks = torch.nn.ModuleList(_NumpyInForwardBlock() for _ in range(4))
    tread_fx.route(model, routes=[(1, 3)], seed=0).train()
    with pytest.raises(
        SideInputError,
        match=r"(?s)blocks\.\d \(traced through only up to the line that stopped it: .*numpy.* at "
        r".*test_adapters.py:\d+",
    ):
        model(*_inputs(False))
