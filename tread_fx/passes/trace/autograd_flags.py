"""``x.requires_grad`` in traced code, answered as the training call would see it.

The trace computes its values without gradients on detached copies, so a traced tensor's own
``requires_grad`` is always ``False``; code branching on it (``if self.use_checkpoint and
x.requires_grad: x = checkpoint(...)``) was refused as reading autograd state. Whether a value
requires grad in the real call follows from the graph: it is a floating tensor computed, with
grad enabled (the traced code's grad mode, itself part of the call key), from a parameter or
an input that requires grad, by ops other than ``detach``. Each node's flag is kept as the
trace runs (:func:`requires_grad_of`); a read of ``requires_grad`` is answered from it and
checked on every routed call (:func:`check_requires_grad`): a parameter frozen after the trace
fails loudly instead of taking the other branch silently. The rest of autograd's state
(``grad_fn``, ``is_leaf``, the version counter) stays refused.

Example:
    >>> import torch
    >>> check_requires_grad(torch.ones(1), False, "model.py:3")
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from tread_fx.passes.trace import dataclass_args
from tread_fx.passes.trace.support import user_frame
from tread_fx.runtime.guards import GUARD_MARK

__all__ = ["answer_requires_grad", "check_requires_grad", "requires_grad_of", "with_grad_flags"]

_DETACHING = frozenset(("detach", "detach_"))


def requires_grad_of(tracer: Any, kind: str, target: Any, node: fx.Node, value: Any) -> bool:
    """Whether ``node``'s value requires grad in the real call (see module docstring)."""
    if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
        return False
    if kind == "placeholder":
        return tracer.input_grads.get(target, False)
    if kind == "get_attr":
        return value.requires_grad
    if not torch.is_grad_enabled() or target in _DETACHING or target is torch.detach:
        return False
    if kind == "call_module" and any(
        p.requires_grad for p in tracer.root.get_submodule(target).parameters()
    ):
        return True
    return any(flag_of(tracer, n) for n in node.all_input_nodes)


def flag_of(tracer: Any, node: fx.Node) -> bool:
    """The kept flag of ``node`` (a ``get_attr`` fx made for a tensor attribute: its own)."""
    if node in tracer.grad_flags:
        return tracer.grad_flags[node]
    value = tracer.values.get(node)
    return node.op == "get_attr" and isinstance(value, torch.Tensor) and value.requires_grad


def with_grad_flags(tracer: Any, tree: Any) -> Any:
    """The values of the proxies in ``tree``, each tensor that requires grad in the real call
    as a detached copy that does (a block's kept example inputs: traced through, it answers
    ``requires_grad`` as in training)."""

    def value(a: Any) -> Any:
        if dataclass_args.is_instance(a):
            return dataclass_args.map_fields(a, lambda v: fx.node.map_aggregate(v, value))
        if not isinstance(a, fx.Proxy):
            return a
        real = tracer.value_of(a)
        if isinstance(real, torch.Tensor) and flag_of(tracer, a.node):
            return real.detach().requires_grad_()
        return real

    return fx.node.map_aggregate(tree, value)


def answer_requires_grad(proxy: fx.Proxy) -> bool:
    """``proxy.requires_grad`` as the training call sees it, with a check on every call."""
    tracer = proxy.tracer
    answer = flag_of(tracer, proxy.node)
    check = (proxy.node, answer, user_frame())
    tracer.graph.create_node("call_function", check_requires_grad, check, {})
    return answer


def check_requires_grad(tensor: torch.Tensor, expected: bool, where: str) -> None:
    """Check that ``tensor.requires_grad`` is what the trace answered at ``where``.

    Example:
        >>> check_requires_grad(torch.ones(1, requires_grad=True), True, "model.py:3")
    """
    if tensor.requires_grad != expected:
        raise RuntimeError(
            f"{GUARD_MARK}: requires_grad read at {where} is {tensor.requires_grad}, traced as "
            f"{expected} (a parameter frozen or unfrozen after the trace?)"
        )
