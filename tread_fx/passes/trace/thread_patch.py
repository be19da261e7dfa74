"""Patches that only the tracing thread sees.

What torch keeps per thread (grad mode, a ``TorchFunctionMode``, dynamo's config) is set
instead, as is a profile function of the tracing thread (:mod:`.thread_calls`), and every
function keeps its identity. Where nothing per thread serves (:data:`STILL_PATCHED` lists each
name and why), the tracer replaces process-wide names while it runs (``nn.Module.__call__``,
``torch.utils.checkpoint.checkpoint`` ...) only through :func:`thread_local_patch`: the name
gets a *dispatcher* (reference-counted, removed when the last patch of that name ends) that
calls the replacement in a thread that entered the patch and the original elsewhere, so another
thread calling a module during a first routed call runs the real ``__call__``.
:func:`trace_patching_this_thread` sends torch.fx's own patching through it too, and
:data:`TRACING_LOCK` lets one thread trace at a time; routed calls that do not trace never
take it.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch.fx as fx
import torch.fx._symbolic_trace as fx_trace
from torch import nn

__all__ = [
    "STILL_PATCHED",
    "thread_local_patch",
    "thread_local_patches",
    "trace_patching_this_thread",
    "TRACING_LOCK",
    "is_dispatcher",
    "unpatched",
]

#: What a trace still replaces process-wide while it runs (each through
#: :func:`thread_local_patch`: other threads call through to the original, but the name is a
#: dispatcher), and why nothing per thread serves. Everything else the tracer changes is per
#: thread: grad mode, a ``TorchFunctionMode`` (factories, size methods), a profile function
#: (Python random numbers, :mod:`.thread_calls`), a traced value's ``__class__``
#: (``isinstance``, ``torch.is_tensor``), dynamo's config, fx's patcher.
STILL_PATCHED = {
    "torch.nn.Module.__call__": "fx's Tracer.trace records module calls by patching it; a call "
    "is looked up on the class, so nothing per thread or per instance intercepts it short of "
    "swapping the model's instances' classes or rewriting fx's trace",
    "torch.nn.Module.__getattr__": "fx's Tracer.trace patches it to hand out parameters as "
    "graph values; looked up on the class, as __call__ is",
    "torch.fx.wrap": "every function registered with torch.fx.wrap, in the namespace that "
    "registered it (fx's trace patches them all): a call of a Python function has no "
    "per-thread hook that can record it instead",
    "math": "math's functions (fx's autowrap_modules) and a model module's globals holding such "
    "a function or a leaf function (fx's autowrap): a C function handed a traced size must be "
    "recorded, not computed on the size's value, and no TorchFunctionMode sees math",
    "torch.utils.checkpoint.checkpoint": "also its aliases imported or held by the model's "
    "modules: checkpoint(block.forward, x) must become a call of the block, and torch's "
    "checkpoint would run its saved-tensor hooks and autograd Function on traced values",
    "callable": "added to the model's own modules' globals: callable() reads the type, which "
    "is the proxy class for any traced value, not __class__ as isinstance does",
    "type": "added to the model's own modules' globals: type(v) is the proxy class for any "
    "traced value (type(x) is torch.Tensor took the other branch, silently), and no hook "
    "changes what the builtin returns",
    "torch.autograd.Function.apply": "apply, forward and setup_context of a custom autograd "
    "Function the trace found opaque, on its retry: each call becomes one node, and apply "
    "is a classmethod no TorchFunctionMode sees",
    "leaf function attributes": "a leaf function a model's module holds as an attribute "
    "(self.op = fn), an attribute of the model itself: recorded as one node",
}
TRACING_LOCK = threading.RLock()
_MISSING = object()
_REGISTRY_LOCK = threading.Lock()
_LOCAL = threading.local()
# (id(target), name) -> [target, name, original, dispatcher, refcount, had_own_entry]
_INSTALLED: dict[tuple[int, str], list] = {}


def _stacks() -> dict[tuple[int, str], list[Callable]]:
    return _LOCAL.__dict__.setdefault("stacks", {})


def _read(target: Any, name: str) -> Any:
    if isinstance(target, dict):
        return target.get(name, _MISSING)
    return getattr(target, name, _MISSING)


def _own_entry(target: Any, name: str) -> bool:
    return name in target if isinstance(target, dict) else name in vars(target)


def _write(target: Any, name: str, value: Any) -> None:
    if isinstance(target, dict):
        if value is _MISSING:
            target.pop(name, None)
        else:
            target[name] = value
    elif value is _MISSING:
        delattr(target, name)
    else:
        setattr(target, name, value)


def _make_dispatcher(key: tuple[int, str], original: Callable) -> Callable:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_LOCAL, "stacks", {}).get(key)
        if stack:
            return stack[-1](*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__tread_dispatch__ = key  # type: ignore[attr-defined]
    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch


def unpatched(target: Any, name: str) -> Any:
    """``target.name`` as it is without any :func:`thread_local_patch` (for graph targets)."""
    value = _read(target, name)
    return value.__wrapped__ if is_dispatcher(value) else value


def is_dispatcher(value: Any) -> bool:
    """Whether ``value`` is a dispatcher :func:`thread_local_patch` installed."""
    return hasattr(value, "__tread_dispatch__")


def _install(target: Any, name: str) -> tuple[tuple[int, str], Callable]:
    """Install (or reuse) the dispatcher of ``target.name``; return its key and the original."""
    key = (id(target), name)
    with _REGISTRY_LOCK:
        record = _INSTALLED.get(key)
        if record is None:
            own = _own_entry(target, name)
            original = _read(target, name)
            if original is _MISSING and isinstance(target, dict):
                original = getattr(builtins, name)  # fx patches ``len`` into a module's globals
            record = [target, name, original, _make_dispatcher(key, original), 0, own]
            _INSTALLED[key] = record
            _write(target, name, record[3])
        record[4] += 1
        return key, record[2]


def _uninstall(key: tuple[int, str]) -> None:
    with _REGISTRY_LOCK:
        record = _INSTALLED[key]
        record[4] -= 1
        if record[4] == 0:
            target, name, original, _, _, own = record
            del _INSTALLED[key]
            _write(target, name, original if own else _MISSING)


@contextlib.contextmanager
def thread_local_patch(
    target: Any, name: str, make: Callable[[Callable], Callable]
) -> Iterator[Callable]:
    """Replace ``target.name`` (or ``target[name]`` for a dict) for the calling thread only.

    Args:
        target: A module, class, object or namespace dict.
        name: The attribute (or key) to replace.
        make: Builds the replacement from ``previous``, what this thread would call without
            this patch (the original, or an outer patch of the same name in this thread).

    Yields:
        The replacement.

    Example:
        >>> import random, threading
        >>> seen = []
        >>> with thread_local_patch(random, "random", lambda previous: lambda: 0.5):
        ...     t = threading.Thread(target=lambda: seen.append(random.random() != 0.5))
        ...     t.start(); t.join()
        ...     random.random(), seen
        (0.5, [True])
    """
    key, original = _install(target, name)
    stack = _stacks().setdefault(key, [])
    replacement = make(stack[-1] if stack else original)
    stack.append(replacement)
    try:
        yield replacement
    finally:
        stack.remove(replacement)
        if not stack:
            _stacks().pop(key, None)
        _uninstall(key)


@contextlib.contextmanager
def thread_local_patches(patches: Iterable[tuple[Any, str, Callable]]) -> Iterator[None]:
    """:func:`thread_local_patch` for each ``(target, name, make)`` of ``patches``, in order."""
    with contextlib.ExitStack() as stack:
        for target, name, make in list(patches):
            stack.enter_context(thread_local_patch(target, name, make))
        yield


class _ThreadPatcher(fx_trace._Patcher):
    """fx's patcher, patching through :func:`thread_local_patch` instead of ``setattr``."""

    def __init__(self) -> None:
        super().__init__()
        self._exits = contextlib.ExitStack()

    def patch(self, target: Any, name: str, new_fn: Callable, deduplicate: bool = True) -> None:
        """Patch ``target.name`` (a globals dict's entry or a class attribute) for this thread."""
        new_fn.__fx_already_patched = deduplicate  # type: ignore[attr-defined]
        current = _read(target, name)
        if is_dispatcher(current):
            stack = _stacks().get(current.__tread_dispatch__)
            current = stack[-1] if stack else current
        if deduplicate and (
            getattr(current, "__fx_already_patched", False) or is_dispatcher(current)
        ):
            return  # an outer trace in this thread wrapped it (fx's wrappers serve any tracer)
        self._exits.enter_context(thread_local_patch(target, name, lambda previous: new_fn))

    patch_method = patch

    def revert_all_patches(self) -> list:  # noqa: D102 - only fx's CURRENT_PATCHER uses these
        return []

    def reapply_all_patches(self) -> list:  # noqa: D102
        return []

    def __exit__(self, *exc: Any) -> None:
        self._exits.close()
        self.visited.clear()


def trace_patching_this_thread(tracer: fx.Tracer, root: nn.Module) -> fx.Graph:
    """``tracer.trace(root)``, whose patches (``nn.Module.__call__`` ...) go through
    :func:`thread_local_patch`, so another thread calling any ``nn.Module`` during the trace
    runs the real ``__call__``.

    fx's own ``Tracer.trace`` code runs, with a copy of its module's globals in which
    ``_new_patcher`` makes this thread's patcher: no name of fx's module is replaced. Where
    dynamo has wrapped ``Tracer.trace`` (``disable``, once a first ``torch.compile`` imported
    it), the copy is wrapped alike.
    """
    namespace = {**vars(fx_trace), "_new_patcher": _ThreadPatcher}
    trace = inspect.unwrap(fx.Tracer.trace)
    run = types.FunctionType(trace.__code__, namespace, trace.__name__, trace.__defaults__)
    if fx.Tracer.trace is not trace:
        run = sys.modules["torch._dynamo"].disable(run)
    return run(tracer, root)
