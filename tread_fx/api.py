"""``route()`` / ``unroute()``: TREAD token routing, in place, for training only.

A routed model runs its routed graph in training mode and its original forward in eval mode;
:func:`route_info` tells what the last routed call kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.config import RoutingConfig, options_of, resolve_config
from tread_fx.errors import (
    AlreadyRoutedError,
    InvalidRateError,
    NotRoutedError,
    RoutedGraphError,
    TreadFxError,
    with_article,
)
from tread_fx.module_state import (
    WRAPPER_ATTRIBUTES,
    ModuleModes,
    call_signature,
    check_call,
    check_class_forward,
    check_unwrapped,
    traced_through,
    unwrap,
    wrapper_attributes,
)
from tread_fx.passes.rewrite.check import refusal_on_real_values
from tread_fx.passes.rewrite.insert import Reinsert
from tread_fx.passes.trace.support import dynamo_wrappers_run_original, has_call_hooks
from tread_fx.passes.trace.tracer import MODEL_PREFIX
from tread_fx.pipeline import Built, build
from tread_fx.routes import Route
from tread_fx.runtime.guards import GUARD_MARK
from tread_fx.runtime.noise import NoiseSource
from tread_fx.runtime.ops import routed_mask

__all__ = [
    "route",
    "unroute",
    "route_info",
    "is_routed",
    "routed_graphs",
    "routing_config",
    "RouteInfo",
    "check_call",
    "split_example",
    "unwrap",
]

_STATE = "_tread_fx"
_MAX_TRACES = 8


@dataclass
class RouteInfo:
    """What one route did in the last routed training call.

    Attributes:
        route: The resolved route (start, end, rate).
        kept: Kept token ids [B, k], ascending (prefix and suffix tokens included).
        num_tokens: Token count N of the stream at the route start.
        prefix: Leading tokens never routed (cls/registers).
        grid: Patch grid (H, W), or (F, H, W) for video, of the routable tokens: the one the
            route used (``grid=``, the blocks' reshapes, rows selection); else ``None``.
        selection: The selection used (``"auto"`` resolved to ``"random"`` or ``"rows"``).
        suffix: Trailing tokens never routed (a text stream concatenated behind the image).
    """

    route: Route
    kept: torch.Tensor
    num_tokens: int
    prefix: int
    grid: tuple[int, ...] | None
    selection: str = "random"
    suffix: int = 0

    @property
    def routed_mask(self) -> torch.Tensor:
        """Bool [B, N]: True for tokens routed around the blocks."""
        return routed_mask(self.kept, self.num_tokens)


@dataclass
class _Entry:
    built: Built
    fn: Callable
    noise_shapes: list[tuple[int, ...]]
    inlined: tuple[nn.Module, ...] = ()
    checked: bool = False


@dataclass(eq=False, repr=False)
class _RoutingState:
    """Per-model routing state, kept in ``model.__dict__`` (not a submodule or buffer)."""

    config: RoutingConfig
    seed: int | None
    compile: bool | dict
    routing_probability: float = 1.0
    forced: RoutingConfig | None = None

    def __post_init__(self) -> None:
        self.noise = NoiseSource(self.seed)
        self._clear_cache()

    def _clear_cache(self) -> None:
        self.entries: OrderedDict[Any, _Entry] = OrderedDict()
        self.last_info: list[RouteInfo] | None = None
        self.modules = ModuleModes()

    def __getstate__(self) -> dict[str, Any]:
        """What pickles (``torch.save(model)``, ``copy.deepcopy``): the routing settings and the
        selection generators' states; traced graphs are dropped and traced again lazily."""
        keep = ("config", "seed", "compile", "routing_probability", "forced", "noise")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._clear_cache()

    def _route_this_step(self) -> bool:
        if self.routing_probability >= 1.0:
            return True
        return float(self.noise.draw([()], torch.device("cpu"))[0]) < self.routing_probability

    # -- calls ------------------------------------------------------------------------------
    def call(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        config = self.forced or self.config
        if self.forced is None and not self._route_this_step():
            self.last_info = None  # an unrouted step
            return type(model).forward(model, *args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        key, entry = self.entry_for(model, args, kwargs, config, (flat, spec))
        tensors = [flat[i] for i in entry.built.traced.tensor_positions]
        device = tensors[0].device if tensors else torch.device("cpu")
        noises = self.noise.draw(entry.noise_shapes, device)
        try:
            out = self._run(entry, tensors, noises)
        except _TracedValueChanged as changed:
            if self.compile:
                raise RoutedGraphError(
                    f"a value the model's forward reads from tensor data changed{changed} "
                    "(this call's inputs differ from the traced ones there). A compiled routed "
                    "graph cannot trace again by itself: call route(..., compile=False), or "
                    "keep that value fixed across training calls."
                ) from changed
            entry = self._build(model, args, kwargs, config)
            self._store(model, key, entry, (flat, spec))
            out = self._run(entry, tensors, noises)  # traced again for these inputs
        n = entry.built.num_model_outputs
        self.last_info = [
            RouteInfo(
                plan.route,
                kept,
                plan.layout.num_tokens,
                plan.layout.prefix,
                plan.layout.grid,
                entry.built.selection,
                plan.layout.suffix,
            )
            for plan, kept in zip(entry.built.plans, out[n:])
        ]
        return pytree.tree_unflatten(list(out[:n]), entry.built.traced.out_spec)

    def entry_for(
        self, model: nn.Module, args: tuple, kwargs: dict, config: RoutingConfig, flat_spec: tuple
    ) -> tuple[Any, _Entry]:
        """The cache key and routed graph of this call's signature, built if not cached yet."""
        flat, spec = flat_spec
        hooks_added = self.modules.hooks_changed()
        signature = call_signature(spec, flat, self.modules.modes(model, hooks_added))
        key = (signature, None if config is self.config else repr(config))
        entry = self.entries.get(key)
        if entry is not None and hooks_added and any(has_call_hooks(m) for m in entry.inlined):
            entry = None  # hooks came after the trace (fully_shard): trace again, calling it
        if entry is None:
            entry = self._build(model, args, kwargs, config)
            key = self._store(model, key, entry, flat_spec)
            while len(self.entries) > _MAX_TRACES:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return key, entry

    def _store(self, model: nn.Module, key: tuple, entry: _Entry, flat_spec: tuple) -> tuple:
        """Cache ``entry``; its key (returned) is taken again when the trace went through new
        modules: calls are keyed on the modes of those only (the graph calls the others, which
        read their own mode), so fewer flags are in the key from now on."""
        called = [n.target for n in entry.built.gm.graph.nodes if n.op == "call_module"]
        paths = [c[len(MODEL_PREFIX) :] for c in called if c.startswith(MODEL_PREFIX)]
        if self.modules.watch(model, traced_through(model, paths)):
            flat, spec = flat_spec
            key = (call_signature(spec, flat, self.modules.modes(model)), key[1])
        self.entries[key] = entry
        return key

    def _run(self, entry: _Entry, tensors: list, noises: list) -> tuple:
        """Run the routed graph; uncompiled, code the model compiles itself runs its original
        Python (``tread_fx/passes/trace/support.py``), as it was traced."""
        args = (entry.built.traced.wrapper, *tensors, *noises)
        try:
            if self.compile or torch.compiler.is_compiling():  # dynamo traces the originals
                out = entry.fn(*args)
            else:
                with dynamo_wrappers_run_original():
                    out = entry.fn(*args)
        except TreadFxError:
            raise
        except Exception as err:
            if GUARD_MARK in str(err):
                raise _TracedValueChanged(str(err).split(GUARD_MARK)[-1]) from err
            if entry.checked:
                raise
            refusal = refusal_on_real_values(entry.built, tensors, noises)
            if refusal is not None:  # the node, the block and the line that fail
                raise refusal from err
            raise RoutedGraphError(
                f"the routed graph failed on its first call with {type(err).__name__}; a block "
                "probably needs the full token count: try selection='rows' or another route.\n"
                f"({type(err).__name__}: {err}) The original forward traced fine. A block or "
                "the code between blocks probably depends on the token count (e.g. a fixed "
                "reshape); use "
                "selection='rows' for grid-shaped blocks, a route that avoids that code, or "
                "tread_fx.explain(...) to see the rewritten graph."
            ) from err
        entry.checked = True
        return out

    @torch.compiler.disable(
        reason="tread_fx traces the model for a call signature it has not seen; under "
        "torch.compile(fullgraph=True) run one training call before compiling (or pass "
        "route(..., example_inputs=...)) for every input signature, e.g. a smaller last batch"
    )
    def _build(self, model: nn.Module, args: tuple, kwargs: dict, config: RoutingConfig) -> _Entry:
        check_call(model, args, kwargs)
        with dynamo_wrappers_run_original():  # a real call while tracing: no compile
            built = build(model, args, kwargs, config)
        fn = type(built.gm).forward
        if self.compile:
            options = self.compile if isinstance(self.compile, dict) else {}
            fn = torch.compile(fn, **{"fullgraph": True, "dynamic": False, **options})
        noise_shapes = [(p.layout.batch_size, p.units) for p in built.plans]
        return _Entry(built, fn, noise_shapes, _inlined_modules(model, built.gm))


def _inlined_modules(model: nn.Module, gm: torch.fx.GraphModule) -> tuple[nn.Module, ...]:
    """Submodules without hooks whose code the graph holds inlined (or never calls): should one
    gain hooks (``fully_shard``), the graph would skip them, so the model is traced again."""
    called = [n.target + "." for n in gm.graph.nodes if n.op in ("call_module", "get_attr")]
    return tuple(
        module
        for path, module in model.named_modules()
        if path
        and not has_call_hooks(module)
        and not any(f"{MODEL_PREFIX}{path}.".startswith(c) for c in called)
    )


class _TracedValueChanged(Exception):
    """A runtime guard of the routed graph failed: re-trace (eager) or refuse (compiled)."""


def _prepare_for_compile(model: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
    """Build the routed graph of a compiled call's signature eagerly, before dynamo traces it.

    ``torch.compile(model)`` calls this with the call's real inputs (see
    :func:`~tread_fx.module_state.wrapper_attributes`), so ``fullgraph=True`` works from
    the first call and for every new signature (a smaller last batch).
    """
    state = model.__dict__[_STATE]
    config = state.forced or state.config
    if model.training or state.forced is not None:
        kwargs = kwargs or {}
        state.entry_for(model, args, kwargs, config, pytree.tree_flatten((args, kwargs)))


def _routed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = self.__dict__[_STATE]
    if not self.training and state.forced is None:
        return type(self).forward(self, *args, **kwargs)
    return state.call(self, args, kwargs)


class RoutedForward:
    """``model.forward`` of a routed model: a bound method that pickles with its model.

    Attributes:
        __self__: The routed model.
        __func__: The routed forward function (``__func__(model, *args)``), as on a bound method.
    """

    __slots__ = ("__self__",)
    __func__ = staticmethod(_routed_forward)
    __name__ = "forward"

    def __init__(self, model: nn.Module) -> None:
        self.__self__ = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _routed_forward(self.__self__, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return (RoutedForward, (self.__self__,))


def route(
    model: nn.Module,
    routes: Any = None,
    rate: float = 0.5,
    *,
    selection: str = "auto",
    blocks: str | Sequence[str] | nn.Module | None = None,
    keep_prefix: int | None = None,
    seed: int | None = None,
    compile: bool | dict = False,
    example_inputs: tuple | None = None,
    strict: bool = True,
    grid: tuple[int, ...] | None = None,
    reinsert: Reinsert | None = None,
    reroute: bool = False,
    share_selection: bool | None = None,
    fp32_reentry: bool = False,
    routing_probability: float = 1.0,
    stream: str | int | None = None,
    batch_dim: int | None = None,
) -> nn.Module:
    """Make ``model`` train with TREAD token routing, in place.

    In training mode the model runs a rewritten graph in which blocks ``start .. end-1`` of
    each route see only the kept tokens; in eval mode it runs its original forward. The model
    keeps its class, methods, parameters and state_dict keys.

    Args:
        model: The unwrapped model (route first, then wrap in DDP/FSDP/torch.compile).
        routes: ``(start, end)``, ``(start, end, rate)``, :class:`Route`, the authors' dict
            (inclusive ``end_layer_idx``), or a list of those. Half-open, negatives allowed.
            ``None`` (default): the paper's rule, start 2 and end ``depth - 4`` (DiT-XL/2:
            ``(2, 24)``), scaled down below 12 blocks (:func:`tread_fx.routes.default_route`,
            docs/options.md); ``route_info(model)[0].route`` shows the route chosen.
        rate: Fraction of tokens routed around (default 0.5, the paper's best).
        selection: ``"auto"`` (default: ``"random"``, or ``"rows"`` where a routed block
            reshapes its tokens to the patch grid), ``"random"`` (uniform tokens) or
            ``"rows"`` (whole patch-grid rows).
        blocks: Path(s) of the block container(s) when auto-detection should not decide.
        keep_prefix: Leading tokens never routed; ``None`` detects cls/register tokens.
        seed: Seed of a per-device generator for the selections (``None``: global RNG).
        compile: ``True`` (or ``torch.compile`` kwargs) to compile each routed graph.
        example_inputs: ``(args, kwargs)`` or ``args`` to trace now instead of lazily.
        strict: Refuse side values that look token-aligned but match no adapter.
        grid: Patch grid (H, W), or (F, H, W) for video, for ``selection="rows"`` when it
            cannot be discovered.
        reinsert: How routed-around tokens re-enter (default: unchanged, scatter).
        reroute: Allow routing an already routed model (replaces its routing).
        share_selection: ``None`` (default): every sample keeps its own tokens, except in
            routes that a batch-shared token table enters (a ``[T + N, d]`` RoPE table, an
            ``[N, N]`` mask), where one subset per step is shared by the whole batch.
            ``True``: always share. ``False``: never; such a route is refused.
        fp32_reentry: Run the first block after each route outside autocast, in float32
            (the authors' stability measure under bf16).
        routing_probability: Route on this fraction of training steps (drawn per call from
            the selection generator); the other steps run the original forward.
        stream: The forward argument whose tokens are routed, by name (``"x"``, else
            ``TokenStreamError``) or position. ``None`` (default): data flow decides, else a
            rule that warns (``StreamChoiceWarning``); docs/design.md "Which stream is routed".
        batch_dim: The token stream's batch dim, 0 (``[B, N, C]``) or 1 (``[N, B, C]``).
            ``None`` (default): what the blocks mix tells it (they mix tokens, never
            samples); where they do not, the route is refused and asks for this option.

    Returns:
        ``model`` itself.

    Example:
        >>> import tread_fx
        >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10)
        >>> tread_fx.route(model, routes=[(2, 8)], rate=0.5) is model
        True
        >>> other = tread_fx.route(tread_fx.models.DiT_S_2(input_size=8, depth=8))
        >>> [(r.start, r.end) for r in routing_config(other).resolved]  # the default rule
        [(1, 6)]
    """
    check_unwrapped(model)
    if is_routed(model):
        if not reroute:
            raise AlreadyRoutedError(
                f"{type(model).__name__} is already routed; call tread_fx.unroute(model) "
                "first, or pass reroute=True to replace its routing."
            )
        unroute(model)
    check_class_forward(model)
    config = resolve_config(model, routes, rate, **options_of(locals()))
    state = _RoutingState(config, seed, compile, _check_probability(routing_probability))
    if example_inputs is not None:
        args, kwargs = split_example(example_inputs)
        was_training = [m.training for m in model.modules()]
        model.train()
        state.entry_for(model, args, kwargs, state.config, pytree.tree_flatten((args, kwargs)))
        for m, mode in zip(model.modules(), was_training):
            m.training = mode
    model.__dict__[_STATE] = state
    model.__dict__["forward"] = RoutedForward(model)
    model.__dict__.update(wrapper_attributes(model, _prepare_for_compile))
    return model


def _check_probability(probability: object) -> float:
    ok = isinstance(probability, (int, float)) and not isinstance(probability, bool)
    if not ok or not 0.0 < float(probability) <= 1.0:
        raise InvalidRateError(
            f"routing_probability={probability!r} was given; it is the fraction of training "
            "steps that are routed and must be in (0, 1] (1 routes every step)."
        )
    return float(probability)


def split_example(example: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of example inputs given as ``(args, kwargs)``, ``args`` or one value.

    Example:
        >>> split_example(((1, 2), {"y": 3})), split_example([1, 2]), split_example(1)
        (((1, 2), {'y': 3}), ((1, 2), {}), ((1,), {}))
    """
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[1], dict):
        return tuple(example[0]), dict(example[1])
    return (tuple(example) if isinstance(example, (tuple, list)) else (example,)), {}


def is_routed(model: nn.Module) -> bool:
    """Whether ``route()`` was applied to ``model`` (and not undone) (through wrappers)."""
    return _STATE in getattr(unwrap(model), "__dict__", {})


def routing_config(model: nn.Module) -> RoutingConfig | None:
    """The :class:`RoutingConfig` ``route()`` gave ``model`` (wrappers looked through), or
    ``None`` when it is not routed; ``explain(model)`` describes it."""
    inner = unwrap(model)
    return inner.__dict__[_STATE].config if is_routed(inner) else None


def _state(model: nn.Module, what: str) -> _RoutingState:
    inner = unwrap(model)
    if not is_routed(inner):
        wrapped = "" if inner is model else f" (inside {with_article(type(model).__name__)})"
        raise NotRoutedError(
            f"{what}() was called on {with_article(type(inner).__name__)}{wrapped} that is not "
            "routed; call tread_fx.route(model) first."
        )
    return inner.__dict__[_STATE]


def unroute(model: nn.Module) -> nn.Module:
    """Undo ``route()``: the model is exactly as before (same forward, no extra state).

    Wrappers (DDP, FSDP, ``torch.compile``) are looked through; the argument is returned.

    Example:
        >>> import tread_fx
        >>> m = tread_fx.route(tread_fx.models.DiT_S_2(input_size=8, depth=4), [(1, 3)])
        >>> tread_fx.is_routed(tread_fx.unroute(m))
        False
    """
    _state(model, "unroute")
    inner = unwrap(model)
    for name in (_STATE, "forward", *WRAPPER_ATTRIBUTES):
        inner.__dict__.pop(name, None)
    return model


def route_info(model: nn.Module) -> list[RouteInfo] | None:
    """Per-route info of the last routed training call (``None`` before the first).

    Wrappers (DDP, DataParallel, FSDP, ``torch.compile``) are looked through.

    Example:
        >>> import torch, tread_fx
        >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
        >>> x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([3, 4])
        >>> _ = tread_fx.route(model, routes=[(1, 3)], rate=0.5).train()(x, t, y)
        >>> tread_fx.route_info(model)[0].kept.shape      # 16 tokens, 8 kept
        torch.Size([2, 8])
    """
    return _state(model, "route_info").last_info


def routed_graphs(model: nn.Module) -> list[Built]:
    """The pipeline results cached for a routed model, most recently used last."""
    return [entry.built for entry in _state(model, "routed_graphs").entries.values()]
