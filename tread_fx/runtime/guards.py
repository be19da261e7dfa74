"""Runtime guards for values the tracer read from tensor data.

When the model's forward turns tensor *data* into Python (``if mask.any():``, ``n =
lengths.max().item()``), the tracer resolves it with the traced inputs' value and inserts
:func:`check_traced_value` into the routed graph, which recomputes the value on every call.
A mismatch raises a ``RuntimeError`` carrying :data:`GUARD_MARK` and the file and line;
``route()`` then traces again for those inputs (eager) or raises a clear error (compiled).

The check never asserts on the device (a failed CUDA assert poisons the context, and the
re-trace could not run): the custom op ``tread_fx::check_guard`` reads the comparison on the
host (on CUDA one synchronising bool copy per guard per routed call) and raises there. It is
opaque to ``torch.compile``, so ``fullgraph=True`` compiles around it without a graph break.

Example:
    >>> import torch
    >>> check_traced_value(torch.tensor([0, 1]).any(), True, "bool", "model.py:3")
    >>> try:
    ...     check_traced_value(torch.tensor(3), 2, "int", "model.py:4")
    ... except RuntimeError as err:
    ...     print(GUARD_MARK in str(err))
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["GUARD_MARK", "check_traced_value", "check_traced_length"]

GUARD_MARK = "tread_fx traced-value guard"


@torch.fx.node.has_side_effect
def check_traced_value(value: Any, expected: Any, kind: str, where: str) -> None:
    """Check that ``value`` (a tensor) still gives the Python value ``expected``.

    Args:
        value: The tensor the forward read (``mask.any()``, ``lengths.max()``).
        expected: What it gave when traced (``bool``, ``int``, ``float`` or nested lists).
        kind: How the forward read it: ``"bool"``, ``"int"``, ``"float"`` or ``"item"``.
        where: ``file:line`` of the read, for the error.
    """
    message = f"{GUARD_MARK}: the value read at {where} differs from the traced {expected!r}"
    target = torch.as_tensor(expected, device=value.device)
    if tuple(value.shape) != tuple(target.shape) and target.dim() > 0:
        raise RuntimeError(message)
    if kind == "bool":
        same = (value != 0) == target
    elif kind == "int":
        same = value.trunc() == target if value.is_floating_point() else value == target
    else:
        same = value == target.to(value.dtype)
    torch.ops.tread_fx.check_guard(same.all(), message)


@torch.library.custom_op("tread_fx::check_guard", mutates_args=())
def _check_guard(same: torch.Tensor, message: str) -> None:
    if not bool(same):  # host-side: on CUDA a sync, never a device assert
        raise RuntimeError(message)


@_check_guard.register_fake
def _(same: torch.Tensor, message: str) -> None:
    return None


# no output: marked side-effectful so that graph compilers (dead-code elimination) keep it
torch.fx.node.has_side_effect(torch.ops.tread_fx.check_guard.default)


@torch.fx.node.has_side_effect
def check_traced_length(value: Any, expected: int, where: str) -> None:
    """Check that a tuple or list a library function returned still has ``expected`` items.

    The forward unpacked it (``x, ps = pack([x], "b * d")``); the number of items was read
    while tracing, so a call where the function returns another number must trace again.

    Example:
        >>> check_traced_length((1, [2]), 2, "model.py:5")
    """
    if len(value) != expected:
        raise RuntimeError(
            f"{GUARD_MARK}: the value unpacked at {where} has {len(value)} items, traced {expected}"
        )
