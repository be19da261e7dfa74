"""The values adapters see: the stream layout, a side value entering a route, tensor metadata.

The trace pass records a :class:`TensorMeta` per graph value; the plan pass describes each
value entering a routed region as a :class:`SideValue` and asks the adapter registry about it.

Example:
    >>> import torch
    >>> from tread_fx.adapters.values import TensorMeta
    >>> TensorMeta((2, 16, 32), torch.float32, torch.device("cpu")).shape
    (2, 16, 32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["TensorMeta", "StreamLayout", "SideValue", "NO_BATCH_DIM"]

# ``StreamLayout.batch_dim`` of a packed [tokens, dim] stream: it has no batch dim
NO_BATCH_DIM = -1


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and device of a tensor seen at trace time."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class StreamLayout:
    """Layout of the token stream at a route's start, as adapters see it.

    The stream's ``prefix`` leading and ``suffix`` trailing tokens (cls/registers in front,
    a text stream behind) are never routed; the kept ids always include them.

    A packed ``[tokens, dim]`` stream (samples concatenated along the tokens) has
    ``batch_dim == NO_BATCH_DIM``, ``token_dim == 0`` and ``batch_size == 1``.

    ``batch_size`` is the size of the stream's batch dim; for a stream whose dim 0 folds
    frames (or positions) into the batch (``[B * F, N, C]``) it is ``B * F`` and ``folded``
    is ``F``, so the model's own batch is ``batch_size // folded``.
    """

    batch_dim: int
    token_dim: int
    batch_size: int
    num_tokens: int
    prefix: int
    grid: tuple[int, int] | None
    suffix: int = 0
    folded: int = 1

    @property
    def routable(self) -> int:
        """Tokens a route may leave out: all but the prefix and the suffix."""
        return self.num_tokens - self.prefix - self.suffix

    @property
    def token_counts(self) -> set[int]:
        """The counts a token dim of a value may have here: all tokens, those after the
        prefix, the routable ones.

        Example:
            >>> sorted(StreamLayout(0, 1, 2, 17, 1, None).token_counts)
            [16, 17]
        """
        return {self.num_tokens, self.num_tokens - self.prefix, self.routable}

    @property
    def samples(self) -> int:
        """The model's batch size (the stream's batch rows over the folded sequences)."""
        return self.batch_size // self.folded


@dataclass(frozen=True)
class SideValue:
    """A value entering a routed region, as seen by adapters.

    Attributes:
        node: The graph node.
        meta: ``TensorMeta`` of the value (or a tuple of them, or a Python value).
        arg_names: Names under which blocks in the region receive it (kwarg names, or
            ``"arg{i}"`` for positional arguments).
        block_classes: Classes of the blocks in the region that receive it directly.
        stream: The stream layout.
        token_aligned: Its shape has the batch and token sizes at the stream's dims.
        from_stream: It is computed from the model's first input (a version of the stream).
        combined_with_stream: A region op combines it elementwise with a region value.
        from_inputs: Its values come from a model input (not only from constants,
            parameters, buffers or tensor shapes): it can vary with the batch.
        use: How the routed blocks and the code between them use it
            (:class:`tread_fx.passes.plan.uses.Use` value: ``"mask"``, ``"table"``, ``"ids"``,
            ``"context"``, ``"none"``, ``"unknown"``: it meets the stream only inside a
            leaf module), or ``None``
            when no block receiving it could be traced through. Built-in rules decide by
            this and the shapes; ``arg_names`` are hints for ``explain`` and user adapters.
        reaches: Names of the block ops that read it first (for refusal messages).
        primary: The model input the routed stream comes from (ties between table parts
            of N rows go to the part computed from it).
        batch_broadcast: The stream's batch dim, where the value has size 1 there and every
            use of it in the region is elementwise with the stream between the blocks (the
            graph shows it broadcast over the batch); else ``None``.
    """

    node: fx.Node
    meta: Any
    arg_names: frozenset[str]
    block_classes: frozenset[type]
    stream: StreamLayout
    token_aligned: bool
    from_stream: bool
    combined_with_stream: bool
    from_inputs: bool = False
    use: str | None = None
    reaches: frozenset[str] = frozenset()
    primary: fx.Node | None = None
    batch_broadcast: int | None = None

    def dims_of_size(self, size: int) -> list[int]:
        """Dims (other than batch) of the value whose size is ``size``."""
        shape = getattr(self.meta, "shape", ())
        return [d for d, s in enumerate(shape) if s == size and d != self.stream.batch_dim]
