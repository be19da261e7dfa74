"""What of a model's module tree a routed call checks, at a cost independent of its size.

Every routed call needs the training flag of every submodule (an inlined module's
``if self.training:`` is baked into its trace) and must notice hooks added after a trace
(``fully_shard`` gathers parameters in a pre-hook). Walking ``model.modules()`` on every call
costs in proportion to the module count; :class:`ModuleModes` keeps the module tuple and reads
the flags with one C-level ``map``, and tells whether any hook was registered anywhere since
the last call from torch's hook-handle counter (every ``register_*_hook`` takes a new id).

Example:
    >>> import torch
from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    >>> modes = ModuleModes()
    >>> modes.hooks_changed(), modes.modes(model.eval(), refresh=True)
    (True, (False, False, False))
    >>> modes.hooks_changed()
    False
    >>> _ = model[0].register_forward_pre_hook(lambda m, a: None)
    >>> modes.hooks_changed()
    True
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ModuleModes"]

_TRAINING = operator.attrgetter("training")


class ModuleModes:
    """The per-call module checks of one routed model (see the module docstring)."""

    def __init__(self) -> None:
        self._hook_id = -1
        self._root: nn.Module | None = None
        self._modules: tuple[nn.Module, ...] = ()
        self._children = -1

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

    def modes(self, model: nn.Module, refresh: bool = False) -> tuple[bool, ...]:
        """The ``training`` flag of every module of ``model`` (``model.modules()`` order).

        The module tuple is taken again when ``refresh`` is set (a hook was registered), or
        the model or its number of direct children changed (submodules swapped deep inside a
        model are not noticed otherwise; routing does not support changing its structure).
        """
        children = len(model._modules)
        if refresh or model is not self._root or children != self._children:
            self._root, self._children = model, children
            self._modules = tuple(model.modules())
        if torch.compiler.is_compiling():  # dynamo cannot call an attrgetter
            return tuple(m.training for m in self._modules)
        return tuple(map(_TRAINING, self._modules))
