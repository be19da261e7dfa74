"""Leaf registries: modules and functions that tracing records as one opaque call.

Like timm's ``register_notrace_module``/``register_notrace_function``: a registered module
class is never traced into (its calls become a single ``call_module`` node); a registered
function becomes a single ``call_function`` node wherever the model's code calls it by a
global name. Use this for code that branches on tensor data, loops over a sequence (a
selective scan), or calls into C extensions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

from tread_fx.errors import RegistrationError

__all__ = [
    "register_leaf_module",
    "register_leaf_function",
    "leaf_modules",
    "leaf_functions",
]

_LEAF_MODULES: set[type[nn.Module]] = set()
_LEAF_FUNCTIONS: list[Callable] = []

M = TypeVar("M", bound=type)
F = TypeVar("F", bound=Callable)


def register_leaf_module(cls: M) -> M:
    """Register a module class whose calls tracing records as one node.

    Usable as a decorator. Subclasses of a registered class are leaves too.

    Args:
        cls: An ``nn.Module`` subclass.

    Returns:
        ``cls`` unchanged.

    Example:
        >>> import torch, tread_fx
        >>> @tread_fx.register_leaf_module
        ... class Scan(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise RegistrationError(
            f"register_leaf_module expects an nn.Module subclass, got {cls!r}; "
            "pass the class itself (not an instance), or use register_leaf_function for functions."
        )
    _LEAF_MODULES.add(cls)
    return cls


def register_leaf_function(fn: F) -> F:
    """Register a function that tracing records as one ``call_function`` node.

    Usable as a decorator. The function must be called through a module-level (global) name
    of the file that calls it, and that name must not start with an underscore (torch.fx's
    autowrap skips private names).

    Args:
        fn: A plain Python function taking and returning tensors.

    Returns:
        ``fn`` unchanged.

    Example:
        >>> import torch, tread_fx
        >>> @tread_fx.register_leaf_function
        ... def my_scan(x: torch.Tensor) -> torch.Tensor:
        ...     return x.cumsum(1)
        >>> my_scan in tread_fx.registry.leaf_functions()
        True
    """
    if not callable(fn) or isinstance(fn, type):
        raise RegistrationError(
            f"register_leaf_function expects a function, got {fn!r}; "
            "use register_leaf_module for nn.Module classes."
        )
    if fn not in _LEAF_FUNCTIONS:
        _LEAF_FUNCTIONS.append(fn)
    return fn


def leaf_modules() -> tuple[type[nn.Module], ...]:
    """Return the registered leaf module classes."""
    return tuple(_LEAF_MODULES)


def leaf_functions() -> tuple[Callable, ...]:
    """Return the registered leaf functions."""
    return tuple(_LEAF_FUNCTIONS)
