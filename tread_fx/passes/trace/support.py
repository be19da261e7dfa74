"""Tracing aids for third-party models: the patches the value-carrying tracer runs under
(:func:`tread_fx.passes.trace.tracer.trace_restoring_state` enters them all), what its refusals
raise (:class:`DataDependentError`, at :func:`user_frame`), and the messages of a refused trace.

What torch keeps per thread (grad mode, dynamo's config, a ``TorchFunctionMode``) is set, not
patched, so its functions keep their identity; every remaining patch goes through
:func:`tread_fx.passes.trace.thread_patch.thread_local_patch`, so only the tracing thread sees
it (a new tracing patch must use it too, and be listed in ``STILL_PATCHED``). Code compiled
with ``torch.compile`` (by any path) runs its original Python; ``torch.is_tensor``,
``isinstance`` and ``callable`` in the model's own code answer by the value a traced value
stands for.

Example:
    >>> has_call_hooks(nn.Linear(2, 2))
    False
    >>> from tread_fx.passes.trace.tracer import trace_call
    >>> class Embed(torch.nn.Module):
    ...     def forward(self, t):
    ...         return t if torch.is_tensor(t) else torch.tensor([t])
    >>> traced = trace_call(Embed(), (torch.ones(2),), {}, leaf_paths=set())
    >>> [n.op for n in traced.gm.graph.nodes]
    ['placeholder', 'output']
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import os
import re
import sys
import types
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from tread_fx.errors import UntraceableModelError
from tread_fx.passes.trace.thread_patch import thread_local_patches, unpatched
from tread_fx.stages import own_file

__all__ = [
    "DataDependentError",
    "user_frame",
    "checkpoint_as_plain_call",
    "python_modules",
    "call_python_modules",
    "factories_take_proxies",
    "has_call_hooks",
    "name_placeholders",
    "side_effect_error",
    "stored_value_error",
    "traceback_location",
    "untraceable_error",
    "store_object_constant",
    "dynamo_wrappers_call_through",
    "is_compiled_module_wrapper",
    "is_stateless",
    "failure_reason",
    "dynamo_wrappers_run_original",
    "traced_values_are_tensors",
    "asks_as_model_code",
]

_CHECKPOINT_OPTIONS = (
    "use_reentrant", "preserve_rng_state", "determinism_check", "debug", "context_fn"
)  # fmt: skip
# factories of a graph value even with constant sizes (a draw is never baked in as a constant)
_RANDOM = frozenset(map(id, (torch.rand, torch.randn, torch.randint)))


def factories_take_proxies(tracer: Any) -> AbstractContextManager:
    """Record ``torch.ones(b, n)``, ``torch.arange(n)``, ``torch.tensor([n, 1])`` and
    ``t.expand(b, -1)`` with traced sizes (``n`` from a shape) as graph calls, and random
    factories always, so a draw is never baked in as a constant.

    A ``TorchFunctionMode`` of the tracing thread does it: other threads see every function
    unchanged. It records every torch call handed a traced value that would not reach the
    proxies' own ``__torch_function__`` (one in a list, a size among varargs:
    :mod:`.thread_calls`), as that would.

    Example:
        >>> from tread_fx.passes.trace.tracer import trace_call
        >>> class Ones(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x + torch.ones(x.shape[0], 1)
        >>> traced = trace_call(Ones(), (torch.zeros(2, 3),), {}, leaf_paths=set())
        >>> torch.ones in [n.target for n in traced.gm.graph.nodes]
        True
    """
    return _FactoryMode(tracer)


class _FactoryMode(TorchFunctionMode):
    """Record torch calls handed traced values the proxies do not see (see
    :func:`factories_take_proxies`), and random factories; every other call, and eager
    code's, runs as it is."""

    def __init__(self, tracer: Any) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        self.tracer.sizes_call = None  # parsed: the proxies take part again
        if self.tracer.running_eager or any(issubclass(t, fx.Proxy) for t in types):
            return func(*args, **kwargs)  # eager code, or the proxies record it themselves
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(a, fx.Proxy) and a.tracer is self.tracer for a in leaves):
            return fx.Proxy.__torch_function__(func, types, args, kwargs)
        if id(func) in _RANDOM:
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)


def name_placeholders(graph: fx.Graph, call: tuple, positions: tuple[int, ...]) -> None:
    """Record each tensor input's argument name (``img_ids``, ``arg0``) in ``meta``."""
    paths = [path for path, _ in pytree.tree_flatten_with_path(call)[0]]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, pos in zip(placeholders, positions):
        top, argument = paths[pos][:2]  # the (args, kwargs) index, then the argument's
        name = str(getattr(argument, "key", getattr(argument, "idx", argument)))
        node.meta["tread_input_name"] = name if top.idx == 1 else f"arg{name}"


class DataDependentError(Exception):
    """Python read tensor data (or drew Python random numbers) while being traced."""

    def __init__(self, what: str, module_path: str | None, where: str) -> None:
        super().__init__(f"{what} at {where}")
        self.what = what
        self.module_path = module_path
        self.where = where

    @classmethod
    def at(cls, what: str, tracer: Any) -> DataDependentError:
        """The error for ``what`` at the user's frame, in the innermost module ``tracer`` is in."""
        return cls(what, tracer.module_stack[-1] if tracer.module_stack else None, user_frame())


def user_frame() -> str:
    """Return ``file:line`` of the innermost frame outside torch and tread_fx."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    for frame_info in inspect.stack()[2:]:
        filename = os.path.abspath(frame_info.filename)
        if not (filename.startswith(torch_dir) or own_file(filename) or "contextlib" in filename):
            return f"{frame_info.filename}:{frame_info.lineno}"
    return "<unknown location>"


def checkpoint_as_plain_call(tracer: Any, model: nn.Module) -> AbstractContextManager:
    """Trace blocks called through activation checkpointing as plain, marked calls.

    ``checkpoint(block, *args)`` or ``checkpoint(block.forward, *args)`` (looked up in torch,
    imported, or held by a module, as a ``functools.partial`` too) becomes ``block(*args)``; the
    nodes get ``meta["tread_checkpoint"]`` and the rewrite pass checkpoints them again.
    """
    import torch.utils.checkpoint as ckpt

    original = unpatched(ckpt, "checkpoint")

    def plain(function, *args, **kwargs):
        if tracer.running_eager:  # inside a module run for real: checkpoint as asked
            return original(function, *args, **kwargs)
        for key in _CHECKPOINT_OPTIONS:
            kwargs.pop(key, None)
        function = _called_block(function)
        called = function.func if isinstance(function, functools.partial) else function
        tracer.checkpointed.add(id(getattr(called, "__self__", called)))
        return function(*args, **kwargs)

    def make(previous):  # a held partial keeps its options (use_reentrant=False, ...)
        if isinstance(previous, functools.partial):
            return functools.partial(plain, *previous.args, **previous.keywords)
        return plain

    namespaces = _forward_namespaces(model)
    imported = [(ns, k) for ns in namespaces for k, v in list(ns.items()) if v is original]
    held = [
        (m.__dict__, k)
        for m in model.modules()
        for k, v in list(m.__dict__.items())
        if v is original or (isinstance(v, functools.partial) and v.func is original)
    ]
    # also `from torch.utils.checkpoint import checkpoint`, and a held (partial of) checkpoint
    named = [(ckpt, "checkpoint")] + imported + held
    return thread_local_patches((target, key, make) for target, key in named)


def _called_block(function: Any) -> Any:
    """The module a checkpointed ``block.forward`` (or a partial of it) belongs to, to be
    called as a module so the trace records the block call; any other function, and the
    ``forward`` of a module with call hooks (which it skips), stay as they are."""
    inner = function.func if isinstance(function, functools.partial) else function
    owner = getattr(inner, "__self__", None)
    forward = getattr(type(owner), "forward", None)
    calls_forward = isinstance(owner, nn.Module) and getattr(inner, "__func__", None) is forward
    if not calls_forward or has_call_hooks(owner):
        return function
    if inner is function:
        return owner
    return functools.partial(owner, *function.args, **function.keywords)


def python_modules(model: nn.Module) -> list[types.ModuleType]:
    """The Python modules defining the model's classes."""
    names = {type(m).__module__ for m in model.modules()}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules]


def call_python_modules(model: nn.Module, leaves: list[Any]) -> list[types.ModuleType]:
    """The Python modules defining the classes of ``model`` and of the modules among a
    call's flat arguments ``leaves`` (a rotary module handed to a block)."""
    handed = [v for v in leaves if isinstance(v, nn.Module) and v is not model]
    return list(dict.fromkeys(m for x in [model, *handed] for m in python_modules(x)))


def _forward_namespaces(model: nn.Module) -> list[dict]:
    """Global namespaces of the modules defining the model's classes and every ``forward``
    they inherit (a subclass defined elsewhere runs its base's code, and its imports)."""
    classes = {c for m in model.modules() for c in type(m).__mro__ if "forward" in vars(c)}
    names = {c.__module__ for c in classes} - {nn.Module.__module__}
    modules = python_modules(model) + [sys.modules[n] for n in names if n in sys.modules]
    return list({id(module): vars(module) for module in modules}.values())


def side_effect_error(model: nn.Module, effects: list[str]) -> UntraceableModelError:
    return UntraceableModelError(
        f"{type(model).__name__}.forward changes the module on every call, which a routed "
        "graph would replay each step; make that change once before routing.\n("
        + "; ".join(effects[:4])
        + "). A routed graph would replay that on every training step; tread_fx lets such a "
        "change happen once, while tracing, and traces again, but here the second trace "
        "changed it again. Make the change once before routing (e.g. call the model once), "
        "or move it out of forward."
    )


def stored_value_error(model: nn.Module, stored: list[str]) -> UntraceableModelError:
    return UntraceableModelError(
        f"{type(model).__name__}.forward keeps values it computes on the module "
        f"({', '.join(stored[:3])}{', ...' if len(stored) > 3 else ''}) for a later call.\n"
        "A routed graph returns only the model's outputs, so each routed training call would "
        "leave them as they were, and a later call would read stale values. Store them only "
        "outside training (e.g. under `if not self.training:`), or route a forward that does "
        "not keep them."
    )


def traceback_location(err: BaseException) -> str:
    frames = [f for f in inspect.getinnerframes(err.__traceback__) if "torch" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "<unknown location>"


def untraceable_error(model: nn.Module, err: DataDependentError) -> UntraceableModelError:
    return UntraceableModelError(
        f"cannot trace {type(model).__name__}.forward: {err.what} at {err.where}. "
        "Shape-derived Python is resolved while tracing, and tensor data read in the model's "
        "own forward is resolved with a runtime guard; Python or numpy random numbers, and code fx "
        "cannot record there, cannot be routed safely. Move that code into a submodule and "
        "register it with "
        "tread_fx.register_leaf_module (or the function with tread_fx.register_leaf_function)."
    )


def has_call_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has hooks that only its ``__call__`` runs (forward or backward): it is
    traced as one call, as an inlined FSDP2 unit would compute with its sharded parameters."""
    return bool(
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
    )


_OBJECT_PREFIX = "_tread_object_"


def store_object_constant(root: nn.Module, obj: Any) -> str | None:
    """Store a plain Python object on ``root`` for a ``get_attr`` node; return its name.

    fx has no argument type for an instance of a user class (a per-layer key/value cache the
    forward hands to its blocks). Such an object is a constant of one trace, as the non-tensor
    model inputs it comes from are (the signature key holds those by identity).

    Args:
        root: The module being traced (the call wrapper, never the user's model).
        obj: The argument fx rejected.

    Returns:
        The attribute name, or ``None`` when ``obj`` is not a plain object.

    Example:
        >>> class Cache: ...
        >>> root, cache = nn.Module(), Cache()
        >>> store_object_constant(root, cache), store_object_constant(root, cache)
        ('_tread_object_0', '_tread_object_0')
    """
    containers = (nn.Module, torch.Tensor, tuple, list, dict, type)
    if isinstance(obj, containers) or not hasattr(obj, "__dict__"):
        return None
    stored = {k: v for k, v in vars(root).items() if k.startswith(_OBJECT_PREFIX)}
    name = next((k for k, v in stored.items() if v is obj), f"{_OBJECT_PREFIX}{len(stored)}")
    setattr(root, name, obj)
    return name


def dynamo_wrappers_call_through() -> AbstractContextManager:
    """Let code optimized by ``torch.compile`` run as its original Python while fx traces, by
    whatever path the model reaches it: a decorator, a wrapper object compiling on its first
    call, ``torch.compile`` inside ``forward``, a submodule compiled in place.

    Dynamo's own switch, ``torch._dynamo.config.error_on_nested_fx_trace``, is turned off for
    the tracing thread only (dynamo's config patches are per thread). Dynamo is imported here
    (once per process) even if the model has compiled nothing yet: a first ``torch.compile``
    inside the trace would import it too late for the switch. ``torch.compiler.set_stance(
    "force_eager")`` cannot replace it: dynamo checks for an fx trace before it reads the stance
    (and raises whatever the stance), and the stance holds for every thread of the process.

    Example:
        >>> import torch
        >>> with dynamo_wrappers_call_through():
        ...     torch._dynamo.config.error_on_nested_fx_trace
        False
    """
    import torch._dynamo

    return torch._dynamo.config.patch(error_on_nested_fx_trace=False)


def is_compiled_module_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper of another module (``OptimizedModule``):
    while tracing, its call runs the module it wraps, which the trace records.

    Example:
        >>> is_compiled_module_wrapper(nn.Linear(2, 2))
        False
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def failure_reason(err: BaseException) -> str:
    """What a trace raised and where (the message cut at 200 characters), for the note on a
    call kept whole and for refusals that name code tread_fx could not see into.

    Example:
        >>> failure_reason(ValueError("bad"))
        'ValueError: bad at <unknown location>'
    """
    where, text = getattr(err, "where", None) or traceback_location(err), str(err)
    if isinstance(err, UntraceableModelError):  # a refusal naming its line: its first sentence
        first = re.split(r"\.\s", text)[0][:200]
        return f"{type(err).__name__}: {first}"
    text = text[:200]
    return f"{type(err).__name__}: {text}" + ("" if where and where in text else f" at {where}")


def is_stateless(module: nn.Module) -> bool:
    """Whether ``module`` owns no parameters and no buffers: called from a forward without being
    a submodule (a module-level instance wrapping a function, as the ``kernels`` package makes of
    ``apply_rotary_pos_emb``), its code is the caller's code and traces as such. One with state
    is refused by the trace (its parameters would become constants of the graph).

    Example:
        >>> is_stateless(nn.GELU()), is_stateless(nn.Linear(2, 2))
        (True, False)
    """
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


@contextlib.contextmanager
def dynamo_wrappers_run_original() -> Iterator[None]:
    """Run functions and modules optimized by ``torch.compile`` as their original code.

    The routed graph runs under this when it is not compiled itself (``compile=False``), so a
    block it calls whole is not compiled again for each routed token count and grad mode.
    Uses dynamo's thread-local switch, else ``set_stance("force_eager")`` (torch >= 2.6);
    older torch calls the decorated code.

    Example:
        >>> import torch
        >>> double = torch.compile(lambda x: 2 * x, backend="eager")
        >>> with dynamo_wrappers_run_original():  # runs the lambda itself
        ...     double(torch.ones(1))
        tensor([2.])
    """
    dynamo = sys.modules.get("torch._dynamo")
    eager = getattr(getattr(dynamo, "eval_frame", None), "_use_eager_on_nested_compile", None)
    if eager is not None:
        with eager():
            yield
    elif dynamo is not None and hasattr(torch.compiler, "set_stance"):
        with torch.compiler.set_stance("force_eager"):
            yield
    else:
        yield


_IS_TENSOR = torch.is_tensor.__code__


def _is_torch_frame(frame: types.FrameType | None) -> bool:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name == "torch" or name.startswith("torch.")


def asks_as_model_code(frame: types.FrameType, namespaces: set[int]) -> bool:
    """Whether an ``isinstance`` called in ``frame`` (it reads a traced value's ``__class__``)
    is the model's: ``frame`` runs in one of the model's modules (``namespaces``: ids of their
    globals), or is ``torch.is_tensor`` called from outside torch (torch's own code keeps
    seeing proxies as proxies)."""
    if frame.f_code is _IS_TENSOR:
        return not _is_torch_frame(frame.f_back)
    return id(frame.f_globals) in namespaces


def traced_values_are_tensors(tracer: Any, model: nn.Module) -> AbstractContextManager:
    """Make ``torch.is_tensor`` and ``isinstance(v, torch.Tensor)`` true for traced tensors,
    and ``callable(v)`` and ``type(v)`` answer as for the value a traced value stands for.

    Else ``if not torch.is_tensor(t): t = torch.tensor([t])`` takes a branch it never takes
    eagerly. A traced value's ``__class__`` is its value's class where the model's modules or
    ``torch.is_tensor`` (called from outside torch) ask (:func:`asks_as_model_code`, set here
    as ``tracer.model_namespaces``): ``isinstance`` reads it, and no name changes. ``callable``
    reads the type, not ``__class__``, and so does ``type``: the model's modules see a
    ``callable`` and a ``type`` of their own (for the tracing thread only)."""

    def traced_callable(obj: Any) -> bool:
        if isinstance(obj, fx.Proxy) and obj.tracer is tracer:
            return callable(tracer.value_of(obj))
        return callable(obj)

    traced_type = _type_of_values(tracer)

    namespaces = {
        id(ns): ns
        for ns in map(vars, python_modules(model))
        if not str(ns.get("__name__", "")).startswith(("torch.", "tread_fx."))
    }
    tracer.model_namespaces = set(namespaces)
    patches = [("callable", traced_callable), ("type", traced_type)]
    return thread_local_patches(  # seen by the tracing thread only
        [
            (ns, name, lambda _, own=own: own)
            for ns in namespaces.values()
            for name, own in patches
            if name not in ns
        ]
    )


def _type_of_values(tracer: Any) -> type:
    """The ``type`` the model's modules see while ``tracer`` traces: ``type(v)`` of one of its
    traced values is the class of the value it stands for (``type(x) is torch.Tensor`` holds
    as it does eagerly; it read the proxy class, and the other branch was traced silently);
    every other use is the builtin's (three-argument calls, ``isinstance(c, type)``)."""

    class TypeOfValues(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            obj = args[0] if len(args) == 1 and not kwargs else None
            if isinstance(obj, fx.Proxy) and obj.tracer is tracer:
                with contextlib.suppress(KeyError, AttributeError):  # a proxy being made
                    return builtins.type(tracer.value_of(obj))
            return builtins.type(*args, **kwargs)

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, builtins.type)

        def __subclasscheck__(cls, sub: Any) -> bool:
            return issubclass(sub, builtins.type)

    return TypeOfValues("type", (), {})
