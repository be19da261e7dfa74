"""Tracing patches for community and research model code (issue 29's tracing classes).

Each patch is a context manager built like those in :mod:`tread_fx.passes.trace.support`
and acts only while the value-carrying tracer runs; :func:`research_code_patches` enters them
all (``trace_restoring_state`` does).

- :func:`dynamo_wrappers_call_through`: functions and modules the model decorates with
  ``@torch.compile`` (its ``forward``, a modulate helper, an embedder) run their original
  Python while being traced, as dynamo itself offers (``error_on_nested_fx_trace``); the
  routed graph is compiled as a whole as usual, and the decorators still apply in eval;
  :func:`dynamo_wrappers_run_original`: an uncompiled routed graph runs their original code.
- :func:`traced_values_are_tensors` (through ``thread_local_patch``: only the tracing thread
  sees it): ``torch.is_tensor(v)`` and ``isinstance(v, torch.Tensor)``
  in the model's own code hold for a traced value that stands for a tensor, so a time
  embedding takes the branch it takes eagerly; ``callable(v)`` answers by the value too
  (a proxy has ``__call__``, a tensor has not: ``default(context, x)`` helpers that call a
  callable default would call the tensor).

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
from tread_fx.passes.trace.support import module_namespaces
from tread_fx.passes.trace.thread_patch import thread_local_patch

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


@contextlib.contextmanager
def dynamo_wrappers_call_through() -> Iterator[None]:
    """Let functions and modules optimized by ``torch.compile`` run their original code.

    A dynamo-optimized function called while fx traces raises "Detected that you are using FX
    to symbolically trace a dynamo-optimized function" unless dynamo's
    ``error_on_nested_fx_trace`` is off; then it calls the function it wraps
    (``_torchdynamo_orig_callable``), so the trace records the original operations. Nothing
    is compiled while tracing. Without ``torch._dynamo`` imported nothing can be optimized.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        yield
        return
    with dynamo.config.patch(error_on_nested_fx_trace=False):
        yield


@contextlib.contextmanager
def dynamo_wrappers_run_original() -> Iterator[None]:
    """Run functions and modules optimized by ``torch.compile`` as their original code.

    The routed graph runs under this when it is not compiled itself (``compile=False``): it
    records the original operations of the code it traced through, and a block it calls
    whole (a block whose ``forward`` the model decorates, or a block wrapped in
    ``torch.compile``) runs its original code as well, rather than being compiled again
    for each routed token count and grad mode with the code around it left eager. The
    routed graph is compiled as a whole with ``compile=``. Uses dynamo's own thread-local
    switch for this where torch has it, else ``set_stance("force_eager")`` (torch >= 2.6);
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


def _is_model_frame(depth: int) -> bool:
    """Whether the caller ``depth`` frames up, past the patch dispatcher, is outside torch
    (torch's own code keeps seeing proxies as proxies)."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_globals.get("__name__") == thread_patch.__name__:
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return not (name == "torch" or name.startswith("torch."))


@contextlib.contextmanager
def traced_values_are_tensors(tracer: Any, model: nn.Module) -> Iterator[None]:
    """Make ``torch.is_tensor`` and ``isinstance(v, torch.Tensor)`` true for traced tensors,
    and ``callable(v)`` answer as for the value a traced value stands for.

    A proxy is no ``torch.Tensor``, so model code such as
    ``if not torch.is_tensor(t): t = torch.tensor([t])`` would take the branch it never takes
    eagerly. While tracing, ``torch.is_tensor`` (and the name imported from torch) answers by
    the value a proxy stands for when called from outside torch, and the model's Python modules
    see an ``isinstance`` that does the same for tensors (other checks are unchanged), and a
    ``callable`` that answers by the value for every traced value.
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
        for ns in module_namespaces(model)
        if not str(ns.get("__name__", "")).startswith(("torch.", "tread_fx."))
    }.values()
    imported = [(ns, k) for ns in namespaces for k, v in ns.items() if v is original_is_tensor]
    shadowed = [ns for ns in namespaces if "isinstance" not in ns]
    uncalled = [ns for ns in namespaces if "callable" not in ns]
    with contextlib.ExitStack() as patches:  # seen by the tracing thread only
        patches.enter_context(thread_local_patch(torch, "is_tensor", lambda _: is_tensor))
        for ns, key in imported:  # `from torch import is_tensor`
            patches.enter_context(thread_local_patch(ns, key, lambda _: is_tensor))
        for ns in shadowed:
            patches.enter_context(thread_local_patch(ns, "isinstance", lambda _: traced_isinstance))
        for ns in uncalled:
            patches.enter_context(thread_local_patch(ns, "callable", lambda _: traced_callable))
        yield
