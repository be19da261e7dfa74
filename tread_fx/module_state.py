"""What of a model's module tree a routed call checks, at a cost independent of its size.

A routed graph bakes in the ``training`` flag of every module whose code it holds inlined
(``if self.training:`` in the model's own forward); modules it *calls* (the blocks, every
``torch.nn`` layer) read their own flag when called. So the cache key of a call holds the
flags of the modules the trace went through only: for a block-stack model a handful (the root,
the embedders, the final layer), whatever the depth. Before the first trace every module is
watched. The module tuples are kept between calls, and whether any hook was registered
anywhere since the last call (``fully_shard`` after a trace: an inlined module must be called
again) is read from torch's hook-handle counter (every ``register_*_hook`` takes a new id).

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    >>> modes = ModuleModes()
    >>> modes.hooks_changed(), modes.modes(model.eval())
    (True, (False, False, False))
    >>> modes.watch(model, {""}), modes.modes(model)  # a trace that called both layers
    (True, (False,))
    >>> _ = model[0].register_forward_pre_hook(lambda m, a: None)
    >>> modes.hooks_changed()
    True
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

__all__ = [
    "check_call",
    "ModuleModes",
    "traced_through",
    "call_signature",
]

_TRAINING = operator.attrgetter("training")


def traced_through(model: nn.Module, called: list[str]) -> set[str]:
    """Paths of ``model``'s modules that are not (inside) one of the ``called`` modules: those
    whose code the trace went through (``""`` is the model itself).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.ReLU())
        >>> sorted(traced_through(model, ["0.0", "1"]))
        ['', '0']
    """
    prefixes = tuple(f"{path}." for path in called)
    return {path for path, _ in model.named_modules() if not f"{path}.".startswith(prefixes)}


class ModuleModes:
    """The per-call module checks of one routed model (see the module docstring)."""

    def __init__(self) -> None:
        self._hook_id = -1
        self._root: nn.Module | None = None
        self._children = -1
        self._paths: set[str] | None = None  # None: every module
        self._watched: tuple[nn.Module, ...] = ()

    def hooks_changed(self) -> bool:
        """Whether a hook was registered (on any module or tensor) since the last call.

        Always ``False`` under ``torch.compile``: compiled code must not read a counter that
        changes (it would recompile); hooks belong on the model before it is compiled.
        """
        if torch.compiler.is_compiling():
            return False
        current = RemovableHandle.next_id
        changed, self._hook_id = current != self._hook_id, current
        return changed

    def watch(self, model: nn.Module, paths: set[str]) -> bool:
        """Watch the modules at ``paths`` too (a new trace went through them); whether the
        watched set changed (keys computed before are stale)."""
        merged = paths if self._paths is None else self._paths | paths
        if merged == self._paths:
            return False
        self._paths = merged
        self._take(model)
        return True

    def _take(self, model: nn.Module) -> None:
        self._root, self._children = model, len(model._modules)
        self._watched = tuple(
            module
            for path, module in model.named_modules()
            if self._paths is None or path in self._paths
        )

    def modes(self, model: nn.Module, refresh: bool = False) -> tuple[bool, ...]:
        """The ``training`` flags of the watched modules (``model.modules()`` order).

        The module tuple is taken again when ``refresh`` is set (a hook was registered), or
        the model or its number of direct children changed (submodules swapped deep inside a
        model are not noticed otherwise; routing does not support changing its structure).
        """
        if refresh or model is not self._root or len(model._modules) != self._children:
            self._take(model)
        if torch.compiler.is_compiling():  # dynamo cannot call an attrgetter
            return tuple(m.training for m in self._watched)
        return tuple(map(_TRAINING, self._watched))


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return ("unhashable", type(value).__qualname__, id(value))


def call_signature(spec: pytree.TreeSpec, flat: list, modes: tuple[bool, ...]) -> tuple:
    """The cache key of a call: input structure, tensor shapes/dtypes/devices, other inputs
    (by value, or identity when unhashable), module modes, autocast and grad mode."""
    leaves = tuple(
        (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else _hashable(v)
        for v in flat
    )
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return spec, leaves, modes, autocast, torch.is_grad_enabled()


def check_call(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise the ``TypeError`` the unrouted model raises for a call that does not fit its forward.

    A missing or unexpected argument is the caller's mistake, not the tracer's: it is reported
    exactly as ``type(model).forward`` reports it, before anything is traced.

    Raises:
        TypeError: The arguments do not bind to ``type(model).forward``.

    Example:
        >>> import tread_fx
        >>> model = tread_fx.models.DiT_S_2(input_size=8, depth=2)
        >>> check_call(model, (1, 2), {})
        Traceback (most recent call last):
        TypeError: DiT.forward() missing 1 required positional argument: 'y'
    """
    forward = inspect.unwrap(type(model).forward)
    if not inspect.isfunction(forward) or hasattr(forward, "__signature__"):
        return  # a builtin or a declared signature: let the call itself decide
    try:
        inspect.signature(forward).bind(model, *args, **kwargs)
    except TypeError:
        # Binding fails the same way for the real function, before its body runs, so this
        # raises the very TypeError the unrouted model raises (same message).
        forward(model, *args, **kwargs)
        raise
