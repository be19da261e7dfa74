"""``tread_fx.explain``: see exactly what routing does to a model, without touching it.

It runs the same passes as ``route()`` (trace -> locate -> plan -> rewrite) on example inputs
and gathers what they did into an :class:`~tread_fx.inspection.report.Explanation` (stacks,
stream, boundary values, inserted nodes, tokens and FLOPs per block, graph diff, guards).

Example:
    >>> import torch, tread_fx
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> report = tread_fx.explain(model, routes=[(1, 3)], rate=0.5)
    >>> [(b.tokens_original, b.tokens_routed) for b in report.blocks]
    [(16, 16), (16, 8), (16, 8), (16, 16)]
    >>> report.flops.speedup > 1
    True
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.api import routing_config, split_example
from tread_fx.config import RoutingConfig, options_of, resolve_config
from tread_fx.errors import SideInputError
from tread_fx.inspection.flops import block_nodes, fake_shapes, module_arg_index, profile_graph
from tread_fx.inspection.graphdiff import diff_graphs, module_path, shape_of, target_name
from tread_fx.inspection.guards import (
    Guard,
    input_names,
    recording_specialisations,
    signature_guards,
    specialisation_guards,
)
from tread_fx.inspection.inputs import example_inputs as make_example_inputs
from tread_fx.inspection.records import (
    BlockReport,
    FlopReport,
    InsertedNode,
    RouteReport,
    SideInput,
)
from tread_fx.inspection.report import Explanation
from tread_fx.module_state import check_call
from tread_fx.passes.locate.dataflow import argument_name, input_slots
from tread_fx.passes.locate.dims import token_major_unit
from tread_fx.passes.locate.stacks import block_leaf_paths, candidate_stacks
from tread_fx.passes.locate.stream import BlockCall
from tread_fx.passes.plan.crossings import Crossing
from tread_fx.passes.rewrite.check import refusal_on_real_values
from tread_fx.passes.rewrite.insert import Reinsert
from tread_fx.passes.trace.tracer import trace_call
from tread_fx.pipeline import Built, build
from tread_fx.stages import stage

__all__ = ["explain", "Explanation", "RouteReport", "BlockReport", "SideInput", "FlopReport"]


# -- building blocks ------------------------------------------------------------------------


def _build(model: nn.Module, args: tuple, kwargs: dict, config: RoutingConfig) -> tuple:
    """Build strictly; on a strict refusal, build leniently and note what was refused."""
    check_call(model, args, kwargs)
    try:
        return build(model, args, kwargs, config), None
    except SideInputError as err:
        if not config.strict:
            raise
        refusal = str(err)
    lenient = dataclasses.replace(config, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(model, args, kwargs, lenient), refusal


def _slot_names(block_node: fx.Node, module: nn.Module | None, value: fx.Node) -> list[str]:
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    names = []
    for key, arg in input_slots(block_node).items():
        inserted = arg.meta.get("tread_role") and value in arg.all_input_nodes
        if arg is not value and not inserted:
            continue
        if key[0] == "kwarg":
            names.append(str(key[1]))
        else:
            i = key[1]
            names.append(params[i] if i < len(params) else f"arg{i}")
    return names


def _treatment(crossing: Crossing, direction: str) -> str:
    if crossing.reason == "non-strict guess":
        return "refused"
    action = crossing.action
    if callable(action):
        return f"adapted ({getattr(action, '__name__', 'fn')})"
    if direction == "out":
        return "scattered back" if action == "scatter" else "passed through"
    return "gathered" if action == "gather" else "passed through"


def _side_inputs(built: Built, plan: Any, names: dict[str, str], shapes: dict) -> list[SideInput]:
    gm = built.gm
    blocks = {b.node: b for b in built.info.blocks}
    out = []
    for direction, crossings in (("in", plan.entering), ("out", plan.leaving)):
        for c in crossings:
            received = []
            for user in c.users:
                if user in blocks:
                    module = gm.get_submodule(user.target) if user.op == "call_module" else None
                    received += _slot_names(user, module, c.node)
            node = c.node
            source = names.get(node.name) or target_name(node)
            where = module_path(node)
            out.append(
                SideInput(
                    node.name,
                    direction,
                    shape_of(node, shapes),
                    f"{source} (in {where})" if where and where != source else source,
                    sorted(set(received)),
                    _treatment(c, direction),
                    c.reason,
                )
            )
    return out


def _inserted(gm: fx.GraphModule, index: int, shapes: dict) -> list[InsertedNode]:
    return [
        InsertedNode(
            n.name,
            n.meta["tread_role"],
            target_name(n),
            shape_of(n, shapes),
            [a.name for a in n.all_input_nodes],
        )
        for n in gm.graph.nodes
        if n.meta.get("tread_role") and n.meta.get("tread_route") == index
    ]


def _block_node(gm: fx.GraphModule, path: str) -> fx.Node:
    return next(n for n, p in block_nodes(gm, [path]).items() if p == path)


def _stream_tokens(gm: fx.GraphModule, block: BlockCall, shapes: dict, token_dim: int) -> int:
    node = _block_node(gm, block.path)
    slot = block.in_slot
    index = module_arg_index(node)  # checkpoint(module, *args), call_in_fp32(module, *args)
    if index is not None and slot[0] == "arg":
        slot = ("arg", slot[1] + index + 1, *slot[2:])
    value = input_slots(node).get(slot)
    shape = shapes.get(value.name) if value is not None else None
    return shape[token_dim] if isinstance(shape, tuple) and len(shape) > token_dim else -1


def _blocks(model, built, original, shapes, profiles) -> list[BlockReport]:
    info = built.info
    route_of = {i: p for p in built.plans for i in range(p.route.start, p.route.end)}
    called = set(block_nodes(built.gm, [b.path for b in info.blocks]).values())
    routed_costs = iter(profiles[1].blocks if profiles is not None else ())
    reports = []
    for i, block in enumerate(info.blocks):
        inlined = block.path not in called  # traced through: its token tables are cut
        report = BlockReport(
            i,
            block.path,
            type(model.get_submodule(block.path)).__name__,
            route_of[i].index if i in route_of else None,
            _stream_tokens(original.gm, block, shapes[0], info.layout.token_dim),
            route_of[i].kept_tokens
            if inlined
            else _stream_tokens(built.gm, block, shapes[1], info.layout.token_dim),
            node_original=_block_node(original.gm, block.path).name,
            node_routed="(inlined)" if inlined else _block_node(built.gm, block.path).name,
        )
        if profiles is not None and not inlined:  # inlined blocks count outside the blocks
            report.original, report.routed = profiles[0].blocks[i], next(routed_costs)
        reports.append(report)
    return reports


def _stacks(model: nn.Module, built: Built) -> tuple[list[dict], list[str]]:
    stacks = []
    for path in built.info.list_paths:
        members = [b for b in built.info.blocks if b.list_path == path]
        classes = sorted({type(model.get_submodule(b.path)).__name__ for b in members})
        stacks.append({"path": path, "class": ", ".join(classes), "count": len(members)})
    others = [p for p in candidate_stacks(model) if p not in built.info.list_paths]
    return stacks, others


def _stream(built: Built) -> dict[str, Any]:
    info = built.info
    meta = info.stream_meta
    grid = built.plans[0].layout.grid if built.plans else None
    return {
        "shape": list(meta.shape),
        "dtype": str(meta.dtype).replace("torch.", ""),
        "batch_dim": info.layout.batch_dim,
        "token_dim": info.layout.token_dim,
        "batch_reason": info.batch_reason,
        "num_tokens": info.layout.num_tokens,
        "prefix": info.layout.prefix,
        "suffix": info.layout.suffix,
        "grid": list(grid) if grid else None,
        "selection": built.selection,
        "unit": token_major_unit(meta.shape),
        "folded": info.layout.folded,
        "enters_at": info.blocks[0].path,
        "choice": _choice(info.choice),
    }


def _choice(choice: Any) -> dict[str, Any] | None:
    """How the routed stream was chosen (``tread_fx/passes/locate/choice.py``)."""
    if choice is None:
        return None
    data = {k: getattr(choice, k) for k in ("chosen", "reason", "candidates", "guessed")}
    return {**data, "candidates": list(choice.candidates), "option": f"stream={choice.option}"}


def _config(model: nn.Module, routes: Any, rate: float | None, options: dict) -> RoutingConfig:
    """What ``explain`` describes: a routed model's own routing where the call leaves
    ``routes``, ``rate`` or an option unset (at its default), else what the call asks for."""
    own = routing_config(model)
    if own is not None:
        routes = own.routes if routes is None else routes
        rate = own.rate if rate is None else rate
        defaults = {f.name: f.default for f in dataclasses.fields(RoutingConfig)}
        options = {
            name: getattr(own, name) if _unset(value, defaults[name]) else value
            for name, value in options.items()
        }
    return resolve_config(model, routes, 0.5 if rate is None else rate, **options)


def _unset(value: Any, default: Any) -> bool:
    return value is default or (isinstance(default, str) and value == default)


def explain(
    model: nn.Module,
    routes: Any = None,
    rate: float | None = None,
    example_inputs: Any = None,
    *,
    selection: str = "auto",
    blocks: Any = None,
    keep_prefix: int | None = None,
    strict: bool = True,
    grid: tuple[int, int] | None = None,
    reinsert: Reinsert | None = None,
    share_selection: bool | None = None,
    fp32_reentry: bool = False,
    stream: str | int | None = None,
    batch_dim: int | None = None,
    flops: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Explanation:
    """Explain what ``route(model, routes, rate, ...)`` would do; the model is not modified.

    On a routed model it explains the routing the model has: ``routes``, ``rate`` and every
    option left unset (at its default) are the ones ``route()`` was given.

    Args:
        model: The model (routed or not; its class ``forward`` is what gets traced).
        routes: Routes as for :func:`tread_fx.route`; ``None`` (default): a routed model's
            own, else the default route (:func:`tread_fx.routes.default_route`).
        rate: Fraction of tokens routed around; ``None`` (default): a routed model's own,
            else 0.5.
        example_inputs: ``args`` or ``(args, kwargs)`` of a training call; default: made by
            :func:`tread_fx.inspection.inputs.example_inputs` from the model's attributes.
        selection: ``"auto"`` (default), ``"random"`` or ``"rows"``, as for ``route()``.
        blocks: Block container path(s), as for ``route()``.
        keep_prefix: Leading tokens never routed (``None``: detect).
        strict: As for ``route()``; a strict refusal is reported (lenient graph shown).
        grid: Patch grid for ``selection="rows"``.
        reinsert: How routed-around tokens re-enter.
        share_selection: As for ``route()`` (share one selection across the batch).
        fp32_reentry: As for ``route()`` (the block after each route runs in float32).
        stream: As for ``route()`` (the forward argument whose tokens are routed).
        batch_dim: As for ``route()`` (the token stream's batch dim; ``None``: the blocks tell).
        flops: Count ATen ops and FLOPs (``make_fx`` on fake tensors); ``False`` is faster.
        progress: Called with a short line before each stage (tracing, planning, FLOP
            counting); the ``tread-fx`` command prints them to stderr.

    Returns:
        An :class:`Explanation`; ``print()`` it for the report, ``.to_json()`` for tools.

    Example:
        >>> import tread_fx
        >>> m = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
        >>> print(tread_fx.explain(m, [(1, 3)], flops=False).routes[0].kept_tokens)
        8
        >>> r = tread_fx.explain(tread_fx.route(m, rate=0.25), flops=False).routes[0]
        >>> (r.start, r.end, r.rate, r.kept_tokens)    # the routing m has: the default route
        (1, 3, 0.25, 12)
    """
    config = _config(model, routes, rate, options_of(locals()))
    if example_inputs is None:
        example_inputs = make_example_inputs(model)
    args, kwargs = split_example(example_inputs)
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    say = progress or (lambda _line: None)
    try:
        say("tracing the routed call and planning the routes (one real forward)")
        built, refusal = _build(model, args, kwargs, config)
        if not built.checked:
            say("running the routed graph once (fake tensors could not check it)")
            _check_on_real_values(built, args, kwargs)
        say("tracing the original graph (one more real forward)")
        leaves = block_leaf_paths(model, built.info.list_paths)
        with recording_specialisations() as records, stage("tracing", lambda: {"model": model}):
            original = trace_call(model, args, kwargs, leaves)
        guards = signature_guards(model, args, kwargs)
        names = _placeholder_names(model, args, kwargs, original)
        guards += specialisation_guards(list(records), names) + _route_guards(built)
        found = (built, original, refusal)
        say("counting ATen ops and FLOPs of both graphs" if flops else "diffing the graphs")
        return _assemble(model, (args, kwargs), found, guards, names, config, flops)
    finally:
        for module, mode in modes:
            module.training = mode


def _check_on_real_values(built: Built, args: tuple, kwargs: dict) -> None:
    """Run the routed graph once on the example's values; refuse as the first call would."""
    flat = pytree.tree_leaves((args, kwargs))
    tensors = [flat[i] for i in built.traced.tensor_positions]
    draws = torch.Generator().manual_seed(0)  # the user's random state is left alone
    noises = [torch.rand(p.layout.batch_size, p.units, generator=draws) for p in built.plans]
    refusal = refusal_on_real_values(built, tensors, noises)
    if refusal is not None:
        raise refusal


def _route_guards(built: Built) -> list[Guard]:
    """The tokens each route keeps, and the block ints it rewrites: only those that size the
    stream's token dim (``tread_fx/passes/plan/uses.py``); any other int stays."""
    gm = built.gm
    keeps = [
        Guard("route", f"route {p.index} keeps", f"{p.kept_tokens} of {p.layout.num_tokens} tokens")
        for p in built.plans
    ]
    return keeps + [
        Guard(
            "route",
            f"route {p.index} tells {node.target.removeprefix('model.')} "
            f"'{argument_name(gm.get_submodule(node.target), slot)}'",
            f"{count} (a token count: it sizes the tokens in the block)",
        )
        for p in built.plans
        for node, slot, count in p.count_args
    ]


def _placeholder_names(model, args, kwargs, traced) -> dict[str, str]:
    """Map the trace's placeholders (``t0``, ``t1``, ...) to the forward's argument names."""
    names = input_names(model, args, kwargs)
    if len(names) != len(pytree.tree_leaves((args, kwargs))):
        return {}
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    return {p.name: names[pos] for p, pos in zip(placeholders, traced.tensor_positions)}


def _try_profiles(original, routed, tensors, noise, paths) -> tuple | None:
    """FLOP profiles of both graphs; a failure is reported and the rest of the report kept."""
    costs: dict = {}
    try:
        return (
            profile_graph(original, tensors, paths, costs),
            profile_graph(routed, tensors + noise, paths, costs),
        )
    except Exception as err:  # noqa: BLE001 - inspection never fails the whole report
        where = getattr(err, "__notes__", None) or [""]
        warnings.warn(
            f"explain: FLOP counting failed ({type(err).__name__}: {str(err).splitlines()[0]}"
            f"{' ' + where[0] if where[0] else ''}); the report shows no FLOPs. Pass "
            "flops=False to skip counting.",
            stacklevel=3,
        )
        return None


def _assemble(model, call, found, guards, names, config, flops) -> Explanation:
    built, original, refusal = found
    flat = pytree.tree_leaves(call)
    tensors = [flat[i] for i in original.tensor_positions]
    noise = [torch.zeros(p.layout.batch_size, p.units) for p in built.plans]  # shapes only
    paths = [b.path for b in built.info.blocks]
    profiles = _try_profiles(original.gm, built.gm, tensors, noise, paths) if flops else None
    flop_report = None
    if profiles is not None:
        before, after = profiles
        shapes = (before.shapes, after.shapes)
        flop_report = FlopReport(before.total, after.total, before.outside, after.outside)
    else:
        shapes = (
            fake_shapes(original.gm, tensors, paths),
            fake_shapes(built.gm, tensors + noise, paths),
        )
    alive = set(built.gm.graph.nodes)
    routes = [
        RouteReport(
            p.index,
            p.route.start,
            p.route.end,
            p.route.rate,
            p.layout.num_tokens,
            p.kept_tokens,
            p.layout.prefix,
            p.layout.suffix,
            p.units,
            p.keep_units,
            _inserted(built.gm, p.index, shapes[1]),
            _side_inputs(built, p, names, shapes[1]),
            sorted(n.name for n in p.region if n in alive),
        )
        for p in built.plans
    ]
    stacks, candidates = _stacks(model, built)
    return Explanation(
        model=type(model).__name__,
        stacks=stacks,
        candidates=candidates,
        stream=_stream(built),
        routes=routes,
        blocks=_blocks(model, built, original, shapes, profiles),
        flops=flop_report,
        guards=guards,
        auto_leaves=dict(original.auto_leaves),
        diff=diff_graphs(original.gm.graph, built.gm.graph, shapes[0], shapes[1]),
        refusal=refusal,
        original_graph=original.gm,
        routed_graph=built.gm,
        profiles=profiles,
        input_names=names,
        config=config,
    )
