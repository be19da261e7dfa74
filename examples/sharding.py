"""FSDP2 for routed models: per-block ``fully_shard`` with optional activation checkpointing.

The order is fixed: route first, then checkpoint, shard and compile, all in place::

    tread_fx.route(model, routes=[(1, -1)])        # 1. route (in place)
    shard(model, checkpointing=True)               # 2. checkpoint + fully_shard per block, root
    model.compile()                                # 3. optional

``tread_fx.route`` refuses a model that is already sharded (any ``FSDPModule`` inside) or
compiled, with a ``WrappedModelError`` naming this order. It works because the routed graph
calls each block through its ``__call__``: FSDP2's pre-forward hook gathers that block's
parameters, the composable ``checkpoint`` hooks recompute it in the backward pass, and
parameters of the model itself are read from the live module, where FSDP2 swaps the gathered
tensors in. Routing does not change what a block sees beyond its token count, so sharding and
checkpointing behave as for the unrouted model.

``accelerate`` (``distributed_type: FSDP``, ``fsdp_version: 2``) applies the same order when the
routed model goes through ``accelerator.prepare``: its ``checkpoint_wrapper`` replaces each block
by a wrapper module, which the routed graph also calls through the live attribute path.

Example:
    >>> import tread_fx
    >>> model = tread_fx.models.DiT(input_size=8, depth=2, hidden_size=32, num_heads=2)
    >>> [type(b).__name__ for b in block_modules(model)]
    ['DiTBlock', 'DiTBlock']
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["block_modules", "shard"]


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: members of every ``nn.ModuleList`` of 2+ same-class modules.

    Flux-like models yield both their joint and single blocks; nested lists inside a block are
    not counted separately (the block is the unit).
    """
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) == 1:
            blocks.extend(module)
            inside.update(id(m) for b in module for m in b.modules())
    return blocks


def shard(
    model: nn.Module,
    *,
    checkpointing: bool = False,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
) -> nn.Module:
    """Applies activation checkpointing and FSDP2 ``fully_shard`` per block, then to the root.

    Call it after ``tread_fx.route`` and before ``torch.compile``; the process group must be
    initialised. The model is changed in place (its class becomes ``FSDP<Class>``) and
    returned.

    Args:
        model: The (routed) model, on its device.
        checkpointing: Recompute each block in the backward pass (composable ``checkpoint``).
        mesh: Device mesh for ``fully_shard`` (default: all ranks of the default group).
        reshard_after_forward: Free gathered block parameters after the forward pass.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy`` (default: none).

    Returns:
        ``model``.

    Raises:
        ValueError: The model has no block list to shard.
    """
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = block_modules(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to shard")
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in blocks:
        if checkpointing:
            checkpoint(block)
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    return model
