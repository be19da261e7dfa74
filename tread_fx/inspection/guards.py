"""The specialisations a trace fixes: what a call must match to reuse a routed graph.

A routed graph is specialised to its input signature (tensor shapes, dtypes, devices and the
non-tensor arguments), the modules' training flags, grad mode and autocast (``route()`` keys
its trace cache on exactly these), and to the shape-derived Python values the tracer resolved
(``B, N, C = x.shape``, ``if H != self.img_size``, ``int(N ** 0.5)``). This module lists them.

Example:
    >>> import torch
    >>> from tread_fx.inspection.guards import signature_guards
    >>> lin = torch.nn.Linear(4, 4)
    >>> [str(g) for g in signature_guards(lin, (torch.randn(2, 4),), {})][0]
    'input     input = Tensor[2, 4] float32 cpu'
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.passes.trace import tracer as trace_pass

__all__ = [
    "Guard",
    "signature_guards",
    "input_names",
    "recording_specialisations",
    "specialisation_guards",
    "describe",
]

_BINARY = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.truediv: "/",
    operator.floordiv: "//",
    operator.mod: "%",
    operator.pow: "**",
    operator.eq: "==",
    operator.ne: "!=",
    operator.lt: "<",
    operator.le: "<=",
    operator.gt: ">",
    operator.ge: ">=",
}


@dataclass(frozen=True)
class Guard:
    """One specialisation: its kind, what it is about, and the value fixed at trace time."""

    kind: str
    what: str
    value: str
    note: str = ""

    def __str__(self) -> str:
        note = f"  ({self.note})" if self.note else ""
        return f"{self.kind:<9} {self.what} = {self.value}{note}"


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        shape = ", ".join(map(str, value.shape))
        dtype = str(value.dtype).replace("torch.", "")
        return f"Tensor[{shape}] {dtype} {value.device}"
    return repr(value)


def input_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """Names of the flattened call leaves, from the forward's signature (``x``, ``t``, ...)."""
    try:
        bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
        params = {n: v for n, v in bound.arguments.items() if v is not model}
        flat, _ = pytree.tree_flatten_with_path(params)
        return [pytree.keystr(path).strip("[]'\"") for path, _ in flat]
    except (TypeError, ValueError):
        flat, _ = pytree.tree_flatten_with_path((args, kwargs))
        return [pytree.keystr(path) for path, _ in flat]


def signature_guards(model: nn.Module, args: tuple, kwargs: dict) -> list[Guard]:
    """Guards of the call signature, the training flags, grad mode and the autocast state."""
    leaves = pytree.tree_leaves((args, kwargs))
    names = input_names(model, args, kwargs)
    if len(names) != len(leaves):
        names = [f"leaf{i}" for i in range(len(leaves))]
    guards = [
        Guard("input" if isinstance(v, torch.Tensor) else "constant", n, _describe_value(v))
        for n, v in zip(names, leaves)
    ]
    modes = [m.training for m in model.modules()]
    guards.append(Guard("mode", f"training flags of {len(modes)} modules", "all True (train)"))
    guards.append(Guard("mode", "grad mode", "enabled" if torch.is_grad_enabled() else "disabled"))
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            dtype = str(torch.get_autocast_dtype(device)).replace("torch.", "")
            guards.append(Guard("autocast", device, dtype))
    return guards


@contextlib.contextmanager
def recording_specialisations() -> Iterator[list[tuple[fx.Node, str, Any]]]:
    """Record every shape-derived value the tracer turns into a Python constant.

    Yields a list that fills with ``(node, what, value)`` of the last trace attempt (a trace
    retried with an auto-leaf starts over).
    """
    tracer_cls = trace_pass.ValueTracer
    records: list[tuple[fx.Node, str, Any]] = []
    original_concrete, original_structure = tracer_cls.concrete, tracer_cls.structure
    last: dict[str, Any] = {"tracer": None}

    def note(tracer: Any, proxy: fx.Proxy, what: str, value: Any) -> None:
        if last["tracer"] is not tracer:
            records.clear()
            last["tracer"] = tracer
        node = getattr(proxy, "node", None)
        if isinstance(node, fx.Node) and not tracer.running_eager:
            records.append((node, what, value))

    def concrete(self: Any, proxy: fx.Proxy, what: str) -> Any:
        value = original_concrete(self, proxy, what)
        note(self, proxy, what, value)
        return value

    def structure(self: Any, proxy: fx.Proxy, what: str) -> Any:
        value = original_structure(self, proxy, what)
        if not isinstance(value, torch.Tensor):
            note(self, proxy, what, value)
        return value

    tracer_cls.concrete, tracer_cls.structure = concrete, structure
    try:
        yield records
    finally:
        tracer_cls.concrete, tracer_cls.structure = original_concrete, original_structure


def describe(node: Any, names: dict[str, str], depth: int = 0) -> str:
    """A Python-like expression for a shape-derived node (``x.shape[2] * 2``)."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if depth > 6:
        return node.name
    if node.op == "placeholder":
        return names.get(node.name, node.name)
    sub = lambda a: describe(a, names, depth + 1)
    if node.op == "call_function" and node.target is getattr:
        return f"{sub(node.args[0])}.{node.args[1]}"
    if node.op == "call_function" and node.target is operator.getitem:
        return f"{sub(node.args[0])}[{sub(node.args[1])}]"
    if node.op == "call_function" and node.target in _BINARY and len(node.args) == 2:
        return f"({sub(node.args[0])} {_BINARY[node.target]} {sub(node.args[1])})"
    if node.op == "call_method" and node.target == "size" and len(node.args) == 2:
        return f"{sub(node.args[0])}.shape[{sub(node.args[1])}]"
    if node.op == "call_method" and node.args:
        inner = ", ".join(sub(a) for a in node.args[1:])
        return f"{sub(node.args[0])}.{node.target}({inner})"
    if node.op == "call_function" and node.target is len:
        return f"len({sub(node.args[0])})"
    return node.name


def specialisation_guards(
    records: list[tuple[fx.Node, str, Any]], placeholder_names: dict[str, str]
) -> list[Guard]:
    """Turn recorded specialisations into guards (one per distinct expression)."""
    guards, seen = [], set()
    for node, what, value in records:
        expr = describe(node, placeholder_names)
        if isinstance(value, torch.Size):
            value = tuple(value)
        elif isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
            what, value = f"{what}: number of items", len(value)
        key = (expr, repr(value))
        if key in seen:
            continue
        seen.add(key)
        module = node.meta.get("nn_module_stack")
        note = what
        if module:
            last = list(module)[-1] if isinstance(module, dict) else module[-1]
            note += f", in {str(last).removeprefix(trace_pass.MODEL_PREFIX)}"
        if len(expr) > 60:
            expr = expr[:57] + "..."
        guards.append(Guard("shape", expr, repr(value), note))
    return guards
