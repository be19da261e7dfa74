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
from tread_fx.module_state import attributes_kept, random_state_kept
from tread_fx.passes.locate.batch_dim import UNTOLD, untold_warning
from tread_fx.passes.locate.choice import choose_stream, thin_stack
from tread_fx.passes.locate.dataflow import fed_by
from tread_fx.passes.locate.dims import GRID_ROWS, is_token_major
from tread_fx.passes.locate.layout import check_no_token_tables_inside, grid_in_block_arguments
from tread_fx.passes.locate.stacks import block_leaf_paths, resolve_block_lists
from tread_fx.passes.locate.stream import StreamInfo
from tread_fx.passes.plan.crossings import Crossing
from tread_fx.passes.plan.forms import (
    cut_at_route_ends,
    form_changes,
    locate_tokens,
    needs_split,
    refuse_interleaved,
)
from tread_fx.passes.plan.grid_uses import grid_by_use, grid_uses, inline_kept_grid, needs_inlining
from tread_fx.passes.plan.inline_tables import InlineBlock, find_token_tables, inline_token_tables
from tread_fx.passes.plan.route_plan import RoutePlan, graph_to_networkx, plan_route
from tread_fx.passes.rewrite.check import check_routed_graph
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
    #: Whether the check on fake tensors decided (else the first real call does).
    checked: bool = False

    @property
    def gm(self) -> fx.GraphModule:
        return self.traced.gm


def find_grid(model: nn.Module, num_tokens: int) -> tuple[int, int] | None:
    """Find the patch grid (H, W) with ``H * W == num_tokens`` among the model's attributes.

    The last resort of ``selection="rows"`` where no routed block reshapes its tokens to a
    grid (so the graph does not show it; :mod:`tread_fx.passes.plan.grid_uses` finds it by use
    first): ``model.grid_size``, any submodule's ``grid_size`` (timm's PatchEmbed), then
    diffusers-style ``height``/``width``/``patch_size``. A grid found here is reported.

    Example:
        >>> import tread_fx
        >>> find_grid(tread_fx.models.DiT_S_2(input_size=8, in_channels=1, depth=1), 16)
        (4, 4)
    """
    found = _grid_attribute(model, num_tokens)
    return found[0] if found is not None else None


def _grid_attribute(model: nn.Module, num_tokens: int) -> tuple[tuple[int, int], str] | None:
    """(grid, the attribute it was read from) for :func:`find_grid`."""
    candidates = list(model.named_modules())
    for path, module in candidates:
        grid = getattr(module, "grid_size", None)
        if isinstance(grid, (tuple, list)) and len(grid) == 2 and grid[0] * grid[1] == num_tokens:
            return (int(grid[0]), int(grid[1])), f"{path}.grid_size".lstrip(".")
    for path, module in candidates:
        with warnings.catch_warnings():  # diffusers warns on config attributes read directly
            warnings.simplefilter("ignore", FutureWarning)
            h, w, p = (getattr(module, k, None) for k in ("height", "width", "patch_size"))
        where = f"{path}.height/width/patch_size".lstrip(".")
        if all(isinstance(v, int) for v in (h, w, p)) and (h // p) * (w // p) == num_tokens:
            return (h // p, w // p), where
        if all(isinstance(v, int) for v in (h, w, p)) and h * w == num_tokens:
            return (h, w), where  # diffusers' PatchEmbed stores height/width in patches
    return None


def _grid_for(model: nn.Module, config: RoutingConfig, info: StreamInfo, uses: list) -> tuple:
    """The patch grid: ``grid=``, else the one the routed blocks reshape their tokens to
    (``uses``), else the one they are told as numbers, else (reported) a model attribute."""
    layout, routable = info.layout, info.layout.routable
    if config.grid is not None and math.prod(config.grid) != routable:
        suffix = f", minus {layout.suffix} suffix" if layout.suffix else ""
        raise SelectionError(
            f"grid={config.grid} was given, but the token stream has {routable} routable "
            f"tokens ({layout.num_tokens} minus {layout.prefix} prefix{suffix}); H * W must "
            "equal that (F * H * W for a video grid)."
        )
    grid = grid_by_use(uses, config.grid) or grid_in_block_arguments(info, routable)
    if grid is None and config.strategy.needs_grid:
        grid = _reported_attribute_grid(model, config, routable)
    return grid


def _reported_attribute_grid(model: nn.Module, config: RoutingConfig, routable: int) -> tuple:
    """The grid read from a model attribute (no block shows it), with a warning saying so."""
    found = _grid_attribute(model, routable)
    if found is None:
        raise SelectionError(
            f"selection={config.selection!r} needs the patch grid, but no routed block of "
            f"{type(model).__name__} reshapes its tokens into H x W == {routable} (nor is told "
            "such a grid as numbers, nor has the model a grid attribute); pass grid=(H, W) to "
            "route()."
        )
    grid, where = found
    warn_at_caller(
        f"selection={config.selection!r} keeps whole rows of the patch grid {grid}, read from "
        f"the attribute '{where}' of {type(model).__name__}: no routed block reshapes its "
        "tokens to a grid, so the graph does not show it. Pass grid=(H, W) to route() to "
        "choose it yourself."
    )
    return grid


def _split_routes(traced, info: StreamInfo, routes: list[Route], args, kwargs) -> dict:
    """Routes that cross a change of the stream's form, with where their tokens land."""
    g = graph_to_networkx(traced.gm.graph)
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    refuse_interleaved(traced.gm, info, tensors)
    splits = {}
    for i, route in enumerate(routes):
        _refuse_restart(info, route)
        cut_at_route_ends(g, info, route)
        changes = form_changes(g, info, route)
        if needs_split(g, info, route, changes):
            splits[i] = locate_tokens(traced.gm, info, route, changes, tensors)
            info.form_cuts.update(changes)
    return splits


def _refuse_restart(info: StreamInfo, route: Route) -> None:
    """A route carries one token stream: a block inside it whose stream does not come from
    the block before it (DDT's decoder blocks take a new stream after the encoder's) starts
    another, and the tokens the route skipped have no value in it. A route ending at such a
    block ends at the outputs of the block before it."""
    if route.end < info.depth and _restarts(info, route.end):
        info.form_cuts.add(route.end)  # the route ends at its last block's outputs
    for j in range(route.start + 1, route.end):
        if _restarts(info, j):
            block = info.blocks[j]
            raise TokenStreamError(
                f"route ({route.start}, {route.end}) crosses block {j} ({block.path}), whose "
                f"token stream does not come from block {j - 1}: route each stream apart.\n"
                f"A new stream starts at block {j} ({block.stream_in.name}), so the tokens the "
                f"route skipped would be written back into another stream. Use routes that "
                f"end at block {j} or start there, e.g. routes=[({route.start}, {j}), "
                f"({j}, {route.end})]."
            )


def _restarts(info: StreamInfo, index: int) -> bool:
    """Whether block ``index`` takes a stream not computed from the block before it."""
    return not fed_by(info.blocks[index].stream_in, info.blocks[index - 1].stream_out)


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


def _resolve_auto(traced, info: StreamInfo, routes: list[Route], config, grid, splits, focus, uses):
    """The strategy to use: ``selection="auto"`` becomes ``"random"``, or ``"rows"`` when a
    routed block reshapes its tokens to the patch grid (``uses``, or told it as numbers:
    random tokens make no grid). A selection asked for that makes no grid is refused there."""
    if config.strategy.name != "auto":
        _refuse_gridless(config.strategy, uses)
        return config.strategy
    if grid is not None and uses:
        return get_strategy("rows")
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


def _refuse_gridless(strategy, uses: list) -> None:
    """Refuse a selection without rows for blocks that reshape their tokens to a grid with
    numbers they hold themselves and none read from the tokens (so no other count fits; those
    told the grid as arguments are refused when planned)."""
    own = [u for u in uses if "literal" in u.sources and "data" not in u.sources]
    if own and not strategy.needs_grid:
        raise SelectionError(
            f"{own[0].describe()}, so it cannot run on a random subset of its tokens, but "
            f"selection={strategy.name!r} was asked for; use selection='rows' (or the default "
            "'auto'), which keeps whole rows and gives the blocks the kept grid."
        )


def _kept_grid_blocks(traced, info: StreamInfo, plan: RoutePlan, found: list) -> list:
    """Routed blocks to inline with the kept grid in place of grid numbers they hold
    themselves (``tread_fx/passes/plan/grid_uses.py``); refuses those told a count too (an
    inlined block keeps the traced numbers)."""
    route = plan.route
    uses = grid_uses(traced.gm, info, info.blocks[route.start : route.end], decided=True)
    grid, keep = plan.layout.grid, plan.keep_units
    counted = {node for node, _, _ in plan.count_args}
    for use in needs_inlining(uses, grid, keep) if grid is not None else ():
        if use.block.node in counted:
            raise SelectionError(
                f"{use.describe()} and is told a token count as a number; tread_fx cannot "
                "inline it with both changed. Pass blocks= to route other blocks."
            )
    return inline_kept_grid(traced.gm, uses, grid, keep, found) if grid is not None else []


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
        if strategy.needs_grid:
            found += _kept_grid_blocks(traced, info, plan, found)
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

    Raises:
        RouteCheckError: the routed graph fails on fake tensors where the model runs.
    """
    with stage_clock() as seconds, attributes_kept(model, only_traced=True):
        built = _build(model, args, kwargs, config)
        with stage("checking", lambda: {"model": model}), random_state_kept([]):
            built.checked = check_routed_graph(built, model, args, kwargs)
    built.stage_seconds = dict(seconds)
    return built


def _routed_blocks(info: StreamInfo, routes: list[Route]) -> list:
    indices = sorted({i for route in routes for i in range(route.start, route.end)})
    return [info.blocks[i] for i in indices]


def _build(model: nn.Module, args: tuple, kwargs: dict, config: RoutingConfig) -> Built:
    focus: dict = {"model": model}
    list_paths = config.block_lists or resolve_block_lists(model, config.blocks)
    with stage("tracing", lambda: focus):
        traced = trace_call(model, args, kwargs, block_leaf_paths(model, list_paths))
    with stage("locating", lambda: focus):
        explicit = config.blocks is not None
        prefix, batch_dim = config.keep_prefix, config.batch_dim
        info = choose_stream(traced, model, list_paths, explicit, prefix, config.stream, batch_dim)
        thin = None if explicit else thin_stack(traced, model, info, list_paths, prefix, batch_dim)
    if info.choice is not None and info.choice.guessed:
        warn_at_caller(info.choice.message(), StreamChoiceWarning)
    if info.batch_reason == UNTOLD:
        warn_at_caller(
            untold_warning(info.blocks[0].path, info.stream_meta.shape), StreamChoiceWarning
        )
    if thin is not None:
        warn_at_caller(thin, ThinRouteWarning)
    routes = config.routes_for(info.depth)
    with stage("planning", lambda: focus):  # the selection for all routes
        splits = _split_routes(traced, info, routes, args, kwargs)
        if is_token_major(info.stream_meta.shape):  # whole dim-1 slices: rows of a grid
            grid, strategy = None, GRID_ROWS
        else:
            routed = _routed_blocks(info, routes)
            uses = grid_uses(traced.gm, info, routed, decided=config.grid is not None)
            grid = _grid_for(model, config, info, uses)
            strategy = _resolve_auto(traced, info, routes, config, grid, splits, focus, uses)
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
