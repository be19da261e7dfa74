"""Dataclass instances that carry traced values through the graph.

A forward may hand its blocks a dataclass holding tensors it computed (Chroma's
``ModulationOut(shift, scale, gate)`` per block). fx has no argument type for it, and a block
run on real values while tracing must see the real tensors in it, not proxies. Such an
instance becomes one graph call that builds it from its fields (:func:`constructor`), and its
real value is the same dataclass built from the fields' real values (:func:`map_fields`).

Example:
    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Pair:
    ...     a: int
    ...     b: int
    >>> constructor(Pair)(a=1, b=2)
    Pair(a=1, b=2)
    >>> map_fields(Pair(1, 2), lambda v: v * 10)
    Pair(a=10, b=20)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch.fx as fx

__all__ = [
    "built_class",
    "constructor",
    "holds_proxy",
    "init_fields",
    "is_instance",
    "map_fields",
]


def is_instance(value: Any) -> bool:
    """Whether ``value`` is a dataclass instance (not a dataclass type)."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def init_fields(value: Any) -> dict[str, Any]:
    """The fields ``value``'s ``__init__`` takes, by name."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}


def holds_proxy(value: Any) -> bool:
    """Whether a dataclass instance holds a traced value in a field (in a container too)."""
    found = []
    fx.node.map_aggregate(
        list(init_fields(value).values()),
        lambda v: (
            found.append(v) if isinstance(v, fx.Proxy) or (is_instance(v) and holds_proxy(v)) else v
        ),
    )
    return bool(found)


def map_fields(value: Any, fn: Callable[[Any], Any]) -> Any:
    """A copy of the dataclass ``value`` with ``fn`` applied to each ``__init__`` field."""
    return dataclasses.replace(value, **{k: fn(v) for k, v in init_fields(value).items()})


@functools.cache
def constructor(cls: type) -> Callable[..., Any]:
    """A function building ``cls`` from its fields, for a graph call (fx cannot hold ``cls``)."""

    def build(**fields: Any) -> Any:
        return cls(**fields)

    build.__name__ = build.__qualname__ = f"build_{cls.__name__}"
    build.dataclass = cls  # type: ignore[attr-defined]
    return build


def built_class(node: Any) -> type | None:
    """The dataclass a graph node builds with :func:`constructor`, or ``None``."""
    is_call = isinstance(node, fx.Node) and node.op == "call_function"
    return getattr(node.target, "dataclass", None) if is_call else None
