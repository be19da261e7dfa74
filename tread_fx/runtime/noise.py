"""The uniform noise that selections are drawn from, seeded or not, eager or compiled.

``seed=None`` draws from torch's global RNG (``torch.rand``, which ``torch.compile`` traces).
A seed gives every device its own ``torch.Generator``, which dynamo cannot trace: under
``torch.compile`` the draw goes through the opaque custom op ``tread_fx::seeded_noise`` on
the same generator, so compiled and eager models select the same tokens, ``fullgraph=True``
holds and nothing recompiles across steps. A call's noise is one flat draw (split per route
afterwards), so the op runs once per call and its draws keep their order. A
:class:`NoiseSource` pickles as its seed and its generators' states.

Example:
    >>> import torch
    >>> a, b = NoiseSource(0), NoiseSource(0)
    >>> [n.shape for n in a.draw([(2, 4), (2, 3)], torch.device("cpu"))]
    [torch.Size([2, 4]), torch.Size([2, 3])]
    >>> torch.equal(a.draw([(5,)], torch.device("cpu"))[0], b.draw([(2, 4), (2, 3), (5,)],
    ...     torch.device("cpu"))[2])
    True
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any

import torch

__all__ = ["NoiseSource"]

_SOURCES: weakref.WeakValueDictionary[int, NoiseSource] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("tread_fx::seeded_noise", mutates_args=())
def _seeded_noise(key: int, numel: int, device: torch.device) -> torch.Tensor:
    return _SOURCES[key].flat(numel, device)


@_seeded_noise.register_fake
def _(key: int, numel: int, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, device=device)


class NoiseSource:
    """Uniform [0, 1) noise for token selections.

    Args:
        seed: Seed of the per-device generators, or ``None`` for torch's global RNG.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}
        self._saved: dict[str, torch.Tensor] = {}  # generator states of a loaded source
        self._register()

    def _register(self) -> None:
        self.key = next(_KEYS)
        _SOURCES[self.key] = self

    def draw(self, shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.Tensor]:
        """One tensor of uniform noise per shape, on ``device``."""
        if self.seed is None:
            return [torch.rand(shape, device=device) for shape in shapes]
        numels = [math.prod(shape) for shape in shapes]
        if torch.compiler.is_compiling():
            flat = torch.ops.tread_fx.seeded_noise(self.key, sum(numels), device)
        else:
            flat = self.flat(sum(numels), device)
        return [part.view(shape) for part, shape in zip(flat.split(numels), shapes)]

    def flat(self, numel: int, device: torch.device) -> torch.Tensor:
        """``numel`` draws from this source's generator for ``device``."""
        gen = self.generators.get(device)
        if gen is None:
            gen = self.generators[device] = torch.Generator(device)
            saved = self._saved.pop(str(device), None)
            if saved is None:
                gen.manual_seed(self.seed)
            else:
                gen.set_state(saved)
        return torch.rand(numel, device=device, generator=gen)

    def __getstate__(self) -> dict[str, Any]:
        states = {str(d): g.get_state() for d, g in self.generators.items()}
        return {"seed": self.seed, "states": {**self._saved, **states}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.seed = state["seed"]
        self.generators = {}
        self._saved = {device: s.clone() for device, s in state["states"].items()}
        self._register()
