"""The containers round: blocks in an ``nn.ModuleDict`` or in nested stages, text packed.

:func:`draw_containers` may replace the first round's container with

- ``moduledict``: an ``nn.ModuleDict`` of the blocks (insertion order is call order), walked
  by ``.values()``, ``.items()`` or its keys;
- ``stages``: an ``nn.ModuleList`` of stages, each an ``nn.ModuleList`` of blocks of one width,
  walked stage by stage.

The blocks are numbered in the order the stream passes them, across stages (docs/design.md,
"Blocks outside one long list": lists in a row of one class and one form chain, and a route
may span them), so a route ``(a, b)`` counts blocks, never stages; the twin walks the same
blocks flattened. And it may join the text stream with ``einops.pack``/``unpack`` instead of
``torch.cat`` and a slice (``text_join="pack"``; the company already has both joins).

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> d = draw(11)
    >>> d.container != "stages" or sum(d.stages) == d.depth
    True
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.generated.grammar import Draw

__all__ = ["CONTAINER_ROLES", "MORE_CONTAINERS", "containers_features", "draw_containers"]

CONTAINER_ROLES = ("dict_key", "stages", "stage")
MORE_CONTAINERS = ("moduledict", "stages")
_WALKS = ("values", "items", "keys")


def _stages(rng: random.Random, depth: int) -> tuple[int, ...]:
    count = rng.randint(2, min(3, depth))
    cuts = sorted(rng.sample(range(1, depth), count - 1))
    bounds = [0, *cuts, depth]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def draw_containers(d: Draw) -> None:
    """Draw the containers round into ``d`` (in place; from a generator of its own). A fold
    is left in its own containers (it needs the block index inside the loop); a width change
    is never drawn in stages."""
    rng = random.Random(f"generated-containers-{d.seed}")
    if d.refuse != "fold" and rng.random() < 0.3:
        # stages of two widths are lists of two forms: the design routes the longer one, so a
        # width change would not lie inside the route (a ModuleDict holds one list)
        d.container = "moduledict" if d.refuse == "width" else rng.choice(MORE_CONTAINERS)
        d.dict_walk = rng.choice(_WALKS)
        d.stages = _stages(rng, d.depth) if d.container == "stages" else ()
    if d.text in ("prefix", "suffix") and rng.random() < 0.5:
        d.text_join = "pack"


def containers_features(d: Draw) -> list[str]:
    """The table labels of the containers round (the container itself is the first
    round's ``container=`` label)."""
    out = [f"moduledict.{d.dict_walk}"] if d.container == "moduledict" else []
    out += [f"stages={len(d.stages)}"] if d.stages else []
    return out + (["text_join=pack"] if d.text_join == "pack" else [])
