"""Tests for the reference Diffusion-RWKV model (tread_fx.models.rwkv)."""

from __future__ import annotations

import pytest
import torch

from tread_fx.models.rwkv import (
    RWKV_B_2,
    RWKV_S_2,
    DiffusionRWKV,
    RWKV_models,
    RWKVBlock,
    bi_wkv,
    q_shift,
)

TINY = dict(input_size=8, in_channels=1, num_classes=10, depth=4, hidden_size=32)


def reference_wkv(w, u, k, v):
    """Bi-WKV by its definition: an explicit loop over output t and input i, in float64.

    Each output's log-weights are shifted by their (detached) maximum before exponentiating,
    which leaves the value and the gradient unchanged and keeps float64 finite for any input.
    """
    b, n, c = k.shape
    w, u, k, v = w.double(), u.double(), k.double(), v.double()
    out = []
    for t in range(n):
        logw = []
        for i in range(n):
            logw.append(u + k[:, i] if i == t else k[:, i] - (abs(t - i) - 1) / n * w)
        top = torch.stack(logw).amax(0).detach()
        num = torch.zeros(b, c, dtype=torch.float64)
        den = torch.zeros(b, c, dtype=torch.float64)
        for i in range(n):
            weight = torch.exp(logw[i] - top)
            num = num + weight * v[:, i]
            den = den + weight
        out.append(num / den)
    return torch.stack(out, 1)


def wkv_inputs(b, n, c, scale, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(c, generator=gen, dtype=dtype) * scale
    u = torch.randn(c, generator=gen, dtype=dtype) * scale
    k = torch.randn(b, n, c, generator=gen, dtype=dtype) * scale
    v = torch.randn(b, n, c, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (w, u, k, v)]


@pytest.fixture
def flush_denormal():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# ---------------------------------------------------------------------------------------- Bi-WKV


@pytest.mark.parametrize("scale", [1.0, 30.0, 400.0])  # 400: e^k over/underflows even float64
def test_bi_wkv_matches_reference_values_and_gradients(scale):
    inputs = wkv_inputs(2, 9, 5, scale)
    out, ref = bi_wkv(*inputs), reference_wkv(*inputs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out)
    for name, g, r in zip("wukv", grads, ref_grads):
        tol = 1e-10 * max(1.0, r.abs().max().item())
        torch.testing.assert_close(g, r, rtol=1e-9, atol=tol, msg=f"grad of {name}")


@pytest.mark.parametrize("n", [1, 2, 6])
def test_bi_wkv_gradcheck(n):
    inputs = wkv_inputs(2, n, 3, 1.0, seed=n)
    assert torch.autograd.gradcheck(bi_wkv, inputs)


def test_bi_wkv_float32_matches_reference():
    inputs = wkv_inputs(3, 16, 8, 20.0, dtype=torch.float32)
    out = bi_wkv(*inputs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference_wkv(*inputs), rtol=1e-4, atol=1e-4)


def test_bi_wkv_exact_under_flushed_denormals(flush_denormal):
    for dtype, scale, tol in [(torch.float64, 400.0, 1e-10), (torch.float32, 60.0, 1e-4)]:
        inputs = wkv_inputs(2, 12, 6, scale, dtype=dtype, seed=3)
        out, ref = bi_wkv(*inputs), reference_wkv(*inputs)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        grads = torch.autograd.grad(out.sum(), inputs)
        ref_grads = torch.autograd.grad(ref.sum(), inputs)
        for g, r in zip(grads, ref_grads):
            atol = tol * max(1.0, r.abs().max().item())
            torch.testing.assert_close(g.double(), r.double(), rtol=tol, atol=atol)


def test_bi_wkv_divides_decay_by_current_length():
    # With zero keys, v = e_j and bonus 0, out_t weights token j by e^{-(|t-j|-1) w / T}.
    n, w = 8, 4.0
    k = torch.zeros(1, n, 1, dtype=torch.float64)
    v = torch.zeros(1, n, 1, dtype=torch.float64)
    v[0, 0] = 1.0
    out = bi_wkv(
        torch.full((1,), w, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), k, v
    )
    weights = torch.tensor([1.0] + [torch.e ** (-(i - 1) * w / n) for i in range(1, n)])
    torch.testing.assert_close(out[0, n - 1, 0].item(), (weights[n - 1] / weights.sum()).item())


def test_bi_wkv_is_traced_as_one_node():
    # plain PyTorch (torch.fx.wrap in the model file): no tread_fx registration needed
    from tread_fx.passes.trace.tracer import trace_call

    model = RWKV_S_2(**TINY)
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    nodes = trace_call(model, (x, t, y), {}, set()).gm.graph.nodes
    assert sum(n.target is bi_wkv for n in nodes) == 1 * TINY["depth"]


# --------------------------------------------------------------------------------------- q-shift


def expected_shift(ids: torch.Tensor, s: int) -> torch.Tensor:
    """Per token of an r x W id grid: the ids of its left, right, upper and lower neighbour."""
    r, w = ids.shape
    out = torch.zeros(r, w, 4)
    for i in range(r):
        for j in range(w):
            out[i, j, 0] = ids[i, j - s] if j - s >= 0 else 0
            out[i, j, 1] = ids[i, j + s] if j + s < w else 0
            out[i, j, 2] = ids[i - s, j] if i - s >= 0 else 0
            out[i, j, 3] = ids[i + s, j] if i + s < r else 0
    return out


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [0, 2, 3], [1, 4], [3]])
@pytest.mark.parametrize("shift", [1, 2])
def test_q_shift_reads_true_neighbours(rows, shift):
    h, w, g = 5, 4, 3
    ids = (torch.arange(h * w, dtype=torch.float32) + 1).view(h, w)  # unique, nonzero
    kept = ids[rows]  # whole rows in ascending order: an r x W grid, fed as one sequence
    x = kept.reshape(1, -1, 1).expand(2, -1, 4 * g + 2).contiguous()
    out = q_shift(x, w, shift).view(2, len(rows), w, 4 * g + 2)
    want = expected_shift(kept, shift)
    for group in range(4):
        got = out[..., group * g : (group + 1) * g]
        torch.testing.assert_close(got, want[..., group, None].expand_as(got))
    torch.testing.assert_close(out[..., 4 * g :], x.view_as(out)[..., 4 * g :])  # pass-through


def test_q_shift_rejects_partial_rows():
    with pytest.raises(ValueError, match="whole number of grid rows"):
        q_shift(torch.randn(1, 10, 8), grid_width=4)


# ----------------------------------------------------------------------------- blocks and model


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("input_size", [8, 16])
def test_output_shapes(skip, input_size):
    model = RWKV_S_2(**{**TINY, "input_size": input_size}, skip=skip).eval()
    x = torch.randn(2, 1, input_size, input_size)
    out = model(x, torch.tensor([1, 900]), torch.tensor([0, 9]))
    assert out.shape == (2, 2, input_size, input_size)
    assert model.out_channels == 2 and model.patch_size == 2
    assert model.grid_size == (input_size // 2, input_size // 2)
    assert len(model.blocks) == 4
    assert model.skip_pairs == ({3: 0, 2: 1} if skip else {})
    flat = RWKV_S_2(**TINY, learn_sigma=False).eval()
    assert flat(x[:, :, :8, :8], torch.tensor([1, 2]), torch.tensor([1, 2])).shape == (2, 1, 8, 8)


def test_non_square_grid_and_odd_depth_skips():
    model = DiffusionRWKV(input_size=(4, 8), in_channels=3, hidden_size=16, depth=5, skip=True)
    assert model.grid_size == (2, 4)
    assert model.skip_pairs == {4: 0, 3: 1}  # the middle block (2) has none
    assert [b.skip_linear is not None for b in model.blocks] == [False, False, False, True, True]
    out = model.eval()(torch.randn(1, 3, 4, 8), torch.tensor([5]), torch.tensor([1]))
    assert out.shape == (1, 6, 4, 8)


def test_factories():
    assert set(RWKV_models) == {"RWKV-S/2", "RWKV-B/2"}
    model = RWKV_B_2(**TINY)
    assert model.blocks[0].norm1.normalized_shape == (32,)  # overrides win over the defaults


@pytest.mark.parametrize("skip", [False, True])
def test_blocks_accept_any_number_of_whole_rows(skip):
    torch.manual_seed(0)
    width, dim = 4, 16
    block = RWKVBlock(dim, width, skip=skip)
    torch.nn.init.normal_(block.adaLN_modulation[-1].weight, std=0.1)
    c = torch.randn(2, dim)
    for rows in (1, 2, 3, 5):
        x = torch.randn(2, rows * width, dim)
        out = block(x, c, skip=torch.randn_like(x) if skip else None)
        assert out.shape == x.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="whole number of grid rows"):
        block(torch.randn(2, 6, dim), c, skip=torch.randn(2, 6, dim) if skip else None)
    with pytest.raises(ValueError, match="skip"):
        block(torch.randn(2, 8, dim), c, skip=None if skip else torch.randn(2, 8, dim))


def test_block_starts_as_identity():
    block = RWKVBlock(16, 4)
    x = torch.randn(2, 8, 16)
    assert torch.equal(block(x, torch.randn(2, 16)), x)


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = RWKV_S_2(**TINY, skip=True, class_dropout_prob=0.0).train()
    zeroed = [b.adaLN_modulation[-1] for b in model.blocks]
    zeroed += [model.final_layer.adaLN_modulation[-1], model.final_layer.linear]
    with torch.no_grad():
        for linear in zeroed:  # adaLN-Zero blocks would otherwise stop most gradients
            linear.weight.normal_(std=0.05)
            linear.bias.normal_(std=0.05)
    x, t, y = torch.randn(4, 1, 8, 8), torch.tensor([1, 50, 300, 999]), torch.tensor([0, 3, 5, 9])
    model(x, t, y).square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        used = param.grad[y] if name == "y_embedder.embedding_table.weight" else param.grad
        assert used.abs().sum() > 0, name


def test_eval_is_deterministic_and_label_dropout_only_in_training():
    torch.manual_seed(0)
    model = RWKV_S_2(**TINY, class_dropout_prob=1.0)
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])
    model.eval()
    first = model(x, t, y)
    assert torch.equal(first, model(x, t, y))
    null = torch.full_like(y, model.num_classes)
    assert not torch.equal(model.y_embedder(y), model.y_embedder(null))
    model.train()  # every label dropped: the null class
    assert torch.equal(model.y_embedder(y), model.y_embedder.eval()(null))
