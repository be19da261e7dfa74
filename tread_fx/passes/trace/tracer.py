"""Pass 1 — trace: turn a model call into a GraphModule, resolving shape-derived Python.

:class:`~tread_fx.passes.trace.value_tracer.ValueTracer` runs the real computation beside the
symbolic one, so Python that reads shapes resolves as it does eagerly (the signature guard,
one trace per input shapes/dtypes/devices/non-tensor arguments, covers the specialisation).
A submodule that reads tensor data, draws Python random numbers (:class:`DataDependentError`)
or does what fx cannot record becomes a leaf (auto-leaf) and the trace is retried; in the
model's own ``forward`` the trace is refused with the file and line.

Example:
    >>> import torch
    >>> from tread_fx.passes.trace.tracer import trace_call
    >>> lin = torch.nn.Linear(4, 4)
    >>> traced = trace_call(lin, (torch.randn(2, 4),), {}, leaf_paths=set())
    >>> [n.op for n in traced.gm.graph.nodes]
    ['placeholder', 'get_attr', 'get_attr', 'call_function', 'output']
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.adapters.values import TensorMeta
from tread_fx.errors import UntraceableModelError
from tread_fx.module_state import random_state_kept
from tread_fx.passes.trace.mutation import (
    defining_modules,
    drop_unused_sizes,
    library_function_of,
    module_flags,
    side_effects,
    stored_traced_values,
    thread_inplace,
)
from tread_fx.passes.trace.opaque import (
    FunctionApply,
    LeavesTorchError,
    OpaqueFunctionError,
    enclosing_function,
    functions_as_calls,
    leaf_functions_held_by_modules,
)
from tread_fx.passes.trace.support import (
    DataDependentError,
    call_python_modules,
    checkpoint_as_plain_call,
    dynamo_wrappers_call_through,
    factories_take_proxies,
    failure_reason,
    name_placeholders,
    side_effect_error,
    stored_value_error,
    traceback_location,
    traced_values_are_tensors,
    untraceable_error,
)
from tread_fx.passes.trace.thread_calls import watch_thread_calls
from tread_fx.passes.trace.thread_patch import TRACING_LOCK, trace_patching_this_thread
from tread_fx.passes.trace.value_tracer import EagerFailure, ValueTracer, fetch_attr

__all__ = [
    "TensorMeta",
    "TracedCall",
    "DataDependentError",
    "FlatCall",
    "trace_call",
    "trace_restoring_state",
    "MODEL_PREFIX",
    "LEAF_REASON_KEY",
    "mark_leaf_reasons",
    "ARG_MODULE_PREFIX",
    "fetch_attr",
]

MODEL_PREFIX = "model."
ARG_MODULE_PREFIX = "arg_module_"
_MAX_AUTO_LEAVES = 64


@dataclass
class TracedCall:
    """The result of tracing one call signature.

    Attributes:
        gm: GraphModule rooted at a :class:`FlatCall` wrapper; module targets start with
            ``model.``. Call it through ``forward_fn(wrapper, *tensors)``.
        wrapper: The :class:`FlatCall` whose ``model`` child is the live model.
        in_spec: Pytree spec of ``(args, kwargs)`` of the traced call.
        tensor_positions: Indices of the tensor leaves among the flattened inputs.
        out_spec: Pytree spec of the model's return value.
        auto_leaves: Paths of submodules made leaves (they could not be traced): the reason.
        stopped: ``None`` for a whole trace; for the part traced before a line no leaf could
            get past (``UntraceableModelError.partial``), what stopped it. Such a graph is read
            for how the call uses its inputs, never run.
    """

    gm: fx.GraphModule
    wrapper: FlatCall
    in_spec: pytree.TreeSpec
    tensor_positions: tuple[int, ...]
    out_spec: pytree.TreeSpec
    auto_leaves: dict[str, str] = field(default_factory=dict)
    stopped: str | None = None


class FlatCall(nn.Module):
    """Calls ``model``'s original forward from a flat tuple of tensors (non-tensor arguments
    are constants of one trace: they are part of the signature key)."""

    def __init__(self, model: nn.Module, in_spec: pytree.TreeSpec, leaves: list[Any]) -> None:
        super().__init__()
        self.model = model
        self.in_spec = in_spec
        self.const_leaves = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        for i, v in enumerate(leaves):  # a module handed in (a rotary module): traced through
            if isinstance(v, nn.Module) and v is not model:
                self.add_module(f"{ARG_MODULE_PREFIX}{i}", v)
        self.tensor_positions = tuple(
            i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)
        )
        self.out_spec: pytree.TreeSpec | None = None

    def call_model(self, tensors: tuple[Any, ...]) -> tuple[Any, ...]:
        leaves = list(self.const_leaves)
        for pos, tensor in zip(self.tensor_positions, tensors):
            leaves[pos] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        out = type(self.model).forward(self.model, *args, **kwargs)
        flat_out, self.out_spec = pytree.tree_flatten(out)
        return tuple(flat_out)


def _flat_forward(num_tensors: int):
    """Build ``forward(self, t0, ..., tn)``: fx needs real named parameters to trace."""
    names = "".join(f"t{i}, " for i in range(num_tensors))  # a tuple of them: ``(t0, )``
    namespace: dict[str, Any] = {}
    source = f"def forward(self, {names}):\n    return self.call_model(({names}))\n"
    exec(source, namespace)  # noqa: S102 - generated signature only
    return namespace["forward"]


def _stuck(
    model: nn.Module, err: DataDependentError, tracer: Any, call: tuple, auto_leaves: dict
) -> UntraceableModelError:
    """The refusal of a trace no new leaf can get past, holding as ``partial`` the part traced
    before the line that stopped it (a :class:`TracedCall` whose ``stopped`` says why), or
    ``None``: how a block uses its side inputs up to there is still seen."""
    error = untraceable_error(model, err)
    error.partial = None
    graph, wrapper = getattr(tracer, "graph", None), getattr(tracer, "root", None)
    if graph is None or not isinstance(wrapper, FlatCall):
        return error
    with contextlib.suppress(Exception):  # a graph left unfit for reading: no partial uses
        graph.output(None)
        thread_inplace(graph)
        gm = fx.GraphModule(wrapper, graph, class_name=type(model).__name__ + "Partial")
        name_placeholders(gm.graph, call, wrapper.tensor_positions)
        mark_leaf_reasons(gm.graph, auto_leaves)
        spec, positions = wrapper.in_spec, wrapper.tensor_positions
        stopped = failure_reason(error)
        error.partial = TracedCall(gm, wrapper, spec, positions, None, auto_leaves, stopped)
    return error


def _new_leaf(path: str | None, auto_leaves: dict[str, str]) -> str | None:
    """The model-relative path to make a leaf after a failure in module ``path``, or ``None``
    (no path, not a submodule of the model, already a leaf, or the cap reached)."""
    if path is None or not path.startswith(MODEL_PREFIX) or len(auto_leaves) >= _MAX_AUTO_LEAVES:
        return None
    leaf = path[len(MODEL_PREFIX) :]
    return None if leaf in auto_leaves else leaf


def _add_enclosing(err: BaseException, auto_functions: list) -> bool:
    """Make the smallest module-level function around a failure that no submodule leaf can
    get past a leaf function (:func:`.opaque.enclosing_function`); whether it is a new one.
    Only for code the tracer cannot follow: a value leaving torch, or an error not raised on
    purpose by the tracer (a data read or Python random numbers keep their refusal)."""
    if isinstance(err, DataDependentError) and not isinstance(err, LeavesTorchError):
        return False
    fn = enclosing_function(err)
    if fn is None or fn in auto_functions:
        return False
    auto_functions.append(fn)
    return True


def trace_call(
    model: nn.Module, args: tuple, kwargs: dict, leaf_paths: set[str], through_hooks: bool = False
) -> TracedCall:
    """Trace ``model(*args, **kwargs)`` into a GraphModule with tensor-only inputs.

    Submodules whose code cannot be traced become leaves automatically (at most 64).
    The trace runs the real computation once without gradients; RNG state and buffers
    (e.g. BatchNorm statistics) are restored afterwards, so tracing changes nothing.

    Args:
        model: The model; its class ``forward`` is traced (not an instance override).
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.
        leaf_paths: Module paths (relative to ``model``) to keep as single calls.
        through_hooks: Trace submodules with call hooks through, their hooks run on the
            values (for a graph that is read, never run); by default they are single calls.

    Returns:
        The :class:`TracedCall`.

    Raises:
        UntraceableModelError: when the model's own forward draws Python random numbers, does
            what fx cannot record, or changes the module on every call.
    """
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    auto_leaves: dict[str, str] = {}
    auto_functions: list = []
    calling: list = []  # the modules calling each of them (patched where they find its name)
    function_reasons: dict[Any, str] = {}  # leaf function (or Function's apply) -> why
    opaque: set[type] = set()  # custom autograd Functions called as one node
    # a class defined in a notebook, a REPL or ``python -c`` lives in a module with no file
    # the model's classes and those of modules handed in as arguments (a rotary module)
    code_modules = call_python_modules(model, flat)
    files = (getattr(m, "__file__", None) for m in code_modules)
    model_files = {os.path.abspath(f) for f in files if f}
    flags, retraced = module_flags(model), False
    while True:
        tensors = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        wrapper_cls = type("FlatCall", (FlatCall,), {"forward": _flat_forward(len(tensors))})
        wrapper = wrapper_cls(model, in_spec, flat)
        example = {f"t{i}": t.detach().clone() for i, t in enumerate(tensors)}
        paths = {MODEL_PREFIX + p for p in leaf_paths | set(auto_leaves)}
        grads = {f"t{i}": t.requires_grad for i, t in enumerate(tensors)}  # example's: detached
        tracer = ValueTracer(
            paths, example, auto_functions, through_hooks, frozenset(opaque), grads
        )
        # registered leaf functions called from the model's own forward (called directly,
        # not through Module.__call__, so fx would not look in its globals by itself)
        tracer._autowrap_search.extend(code_modules)
        tracer._autowrap_search.extend(m for m in calling if m is not None)
        tracer._autowrap_search.extend(m for f in auto_functions for m in defining_modules(f))
        try:
            graph = trace_restoring_state(tracer, wrapper, model, tensors)
            stored = stored_traced_values(model)
            effects = [] if stored else side_effects(flags, model, graph)
            if not effects:
                break
            if retraced:  # the forward changes the module on every call: never replay that
                raise side_effect_error(model, effects)
            retraced, flags = True, module_flags(model)  # once, for real: trace after them
        except EagerFailure as failure:
            with contextlib.suppress(AttributeError):  # the model's own: never "internal"
                failure.original.tread_model_error = True
            raise failure.original from None
        except OpaqueFunctionError as err:
            if err.function in opaque:  # called as one node already: no progress
                stuck = DataDependentError(str(err), None, err.where)
                raise _stuck(model, stuck, tracer, (args, kwargs), auto_leaves) from None
            opaque.add(err.function)
            function_reasons[FunctionApply.of(err.function)] = failure_reason(err)
        except DataDependentError as err:
            leaf = _new_leaf(err.module_path, auto_leaves)
            if leaf is None and _add_enclosing(err, auto_functions):
                function_reasons[auto_functions[-1]] = failure_reason(err)
                continue  # ``t.numpy()`` in a helper function of the model's code: a leaf
            if leaf is None:
                raise _stuck(model, err, tracer, (args, kwargs), auto_leaves) from None
            auto_leaves[leaf] = f"{err.what} at {err.where}"
        except Exception as err:  # fx limitation inside a submodule: make it a leaf
            library_fn, caller = library_function_of(err, model_files) or (None, None)
            new = library_fn not in auto_functions or caller not in calling
            if library_fn is not None and new:  # e.g. einops: run on real values, patched
                if library_fn not in auto_functions:  # wherever the model's code calls it
                    auto_functions.append(library_fn)
                calling.append(caller)
                continue
            leaf = _new_leaf(getattr(err, "tread_module_path", None), auto_leaves)
            if leaf is None and _add_enclosing(err, auto_functions):
                function_reasons[auto_functions[-1]] = failure_reason(err)
                continue  # C code that rejects a traced value, in a helper function
            if leaf is None:  # no submodule of the model left to make a leaf: no progress
                stuck = DataDependentError(str(err), None, traceback_location(err))
                raise _stuck(model, stuck, tracer, (args, kwargs), auto_leaves) from None
            auto_leaves[leaf] = failure_reason(err)
    if stored:
        raise stored_value_error(model, stored)
    thread_inplace(graph)
    drop_unused_sizes(graph)
    gm = fx.GraphModule(wrapper, graph, class_name=type(model).__name__ + "Traced")
    name_placeholders(gm.graph, (args, kwargs), wrapper.tensor_positions)
    mark_leaf_reasons(gm.graph, auto_leaves, function_reasons)
    return TracedCall(gm, wrapper, in_spec, wrapper.tensor_positions, wrapper.out_spec, auto_leaves)


#: ``node.meta`` key of a submodule call kept as one call by the tracer: why (for messages)
LEAF_REASON_KEY = "tread_leaf_reason"


def mark_leaf_reasons(
    graph: fx.Graph, auto_leaves: dict[str, str], functions: dict[Any, str] | None = None
) -> None:
    """Note on each call the trace kept as one call (a submodule made a leaf, a helper function
    of the model's code, a custom autograd Function) what tracing into it raised, so a refusal
    naming the call can say why tread_fx cannot see into it."""
    functions = functions or {}
    for node in graph.nodes:
        if node.op == "call_module":
            reason = auto_leaves.get(str(node.target).removeprefix(MODEL_PREFIX))
        elif node.op == "call_function":
            reason = functions.get(node.target) if _hashable(node.target) else None
        else:
            continue
        if reason is not None:
            node.meta[LEAF_REASON_KEY] = reason


def _hashable(target: Any) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


def trace_restoring_state(
    tracer: fx.Tracer, wrapper: nn.Module, model: nn.Module, tensors: list[torch.Tensor]
) -> fx.Graph:
    """``tracer.trace(wrapper)`` under the patches of :mod:`.support` (seen by this thread
    only), leaving RNG state and ``model``'s buffers (BatchNorm statistics) as they were;
    ``TRACING_LOCK`` lets one thread trace at a time. Traced code sees the caller's grad mode
    (thread-local, so nothing is patched for it); the tracer computes values without grad."""
    devices = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
    with TRACING_LOCK:
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        try:
            with (
                random_state_kept(devices),
                factories_take_proxies(tracer),
                watch_thread_calls(tracer),
                checkpoint_as_plain_call(tracer, model),
                dynamo_wrappers_call_through(),
                traced_values_are_tensors(tracer, model),
                functions_as_calls(tracer, getattr(tracer, "opaque_functions", frozenset())),
                leaf_functions_held_by_modules(tracer, model),
            ):
                graph = trace_patching_this_thread(tracer, wrapper)
                tracer.numpy_draws.check(tracer)  # the model's own code after its last op
                return graph
        finally:
            with torch.no_grad():
                for live, saved in buffers:
                    live.copy_(saved)
