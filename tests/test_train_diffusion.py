"""examples/diffusion.py: objectives, samplers and EMA."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
diffusion = importlib.import_module("diffusion")


class Recorder(nn.Module):
    """A tiny conditional 'network' that records its inputs; output has ``out`` channels."""

    def __init__(self, channels: int = 1, out: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, out, 3, padding=1)
        self.emb = nn.Embedding(num_classes + 1, out)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, x, t, y):
        self.calls.append((x, t, y))
        scale = torch.cos(t / 1000.0)[:, None, None, None]
        return self.conv(x) * scale + self.emb(y)[:, :, None, None]


def _batch(seed: int = 0, b: int = 4):
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.rand(b, 1, 8, 8, generator=gen) * 2 - 1
    return x0, torch.randint(0, 10, (b,), generator=gen)


def test_rectified_flow_training_target_matches_direct_computation():
    x0, _ = _batch()
    rf = diffusion.RectifiedFlow()
    gen = torch.Generator().manual_seed(3)
    (x_t, t_in), target, weight = rf.sample_training(x0, gen)
    ref = torch.Generator().manual_seed(3)
    t = torch.sigmoid(torch.randn(4, generator=ref))  # logit-normal(0, 1)
    noise = torch.randn(x0.shape, generator=ref)
    tb = t[:, None, None, None]
    torch.testing.assert_close(x_t, (1 - tb) * x0 + tb * noise)
    torch.testing.assert_close(target, noise - x0)
    torch.testing.assert_close(t_in, 1000 * t)
    assert torch.all(weight == 1)


def test_edm_training_target_matches_direct_computation():
    x0, y = _batch()
    edm = diffusion.EDM()
    sigma = torch.tensor([0.01, 0.3, 1.0, 20.0])
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    (x_in, t_in), target, weight = edm.sample_training(x0, t=sigma, noise=noise)
    s = sigma[:, None, None, None]
    c_skip, c_out = 0.25 / (s**2 + 0.25), s * 0.5 / (s**2 + 0.25).sqrt()
    x = x0 + s * noise
    torch.testing.assert_close(x_in, x / (s**2 + 0.25).sqrt())
    torch.testing.assert_close(t_in, 1000 * sigma.log() / 4)
    torch.testing.assert_close(target, (x0 - c_skip * x) / c_out)
    # The F-space loss equals lambda(sigma) * (D(x) - x0)^2 with the Karras weight.
    model = Recorder()
    per = edm.loss(model, x0, y, t=sigma, noise=noise, reduction="none")
    assert per.shape == x0.shape and per.dtype == torch.float32
    denoised = edm.denoise(model(x_in, t_in, y), x, sigma)
    lam = (s**2 + 0.25) / (s * 0.5) ** 2
    torch.testing.assert_close(per, lam * (denoised - x0) ** 2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight, torch.ones_like(weight))  # lambda * c_out^2 == 1


def test_edm_sigma_distribution_and_reduction():
    edm = diffusion.EDM()
    sigma = edm.sample_time(20000, torch.Generator().manual_seed(0), "cpu")
    assert abs(sigma.log().mean().item() + 1.2) < 0.05
    assert abs(sigma.log().std().item() - 1.2) < 0.05
    x0, y = _batch()
    model = Recorder()
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    mean = edm.loss(model, x0, y, generator=gen())
    per = edm.loss(model, x0, y, generator=gen(), reduction="none")
    torch.testing.assert_close(mean, per.mean())
    with pytest.raises(ValueError, match="reduction"):
        edm.loss(model, x0, y, reduction="sum")


@pytest.mark.parametrize("objective", ["rf", "edm"])
def test_learned_sigma_channels_are_ignored(objective):
    x0, y = _batch()
    obj = diffusion.make_objective(objective)
    narrow, wide = Recorder(out=1), Recorder(out=2)
    with torch.no_grad():  # the first output channel of `wide` equals `narrow`'s output
        wide.conv.weight[:1].copy_(narrow.conv.weight)
        wide.conv.bias[:1].copy_(narrow.conv.bias)
        wide.emb.weight[:, :1].copy_(narrow.emb.weight)
    a = obj.loss(narrow, x0, y, generator=torch.Generator().manual_seed(0), reduction="none")
    b = obj.loss(wide, x0, y, generator=torch.Generator().manual_seed(0), reduction="none")
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="3 channels"):
        diffusion.take_channels(torch.zeros(1, 3, 2, 2), 1)


@pytest.mark.parametrize("objective", ["rf", "edm"])
@pytest.mark.parametrize("method", ["euler", "heun"])
def test_samplers_shape_and_determinism(objective, method):
    obj = diffusion.make_objective(objective)
    model = Recorder().eval()
    labels = torch.tensor([0, 3, 7])
    run = lambda seed: diffusion.sample(  # noqa: E731
        obj, model, labels, (1, 8, 8), steps=4, method=method, cfg_scale=2.5, null_label=10,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    a, b, c = run(0), run(0), run(1)
    assert a.shape == (3, 1, 8, 8) and torch.isfinite(a).all()
    assert torch.equal(a, b) and not torch.equal(a, c)
    calls = model.calls[: len(model.calls) // 3]
    evals = 4 if method == "euler" else (7 if objective == "edm" else 8)
    assert len(calls) == evals  # Heun skips its correction on EDM's last step to sigma = 0
    x, t, y = calls[0]
    assert x.shape[0] == 6 and y.tolist() == [0, 3, 7, 10, 10, 10]  # cond, then null class


def test_cfg_combines_conditional_and_unconditional():
    model = Recorder().eval()
    x = torch.randn(2, 1, 8, 8)
    t, y = torch.full((2,), 500.0), torch.tensor([1, 2])
    guided = diffusion.guided_prediction(model, x, t, y, 3.0, 10)
    cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, 10))
    torch.testing.assert_close(guided, uncond + 3.0 * (cond - uncond))
    model.calls.clear()
    torch.testing.assert_close(diffusion.guided_prediction(model, x, t, y, 1.0, 10), cond)
    assert len(model.calls) == 1 and model.calls[0][0].shape[0] == 2  # no null batch at scale 1


def test_rf_sampler_is_exact_for_a_perfect_velocity():
    # With v = noise - x0 known exactly, Euler on the straight path lands on x0.
    target = torch.full((2, 1, 4, 4), 0.25)

    class Oracle(nn.Module):
        def forward(self, x, t, y):
            tb = (t / 1000)[:, None, None, None]
            noise = (x - (1 - tb) * target) / tb.clamp_min(1e-6)
            return noise - target

    out = diffusion.sample(
        diffusion.RectifiedFlow(), Oracle(), torch.tensor([0, 1]), (1, 4, 4), steps=3,
        method="euler", generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    torch.testing.assert_close(out, target, atol=1e-4, rtol=0)


def test_edm_karras_grid():
    grid = diffusion.EDM().time_grid(5, "cpu")
    assert grid[0].item() == pytest.approx(80.0) and grid[-2].item() == pytest.approx(0.002)
    assert grid[-1] == 0 and torch.all(grid[1:] < grid[:-1])


def test_sampler_argument_errors():
    obj, model, labels = diffusion.RectifiedFlow(), Recorder(), torch.tensor([1])
    with pytest.raises(ValueError, match="null_label"):
        diffusion.sample(obj, model, labels, (1, 8, 8), cfg_scale=2.0)
    with pytest.raises(ValueError, match="unknown sampler"):
        diffusion.sample(obj, model, labels, (1, 8, 8), method="dpm")
    with pytest.raises(ValueError, match="unknown objective"):
        diffusion.make_objective("ddpm")


def test_ema_update_in_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = diffusion.make_ema(model)
    assert not ema.training and all(not p.requires_grad for p in ema.parameters())
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model[1].running_mean.fill_(3.0)
    model.bfloat16()  # the EMA stays fp32 whatever the model's dtype
    diffusion.update_ema(ema, model, 0.9)
    for name, p in ema.named_parameters():
        src = dict(model.named_parameters())[name].float()
        torch.testing.assert_close(p, 0.9 * before[name] + 0.1 * src)
        assert p.dtype == torch.float32
    assert torch.all(ema[1].running_mean == 3.0)  # buffers are copied
    diffusion.update_ema(ema, model, 0.0)
    torch.testing.assert_close(ema[0].weight, model[0].weight.float())
    with pytest.raises(ValueError, match="decay"):
        diffusion.update_ema(ema, model, 1.5)
    assert diffusion.warmup_ema_decay(0.999, 0) == pytest.approx(0.1)
    assert diffusion.warmup_ema_decay(0.999, 10**6) == 0.999
