"""The last pass: run the routed graph on fake tensors before its first real call.

A plan that cannot run (a block handed the full token count, a table left at the full length,
a reshape to the whole grid) fails here, on fake copies of the call's tensors (shapes, dtypes
and devices only: no compute, no randomness drawn), and is refused naming the route, the node,
the module it calls and the model's line. What fake tensors cannot run (code that reads tensor
data, ops without a fake kernel) leaves the check undecided; the plain forward is then run on
fakes as well, and only a graph that fails where the plain forward runs is refused.

The model is left as it was: attributes a forward sets on its modules (caches, counters) while
the check runs are put back afterwards.

Example:
    >>> import torch, tread_fx
    >>> from tread_fx.config import resolve_config
    >>> from tread_fx.pipeline import build
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=4)
    >>> args = (torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2]))
    >>> built = build(model, args, {}, resolve_config(model, [(1, 3)], 0.5))
    >>> check_routed_graph(built, model, args, {})  # raises RouteCheckError if it cannot run
    True
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses import fake_tensor

from tread_fx.errors import RouteCheckError, shown
from tread_fx.module_state import attributes_kept
from tread_fx.passes.trace.support import dynamo_wrappers_run_original
from tread_fx.stages import model_frame, source_line

__all__ = ["check_routed_graph"]

#: What fake tensors cannot run; the check is undecided, never a refusal.
_FAKE_LIMITS = (
    fake_tensor.DataDependentOutputException,
    fake_tensor.DynamicOutputShapeException,
    fake_tensor.UnsupportedOperatorException,
    fake_tensor.UnsupportedFakeTensorException,
    NotImplementedError,
)


class _NodeRunner(fx.Interpreter):
    """Runs the graph node by node, remembers the node that raised, and runs a module once
    per class, configuration and input shapes (the blocks of a stack: one fake run each)."""

    def __init__(self, built: Any, reuse: bool = True) -> None:
        super().__init__(built.traced.wrapper, graph=built.gm.graph)
        self.failed: fx.Node | None = None
        self.outputs: dict[tuple, Any] | None = {} if reuse else None  # real values: no reuse

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception:
            self.failed = self.failed or n
            raise

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        module = self.fetch_attr(target)
        key = None if self.outputs is None else _call_key(module, args, kwargs)
        if key is None:
            return super().call_module(target, args, kwargs)
        if key not in self.outputs:
            self.outputs[key] = super().call_module(target, args, kwargs)
        return pytree.tree_map_only(torch.Tensor, _like, self.outputs[key])


def _like(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh fake of ``tensor``'s shape, strides and dtype, not a leaf where it needs
    gradients (the model may write into a block's output in place, ``x.add_(pos)``)."""
    return (
        tensor.clone()
        if tensor.requires_grad
        else torch.empty_strided(
            tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device
        )
    )


def _call_key(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """What decides a module call's output shapes: its class, its state's shapes, its plain
    attributes (ints, flags, strings), its inputs' shapes; ``None`` where something unhashable
    takes part."""
    state = [(n, t.shape, t.dtype) for n, t in module.state_dict(keep_vars=True).items()]
    plain = [
        (name, value)
        for name, value in vars(module).items()
        if isinstance(value, (int, float, bool, str, type(None)))
    ]
    inputs = pytree.tree_map_only(
        torch.Tensor, lambda t: (t.shape, t.stride(), t.dtype, t.device), (args, kwargs)
    )
    key = (
        type(module),
        tuple(state),
        tuple(plain),
        tuple(pytree.tree_flatten(inputs)[0]),
        pytree.tree_structure(inputs),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def check_routed_graph(built: Any, model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Run ``built``'s routed graph on fake copies of this call's tensors.

    Args:
        built: The pipeline's :class:`~tread_fx.pipeline.Built` for this call.
        model: The model (its plain forward decides a failure fake tensors may have caused).
        args: The call's positional arguments.
        kwargs: The call's keyword arguments.

    Returns:
        Whether the check decided (``False``: fake tensors could not run the model's code,
        and the first real call decides, :func:`refusal_on_real_values`).

    Raises:
        RouteCheckError: the routed graph fails where the model's own forward runs.
    """
    if not _plain_tensors(model):
        return False  # sharded (DTensor) or quantised weights: fakes cannot stand in for them
    flat = pytree.tree_leaves((args, kwargs))
    tensors = [flat[i] for i in built.traced.tensor_positions]
    noises = [torch.zeros(p.layout.batch_size, p.units) for p in built.plans]
    runner = _NodeRunner(built)
    try:
        _on_fakes(model, lambda: runner.run(*tensors, *noises))
    except Exception as err:  # noqa: BLE001 - each failure is judged below
        if isinstance(err, _FAKE_LIMITS) or _plain_forward_fails(model, args, kwargs):
            return False  # fake tensors cannot tell: the first real call decides
        raise _refusal(built, runner.failed, err) from err
    return True


def refusal_on_real_values(built: Any, tensors: list, noises: list) -> RouteCheckError | None:
    """Where the check on fake tensors could not decide, the first real call failed: run the
    routed graph again node by node on the same values (no gradients, the model's attributes
    put back) to name the route, the node and the line that fail. ``None`` if it runs."""
    runner = _NodeRunner(built, reuse=False)
    try:
        with attributes_kept(built.traced.wrapper), torch.no_grad(), dynamo_wrappers_run_original():
            runner.run(*tensors, *noises)
    except Exception as err:  # noqa: BLE001 - the failure is what is reported
        refusal = _refusal(built, runner.failed, err, checked="on the first call's values")
        refusal.__cause__ = err
        return refusal
    return None


def _plain_tensors(model: nn.Module) -> bool:
    """Whether every parameter and buffer is a plain tensor (no tensor subclass)."""
    plain = (torch.Tensor, nn.Parameter)
    return all(type(t) in plain for t in [*model.parameters(), *model.buffers()])


def _plain_forward_fails(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the model's own forward fails on fake copies of the call's tensors."""
    try:
        _on_fakes(model, lambda: type(model).forward(model, *args, **kwargs))
    except Exception:  # noqa: BLE001 - any failure means fakes cannot judge this model
        return True
    return False


def _on_fakes(model: nn.Module, call: Any) -> Any:
    """``call()`` in a fake tensor mode that fakes every real tensor it meets; the modules'
    attributes are put back afterwards (a forward that caches on itself caches fakes)."""
    fakes = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    with attributes_kept(model), dynamo_wrappers_run_original(), _quiet_fake_errors(), fakes:
        return call()


@contextlib.contextmanager
def _quiet_fake_errors() -> Iterator[None]:
    """torch logs each op that fails on fakes; the check reports the failure itself."""
    logger = logging.getLogger(fake_tensor.__name__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _refusal(
    built: Any,
    node: fx.Node | None,
    err: Exception,
    checked: str = "before the first call on fake tensors (shapes only)",
) -> RouteCheckError:
    """The refusal: the route the failing node is in, the node, the module and the line."""
    plan = _plan_of(built, node)
    route = (
        f"route {(plan.route.start, plan.route.end)}" if plan is not None else "the routed graph"
    )
    what = _describe(built.gm, node)
    where = model_frame(err) or (_module_line(built.gm, node) if node is not None else "")
    detail = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    return RouteCheckError(
        f"{route} cannot run: {what} fails on the kept tokens ({type(err).__name__}); "
        "route around it.\n"
        f"  {type(err).__name__}: {detail}\n"
        + (f"  model code: {where}\n" if where else "")
        + f"Checked {checked}: the original forward runs, the routed graph does not. "
        "That code needs every token (a fixed reshape or size, a table of every position): "
        "end the route before it, or use selection='rows' where it needs a grid of rows; "
        "tread_fx.explain(...) shows the rewritten graph."
    )


def _module_path(node: fx.Node | None) -> str | None:
    """The module a node calls: itself (``call_module``) or checkpointed (its first argument)."""
    if node is None:
        return None
    if node.op == "call_module":
        return node.target
    first = node.args[0] if node.args else None
    if isinstance(first, fx.Node) and first.op == "get_attr":
        return first.target
    return None


def _plan_of(built: Any, node: fx.Node | None) -> Any:
    """The route whose region holds ``node``, or whose blocks include the block it calls."""
    path = (_module_path(node) or "").removeprefix("model.")
    index = next((b.index for b in built.info.blocks if b.path == path), None)
    for plan in built.plans:
        for piece in [plan, *plan.pieces]:
            if node in piece.region or (
                index is not None and piece.route.start <= index < piece.route.end
            ):
                return plan
    return None


def _describe(gm: fx.GraphModule, node: fx.Node | None) -> str:
    if node is None:
        return "a node"
    path = _module_path(node)
    if path is not None and isinstance(gm.get_submodule(path), nn.Module):
        module = type(gm.get_submodule(path)).__name__
        return f"{shown(path.removeprefix('model.'))} ({module}, node {node.name!r})"
    target = getattr(node.target, "__name__", node.target)
    return f"{target} (node {node.name!r})"


def _module_line(gm: fx.GraphModule, node: fx.Node) -> str:
    path = _module_path(node)
    if path is not None:
        return source_line(gm.get_submodule(path))
    return node.meta.get("tread_where", "")
