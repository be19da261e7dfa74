"""The benchmarked model configurations, their routes and their inputs.

Example:
    >>> from benchmarks.specs import get_spec
    >>> spec = get_spec("dit-s2", tiny=True)
    >>> spec.route, spec.kept_tokens(spec.build())
    ((1, 3), 8)
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSpec", "SPECS", "get_spec", "make_inputs", "model_available"]

_TINY = {"depth": 4, "hidden_size": 32, "input_size": 8, "num_classes": 10}
_MAMBA = {"input_size": 32, "in_channels": 4, "depth": 12}
_RWKV = {"input_size": 32, "in_channels": 4}
_SCAN_NOTE = (
    "the scan is a Python loop over tokens, a torch.library custom op with a hand-written "
    "backward: torch.compile calls it as one opaque kernel and compiles what is around it"
)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model.

    Attributes:
        name: Command-line name (``dit-s2``).
        label: Display name (``DiT-S/2``).
        module: Module of ``tread_fx.models`` holding the factory.
        factory: Factory name in that module.
        kwargs: Factory arguments.
        route: The route ``(start, end)``, half-open.
        rate: Fraction of tokens (or rows) routed around.
        selection: ``"random"`` tokens or whole ``"rows"`` (grid-shaped blocks).
        note: Anything a reader of the table must know.
        batch: Default batch size on CPU.
    """

    name: str
    label: str
    module: str
    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    route: tuple[int, int] = (2, 9)
    rate: float = 0.5
    selection: str = "random"
    note: str = ""
    batch: int = 8

    def build(self, seed: int = 0) -> nn.Module:
        """A fresh model in training mode, weights drawn from ``seed``."""
        torch.manual_seed(seed)
        factory = getattr(importlib.import_module(f"tread_fx.models.{self.module}"), self.factory)
        return factory(**self.kwargs).train()

    def input_size(self) -> int:
        return int(self.kwargs.get("input_size", 32))

    def num_classes(self) -> int:
        return int(self.kwargs.get("num_classes", 1000))

    def kept_tokens(self, model: nn.Module) -> int:
        """Tokens the routed blocks see: ``N - floor(N * rate)`` (whole rows for ``rows``)."""
        h, w = model.grid_size
        if self.selection == "rows":
            return (h - math.floor(h * self.rate)) * w
        return h * w - math.floor(h * w * self.rate)

    def draw_ids(self, model: nn.Module, batch: int, generator: torch.Generator | None, device):
        """Hand-written selection: kept token ids [B, k], ascending (see ``handwritten``)."""
        from benchmarks.handwritten import random_row_ids, random_token_ids

        h, w = model.grid_size
        if self.selection == "rows":
            keep = h - math.floor(h * self.rate)
            return random_row_ids(batch, (h, w), keep, generator, device)
        keep = h * w - math.floor(h * w * self.rate)
        return random_token_ids(batch, h * w, keep, generator, device)

    def tiny(self) -> ModelSpec:
        """The same model family at test size: depth 4, width 32, 16 tokens, route (1, 3)."""
        kwargs = {**self.kwargs, **_TINY}
        if "num_heads" in kwargs or self.module == "dit":
            kwargs["num_heads"] = 2
        if self.module == "mamba":
            kwargs["d_state"] = 4
        return ModelSpec(
            self.name, self.label + " (tiny)", self.module, self.factory, kwargs, (1, 3),
            self.rate, self.selection, self.note, 2,
        )  # fmt: skip


SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("dit-s2", "DiT-S/2", "dit", "DiT_S_2", {"input_size": 32, "in_channels": 4},
                  route=(2, 10), note="route (2, 10) as in the prototype figures"),
        ModelSpec("dit-b2", "DiT-B/2", "dit", "DiT_B_2", {"input_size": 32, "in_channels": 4},
                  route=(2, 9), note="route (2, 9): the authors' DiT-B/2 default (2..8 incl.)"),
        ModelSpec("dit-xl2", "DiT-XL/2", "dit", "DiT_XL_2", {"input_size": 32, "in_channels": 4},
                  route=(2, 24), note="route (2, 24): the 'start 2, end depth-4' rule"),
        ModelSpec("mamba", "Mamba 12x384/2", "mamba", "Mamba_S_2", _MAMBA, route=(2, 10),
                  batch=8, note=_SCAN_NOTE),
        ModelSpec("mamba-rows", "Mamba 12x384/2 rows", "mamba", "Mamba_S_2", _MAMBA,
                  route=(2, 10), selection="rows", batch=8, note="'rows' selection"),
        ModelSpec("rwkv", "RWKV-S/2", "rwkv", "RWKV_S_2", _RWKV, route=(2, 10),
                  selection="rows", batch=8,
                  note="'rows' selection (the 2-D q-shift reads true neighbours only in whole "
                       "rows); " + _SCAN_NOTE),
        ModelSpec("rwkv-random", "RWKV-S/2 random", "rwkv", "RWKV_S_2", _RWKV, route=(2, 10),
                  batch=8,
                  note="'random' selection: same cost as rows, but the routed blocks' q-shift "
                       "then mixes tokens that are not grid neighbours (timing only)"),
    ]
}  # fmt: skip


def model_available(spec: ModelSpec) -> bool:
    """Whether the model's module exists in this checkout (Mamba/RWKV may still be missing)."""
    try:
        module = importlib.import_module(f"tread_fx.models.{spec.module}")
    except ImportError:
        return False
    return hasattr(module, spec.factory)


def get_spec(name: str, tiny: bool = False) -> ModelSpec:
    """The spec called ``name`` (at test size with ``tiny``).

    Raises:
        KeyError: For an unknown name (the message lists the known ones).
    """
    if name not in SPECS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(SPECS)}")
    return SPECS[name].tiny() if tiny else SPECS[name]


def make_inputs(
    spec: ModelSpec, batch: int, device: torch.device | str = "cpu", seed: int = 1
) -> tuple[torch.Tensor, ...]:
    """Latents ``x`` [B, C, H, W], times ``t`` [B], labels ``y`` [B], a target like the output."""
    gen = torch.Generator().manual_seed(seed)
    size, channels = spec.input_size(), int(spec.kwargs.get("in_channels", 4))
    x = torch.randn(batch, channels, size, size, generator=gen)
    t = torch.rand(batch, generator=gen) * 999
    y = torch.randint(0, spec.num_classes(), (batch,), generator=gen)
    target = torch.randn(batch, 2 * channels, size, size, generator=gen)
    return tuple(v.to(device) for v in (x, t, y, target))
