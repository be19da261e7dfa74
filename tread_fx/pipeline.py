"""The pass pipeline: trace -> locate -> plan -> rewrite, for one call signature.

``route()`` runs it lazily on the first training call of each input signature;
``explain()`` runs it on example inputs without touching the model.

Example:
    >>> import torch, tread_fx
    >>> from tread_fx.config import resolve_config
    >>> from tread_fx.pipeline import build
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> cfg = resolve_config(model, [(1, 3)], 0.5)
    >>> args = (torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2]))
    >>> built = build(model, args, {}, cfg)
    >>> [p.kept_tokens for p in built.plans]
    [8]
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from tread_fx.adapters.token_tables import take_rows
from tread_fx.config import RoutingConfig
from tread_fx.errors import (
    SelectionError,
    SideInputError,
    StreamChoiceWarning,
    ThinRouteWarning,
    TokenStreamError,
    warn_at_caller,
)
from tread_fx.passes.locate.choice import choose_stream, thin_stack
from tread_fx.passes.locate.dims import GRID_ROWS, is_token_major
from tread_fx.passes.locate.layout import check_no_token_tables_inside, grid_in_block_arguments
from tread_fx.passes.locate.stacks import block_leaf_paths, resolve_block_lists
from tread_fx.passes.locate.stream import StreamInfo
from tread_fx.passes.plan.forms import cut_at_route_ends, form_changes, locate_tokens, needs_split
from tread_fx.passes.plan.inline_tables import InlineBlock, find_token_tables, inline_token_tables
from tread_fx.passes.plan.route_plan import Crossing, RoutePlan, graph_to_networkx, plan_route
from tread_fx.passes.rewrite.insert import append_route_outputs, rewrite_route
from tread_fx.passes.trace.block import drop_examples
from tread_fx.passes.trace.tracer import TracedCall, trace_call
from tread_fx.routes import Route
from tread_fx.runtime.selection import get_strategy
from tread_fx.stages import stage, stage_clock

__all__ = ["Built", "build", "find_grid"]


@dataclass
class Built:
    """The result of the pipeline for one call signature."""

    traced: TracedCall
    info: StreamInfo
    routes: list[Route]
    plans: list[RoutePlan]
    num_model_outputs: int
    selection: str = "random"
    #: Wall seconds of each stage (tracing, locating, planning, rewriting) of this build.
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def gm(self) -> fx.GraphModule:
        return self.traced.gm


def find_grid(model: nn.Module, num_tokens: int) -> tuple[int, int] | None:
    """Find the patch grid (H, W) with ``H * W == num_tokens``.

    Looks at ``model.grid_size``, then at any submodule's ``grid_size`` (timm's PatchEmbed),
    then at diffusers-style ``height``/``width``/``patch_size`` attributes.
    """
    candidates = [model, *model.modules()]
    for module in candidates:
        grid = getattr(module, "grid_size", None)
        if isinstance(grid, (tuple, list)) and len(grid) == 2 and grid[0] * grid[1] == num_tokens:
            return int(grid[0]), int(grid[1])
    for module in candidates:
        with warnings.catch_warnings():  # diffusers warns on config attributes read directly
            warnings.simplefilter("ignore", FutureWarning)
            h, w, p = (getattr(module, k, None) for k in ("height", "width", "patch_size"))
        if all(isinstance(v, int) for v in (h, w, p)) and (h // p) * (w // p) == num_tokens:
            return h // p, w // p
        if all(isinstance(v, int) for v in (h, w, p)) and h * w == num_tokens:
            return h, w  # diffusers' PatchEmbed stores height/width already in patches
    return None


def _grid_for(model: nn.Module, config: RoutingConfig, info: StreamInfo) -> tuple[int, int] | None:
    layout, routable = info.layout, info.layout.routable
    grid = config.grid or find_grid(model, routable) or grid_in_block_arguments(info, routable)
    if grid is not None and math.prod(grid) != routable:
        suffix = f", minus {layout.suffix} suffix" if layout.suffix else ""
        raise SelectionError(
            f"grid={grid} was given, but the token stream has {routable} routable tokens "
            f"({layout.num_tokens} minus {layout.prefix} prefix{suffix}); H * W must equal that "
            "(F * H * W for a video grid)."
        )
    if grid is None and config.strategy.needs_grid:
        raise SelectionError(
            f"selection={config.selection!r} needs the patch grid, but none with H * W == "
            f"{routable} was found on {type(model).__name__} (no grid_size attribute); pass "
            "grid=(H, W) to route()."
        )
    return grid


def _split_routes(traced, info: StreamInfo, routes: list[Route], args, kwargs) -> dict:
    """Routes that cross a change of the stream's form, with where their tokens land."""
    g = graph_to_networkx(traced.gm.graph)
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    splits = {}
    for i, route in enumerate(routes):
        cut_at_route_ends(g, info, route)
        changes = form_changes(g, info, route)
        if needs_split(g, info, route, changes):
            splits[i] = locate_tokens(traced.gm, info, route, changes, tensors)
            info.form_cuts.update(changes)
    return splits


def _first_piece(route: Route, changes: list | None) -> Route:
    return Route(route.start, changes[0].index, route.rate) if changes else route


def _plan_split(traced, info, config, index: int, route: Route, changes: list, how) -> tuple:
    """Plan and rewrite a route in pieces at its form changes: ``(plan, kept ids node)``, the
    plan of the first piece reporting the whole route, the later pieces in its ``pieces``."""
    strategy, grid = how
    if config.reinsert.mode != "scatter":
        raise TokenStreamError(
            f"route ({route.start}, {route.end}) crosses a change of the token stream's form "
            f"(before block {changes[0].index}), which only reinsert='scatter' supports; end "
            "the route before it, or use the default reinsert."
        )
    gm, embedded, strict = traced.gm, info.blocks[0].stream_in, config.strict
    first = plan_route(gm, info, _first_piece(route, changes), index, strategy, grid, strict)
    _apply_share_selection(first, config.share_selection)
    kept = rewrite_route(gm, first, strategy, config.reinsert, embedded)
    bounds = [route.start, *(c.index for c in changes), route.end]
    for change, start, end in zip(changes, bounds[1:], bounds[2:]):
        piece = Route(start, end, route.rate)
        plan = plan_route(gm, info, piece, index, strategy, None, strict, first, change)
        rewrite_route(gm, plan, strategy, config.reinsert, embedded, kept, traced.wrapper)
        first.pieces.append(plan)
    first.route = route
    return first, kept


def _resolve_auto(traced, info: StreamInfo, routes: list[Route], config, grid, splits, focus):
    """The strategy to use: ``selection="auto"`` becomes ``"random"``, or ``"rows"`` when a
    routed block reshapes its tokens to the patch grid (random tokens make no grid)."""
    if config.strategy.name != "auto":
        return config.strategy
    random = get_strategy("random")
    try:
        for i, route in enumerate(routes):
            _focus_on(focus, info, route)
            piece = _first_piece(route, splits.get(i))
            plan_route(traced.gm, info, piece, i, random, grid, config.strict)
    except SelectionError:
        if grid is None:
            raise
        return get_strategy("rows")
    return random


def _apply_share_selection(plan: RoutePlan, share: bool | None) -> None:
    """Force, allow (``None``: where an adapter needs it) or refuse a batch-shared selection."""
    if share is None:
        return
    needing = [c.node.name for c in plan.entering if c.shares_selection]
    if share is False and needing:
        route = plan.route
        raise SideInputError(
            f"route ({route.start}, {route.end}) receives batch-shared token tables "
            f"{needing} (no batch dim), which can follow the kept tokens only if every sample "
            "keeps the same ones, but share_selection=False was asked for. Pass "
            "share_selection=None (the default) to share the selection where needed, or "
            "register an adapter that makes these tables per-sample."
        )
    plan.shared_selection = share


def _share_where_needed(traced, info: StreamInfo, plan: RoutePlan, share: bool | None) -> list:
    """Keep one token subset for the whole batch where the route needs it (refused when
    ``share_selection=False`` was asked for): where routed blocks build token tables inside
    (traced through, see ``tread_fx/passes/plan/inline_tables.py``; these blocks are returned),
    and where the stream folds frames or positions into its batch dim (blocks that mix the
    folded sequences then see the same tokens in every row)."""
    route = plan.route
    found, known = find_token_tables(traced.gm, info.blocks[route.start : route.end], plan.layout)
    check_no_token_tables_inside(traced.gm, info, route, known)
    if found and share is False:
        raise SideInputError(
            f"route ({route.start}, {route.end}) runs blocks that build token tables "
            f"inside ({found[0].describe()}); the tables have no batch dim, so they can "
            "follow the kept tokens only if every sample keeps the same ones, but "
            "share_selection=False was asked for. Pass share_selection=None (the "
            "default), or choose a route without these blocks."
        )
    if info.layout.folded != 1 and share is False:
        raise SelectionError(
            f"route ({route.start}, {route.end}) routes a stream whose dim 0 folds "
            f"{info.layout.folded} sequences (frames or positions) of each sample into the batch "
            f"({info.layout.batch_size} rows), which must all keep the same tokens, but "
            "share_selection=False was asked for. Pass share_selection=None (the default)."
        )
    if found or info.layout.folded != 1:
        plan.shared_selection = True
    return found


def _inline(traced, plan: RoutePlan, idx, found: list[InlineBlock]) -> None:
    """Inline the blocks with token tables and list the cut tables among the route's
    entering values (so ``explain`` shows them)."""
    for block in found:
        before = set(traced.gm.graph.nodes)
        inline_token_tables(traced.gm, traced.wrapper, block, idx, plan.index)
        cut = [n for n in traced.gm.graph.nodes if n not in before and n.target is take_rows]
        for node in cut:
            reason = f"in-block token table: {block.describe()}"
            plan.entering.append(Crossing(node, take_rows, reason, list(node.users)))


def _focus_on(focus: dict, info: StreamInfo, route: Route) -> None:
    """Name the route and its first block as what the stage works on (for internal errors)."""
    block = info.blocks[route.start]
    module = focus["model"].get_submodule(block.path)
    focus.update(block=block.path, module=module, route=(route.start, route.end))


def _plan_and_rewrite(traced, info, config, index: int, route: Route, changes, how, focus):
    """Plan one route and rewrite the graph for it: ``(plan, kept ids node, inlined)``;
    ``how`` is ``(strategy, grid)``."""
    _focus_on(focus, info, route)
    if changes is not None:
        with stage("planning and rewriting", lambda: focus):
            return (*_plan_split(traced, info, config, index, route, changes, how), [])
    (strategy, grid), share = how, config.share_selection
    with stage("planning", lambda: focus):
        plan = plan_route(traced.gm, info, route, index, strategy, grid, config.strict)
        _apply_share_selection(plan, share)
        found = _share_where_needed(traced, info, plan, share)
    with stage("rewriting", lambda: focus):
        kept = rewrite_route(traced.gm, plan, strategy, config.reinsert, info.blocks[0].stream_in)
    if config.fp32_reentry and plan.end_block is not None:
        plan.end_block.node.meta["tread_fp32"] = True
    return plan, kept, found


def build(model: nn.Module, args: tuple, kwargs: dict, config: RoutingConfig) -> Built:
    """Trace ``model(*args, **kwargs)`` and rewrite it with the configured routes.

    Args:
        model: The (unmodified) model.
        args: Example positional arguments (real tensors).
        kwargs: Example keyword arguments.
        config: What to route.

    Returns:
        A :class:`Built` whose GraphModule takes the call's tensors followed by one noise
        tensor per route and returns the model's flat outputs followed by the kept ids, and
        the seconds each stage took.
    """
    with stage_clock() as seconds:
        built = _build(model, args, kwargs, config)
    built.stage_seconds = dict(seconds)
    return built


def _build(model: nn.Module, args: tuple, kwargs: dict, config: RoutingConfig) -> Built:
    focus: dict = {"model": model}
    list_paths = config.block_lists or resolve_block_lists(model, config.blocks)
    with stage("tracing", lambda: focus):
        traced = trace_call(model, args, kwargs, block_leaf_paths(model, list_paths))
    with stage("locating", lambda: focus):
        explicit = config.blocks is not None
        info = choose_stream(traced, model, list_paths, explicit, config.keep_prefix, config.stream)
        thin = None if explicit else thin_stack(traced, model, info, list_paths, config.keep_prefix)
    if info.choice is not None and info.choice.guessed:
        warn_at_caller(info.choice.message(), StreamChoiceWarning)
    if thin is not None:
        warn_at_caller(thin, ThinRouteWarning)
    routes = config.routes_for(info.depth)
    with stage("planning", lambda: focus):  # the selection for all routes
        splits = _split_routes(traced, info, routes, args, kwargs)
        if is_token_major(info.stream_meta.shape):  # whole dim-1 slices: rows of a grid
            grid, strategy = None, GRID_ROWS
        else:
            grid = _grid_for(model, config, info)
            strategy = _resolve_auto(traced, info, routes, config, grid, splits, focus)
    done = [
        _plan_and_rewrite(traced, info, config, i, route, splits.get(i), (strategy, grid), focus)
        for i, route in enumerate(routes)
    ]
    focus.pop("route", None)
    with stage("rewriting", lambda: focus):
        for plan, kept, found in done:
            _inline(traced, plan, kept, found)
        drop_examples(traced.gm)
        num_outputs = append_route_outputs(traced.gm, [kept for _, kept, _ in done])
    return Built(traced, info, routes, [plan for plan, _, _ in done], num_outputs, strategy.name)
