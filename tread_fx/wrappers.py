"""Wrappers around a model: DDP / DataParallel / FSDP / ``torch.compile``.

``route()`` must see the plain model (route first, then wrap); :func:`unwrap` finds it inside
any nesting of wrappers.

Example:
    >>> import torch, tread_fx
    >>> from tread_fx.wrappers import unwrap
    >>> model = tread_fx.models.DiT_S_2(input_size=8, depth=2)
    >>> unwrap(torch.compile(torch.nn.DataParallel(model))) is model
    True
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from tread_fx.errors import WrappedModelError

__all__ = [
    "unwrap",
    "check_unwrapped",
    "refuse_replica",
    "REPLICATE",
    "install_compile_preparation",
    "remove_compile_preparation",
]

_WRAPPERS = {  # class name: (the attribute holding the model, what to pass route() instead)
    "DistributedDataParallel": ("module", "model.module"),
    "DataParallel": ("module", "model.module"),
    "FullyShardedDataParallel": ("module", "the unwrapped module"),
    "OptimizedModule": ("_orig_mod", "model._orig_mod"),
}


def unwrap(model: Any) -> Any:
    """The model inside DDP / DataParallel / FSDP / ``torch.compile`` wrappers (any nesting).

    Example:
        >>> import torch, tread_fx
        >>> model = tread_fx.models.DiT_S_2(input_size=8, depth=2)
        >>> unwrap(torch.nn.DataParallel(model)) is model
        True
    """
    for _ in range(16):
        wrapper = _WRAPPERS.get(type(model).__name__)
        inner = getattr(model, wrapper[0], None) if wrapper else None
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def check_unwrapped(model: Any) -> None:
    """Refuse a model that is wrapped, sharded or compiled already (route first, then wrap).

    Raises:
        WrappedModelError: naming the wrapper and what to pass instead.
    """
    if not isinstance(model, nn.Module):
        raise WrappedModelError(
            f"route() expects an nn.Module, got {type(model).__name__}; pass the model itself."
        )
    name = type(model).__name__
    if name in _WRAPPERS:
        raise WrappedModelError(
            f"route() was given a {name} wrapper; route the model first, then wrap it "
            f"(route -> DDP/FSDP/torch.compile). To route this one, pass {_WRAPPERS[name][1]}."
        )
    sharded = _fully_sharded(model)
    if sharded is not None:
        what = f"a {name} whose submodule {sharded!r} is" if sharded else f"a {name}"
        raise WrappedModelError(
            f"route() was given {what} already sharded by FSDP2's fully_shard; route first, "
            "then shard: tread_fx.route(model, ...), then fully_shard(block) for each block and "
            "fully_shard(model), then torch.compile. "
            "Build the model again (or load its unsharded state_dict) and route that."
        )
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise WrappedModelError(
            f"route() was given a {name} on which model.compile() was already called; route "
            "first, then compile: tread_fx.route(model, ...), then model.compile() (or "
            "route(..., compile=True), which compiles the routed graph)."
        )


def _fully_sharded(model: nn.Module) -> str | None:
    """The path of the first module FSDP2's ``fully_shard`` was applied to (``""``: the model)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # nothing is sharded before it is imported
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return None
    for path, module in model.named_modules():
        if isinstance(module, fsdp_module):
            return path
    return None


REPLICATE = "_replicate_for_data_parallel"  # what DataParallel calls on every module it copies


def refuse_replica(model: nn.Module) -> None:
    """Refuse ``DataParallel`` replication of a routed model (stored as ``model.REPLICATE``).

    ``DataParallel`` over several GPUs copies the model onto every device on every call; the
    routed graphs and the selection state belong to the one model and would run the copies on
    its device. One device (or none) calls the model itself and routes normally.

    Raises:
        WrappedModelError: naming what to use instead.
    """
    raise WrappedModelError(
        f"DataParallel tried to replicate a routed {type(model).__name__} onto several GPUs; "
        "a routed model's traced graphs belong to the one model, so its copies cannot route. "
        "Use DistributedDataParallel (route, then wrap: one process per GPU), or DataParallel "
        "with a single device."
    )


# torch.compile's lazy-module protocol: ``OptimizedModule`` (``torch.compile(model)``) checks its
# module for these two attributes and, when present, calls ``_infer_parameters(module, args,
# kwargs)`` eagerly with the call's real inputs before dynamo traces the call.
_LAZY_MARK, _LAZY_CALL = "_initialize_hook", "_infer_parameters"


def install_compile_preparation(model: nn.Module, prepare: Any) -> None:
    """Have ``torch.compile(model)`` call ``prepare(model, args, kwargs)`` eagerly before each call.

    A routed model builds its routed graph at the first call of each input signature, which
    dynamo cannot trace (``fullgraph=True`` refuses it). Declaring the model lazy in torch's sense
    lets ``OptimizedModule`` run that preparation outside the compiled region, on the real inputs,
    so the compiled call finds the graph built. The mark stays: every compiled call may meet a new
    signature (a smaller last batch). ``prepare`` must be a module-level function (it pickles).

    Example:
        >>> import torch
        >>> seen = []
        >>> def prepare(module, args, kwargs): seen.append(args[0].shape)
        >>> model = torch.nn.Linear(2, 2)
        >>> install_compile_preparation(model, prepare)
        >>> _ = torch.compile(model, backend="eager")(torch.ones(3, 2))
        >>> seen
        [torch.Size([3, 2])]
    """
    model.__dict__[_LAZY_MARK] = True
    model.__dict__[_LAZY_CALL] = prepare


def remove_compile_preparation(model: nn.Module) -> None:
    """Undo :func:`install_compile_preparation` (the model is as before)."""
    model.__dict__.pop(_LAZY_MARK, None)
    model.__dict__.pop(_LAZY_CALL, None)
