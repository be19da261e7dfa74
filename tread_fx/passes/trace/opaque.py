"""Code the tracer cannot follow runs as it is: one leaf call on the real values.

Three kinds of code give the trace no faithful record of what they do:

- **A custom ``torch.autograd.Function``**: fx would trace its ``forward`` on the proxies and
  record the forward's ops, so the routed graph would differentiate those instead of calling
  the Function's own ``backward`` (a silently wrong gradient). When an op on a traced value is
  recorded inside such a ``forward`` (:func:`function_forward_in_stack`: the frame's code is a
  Function subclass's ``forward``), the trace stops with :class:`OpaqueFunctionError`, and
  the next trace records each ``cls.apply(...)`` of that class as one node
  (:func:`functions_as_calls`, target :class:`FunctionApply`), run on the real values while
  tracing and as itself, with its backward, in the routed graph.
- **Values leaving torch** (``t.numpy()``, :class:`LeavesTorchError`) and **C code that
  rejects a traced value** (a pybind kernel, ``to_dlpack``: no Python frame of its own): the
  smallest module-level function of the model's code around the failure
  (:func:`enclosing_function`) becomes a leaf function, as a library function that rejects a
  proxy does (:mod:`.mutation`); a submodule around it becomes a leaf as before.

Nothing here reads a name: a Function is found by its ``forward``'s code object, a helper by
the traceback.

Example:
    >>> class Twice(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x * 2
    ...
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return g * 2
    >>> FunctionApply.of(Twice)(torch.ones(2))
    tensor([2., 2.])
    >>> Twice.forward.__code__ in function_forwards()
    True
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.passes.trace.support import DataDependentError
from tread_fx.passes.trace.thread_patch import thread_local_patches
from tread_fx.stages import own_file

__all__ = [
    "FunctionApply",
    "LeavesTorchError",
    "OpaqueFunctionError",
    "enclosing_function",
    "function_forward_in_stack",
    "function_forwards",
    "functions_as_calls",
    "leaf_functions_held_by_modules",
]

_NEUTRAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.__file__) + os.sep)


class LeavesTorchError(DataDependentError):
    """A traced value left torch (``Tensor.numpy()``): the code around it must run as it is."""


class OpaqueFunctionError(Exception):
    """An op on a traced value was recorded inside a custom autograd Function's ``forward``.

    Attributes:
        function: The ``torch.autograd.Function`` subclass.
        where: ``file:line`` of the frame that called its ``apply``.
    """

    def __init__(self, function: type, where: str) -> None:
        super().__init__(f"{function.__qualname__}.apply at {where}")
        self.function = function
        self.where = where


class FunctionApply:
    """``function.apply(*args, **kwargs)`` as an fx call target (one node per call).

    fx cannot name a bound ``apply`` in generated code (it has no module); this object can
    (a global of the generated code). One instance per Function class (:meth:`of`).
    """

    _instances: dict[type, FunctionApply] = {}

    def __init__(self, function: type) -> None:
        self.function = function
        self.__name__ = f"{function.__name__}_apply"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    @classmethod
    def of(cls, function: type) -> FunctionApply:
        """The one target for ``function`` (nodes of the same Function share it)."""
        if function not in cls._instances:
            cls._instances[function] = cls(function)
        return cls._instances[function]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function.apply(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return (FunctionApply.of, (self.function,))

    def __repr__(self) -> str:
        return f"{self.function.__qualname__}.apply"


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _innermost_code(fn: Any) -> types.CodeType | None:
    while hasattr(fn, "__wrapped__"):  # ``@custom_fwd`` and other functools.wraps decorators
        fn = fn.__wrapped__
    return getattr(fn, "__code__", None)


def function_forwards() -> dict[types.CodeType, type]:
    """The code of every custom autograd Function's ``forward`` (undecorated): its class."""
    found: dict[types.CodeType, type] = {}
    for cls in _subclasses(torch.autograd.Function):
        forward = vars(cls).get("forward")
        code = _innermost_code(getattr(forward, "__func__", forward))  # a staticmethod's
        if code is not None:
            found.setdefault(code, cls)
    return found


def function_forward_in_stack(forwards: dict[types.CodeType, type]) -> OpaqueFunctionError | None:
    """The error to stop the trace with when the calling frames run inside a ``forward`` of
    ``forwards`` (an op on a traced value is being recorded there), else ``None``."""
    frame = sys._getframe(1)
    while frame is not None:
        function = forwards.get(frame.f_code)
        if function is not None:
            caller = frame.f_back
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller else "<unknown>"
            return OpaqueFunctionError(function, where)
        frame = frame.f_back
    return None


@contextlib.contextmanager
def functions_as_calls(tracer: Any, functions: set[type]) -> Iterator[None]:
    """``F.apply`` (each of ``functions`` and their subclasses) records one node when handed a
    traced value, in the tracing thread only; elsewhere, and on real values, it is itself."""
    classes = {sub for f in functions for sub in (f, *_subclasses(f))}

    patches = []
    for cls in sorted(classes, key=id):
        target, takes_ctx = FunctionApply.of(cls), not _has_setup_context(cls)
        patches += [
            (cls, "apply", _recorded_as(tracer, target)),  # real values: the Function itself
            (cls, "forward", _recorded_as(tracer, target, skip_first=takes_ctx)),
        ]
        if _has_setup_context(cls):
            patches.append((cls, "setup_context", _setup_skipped_on_proxies(tracer)))
    with thread_local_patches(patches):
        yield


def _traced(tracer: Any, values: Any) -> bool:
    leaves = pytree.tree_leaves(values)
    return any(isinstance(a, fx.Proxy) and a.tracer is tracer for a in leaves)


def _has_setup_context(function: type) -> bool:
    """Whether ``function`` defines ``setup_context`` (its ``forward`` then takes no ctx)."""
    base = torch.autograd.Function.setup_context
    return getattr(function.setup_context, "__func__", function.setup_context) is not getattr(
        base, "__func__", base
    )


def _recorded_as(tracer: Any, target: Callable, skip_first: bool = False) -> Callable:
    """A patch that records one ``call_function`` node of ``target`` when handed traced values
    and calls what it replaces otherwise. For a Function's ``forward`` (``skip_first``: its
    ctx is not an input): ``F.apply`` stored before the trace (``scale = F.apply``) is not the
    patched class attribute, but torch's ``apply`` calls the class's ``forward`` and hands on
    what it returns (a proxy is no tensor: passed through untouched)."""

    def patch(previous: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            inputs = args[1:] if skip_first else args
            if not _traced(tracer, (inputs, kwargs)):
                return previous(*args, **kwargs)
            return tracer.create_proxy("call_function", target, inputs, kwargs)

        return call

    return patch


def _setup_skipped_on_proxies(tracer: Any) -> Callable:
    """``setup_context`` that does nothing for a traced call (its node runs the real one)."""

    def patch(previous: Callable) -> Callable:
        def setup_context(ctx: Any, inputs: Any, output: Any) -> Any:
            if _traced(tracer, (inputs, output)):
                return None
            return previous(ctx, inputs, output)

        return setup_context

    return patch


@contextlib.contextmanager
def leaf_functions_held_by_modules(tracer: Any, model: nn.Module) -> Iterator[None]:
    """A leaf function a module holds as an attribute (``self.op = numpy_tanh``, called as
    ``self.op(x)``) records one node like the global it also is: the global is patched by fx,
    the attribute refers to the function itself. Patched for the tracing thread only."""
    ids = getattr(tracer, "leaf_function_ids", set())
    patches = [
        (module, name, _recorded_as(tracer, value))
        for module in model.modules()
        for name, value in list(vars(module).items())
        if callable(value) and id(value) in ids
    ]
    with thread_local_patches(patches):
        yield


def enclosing_function(err: BaseException) -> Callable | None:
    """The smallest module-level function around the failure ``err`` records: walking out
    from the innermost frame outside torch, the standard library and tread_fx, the first one
    that is a module-level function (:func:`_module_function`), or ``None`` when a method of
    a module (a ``forward``) comes first."""
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    for frame in reversed(frames):
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_NEUTRAL) or own_file(path):
            continue
        fn = _module_function(frame)
        if fn is not None:
            return fn
        names = frame.f_code.co_varnames[: frame.f_code.co_argcount]
        if names and isinstance(frame.f_locals.get(names[0]), nn.Module):
            return None
    return None


def _module_function(frame: types.FrameType) -> Callable | None:
    """The function ``frame`` runs if it is a global of its name in an imported module (the
    only functions fx can make leaves: it patches module globals), else ``None``. Code
    ``exec``'d into a bare namespace (the tracer's own generated ``forward``, made anew on
    every retry) is no module's: taking it would retry without end."""
    module = sys.modules.get(frame.f_globals.get("__name__", ""))
    if module is None or vars(module) is not frame.f_globals:
        return None
    fn = frame.f_globals.get(frame.f_code.co_name)
    return fn if getattr(fn, "__code__", None) is frame.f_code else None
