"""Block containers and their members: lists, and runs of block attributes of one parent.

A stack's blocks usually sit in a ``ModuleList``/``Sequential`` (the container's path names
it, ``"blocks"``; its members are ``blocks.0``, ``blocks.1`` ...). A model may instead hold its
blocks as attributes of one parent (``self.blk0``, ``self.blk1`` ... called one after the
other): such a **run** is named by its parent and its members in brace notation,
``"{blk0,blk1,blk2}"`` at the top level, ``"encoder.{a,b}"`` below (module paths never hold
braces). A run's candidates are the >= 2 children of one parent that share a class and hold
layers of their own (a block is made of layers; ``q``/``k``/``v`` projections or ``fc1``/``fc2``
side by side are layers, never blocks); whether they are a stack is decided after the trace by
data flow (each called once, each handing the stream to the next, in the order of the calls).

Example:
    >>> from torch import nn
    >>> m = nn.Module()
    >>> m.a, m.b = nn.Module(), nn.Module()
    >>> m.a.fc, m.b.fc = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> list(attribute_runs(m, ()))
    ['{a,b}']
    >>> [p for p, _ in stack_members(m, "{a,b}")], member_path("b.fc", "{a,b}")
    (['a', 'b'], 'b')
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from torch import nn

from tread_fx.errors import BlockStackNotFoundError

__all__ = [
    "attribute_runs",
    "checked_run",
    "is_composite",
    "is_run",
    "member_path",
    "run_key",
    "stack_members",
]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def run_key(parent: str, names: Iterable[str]) -> str:
    """The path of the run of ``parent``'s children ``names``: ``"{a,b}"``, ``"p.{a,b}"``.

    Example:
        >>> run_key("encoder", ["blk0", "blk1"])
        'encoder.{blk0,blk1}'
    """
    group = "{" + ",".join(names) + "}"
    return f"{parent}.{group}" if parent else group


def _run_parts(key: str) -> tuple[str, list[str]] | None:
    """``(parent, names)`` of a run's path; ``None`` for a container's path."""
    if not key.endswith("}") or "{" not in key:
        return None
    head, _, group = key[:-1].rpartition("{")
    return head.removesuffix("."), group.split(",")


def is_run(key: str) -> bool:
    """Whether ``key`` names a run of block attributes (not a container).

    Example:
        >>> is_run("{blk0,blk1}"), is_run("blocks")
        (True, False)
    """
    return _run_parts(key) is not None


def _joined(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name


def stack_members(model: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of each member of the container or run at ``key``, in definition
    order (a run's blocks run in the order data flow shows; see the module docstring).

    Raises:
        AttributeError: ``key`` names no submodule (or a run member is missing).
    """
    parts = _run_parts(key)
    if parts is None:
        container = model.get_submodule(key)
        return [(_joined(key, n), m) for n, m in container.named_children()]
    parent, names = parts
    base = model.get_submodule(parent)
    return [(_joined(parent, n), base.get_submodule(n)) for n in names]


def checked_run(model: nn.Module, path: str) -> str:
    """A ``blocks=`` run (``"{blk0,blk1}"``) whose members all exist (else refused)."""
    try:
        stack_members(model, path)
    except AttributeError:
        raise BlockStackNotFoundError(
            f"blocks={path!r} names a run of block attributes, but {type(model).__name__} "
            "lacks one of them; name the attributes that hold the blocks, e.g. "
            "blocks='{blk0,blk1}' (or 'parent.{a,b}' below the top level)."
        ) from None
    return path


def member_path(path: str, key: str) -> str:
    """The member of the container or run ``key`` that the module at ``path`` lies in
    (``path`` itself for a member; ``"blocks.3"`` for ``"blocks.3.attn"``).

    Example:
        >>> member_path("blocks.3.attn", "blocks"), member_path("enc.b1", "enc.{b0,b1}")
        ('blocks.3', 'enc.b1')
    """
    parts = _run_parts(key)
    base = key if parts is None else parts[0]
    rest = path[len(base) + 1 :] if base else path
    return _joined(base, rest.split(".")[0])


def is_composite(module: nn.Module) -> bool:
    """A module made of layers (a block), not a layer itself nor a container."""
    return not isinstance(module, _CONTAINERS) and next(module.children(), None) is not None


def attribute_runs(
    model: nn.Module, taken: Iterable[str], class_of: Callable[[nn.Module], type] = type
) -> dict[str, list[nn.Module]]:
    """Runs of >= 2 same-class composite children of one parent (``self.blk0``,
    ``self.blk1`` ...), by path; parents that are containers or lie in a member of a container
    in ``taken`` (traced as one leaf) are skipped. ``class_of`` gives a member's class."""
    inside = tuple(f"{p}." if p else "" for p in taken)
    runs: dict[str, list[nn.Module]] = {}
    for path, parent in model.named_modules():
        if isinstance(parent, _CONTAINERS) or (inside and path.startswith(inside)):
            continue
        groups: dict[type, list[str]] = defaultdict(list)
        for name, child in parent.named_children():
            if is_composite(child):
                groups[class_of(child)].append(name)
        for names in groups.values():
            if len(names) >= 2:
                runs[run_key(path, names)] = [parent.get_submodule(n) for n in names]
    return runs
