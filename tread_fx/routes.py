"""Routes: which blocks run on a subset of tokens.

A route ``(start, end)`` takes tokens out of the stream at the input of block ``start``;
blocks ``start .. end-1`` see only the kept tokens; at the input of block ``end`` (or after
the last block when ``end == depth``) the processed tokens are written back. Indices are
half-open like ``range`` and may be negative, Python-style. The authors'/SimpleTuner dict
form uses an *inclusive* end: ``{"start_layer_idx": 2, "end_layer_idx": 8}`` is ``(2, 9)``.
No routes (``None``) means the paper's rule, :func:`default_route`, applied once the depth of
the block stack is known.

Example:
    >>> from tread_fx.routes import Route, parse_routes, resolve_routes
    >>> routes = parse_routes([(2, -2), {"selection_ratio": 0.25, "start_layer_idx": 0,
    ...                                   "end_layer_idx": 1}], rate=0.5)
    >>> [(r.start, r.end, r.rate) for r in resolve_routes(routes, depth=12, rate=0.5)]
    [(0, 2, 0.25), (2, 10, 0.5)]
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tread_fx.errors import InvalidRateError, InvalidRouteError

__all__ = ["Route", "default_route", "parse_routes", "resolve_routes", "check_rate"]

_DICT_KEYS = {"selection_ratio", "start_layer_idx", "end_layer_idx"}


def _is_index(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_rate(rate: object, what: str = "rate") -> float:
    """Validate a routing rate: a real number in [0, 1)."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise InvalidRateError(
            f"{what}={rate!r} was given; it must be a number in [0, 1), the fraction of "
            "tokens routed around the blocks (the paper's sweet spot is 0.5)."
        )
    if not 0.0 <= float(rate) < 1.0:
        raise InvalidRateError(
            f"{what}={rate} is outside [0, 1): it is the fraction of tokens routed AROUND the "
            "blocks, so 1 would leave no token to process; use e.g. 0.5."
        )
    return float(rate)


@dataclass(frozen=True)
class Route:
    """A route over blocks ``start .. end-1`` (half-open, negative indices allowed).

    Attributes:
        start: First block that sees only kept tokens.
        end: Block at whose input the tokens are written back (``depth`` = after the last).
        rate: Fraction of tokens routed around; ``None`` uses ``route(..., rate=)``.

    Example:
        >>> Route(2, 9, 0.5)
        Route(start=2, end=9, rate=0.5)
    """

    start: int
    end: int
    rate: float | None = None

    def __post_init__(self) -> None:
        if not (_is_index(self.start) and _is_index(self.end)):
            raise InvalidRouteError(
                f"route ({self.start!r}, {self.end!r}) has non-integer block indices; "
                "use integers like (2, 9)."
            )
        both_same_sign = (self.start >= 0) == (self.end >= 0)
        if both_same_sign and self.start >= self.end:
            raise InvalidRouteError(
                f"route ({self.start}, {self.end}) has start >= end; a route covers blocks "
                f"start .. end-1 (half-open), e.g. ({self.start}, {self.start + 1}) for one "
                "block. For the authors' inclusive end use the dict form."
            )
        if self.rate is not None:
            object.__setattr__(self, "rate", check_rate(self.rate, "route rate"))

    @classmethod
    def from_dict(cls, spec: Mapping) -> Route:
        """Convert the authors'/SimpleTuner dict (inclusive ``end_layer_idx``) exactly."""
        unknown = set(spec) - _DICT_KEYS
        missing = {"start_layer_idx", "end_layer_idx"} - set(spec)
        if unknown or missing:
            raise InvalidRouteError(
                f"route dict {dict(spec)!r} has unknown keys {sorted(unknown)} / missing keys "
                f"{sorted(missing)}; expected {sorted(_DICT_KEYS)} (selection_ratio optional)."
            )
        start, end = spec["start_layer_idx"], spec["end_layer_idx"]
        if not (_is_index(start) and _is_index(end)):
            raise InvalidRouteError(f"route dict {dict(spec)!r} has non-integer layer indices.")
        end_exclusive = end + 1 if end != -1 else None
        return _InclusiveEnd(start, end, spec.get("selection_ratio"), end_exclusive)


@dataclass(frozen=True)
class _InclusiveEnd(Route):
    """A dict-form route whose inclusive end -1 means 'through the last block'."""

    end_exclusive: int | None = None

    def __post_init__(self) -> None:
        if (self.start >= 0) == (self.end >= 0) and self.start > self.end:
            raise InvalidRouteError(
                f"route dict start_layer_idx={self.start} > end_layer_idx={self.end} "
                "(inclusive); the start must not come after the end."
            )
        if self.rate is not None:
            object.__setattr__(self, "rate", check_rate(self.rate, "selection_ratio"))


def default_route(depth: int) -> Route:
    """The route used when none is given: the paper's rule, scaled down for shallow stacks.

    The paper routes from block 2 to block ``depth - 4`` (DiT-XL/2, 28 blocks: ``(2, 24)``;
    DiT-B/2, 12 blocks: ``(2, 8)``), leaving the first two and the last four blocks to see
    every token. Below 12 blocks that route would cover under half of the stack (or none of
    it), so shallower stacks keep one block before the route and about a quarter after it:

    - ``depth >= 12``: ``(2, depth - 4)``
    - ``3 <= depth < 12``: ``(1, depth - max(1, depth // 4))``
    - ``depth`` 1 or 2: ``(0, 1)`` (with one block, the route re-enters after it)

    Args:
        depth: Number of blocks in the routed stack.

    Returns:
        The route, without a rate of its own (``route(..., rate=)`` applies).

    Raises:
        InvalidRouteError: ``depth`` is not a positive int.

    Example:
        >>> [(r.start, r.end) for r in map(default_route, (28, 12, 8, 4, 2, 1))]
        [(2, 24), (2, 8), (1, 6), (1, 3), (0, 1), (0, 1)]
    """
    if not _is_index(depth) or depth < 1:
        raise InvalidRouteError(
            f"the default route was asked for a stack of {depth!r} blocks; it needs at least "
            "one block: pass routes=[(start, end)] or blocks= naming the block container."
        )
    if depth >= 12:
        return Route(2, depth - 4)
    if depth >= 3:
        return Route(1, depth - max(1, depth // 4))
    return Route(0, 1)


def parse_routes(routes: object, rate: float) -> list[Route] | None:
    """Normalise the user's ``routes=`` into :class:`Route` objects (not yet range-checked).

    ``None`` stays ``None``: the default route (:func:`default_route`), chosen once the depth
    is known.
    """
    check_rate(rate)
    if routes is None:
        return None
    if isinstance(routes, (Route, Mapping)) or (
        isinstance(routes, tuple) and routes and _is_index(routes[0])
    ):
        routes = [routes]
    if isinstance(routes, (str, bytes)) or not isinstance(routes, Iterable):
        raise InvalidRouteError(
            f"routes={routes!r} is not a list of routes; pass e.g. [(2, 9)], "
            "[tread_fx.Route(2, 9)] or [{'start_layer_idx': 2, 'end_layer_idx': 8}]."
        )
    parsed = [_parse_one(item) for item in routes]
    if not parsed:
        raise InvalidRouteError("routes=[] was given; pass at least one route such as (2, 9).")
    return parsed


def _parse_one(item: object) -> Route:
    if isinstance(item, Route):
        return item
    if isinstance(item, Mapping):
        return Route.from_dict(item)
    if isinstance(item, (tuple, list)) and len(item) in (2, 3):
        return Route(*item)
    raise InvalidRouteError(
        f"route {item!r} is not understood; use (start, end), (start, end, rate), "
        "tread_fx.Route(...) or the dict form with start_layer_idx/end_layer_idx."
    )


def resolve_routes(
    routes: list[Route] | None, depth: int, rate: float | None = None
) -> list[Route]:
    """Resolve negative indices against ``depth``, fill in rates, check range and overlap.

    ``routes=None`` is the default route for ``depth`` (:func:`default_route`).

    Returns routes with non-negative ``start < end <= depth``, sorted by ``start``.
    """
    if routes is None:
        routes = [default_route(depth)]
    resolved = []
    for route in routes:
        start = route.start + depth if route.start < 0 else route.start
        if isinstance(route, _InclusiveEnd):
            end = depth if route.end_exclusive is None else route.end_exclusive
            end = end + depth if end <= 0 and route.end < 0 else end
        else:
            end = route.end + depth if route.end < 0 else route.end
        if not (0 <= start < depth and 0 < end <= depth):
            raise InvalidRouteError(
                f"route {_show(route)} resolves to blocks {start}..{end - 1}, outside the "
                f"{depth} blocks found (valid: 0 <= start < end <= {depth})."
            )
        if start >= end:
            raise InvalidRouteError(
                f"route {_show(route)} resolves to start {start} >= end {end} with {depth} "
                "blocks; a route must cover at least one block."
            )
        resolved.append(Route(start, end, route.rate if route.rate is not None else rate))
    resolved.sort(key=lambda r: r.start)
    for first, second in zip(resolved, resolved[1:]):
        if second.start < first.end:
            raise InvalidRouteError(
                f"routes ({first.start}, {first.end}) and ({second.start}, {second.end}) "
                "overlap; routes must cover disjoint block ranges (they may touch: "
                "(2, 5) and (5, 8))."
            )
    return resolved


def _show(route: Route) -> str:
    if isinstance(route, _InclusiveEnd):
        return f"{{start_layer_idx: {route.start}, end_layer_idx: {route.end}}} (inclusive end)"
    return f"({route.start}, {route.end})"
