"""Tests for the reference diffusion Mamba (tread_fx.models.mamba), at tiny sizes."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tread_fx.models.mamba import (
    BiMambaMixer,
    DiffusionMamba,
    Mamba_B_2,
    Mamba_models,
    Mamba_S_2,
    MambaBlock,
    ScanDirection,
    selective_scan,
    selective_scan_torch,
)

TINY = dict(input_size=8, in_channels=1, num_classes=10, depth=4, hidden_size=32)


def tiny(**overrides) -> DiffusionMamba:
    torch.manual_seed(0)
    return Mamba_S_2(**{**TINY, **overrides})


def inputs(batch: int = 3, size: int = 8, channels: int = 1):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, size, size, generator=g)
    return x, torch.rand(batch, generator=g) * 1000, torch.randint(0, 10, (batch,), generator=g)


def scan_inputs(L: int, batch: int = 2, d: int = 5, n: int = 4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        u=torch.randn(batch, d, L, generator=g, dtype=dtype),
        delta=torch.randn(batch, d, L, generator=g, dtype=dtype),
        A=-torch.rand(d, n, generator=g, dtype=dtype) * 3,
        B=torch.randn(batch, n, L, generator=g, dtype=dtype),
        C=torch.randn(batch, n, L, generator=g, dtype=dtype),
        D=torch.randn(d, generator=g, dtype=dtype),
        delta_bias=torch.randn(d, generator=g, dtype=dtype),
    )


def reference_scan(u, delta, A, B, C, D, delta_bias):
    """The recurrence written out step by step, in float64."""
    u, delta, A, B, C, D, delta_bias = (v.double() for v in (u, delta, A, B, C, D, delta_bias))
    delta = F.softplus(delta + delta_bias[:, None])
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=torch.float64)
    ys = []
    for t in range(u.shape[-1]):
        decay = torch.exp(delta[:, :, t, None] * A)
        h = decay * h + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1) + D * u[:, :, t])
    return torch.stack(ys, dim=-1)


def perturb_zero_init(model: torch.nn.Module, std: float = 0.1) -> None:
    """Give the zero-initialised adaLN and output layers random weights."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or name.startswith("final_layer.linear"):
                p.normal_(std=std)


# --- the selective scan -------------------------------------------------------------------


@pytest.mark.parametrize("L", [1, 2, 7, 16, 33])
def test_selective_scan_matches_float64_reference(L):
    args = scan_inputs(L)
    y = selective_scan(**args, delta_softplus=True)
    assert y.dtype == torch.float32 and y.shape == args["u"].shape
    torch.testing.assert_close(y.double(), reference_scan(**args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L", [1, 6, 17])
def test_selective_scan_gradients_match_reference(L):
    args = {k: v.requires_grad_() for k, v in scan_inputs(L, dtype=torch.float64).items()}
    weight = torch.randn(2, 5, L, dtype=torch.float64)
    (selective_scan_torch(**args, delta_softplus=True) * weight).sum().backward()
    ours = {k: v.grad.clone() for k, v in args.items()}
    for v in args.values():
        v.grad = None
    (reference_scan(**args) * weight).sum().backward()
    for k, v in args.items():
        torch.testing.assert_close(ours[k], v.grad, rtol=1e-10, atol=1e-10, msg=k)


def test_selective_scan_gradcheck():
    args = {k: v.requires_grad_() for k, v in scan_inputs(5, dtype=torch.float64).items()}
    names = list(args)
    fn = lambda *xs: selective_scan_torch(**dict(zip(names, xs)), delta_softplus=True)
    assert torch.autograd.gradcheck(fn, tuple(args.values()))


def test_selective_scan_low_precision_inputs_compute_in_float32():
    args = scan_inputs(9)
    low = {k: v.bfloat16() for k, v in args.items()}
    y = selective_scan(**low, delta_softplus=True)
    assert y.dtype == torch.bfloat16
    expected = reference_scan(**{k: v.float() for k, v in low.items()})
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2)


def test_selective_scan_is_traced_as_one_node():
    # plain PyTorch (torch.fx.wrap in the model file): no tread_fx registration needed
    from tread_fx.passes.trace.tracer import trace_call

    model = Mamba_S_2(**TINY)
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    nodes = trace_call(model, (x, t, y), {}, set()).gm.graph.nodes
    assert sum(n.target is selective_scan for n in nodes) == 2 * TINY["depth"]


def test_selective_scan_is_causal():
    args = scan_inputs(12)
    y = selective_scan(**args, delta_softplus=True)
    for t in (0, 5, 10):
        changed = {k: v.clone() for k, v in args.items()}
        for k in ("u", "delta", "B", "C"):
            changed[k][..., t + 1 :] += 3.0
        y2 = selective_scan(**changed, delta_softplus=True)
        assert torch.equal(y2[..., : t + 1], y[..., : t + 1])
        assert not torch.equal(y2[..., t + 1 :], y[..., t + 1 :])


def test_scan_direction_is_causal_and_mixer_is_bidirectional():
    torch.manual_seed(0)
    direction, mixer = ScanDirection(8, d_state=4, dt_rank=2), BiMambaMixer(8)
    x = torch.randn(2, 8, 10)
    y = direction(x)
    x2 = x.clone()
    x2[..., 6:] = torch.randn(2, 8, 4)
    assert torch.equal(direction(x2)[..., :6], y[..., :6])
    # the mixer sees both ways: its first token depends on the last one
    tokens = torch.randn(2, 10, 8)
    changed = tokens.clone()
    changed[:, -1] += 1.0
    assert not torch.allclose(mixer(tokens)[:, 0], mixer(changed)[:, 0])


@pytest.mark.skipif(
    importlib.util.find_spec("mamba_ssm") is None or not torch.cuda.is_available(),
    reason="needs the optional mamba_ssm CUDA kernel and a CUDA device",
)
def test_cuda_kernel_matches_torch_scan():
    args = {k: v.cuda() for k, v in scan_inputs(37, batch=3, d=16, n=8).items()}
    args = {k: v.requires_grad_() for k, v in args.items()}
    y_kernel = selective_scan(**args, delta_softplus=True)
    y_torch = selective_scan_torch(**args, delta_softplus=True)
    torch.testing.assert_close(y_kernel, y_torch, rtol=1e-4, atol=1e-4)
    weight = torch.randn_like(y_torch)
    grads = [
        torch.autograd.grad((y * weight).sum(), list(args.values())) for y in (y_kernel, y_torch)
    ]
    for name, a, b in zip(args, *grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=name)


# --- blocks and the model -----------------------------------------------------------------


@pytest.mark.parametrize("use_skip", [False, True])
@pytest.mark.parametrize("L", [16, 7, 1])
def test_block_accepts_any_token_count(L, use_skip):
    torch.manual_seed(0)
    block = MambaBlock(32, use_skip=use_skip)
    perturb_zero_init(block)
    hidden, residual, c = torch.randn(2, L, 32), torch.randn(2, L, 32), torch.randn(2, 32)
    skip = torch.randn(2, L, 32) if use_skip else None
    out_hidden, out_residual = block(hidden, residual, c, skip=skip)
    assert out_hidden.shape == out_residual.shape == (2, L, 32)
    assert torch.isfinite(out_hidden).all()
    if not use_skip:
        torch.testing.assert_close(out_residual, residual + hidden)


def test_block_rejects_mismatched_skip():
    h, c = torch.randn(2, 5, 32), torch.randn(2, 32)
    with pytest.raises(ValueError, match="use_skip=True"):
        MambaBlock(32, use_skip=True)(h, h, c)
    with pytest.raises(ValueError, match="use_skip=False"):
        MambaBlock(32)(h, h, c, skip=h)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("learn_sigma", [True, False])
def test_output_shape(skip, learn_sigma):
    model = tiny(skip=skip, learn_sigma=learn_sigma)
    perturb_zero_init(model)
    out = model(*inputs())
    channels = 2 if learn_sigma else 1
    assert model.out_channels == channels
    assert out.shape == (3, channels, 8, 8)
    assert torch.isfinite(out).all()


def test_larger_input_and_attributes():
    model = tiny(input_size=16, in_channels=3, skip=True)
    assert model.grid_size == (8, 8) and model.patch_size == 2 and model.out_channels == 6
    assert len(model.blocks) == 4 and isinstance(model.blocks, torch.nn.ModuleList)
    assert model(*inputs(2, 16, 3)).shape == (2, 6, 16, 16)


def test_zero_initialised_model_predicts_zero():
    assert torch.equal(tiny()(*inputs()), torch.zeros(3, 2, 8, 8))


@pytest.mark.parametrize("skip", [False, True])
def test_gradients_reach_every_parameter(skip):
    model = tiny(skip=skip).train()
    perturb_zero_init(model)
    model(*inputs()).square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


def test_eval_is_deterministic():
    model = tiny(skip=True).eval()
    perturb_zero_init(model)
    x, t, y = inputs()
    assert torch.equal(model(x, t, y), model(x, t, y))


def test_label_dropout_only_in_training():
    model = tiny()
    model.y_embedder.dropout_prob = 1.0
    y = torch.arange(5)
    null = model.y_embedder.embedding_table.weight[10]
    assert torch.equal(model.y_embedder.train()(y), null.expand(5, -1))
    assert torch.equal(model.y_embedder.eval()(y), model.y_embedder.embedding_table(y))


@pytest.mark.parametrize(
    "depth, expected",
    [(4, (None, None, 1, 0)), (5, (None, None, None, 1, 0)), (1, (None,)), (2, (None, 0))],
)
def test_skip_pairing_as_documented(depth, expected):
    model = tiny(depth=depth, skip=True)
    assert model.skip_sources == expected
    assert [b.skip_linear is not None for b in model.blocks] == [s is not None for s in expected]
    assert tiny(depth=depth).skip_sources == (None,) * depth
    # at run time, block i receives the hidden output of block skip_sources[i]
    perturb_zero_init(model)
    seen_skip, outputs = {}, {}

    def record(i):
        def hook(module, args, kwargs, out):
            seen_skip[i], outputs[i] = kwargs.get("skip"), out[0]

        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_hook(record(i), with_kwargs=True)
    model(*inputs())
    for i, src in enumerate(expected):
        assert (seen_skip[i] is None) if src is None else (seen_skip[i] is outputs[src])


def test_forward_with_cfg():
    # DiT's contract: the caller doubles the batch, conditional rows first, then null labels
    model = tiny().eval()
    perturb_zero_init(model)
    x, t, y = inputs()
    x2, t2, y2 = torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, 10)])
    out = model.forward_with_cfg(x2, t2, y2, cfg_scale=1.0)
    assert out.shape == (6, 2, 8, 8)
    torch.testing.assert_close(out[:3], model(x, t, y), rtol=1e-5, atol=1e-5)


def test_factories_and_registry():
    assert Mamba_models == {"Mamba-S/2": Mamba_S_2, "Mamba-B/2": Mamba_B_2}
    model = Mamba_B_2(**TINY)
    assert len(model.blocks) == 4 and model.patch_size == 2
    with pytest.raises(ValueError, match="multiple of 4"):
        Mamba_S_2(**{**TINY, "hidden_size": 30})
