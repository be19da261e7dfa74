"""route() on the reference Mamba and RWKV models: same call, no model-specific routing code."""

from __future__ import annotations

import pytest
import torch
from conftest import randomize_zero_init

import tread_fx
from tread_fx.models import mamba, rwkv
from tread_fx.runtime.ops import gather_tokens
from tread_fx.runtime.selection import select_random, select_rows

FACTORIES = {"mamba": mamba.Mamba_S_2, "rwkv": rwkv.RWKV_S_2}
GRID = (4, 4)  # 8x8 input, patch 2


def _model(family: str, skip: bool = False, depth: int = 6, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = FACTORIES[family](
        input_size=8,
        in_channels=1,
        num_classes=10,
        depth=depth,
        hidden_size=32,
        skip=skip,
        **kwargs,
    )
    randomize_zero_init(model)
    return model


def _inputs(batch: int = 2):
    gen = torch.Generator().manual_seed(3)
    return (
        torch.randn(batch, 1, 8, 8, generator=gen),
        torch.rand(batch, generator=gen),
        torch.randint(0, 10, (batch,), generator=gen),
    )


def _train(model, inputs, seed: int = 11):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model.train()(*inputs)


@pytest.mark.parametrize("family", sorted(FACTORIES))
@pytest.mark.parametrize("selection", ["random", "rows"])
@pytest.mark.parametrize("skip", [False, True])
def test_invariants_on_state_space_models(family, selection, skip):
    model, inputs = _model(family, skip), _inputs()
    reference_eval, reference_train = model.eval()(*inputs), _train(model, inputs)
    keys = list(model.state_dict())
    tread_fx.route(model, routes=[(2, 4)], rate=0.5, selection=selection, seed=0)
    out = _train(model, inputs)
    assert out.shape == reference_train.shape and not torch.allclose(out, reference_train)
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert torch.equal(model.eval()(*inputs), reference_eval)
    assert list(model.state_dict()) == keys
    tread_fx.route(model, routes=[(2, 4)], rate=0.0, selection=selection, reroute=True)
    assert torch.equal(_train(model, inputs), reference_train)


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_rows_selection_feeds_the_routed_blocks_an_r_by_w_grid(family):
    model, inputs = _model(family), _inputs()
    seen = []
    model.blocks[2].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    tread_fx.route(model, routes=[(2, 4)], rate=0.5, selection="rows", seed=0)
    _train(model, inputs)
    kept = tread_fx.route_info(model)[0].kept
    assert seen[-1][1] == 2 * GRID[1], "H - floor(H * 0.5) = 2 whole rows of 4 tokens"
    rows = kept.view(2, 2, GRID[1])
    assert torch.equal(rows - rows[..., :1], torch.arange(GRID[1]).expand_as(rows))
    assert (rows[..., 0] % GRID[1] == 0).all() and (rows[:, 1, 0] > rows[:, 0, 0]).all()


def _grid_ids(height: int, width: int, channels: int = 4) -> torch.Tensor:
    ids = torch.arange(1, height * width + 1, dtype=torch.float64)
    return ids[None, :, None].expand(1, -1, channels).clone()


def test_rows_keep_true_2d_neighbours_for_the_rwkv_shift_and_random_does_not():
    height, width = 8, 8
    x = _grid_ids(height, width)
    noise = torch.rand(1, height, generator=torch.Generator().manual_seed(0))
    kept = select_rows(noise, keep=4, prefix=0, grid=(height, width))
    shifted = rwkv.q_shift(gather_tokens(x, kept), width)
    ids = kept[0]
    for p, original in enumerate(ids.tolist()):
        row, col = divmod(original, width)
        left = original if col > 0 else None  # ids are 1-based: token t has id t + 1
        right = original + 2 if col < width - 1 else None
        up = ids[p - width].item() + 1 if p >= width else None
        down = ids[p + width].item() + 1 if p + width < len(ids) else None
        expected = [v if v is not None else 0 for v in (left, right, up, down)]
        assert shifted[0, p].tolist() == expected, (p, original)
    # with whole rows, the rows above/below in the subset are the nearest kept rows of the
    # same column: the shift reads a true r x W grid; random tokens break left/right
    random_kept = select_random(torch.rand(1, height * width), keep=32, prefix=0)
    shuffled = rwkv.q_shift(gather_tokens(x, random_kept), width)
    left_ok = [
        shuffled[0, p, 0].item() == (o if o % width else 0)
        for p, o in enumerate(random_kept[0].tolist())
    ]
    assert not all(left_ok)


@pytest.mark.parametrize("family", sorted(FACTORIES))
@pytest.mark.parametrize(
    ("routes", "crossing"),
    [
        ([(2, 4)], None),  # block 3 takes its skip from block 2: inside the route
        ([(1, 3)], "out"),  # block 1's output is block 4's skip: produced inside, used after
        ([(4, 6)], "in"),  # blocks 4, 5 take skips from blocks 1, 0: produced before
    ],
)
def test_values_crossing_a_route_are_gathered_or_scattered(family, routes, crossing):
    model, inputs = _model(family, skip=True), _inputs()
    tread_fx.route(model, routes=routes, rate=0.5, seed=0)
    _train(model, inputs).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    (plan,) = tread_fx.routed_graphs(model)[0].plans
    entering = [c.reason for c in plan.entering]
    leaving = [c.reason for c in plan.leaving]
    # a skip made before the route enters it gathered (per sample, along the tokens)
    gathered = [c for c in plan.entering if c.reason.startswith("adapter") and c.action != "pass"]
    assert bool(gathered) == (crossing == "in")
    assert ("stream-shaped value" in leaving) == (crossing == "out")
    if family == "mamba":  # the (hidden, residual) pair: both streams gathered and scattered
        assert "carried token stream ('arg', 1)" in entering
        assert "carried token stream" in leaving


def test_a_token_value_leaving_a_route_without_counterpart_is_refused():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8 + 4, 8)

        def forward(self, x: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
            aux = x.new_zeros(*x.shape[:-1], 4) if aux is None else aux
            return x + self.lin(torch.cat([x, aux], dim=-1))

    class WithAux(torch.nn.Module):
        """From block 2 on, blocks get a per-token side value [B, N, 4] made after the last."""

        def __init__(self) -> None:
            super().__init__()
            self.aux = torch.nn.Linear(8, 4)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            aux = None
            for i, block in enumerate(self.blocks):
                x = block(x, aux)
                aux = self.aux(x) if i >= 1 else None
            return x

    # route (1, 3): block 3's aux is computed inside the route; block 1 had none to scatter into
    model = tread_fx.route(WithAux(), routes=[(1, 3)], seed=0).train()
    with pytest.raises(
        tread_fx.SideInputError, match=r"(?s)route \(1, 3\) splits value 'model_aux_1'.*counterpart"
    ):
        model(torch.randn(2, 16, 8))
    # from block 2 on, the aux at the route start is its counterpart
    tread_fx.route(model, routes=[(2, 4)], seed=0, reroute=True)
    assert model(torch.randn(2, 16, 8)).shape == (2, 16, 8)
