"""Provenance for the coverage verdict: does a route select the tokens of the noisy input?

Shapes, counts, FLOPs and gradients all look right when ``route()`` routes the wrong stream
(the text of a joint model, the text half of two returned streams). This check asks the
model itself: it perturbs the input a case names as the noisy one (diffusers: the latent
the suite passes as its main input; timm: the image; transformers: the embeddings), runs the
*unrouted* model in eval mode twice, and records which positions of the stream entering the
stack's first block change. Those are the image positions. A model routes correctly only if
the positions a route may select (between the never-routed prefix and suffix) are exactly
those, and the prefix and suffix exactly the rest.

Example:
    >>> from benchmarks.coverage_provenance import spans
    >>> spans([False, True, True, False, True])
    '1..3, 4..5'
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import tread_fx
from tread_fx.module_state import random_state_kept, seed_every_generator

__all__ = ["noisy_positions", "stream_mismatch", "spans", "perturbed"]


def spans(flags: Sequence[bool]) -> str:
    """``'a..b, c..d'``: the half-open runs of True in ``flags`` (``'none'`` if empty)."""
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append(f"{start}..{i}")
            start = None
    return ", ".join(runs) or "none"


def perturbed(value: Any, gen: torch.Generator) -> Any:
    """``value`` with every element changed (floats: noise added; ints: another id)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            noise = torch.randn(value.shape, generator=gen, dtype=value.dtype)
            return value + noise.to(value.device)
        return torch.where(value > 0, value - 1, value + 1)
    if isinstance(value, (list, tuple)):
        return type(value)(perturbed(v, gen) for v in value)
    raise TypeError(f"the noisy input is a {type(value).__name__}, not a tensor")


def _with_noisy(args: tuple, kwargs: dict, noisy: str | int) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(7)
    if isinstance(noisy, int):
        args = (*args[:noisy], perturbed(args[noisy], gen), *args[noisy + 1 :])
    else:
        kwargs = {**kwargs, noisy: perturbed(kwargs[noisy], gen)}
    return args, kwargs


def _slot_value(module: nn.Module, args: tuple, kwargs: dict, slot: tuple) -> Any:
    """The value in ``slot`` of a call of ``module``, however this call passes it: a block
    called positionally in training (through a checkpoint) may get keywords in eval mode."""
    if slot[0] == "arg" and len(args) <= slot[1]:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        value = list(bound.arguments.values())[slot[1]]
    else:
        value = args[slot[1]] if slot[0] == "arg" else kwargs[slot[1]]
    for index in slot[2:]:
        value = value[index]
    return value


def _stream_at(model: nn.Module, path: str, slot: tuple, call: tuple[tuple, dict]) -> torch.Tensor:
    """The value in ``slot`` of the first call of block ``path`` (unrouted, eval mode)."""
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not seen:
            seen.append(_slot_value(module, args, kwargs, slot).detach().clone())

    handle = model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad(), random_state_kept():  # the same draws in every run
            seed_every_generator(0)
            model.eval()  # not chained: a model's own eval()/train() may return None (MDM)
            model(*call[0], **call[1])
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError(f"block {path} was not called")
    return seen[0]


def noisy_positions(
    model: nn.Module, path: str, slot: tuple, token_dim: int, call: tuple, noisy: str | int
) -> list[bool]:
    """Per position of the stream entering block ``path``: does it depend on the noisy input?"""
    args, kwargs = call
    before = _stream_at(model, path, slot, (args, kwargs))
    after = _stream_at(model, path, slot, _with_noisy(args, kwargs, noisy))
    changed = (before != after).movedim(token_dim, 0).reshape(before.shape[token_dim], -1)
    return changed.any(dim=1).tolist()


def resolve_noisy(
    model: nn.Module, noisy: str | int | None, args: tuple, kwargs: dict
) -> str | int | None:
    """The case's noisy input as the call passes it: a keyword or a position (``None``
    asked: the first positional argument, else the first keyword holding a tensor)."""
    if noisy is None:
        if args:
            return 0
        return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if isinstance(noisy, str) and noisy not in kwargs:  # a named argument passed by position
        params = list(inspect.signature(type(model).forward).parameters)[1:]
        noisy = params.index(noisy) if noisy in params else noisy
    present = noisy < len(args) if isinstance(noisy, int) else noisy in kwargs
    return noisy if present else None


def stream_mismatch(pristine: nn.Module, routed: nn.Module, call: tuple, noisy: Any) -> str:
    """Why the routed stream is not the noisy input's tokens ('' when it is).

    Args:
        pristine: The unrouted model (a copy is run).
        routed: The same model routed, after one routed training call.
        call: ``(args, kwargs)`` of that call.
        noisy: The case's noisy input (name or position; ``None``: the first input).

    Returns:
        ``''`` if the selectable positions are exactly the ones the noisy input reaches at
        the stack's first block, or those and positions no input reaches (a voxel grid's
        empty cells); otherwise the reason (the ``wrong stream`` verdict).
    """
    built = tread_fx.routed_graphs(routed)[-1]
    info = built.info
    if info.layout.batch_dim == -1:
        return ""  # packed streams: the selectable positions are per segment (not compared)
    first = info.blocks[0]
    name = resolve_noisy(pristine, noisy, *call)
    if name is None:
        raise RuntimeError(f"the call passes no noisy input {noisy!r}")
    reached = noisy_positions(
        copy.deepcopy(pristine), first.path, first.in_slot, info.layout.token_dim, call, name
    )
    n = info.layout.num_tokens
    selectable = [info.layout.prefix <= i < n - info.layout.suffix for i in range(n)]
    if reached == selectable:
        return ""
    unreached = [s and not r for s, r in zip(selectable, reached)]
    if reached == [s and r for s, r in zip(selectable, reached)] and any(reached):
        others = _positions_of_others(copy.deepcopy(pristine), first, info, call, name)
        if not any(u and o for u, o in zip(unreached, others)):
            return ""  # selectable positions no input reaches (empty voxels): no other tokens
    return (
        f"routes positions {spans(selectable)} of the {n}-token stream entering {first.path}, "
        f"but the noisy input {name!r} reaches positions {spans(reached)} there"
    )


def _positions_of_others(model: nn.Module, first: Any, info: Any, call: tuple, noisy: Any) -> list:
    """Per position of the stream entering the first block: does any input other than the
    noisy one reach it?"""
    args, kwargs = call
    gen = torch.Generator().manual_seed(11)
    keys = [i for i in range(len(args)) if i != noisy] + [k for k in kwargs if k != noisy]
    moved_args = tuple(_maybe_perturbed(a, gen) if i in keys else a for i, a in enumerate(args))
    moved_kwargs = {k: _maybe_perturbed(v, gen) if k in keys else v for k, v in kwargs.items()}
    before = _stream_at(model, first.path, first.in_slot, call)
    after = _stream_at(model, first.path, first.in_slot, (moved_args, moved_kwargs))
    dim = info.layout.token_dim
    changed = (before != after).movedim(dim, 0).reshape(before.shape[dim], -1)
    return changed.any(dim=1).tolist()


def _maybe_perturbed(value: Any, gen: torch.Generator) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return ~value
    try:
        return perturbed(value, gen)
    except TypeError:  # not a tensor: left as it is
        return value


def _sample_changed(value: Any, batch_dim: int, gen: torch.Generator) -> Any:
    """``value`` with its first sample (index 0 along ``batch_dim``) changed, the rest kept."""
    if isinstance(value, (list, tuple)):
        return type(value)(_sample_changed(v, batch_dim, gen) for v in value)
    out = value.clone()
    first = out.narrow(batch_dim, 0, 1)
    first.copy_(perturbed(first, gen))
    return out


def _training_outputs(model: nn.Module, calls: Sequence[tuple]) -> list[torch.Tensor]:
    """The first output of a training call on each of ``calls``, dropout drawn alike."""
    from benchmarks.coverage_checks import first_tensor

    outs = []
    model.train()
    for args, kwargs in calls:
        with random_state_kept(), torch.no_grad():
            seed_every_generator(123)
            outs.append(first_tensor(model(*args, **kwargs)))
    return outs


def _other_samples_moved(a: torch.Tensor, b: torch.Tensor, batch_dim: int) -> bool:
    rest = a.shape[batch_dim] - 1
    a, b = (v.narrow(batch_dim, 1, rest).float() for v in (a, b))
    return bool((a - b).abs().max() > 1e-6 * (float(a.abs().max()) + 1e-30)) if rest else False


def samples_mixed(
    pristine: nn.Module, routed: nn.Module, call: tuple, noisy: Any, batch_dim: int = 0
) -> tuple[str, str]:
    """``(why the routed training forward mixes samples, note)``, ``''`` for each when fine.

    With the selection fixed (a copy of ``routed`` draws what ``routed`` draws), the noisy
    input's first sample is changed: no other sample's output may move. A model whose own
    training forward moves other samples (batch statistics) cannot be checked: the note says
    so and the reason is ``''``.

    Args:
        pristine: The unrouted model (copies are run).
        routed: The routed model, after one routed training call.
        call: ``(args, kwargs)`` of a training call.
        noisy: The case's noisy input (name or position; ``None``: the first input).
        batch_dim: The dim of the noisy input and of the first output holding the samples.
    """
    name = resolve_noisy(pristine, noisy, *call)
    if name is None:
        raise RuntimeError(f"the call passes no noisy input {noisy!r}")
    args, kwargs = call
    gen = torch.Generator().manual_seed(11)
    if isinstance(name, int):
        other = (*args[:name], _sample_changed(args[name], batch_dim, gen), *args[name + 1 :])
        changed = (other, kwargs)
    else:
        changed = (args, {**kwargs, name: _sample_changed(kwargs[name], batch_dim, gen)})
    plain = _training_outputs(copy.deepcopy(pristine), [call, changed])
    if plain[0].dim() <= batch_dim:  # a forward that is a training step returns its loss
        return "", "samples not checked apart: the first output has no sample dim (a loss)"
    if _other_samples_moved(*plain, batch_dim):
        return "", "samples not checked apart: the unrouted training forward mixes them"
    twin = copy.deepcopy(routed)  # the same selection generator state: the same selection
    (first,), (second,) = _training_outputs(routed, [call]), _training_outputs(twin, [changed])
    if _other_samples_moved(first, second, batch_dim):
        return (
            f"the routed training forward mixes samples: changing sample 0 of {name!r} (dim "
            f"{batch_dim}) changes other samples' outputs, which the unrouted forward keeps apart"
        ), ""
    return "", ""
