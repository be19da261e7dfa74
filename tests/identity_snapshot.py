"""Identity of every callable a bystander thread can reach by name: module globals and the
attributes of a few classes the tracer has patched (``torch.Tensor``, ``nn.Module``, custom
autograd Functions). Used by the bystander-thread tests to list what a trace replaces.

Example:
    >>> before = snapshot()
    >>> changed(before, snapshot())
    []
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

__all__ = ["snapshot", "changed"]

_MISSING = object()


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def _classes() -> list[type]:
    roots = [torch.Tensor, torch._C.TensorBase, nn.Module, torch.autograd.Function]
    return roots + _subclasses(torch.autograd.Function)


def snapshot(*objects: Any) -> dict[str, dict[str, Any]]:
    """Each loaded module's globals, the classes' own attributes, and ``vars()`` of each of
    ``objects`` (a model's modules): name to the object itself (compared by identity)."""
    spaces: dict[str, dict[str, Any]] = {}
    for name, module in list(sys.modules.items()):
        space = getattr(module, "__dict__", None)
        if isinstance(space, dict):
            spaces[f"module {name}"] = dict(space)
    for cls in _classes():
        spaces[f"class {cls.__module__}.{cls.__qualname__}@{id(cls)}"] = dict(vars(cls))
    for obj in objects:
        spaces[f"object {type(obj).__qualname__}@{id(obj)}"] = dict(vars(obj))
    return spaces


def changed(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """``space: name`` of every callable entry of ``before`` that is not the very same object
    in ``after``, and of every callable entry ``after`` added (spaces of ``before`` only)."""
    found = []
    for space, entries in before.items():
        now = after.get(space)
        if now is None:
            continue
        for name in entries.keys() | now.keys():
            old, new = entries.get(name, _MISSING), now.get(name, _MISSING)
            if old is new or not (callable(old) or callable(new)):
                continue
            found.append(f"{space}: {name}")
    return sorted(found)
