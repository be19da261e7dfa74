"""One routing configuration, resolved once from the user's arguments.

:func:`resolve_config` turns what ``route()``/``explain()`` were given into a
:class:`RoutingConfig`: routes parsed (and range-checked when the block stack is known without
tracing), the selection strategy looked up, the block containers named. ``route()`` keeps it,
``explain()`` describes it, and ``force_routing``/``sparse_guidance`` derive a new rate from it
with :meth:`RoutingConfig.at_rate`; the pass pipeline reads it for every trace.

Example:
    >>> import tread_fx
    >>> from tread_fx.config import resolve_config
    >>> model = tread_fx.models.DiT_S_2(input_size=8, depth=4)
    >>> cfg = resolve_config(model, [(1, -1)], 0.5, selection="rows")
    >>> cfg.block_lists, [(r.start, r.end, r.rate) for r in cfg.resolved], cfg.strategy.name
    (['blocks'], [(1, 3, 0.5)], 'rows')
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tread_fx.errors import BlockStackNotFoundError, TokenStreamError, shown
from tread_fx.module_state import unwrap
from tread_fx.passes.locate.choice import check_stream_option
from tread_fx.passes.locate.members import stack_members
from tread_fx.passes.locate.stacks import (
    candidate_stacks,
    convolutional_block,
    resolve_block_lists,
)
from tread_fx.passes.rewrite.insert import Reinsert
from tread_fx.routes import Route, check_rate, parse_routes, resolve_routes
from tread_fx.runtime.selection import Strategy, get_strategy

__all__ = ["RoutingConfig", "resolve_config", "options_of", "OPTIONS"]

#: The options ``route()`` and ``explain()`` hand to :func:`resolve_config` (config fields).
OPTIONS = (
    "selection",
    "blocks",
    "keep_prefix",
    "strict",
    "grid",
    "reinsert",
    "share_selection",
    "fp32_reentry",
    "stream",
    "batch_dim",
)


@dataclass
class RoutingConfig:
    """Everything ``route()`` was asked for, validated and resolved once.

    Attributes:
        routes: The parsed routes (negative indices not yet resolved); ``None``: the default
            route (:func:`tread_fx.routes.default_route`), chosen where the depth is known.
        rate: Default fraction of tokens routed around.
        selection, blocks, keep_prefix, grid, strict, reinsert, share_selection,
            fp32_reentry, stream, batch_dim: ``route()``'s arguments of these names
            (:data:`OPTIONS`).
        strategy: The selection strategy named by ``selection``.
        block_lists: Paths of the candidate block containers (data flow picks among several).
        depth: Number of blocks when known without tracing, else ``None``.
        resolved: ``routes`` resolved against ``depth`` (``None`` until the depth is known).
    """

    routes: list[Route] | None = None
    rate: float = 0.5
    selection: str = "auto"
    blocks: Any = None
    keep_prefix: int | None = None
    grid: tuple[int, ...] | None = None
    strict: bool = True
    reinsert: Reinsert | None = None
    share_selection: bool | None = None
    fp32_reentry: bool = False
    stream: str | int | None = None
    batch_dim: int | None = None
    strategy: Strategy = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    block_lists: list[str] | None = None
    depth: int | None = None
    resolved: list[Route] | None = None

    def __post_init__(self) -> None:
        if self.strategy is None:
            self.strategy = get_strategy(self.selection)
        self.reinsert = self.reinsert or Reinsert()

    def routes_for(self, depth: int) -> list[Route]:
        """The routes resolved against ``depth`` blocks (computed once per depth)."""
        if self.resolved is None or self.depth != depth:
            return resolve_routes(self.routes, depth, self.rate)
        return self.resolved

    def at_rate(self, rate: float | None = None, routes: Any = None) -> RoutingConfig:
        """This configuration at another rate and/or with other routes.

        Without ``routes``, every route (also one with its own rate) takes ``rate``.
        """
        rate = self.rate if rate is None else check_rate(rate)
        parsed = self.routes if routes is None else parse_routes(routes, rate)
        if routes is None and parsed is not None and rate != self.rate:
            parsed = [dataclasses.replace(r, rate=rate) for r in parsed]
        resolved = None if self.depth is None else resolve_routes(parsed, self.depth, rate)
        return dataclasses.replace(self, routes=parsed, rate=rate, resolved=resolved)


def _takes_input(member: nn.Module) -> bool:
    """Whether a container member can receive a value: a forward with some parameter (or a
    nested list of sub-blocks, one of which can). Unknown signatures count as taking one; an
    empty slot (``None`` in a ``ModuleList``) takes nothing."""
    if member is None:
        return False
    member = unwrap(member)  # a block wrapped by torch.compile on its own takes what it takes
    if isinstance(member, nn.ModuleList):
        return any(_takes_input(sub) for sub in member)
    if type(member).forward is nn.Module.forward:  # ModuleDict, ParameterList: no forward
        return False
    try:
        return len(inspect.signature(member.forward).parameters) > 0
    except (TypeError, ValueError):
        return True


def _refuse_convolutional(model: nn.Module, stacks: dict[str, list]) -> None:
    """Refuse at once a model whose every block list holds convolutional blocks only (a conv
    U-Net, a ResNet): no token sequence can flow through them."""
    members = [unwrap(m) for s in stacks.values() for m in s if m is not None]
    if not members or not all(convolutional_block(m) for m in members):
        return
    classes = sorted({type(m).__name__ for m in members})
    raise TokenStreamError(
        f"no token sequence flows through {type(model).__name__}: its blocks are convolutions "
        "over feature maps; route a token-based backbone (transformer, Mamba, RWKV).\n"
        f"Every block list ({', '.join(map(shown, stacks))}) holds convolutional blocks "
        f"({', '.join(classes)}): 2-D/3-D convolutions and channel norms, no linear layer, "
        "attention or token norm. TREAD routes tokens around blocks; a feature map has none."
    )


def _known_depth(model: nn.Module, blocks: Any, list_paths: list[str]) -> int | None:
    """The number of blocks when the stack is known without tracing (else ``None``).

    It is known when ``blocks=`` names the lists or the model has a single candidate list.
    With several candidates the data flow decides at trace time which lists chain into the
    stack (joint + single lists of unequal lengths), so routes are checked then.
    """
    if blocks is None:
        stacks = candidate_stacks(model)
        if not stacks:
            raise BlockStackNotFoundError(
                f"{type(model).__name__} has no ModuleList/Sequential of same-class modules to "
                "route around; pass blocks='<attribute path>' naming the block container."
            )
        if not any(_takes_input(m) for s in stacks.values() for m in s):
            raise BlockStackNotFoundError(
                f"{type(model).__name__} has no list of blocks that take an input, so no token "
                "stream can pass; pass blocks='<attribute path>' naming the block container.\n"
                f"The members of {', '.join(map(shown, stacks))} take no argument "
                "(or have no forward)."
            )
        _refuse_convolutional(model, stacks)
        if len(stacks) > 1:
            return None  # decided by data flow at trace time
        list_paths = list(stacks)
    return sum(len(stack_members(model, p)) for p in list_paths)


def options_of(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The routing options (:data:`OPTIONS`) among a call's arguments.

    ``route()`` and ``explain()`` take each option as a keyword of their own and hand them on
    with ``resolve_config(model, routes, rate, **options_of(locals()))``.

    Example:
        >>> options = dict.fromkeys(OPTIONS)
        >>> options_of({**options, "seed": 0}) == options
        True
    """
    return {name: arguments[name] for name in OPTIONS}


def resolve_config(
    model: nn.Module, routes: Any, rate: float = 0.5, **options: Any
) -> RoutingConfig:
    """Validate and resolve the routing arguments of ``route()``/``explain()`` for ``model``.

    Args:
        model: The model to route (not modified).
        routes: Routes in any form :func:`tread_fx.routes.parse_routes` accepts; ``None``
            for the default route (:func:`tread_fx.routes.default_route`).
        rate: Fraction of tokens routed around.
        **options: The other options of ``route()`` (:data:`OPTIONS`), as documented there;
            unset ones take the defaults.

    Returns:
        The :class:`RoutingConfig`.

    Raises:
        InvalidRouteError: a route is malformed or outside the known block stack.
        InvalidRateError: the rate is not in [0, 1).
        SelectionError: the selection strategy is unknown.
        BlockStackNotFoundError: ``blocks=`` names no container, or none can be found.
        TokenStreamError: ``stream=`` names no argument of the model's forward, or
            ``keep_prefix`` is not an int >= 0, or ``batch_dim`` not 0, 1 or None.
    """
    check_stream_option(model, options.get("stream"))
    _check_keep_prefix(options.get("keep_prefix"))
    _check_batch_dim(options.get("batch_dim"))
    strategy = get_strategy(options.get("selection", "auto"))
    config = RoutingConfig(parse_routes(routes, rate), rate, **options, strategy=strategy)
    config.block_lists = resolve_block_lists(model, config.blocks)
    config.depth = _known_depth(model, config.blocks, config.block_lists)
    if config.depth is not None:
        config.resolved = resolve_routes(config.routes, config.depth, rate)
    return config


def _check_batch_dim(batch_dim: object) -> None:
    if batch_dim is None or (type(batch_dim) is int and batch_dim in (0, 1)):
        return
    raise TokenStreamError(
        f"batch_dim={batch_dim!r} was given; it is the dim of the token stream that holds the "
        "samples (0 for [B, N, C], 1 for [N, B, C]). Pass 0, 1, or None to let the blocks tell."
    )


def _check_keep_prefix(keep_prefix: object) -> None:
    ok = keep_prefix is None or (
        isinstance(keep_prefix, int) and not isinstance(keep_prefix, bool) and keep_prefix >= 0
    )
    if not ok:
        raise TokenStreamError(
            f"keep_prefix={keep_prefix!r} was given; it counts the leading tokens never routed "
            "(cls/register tokens) and must be an int >= 0, or None to detect them."
        )
