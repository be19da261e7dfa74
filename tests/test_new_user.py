"""What a new user hit (issue 15): the models namespace, misleading errors, packaging."""

from __future__ import annotations

import torch

import tread_fx
from tread_fx.models import dit, mamba, rwkv


def test_every_reference_factory_is_in_the_models_namespace() -> None:
    for module in (dit, mamba, rwkv):
        registry = next(v for k, v in vars(module).items() if k.endswith("_models"))
        for factory in registry.values():
            assert getattr(tread_fx.models, factory.__name__) is factory
            assert factory.__name__ in tread_fx.models.__all__
    model = tread_fx.models.Mamba_S_2(input_size=8, in_channels=1, num_classes=10, depth=2)
    assert isinstance(model, torch.nn.Module)
