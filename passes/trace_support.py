"""Tracing aids for third-party models: what the value-carrying tracer patches while it runs.

- :func:`report_grad_mode`: traced code sees the caller's grad mode although the trace runs
  without grad (diffusers checkpoints blocks only when ``torch.is_grad_enabled()``).
- :func:`factories_take_proxies`: ``torch.ones(b, n)`` with traced sizes, and every random
  draw, become graph calls.
- :func:`name_placeholders`: each tensor input's argument name, for rules keyed on it.

Example:
    >>> # used by tread_fx.passes.trace.trace_call
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["report_grad_mode", "factories_take_proxies", "name_placeholders"]

_FACTORIES = (
    "ones", "zeros", "empty", "full", "rand", "randn", "randint", "arange", "tensor", "as_tensor"
)  # fmt: skip


@contextlib.contextmanager
def factories_take_proxies(tracer: Any) -> Iterator[None]:
    """Record ``torch.ones(b, n)`` with traced sizes as a graph call.

    torch's argument parser rejects proxies as varargs sizes before ``__torch_function__``
    can see them (HunyuanVideo builds its mask with ``torch.ones(batch, seq_len)``). Random
    factories called by traced code are always graph calls, even with constant sizes, so a
    draw is never baked into the graph as a constant.
    """
    originals = {name: getattr(torch, name) for name in _FACTORIES}
    random = {torch.rand, torch.randn, torch.randint}  # never baked in as constants

    def wrap(fn):
        def factory(*args: Any, **kwargs: Any) -> Any:
            flat = pytree.tree_leaves((args, kwargs))
            traced = any(isinstance(a, fx.Proxy) for a in flat) or fn in random
            if tracer.running_eager or not traced:
                return fn(*args, **kwargs)
            return tracer.create_proxy("call_function", fn, args, kwargs)

        return factory

    try:
        for name, fn in originals.items():
            setattr(torch, name, wrap(fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


@contextlib.contextmanager
def report_grad_mode(tracer: Any, enabled: bool) -> Iterator[None]:
    """Let traced code see the caller's grad mode although the trace runs without grad.

    diffusers calls its blocks through gradient checkpointing only under
    ``torch.is_grad_enabled() and self.gradient_checkpointing``; the trace must take that
    branch when the training call would. Eager code (leaves, torch internals) sees the truth.
    """
    original = torch.is_grad_enabled

    def reported() -> bool:
        return original() if tracer.running_eager else enabled

    torch.is_grad_enabled = reported
    try:
        yield
    finally:
        torch.is_grad_enabled = original


def name_placeholders(graph: fx.Graph, call: tuple, positions: tuple[int, ...]) -> None:
    """Record each tensor input's argument name (``img_ids``, ``arg0``) in ``meta``."""
    paths = [path for path, _ in pytree.tree_flatten_with_path(call)[0]]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, pos in zip(placeholders, positions):
        keys = paths[pos][1:]  # drop the (args, kwargs) index
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in keys]
        is_kwarg = paths[pos][0].idx == 1
        node.meta["tread_input_name"] = names[0] if is_kwarg else f"arg{names[0]}"
