"""Tracing patches for community and research model code (issue 29's tracing classes).

Each patch is a context manager built like those in :mod:`tread_fx.passes.trace.support`
and acts only while the value-carrying tracer runs; :func:`research_code_patches` enters them
all (:func:`tread_fx.passes.trace.tracer.trace_restoring_state` does): code decorated with
``@torch.compile`` runs its original Python, and ``torch.is_tensor(v)``, ``isinstance`` and
``callable`` in the model's own code answer by the value a traced value stands for.

Example:
    >>> import torch
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
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from tread_fx.passes.trace import thread_patch
from tread_fx.passes.trace.support import python_modules
from tread_fx.passes.trace.thread_patch import thread_local_patches

__all__ = [
    "research_code_patches",
    "dynamo_wrappers_call_through",
    "dynamo_wrappers_run_original",
    "traced_values_are_tensors",
]

_builtin_isinstance = builtins.isinstance
_builtin_callable = builtins.callable


@contextlib.contextmanager
def research_code_patches(tracer: Any, model: nn.Module) -> Iterator[None]:
    """Enter every patch of this module for one trace of ``model``."""
    with dynamo_wrappers_call_through(), traced_values_are_tensors(tracer, model):
        yield


def dynamo_wrappers_call_through() -> contextlib.AbstractContextManager:
    """Let functions and modules optimized by ``torch.compile`` run their original code.

    With dynamo's ``error_on_nested_fx_trace`` off, a dynamo-optimized function called while
    fx traces calls the function it wraps instead of raising, so the trace records the original
    operations. Without ``torch._dynamo`` imported nothing can be optimized.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return contextlib.nullcontext()
    return dynamo.config.patch(error_on_nested_fx_trace=False)


@contextlib.contextmanager
def dynamo_wrappers_run_original() -> Iterator[None]:
    """Run functions and modules optimized by ``torch.compile`` as their original code.

    The routed graph runs under this when it is not compiled itself (``compile=False``): a
    block it calls whole (decorated, or wrapped in ``torch.compile``) runs its original code as
    well, rather than being compiled again for each routed token count and grad mode. Uses
    dynamo's own thread-local switch where torch has it, else ``set_stance("force_eager")``
    (torch >= 2.6); older torch calls the decorated code.

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


def _is_model_frame(depth: int) -> bool:
    """Whether the caller ``depth`` frames up, past the patch dispatcher, is outside torch
    (torch's own code keeps seeing proxies as proxies)."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_globals.get("__name__") == thread_patch.__name__:
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return not (name == "torch" or name.startswith("torch."))


def traced_values_are_tensors(tracer: Any, model: nn.Module) -> contextlib.AbstractContextManager:
    """Make ``torch.is_tensor`` and ``isinstance(v, torch.Tensor)`` true for traced tensors,
    and ``callable(v)`` answer as for the value a traced value stands for.

    A proxy is no ``torch.Tensor``, so ``if not torch.is_tensor(t): t = torch.tensor([t])``
    would take the branch it never takes eagerly. ``torch.is_tensor`` (and the name imported
    from torch) answers by the value when called from outside torch; the model's Python modules
    see an ``isinstance`` that does so for tensors, and a ``callable`` that does so always.
    """

    def stands_for_tensor(obj: Any) -> bool:
        if not _builtin_isinstance(obj, fx.Proxy) or obj.tracer is not tracer:
            return False
        return _builtin_isinstance(tracer.value_of(obj), torch.Tensor)

    original_is_tensor = torch.is_tensor

    def is_tensor(obj: Any) -> bool:
        if stands_for_tensor(obj) and _is_model_frame(1):
            return True
        return original_is_tensor(obj)

    def traced_isinstance(obj: Any, classinfo: Any) -> bool:
        if _builtin_isinstance(obj, classinfo):
            return True
        if stands_for_tensor(obj):
            return _builtin_isinstance(tracer.value_of(obj), classinfo)
        return False

    def traced_callable(obj: Any) -> bool:
        if _builtin_isinstance(obj, fx.Proxy) and obj.tracer is tracer:
            return _builtin_callable(tracer.value_of(obj))
        return _builtin_callable(obj)

    namespaces = {
        id(ns): ns
        for ns in map(vars, python_modules(model))
        if not str(ns.get("__name__", "")).startswith(("torch.", "tread_fx."))
    }.values()
    imported = [(ns, k) for ns in namespaces for k, v in ns.items() if v is original_is_tensor]
    shadowed = [ns for ns in namespaces if "isinstance" not in ns]
    uncalled = [ns for ns in namespaces if "callable" not in ns]
    return thread_local_patches(  # seen by the tracing thread only
        [(torch, "is_tensor", lambda _: is_tensor)]
        + [(ns, key, lambda _: is_tensor) for ns, key in imported]  # `from torch import is_tensor`
        + [(ns, "isinstance", lambda _: traced_isinstance) for ns in shadowed]
        + [(ns, "callable", lambda _: traced_callable) for ns in uncalled]
    )
