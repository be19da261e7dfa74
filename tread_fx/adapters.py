"""Side-input adapters: how a value entering a routed region is made to fit the kept tokens.

The plan pass classifies every value that enters a routed region. The token stream and
values that are clearly versions of it are gathered automatically. Everything else is asked
of this registry, in order: the first adapter whose ``matches`` accepts the value decides.
An adapter is keyed on what the block receives — the argument name, the block class, the
value's shape relative to the stream — never on the model's name.

An adapter's ``action`` is ``"gather"`` (keep the same tokens along the stream's token dim),
``"pass"`` (leave untouched), or a function ``fn(value, kept_idx, info) -> value`` that the
rewrite pass inserts into the graph (it runs on every step, so it must be pure tensor code).

Example:
    >>> import tread_fx
    >>> from tread_fx.adapters import Adapter, register_adapter
    >>> _ = register_adapter(Adapter(
    ...     name="my-pos-table",
    ...     matches=lambda side: "my_pos" in side.arg_names,
    ...     action="gather",
    ...     doc="my_pos is [B, N, d], one row per token.",
    ... ))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

__all__ = ["SideValue", "Adapter", "register_adapter", "adapters", "StreamLayout"]


@dataclass(frozen=True)
class StreamLayout:
    """Layout of the token stream at a route's start, as adapters see it."""

    batch_dim: int
    token_dim: int
    batch_size: int
    num_tokens: int
    prefix: int
    grid: tuple[int, int] | None


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
    """

    node: fx.Node
    meta: Any
    arg_names: frozenset[str]
    block_classes: frozenset[type]
    stream: StreamLayout
    token_aligned: bool
    from_stream: bool
    combined_with_stream: bool

    def dims_of_size(self, size: int) -> list[int]:
        """Dims (other than batch) of the value whose size is ``size``."""
        shape = getattr(self.meta, "shape", ())
        return [d for d, s in enumerate(shape) if s == size and d != self.stream.batch_dim]


@dataclass(frozen=True)
class Adapter:
    """A rule for side values: what it matches and what to do with it."""

    name: str
    matches: Callable[[SideValue], bool]
    action: str | Callable[[torch.Tensor, torch.Tensor, StreamLayout], Any]
    doc: str = ""
    builtin: bool = field(default=False, compare=False)


_ADAPTERS: list[Adapter] = []


def register_adapter(adapter: Adapter, *, first: bool = True) -> Adapter:
    """Register an adapter; by default it is consulted before the built-in ones.

    Example:
        >>> from tread_fx.adapters import Adapter, register_adapter
        >>> a = register_adapter(Adapter("ctx", lambda s: "ctx" in s.arg_names, "pass"))
    """
    if first:
        _ADAPTERS.insert(0, adapter)
    else:
        _ADAPTERS.append(adapter)
    return adapter


def adapters() -> tuple[Adapter, ...]:
    """Return the registered adapters in the order they are consulted."""
    return tuple(_ADAPTERS)


# -- built-in adapters ------------------------------------------------------------------------

_CONTEXT_NAMES = frozenset(
    {"encoder_hidden_states", "context", "cond", "condition", "c", "y", "temb", "timestep",
     "encoder_attention_mask", "text_embeds", "pooled_projections", "added_cond_kwargs"}
)  # fmt: skip


register_adapter(
    Adapter(
        name="conditioning-by-name",
        matches=lambda side: bool(side.arg_names) and side.arg_names <= _CONTEXT_NAMES,
        action="pass",
        doc=(
            "Values that blocks receive only under conditioning/context argument names "
            "(encoder_hidden_states, context, c, temb, ...) are per-sample or text-token "
            "values, not image tokens: passed through even when their length equals N."
        ),
        builtin=True,
    ),
    first=False,
)

register_adapter(
    Adapter(
        name="stream-derived",
        matches=lambda side: side.token_aligned and side.from_stream,
        action="gather",
        doc=(
            "A token-aligned value computed from the model's first input is a version of the "
            "token stream (a U-ViT skip, a second residual stream): gathered with the same ids."
        ),
        builtin=True,
    ),
    first=False,
)

register_adapter(
    Adapter(
        name="residual",
        matches=lambda side: side.token_aligned and side.combined_with_stream,
        action="gather",
        doc=(
            "A token-aligned value added/multiplied elementwise into region values (e.g. "
            "ControlNet residuals added between blocks) is gathered with the same ids."
        ),
        builtin=True,
    ),
    first=False,
)
