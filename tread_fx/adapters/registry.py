"""Side-input adapters: how a value entering a routed region is made to fit the kept tokens.

The plan pass classifies every value that enters a routed region. The token stream and
values that are clearly versions of it are gathered automatically. Everything else is asked
of this registry, in order: the first adapter whose ``matches`` accepts the value decides.
An adapter is keyed on what the block receives — the argument name (positional arguments
are named by the block's signature), the block class, the value's shape relative to the
stream — never on the model's name. User adapters are consulted before the built-in ones.

An adapter's ``action`` is ``"gather"`` (keep the same tokens along the stream's token dim),
``"pass"`` (leave untouched), or a function ``fn(value, kept_idx, **layout, **options)``
that the rewrite pass inserts into the graph (it runs on every step, so it must be pure
tensor code); ``options(side)`` adds keyword arguments decided at plan time, and
``shares_selection=True`` makes the route's selection the same for every sample.

The built-in rules are one table, :data:`tread_fx.adapters.rules.BUILTIN_ADAPTERS`,
registered after any user adapter when :mod:`tread_fx.adapters` is imported.

Example:
    >>> import tread_fx
    >>> from tread_fx.adapters import Adapter, register_adapter, unregister_adapter
    >>> mine = register_adapter(Adapter(
    ...     name="my-pos-table",
    ...     matches=lambda side: side.arg_names == {"my_pos"},
    ...     action="gather",
    ...     doc="my_pos is [B, N, d], one row per token.",
    ... ))
    >>> unregister_adapter(mine)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tread_fx.adapters.values import SideValue

__all__ = ["Adapter", "register_adapter", "unregister_adapter", "adapters"]


@dataclass(frozen=True)
class Adapter:
    """A rule for side values: what it matches and what to do with it.

    Attributes:
        name: Shown by ``explain`` and in the plan's reasons.
        matches: ``matches(side) -> bool``.
        action: ``"gather"``, ``"pass"``, or ``fn(value, kept_idx, **layout, **options)``.
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
        >>> a = register_adapter(Adapter("ctx", lambda s: "ctx" in s.arg_names, "pass"))
        >>> unregister_adapter(a)
    """
    if first:
        _ADAPTERS.insert(0, adapter)
    else:
        _ADAPTERS.append(adapter)
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
