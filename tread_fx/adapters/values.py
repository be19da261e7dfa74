"""What adapters see and are: tensor metadata, the stream layout, side values, the registry.

The plan pass describes each value entering a routed region as a :class:`SideValue`; the
stream and its clear versions are gathered, and for anything else the first registered
:class:`Adapter` whose ``matches`` accepts it decides. User adapters, consulted first, may
key on what the block receives (argument name, block class, shape), never on the model's
name; the built-in rules (:data:`tread_fx.adapters.rules.BUILTIN_ADAPTERS`) decide by use
and shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "TensorMeta",
    "StreamLayout",
    "SideValue",
    "NO_BATCH_DIM",
    "Adapter",
    "register_adapter",
    "unregister_adapter",
    "adapters",
]

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
            leaf module), or ``None`` when no block receiving it could be traced through.
        reaches: Names of the block ops that read it first (for refusal messages).
        stopped: ``path (what stopped it)`` of each receiving block traced only in part: ``use``
            is read from its code before that line (a warning says so).
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
    stopped: frozenset[str] = frozenset()
    primary: fx.Node | None = None
    batch_broadcast: int | None = None


@dataclass(frozen=True)
class Adapter:
    """A rule for side values: what it matches and what to do with it.

    Attributes:
        name: Shown by ``explain`` and in the plan's reasons.
        matches: ``matches(side) -> bool``.
        action: ``"gather"`` (keep the same tokens along the stream's token dim),
            ``"pass"`` (leave untouched), or ``fn(value, kept_idx, **layout, **options)``
            that the rewrite pass inserts into the graph (it runs on every step, so it must
            be pure tensor code).
        doc: What the rule assumes about the values it matches.
        builtin: Whether tread_fx registered it.
        options: ``options(side) -> dict`` of extra keyword arguments for a function
            action, decided at plan time (e.g. which dims hold token rows).
        shares_selection: The action only works if every sample keeps the same tokens
            (batch-shared tables): routes that this value enters share their selection
            across the batch.
        diagnose: ``diagnose(side) -> str | None``: for a value the rule is meant for but
            cannot handle, why (added to strict mode's refusal).
        by_shape_only: A built-in rule for values whose use the blocks do not show: what it
            decides is reported with a warning naming the value and how to override it.
        segments: The values it matches hold a packed stream's segment boundaries, as
            ``"offsets"`` (``cu_seqlens``) or ``"ids"`` (one segment id per token): the
            route then selects per segment.
    """

    name: str
    matches: Callable[[SideValue], bool]
    action: str | Callable[..., Any]
    doc: str = ""
    builtin: bool = field(default=False, compare=False)
    options: Callable[[SideValue], dict[str, Any]] | None = field(default=None, compare=False)
    shares_selection: bool = False
    diagnose: Callable[[SideValue], str | None] | None = field(default=None, compare=False)
    by_shape_only: bool = field(default=False, compare=False)
    segments: str | None = None


_ADAPTERS: list[Adapter] = []


def register_adapter(adapter: Adapter, *, first: bool = True) -> Adapter:
    """Register an adapter; by default it is consulted before the built-in ones.

    Example:
        >>> from tread_fx.adapters import Adapter, register_adapter, unregister_adapter
        >>> mine = register_adapter(Adapter(
        ...     name="my-pos-table",
        ...     matches=lambda side: side.arg_names == {"my_pos"},
        ...     action="gather",
        ...     doc="my_pos is [B, N, d], one row per token.",
        ... ))
        >>> unregister_adapter(mine)
    """
    _ADAPTERS.insert(0 if first else len(_ADAPTERS), adapter)
    return adapter


def unregister_adapter(adapter: Adapter | str) -> None:
    """Remove an adapter (or every adapter with that name) from the registry.

    Example:
        >>> from tread_fx.adapters import Adapter, register_adapter, unregister_adapter
        >>> unregister_adapter(register_adapter(Adapter("tmp", lambda s: False, "pass")))
    """
    name = adapter if isinstance(adapter, str) else None
    _ADAPTERS[:] = [a for a in _ADAPTERS if not (a is adapter or a.name == name)]


def adapters() -> tuple[Adapter, ...]:
    """Return the registered adapters in the order they are consulted."""
    return tuple(_ADAPTERS)
