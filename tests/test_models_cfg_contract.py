"""The reference backbones share one ``forward_with_cfg`` contract (DiT's;
tread_fx/models/layers.py).

The caller doubles the batch: rows ``[:B]`` conditional, rows ``[B:]`` the null class; only
``x[:B]`` is read. The output has the same ``2B`` rows, the guided noise channels in both halves
and each half's own variance channels; guidance scale 1 is the conditional forward.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tread_fx.models import RWKV_S_2, DiT_S_2, Mamba_S_2

NUM_CLASSES = 10
TINY = dict(input_size=8, in_channels=2, num_classes=NUM_CLASSES, depth=2, hidden_size=32)
FACTORIES = {
    "dit": lambda: DiT_S_2(**TINY, num_heads=4),
    "mamba": lambda: Mamba_S_2(**TINY),
    "rwkv": lambda: RWKV_S_2(**TINY),
}


def tiny(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = FACTORIES[name]()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adaLN-Zero starts at a zero prediction: make the model compute
        for param in model.parameters():
            if not param.any():
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


def doubled_inputs(batch: int = 2):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(batch, 2, 8, 8, generator=generator)
    t = torch.randint(0, 1000, (batch,), generator=generator)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    null = torch.full_like(y, NUM_CLASSES)
    # the second half of x is never read: anything may stand there
    x2 = torch.cat([x, torch.randn(x.shape, generator=generator)])
    return (x, t, y, null), (x2, torch.cat([t, t]), torch.cat([y, null]))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_forward_with_cfg_contract(name: str) -> None:
    model = tiny(name)
    (x, t, y, null), (x2, t2, y2) = doubled_inputs()
    k = model.in_channels
    with torch.no_grad():
        cond, uncond = model(x, t, y), model(x, t, null)
        guided_1 = model.forward_with_cfg(x2, t2, y2, cfg_scale=1.0)
        guided_3 = model.forward_with_cfg(x2, t2, y2, cfg_scale=3.0)
    assert guided_1.shape == guided_3.shape == (4, model.out_channels, 8, 8)
    for half in (guided_1[:2], guided_1[2:]):  # scale 1: the conditional forward
        torch.testing.assert_close(half[:, :k], cond[:, :k], atol=1e-5, rtol=1e-5)
    expected = uncond[:, :k] + 3.0 * (cond[:, :k] - uncond[:, :k])
    torch.testing.assert_close(guided_3[:2, :k], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(guided_3[2:, :k], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(guided_3[:2, k:], cond[:, k:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(guided_3[2:, k:], uncond[:, k:], atol=1e-5, rtol=1e-5)


def test_forward_with_cfg_signatures_agree() -> None:
    signatures = {
        name: list(inspect.signature(tiny(name).forward_with_cfg).parameters) for name in FACTORIES
    }
    assert len({tuple(s) for s in signatures.values()}) == 1, signatures
