"""Which dim of the token stream is its batch: told by what the blocks mix, not by a convention.

Nothing in a diffusion backbone mixes the samples of a batch, and a block's attention, scan or
token convolution mixes its tokens. Where the stream's shape leaves more than one layout open
(``[B, N, C]`` or ``[N, B, C]``: an input given sequence-first as ``[T, B, C]``, a batch as
large as the token count), each block class of the stack runs on the real inputs its first call
received: once as traced, and once per candidate with the stream's first slice along the
candidate batch dim replaced (in eval mode, without gradients, its random draws repeated). A dim
is *mixed* when other slices along it change, in the block's output or in any of its
submodules' outputs laid out like the stream (so a block whose residual branch is gated to zero
at initialisation still shows its attention). The batch dim is the one candidate the blocks do
not mix while they mix the others. Where a block mixes every candidate, or no block can be
run to tell, the route is refused naming the candidates and ``batch_dim=``. Where the blocks
run and mix no position along either dim (token-wise layers only), no reading can mix samples:
the main input's dim 0 is taken and a ``StreamChoiceWarning`` names the choice and
``batch_dim=``.

Example:
    >>> import torch
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)  # sequence-first
    >>> example = ((torch.randn(6, 2, 8),), {})
    >>> sorted(mixed_dims(layer, example, ("arg", 0), [Layout(0, 1, 6), Layout(1, 0, 2)]))
    [0]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from tread_fx.errors import TokenStreamError
from tread_fx.module_state import random_state_kept, seed_every_generator
from tread_fx.passes.trace.block import EXAMPLE_KEY, example_of
from tread_fx.passes.trace.support import dynamo_wrappers_run_original, has_call_hooks

__all__ = ["Layout", "decide_layout", "mixed_dims", "UNTOLD", "untold_warning"]

#: the reason of a layout no block tells: blocks that mix no position keep samples apart in
#: either reading, so the main input's dim 0 is taken, with a warning (``untold_warning``)
UNTOLD = "no block mixes positions along either dim; the main input's dim 0 was taken"


@dataclass(frozen=True)
class Layout:
    """One reading of a stream's dims: ``folded`` rows of dim 0 per sample (``[B * F, N]``)."""

    batch_dim: int
    token_dim: int
    batch_size: int
    folded: int = 1

    def describe(self, shape: Sequence[int]) -> str:
        names = ["tokens" if d == self.token_dim else f"d{d}" for d in range(len(shape))]
        names[self.batch_dim] = "batch" if self.folded == 1 else f"batch * {self.folded}"
        return f"[{', '.join(names)}] (batch_dim={self.batch_dim})"


def decide_layout(
    gm: fx.GraphModule,
    blocks: Sequence[Any],
    shape: Sequence[int],
    layouts: list[Layout],
    batch_dim: int | None,
) -> tuple[Layout, str]:
    """The layout of the stream entering ``blocks[0]`` among ``layouts``, and why.

    Args:
        gm: The traced call (its block calls keep their example inputs).
        blocks: The stack's ``BlockCall``s, in order.
        shape: The stream's shape at the first block.
        layouts: The readings its shape and the model's inputs allow (at least one).
        batch_dim: The user's ``batch_dim=`` (``None``: the blocks decide).

    Returns:
        ``(layout, reason)``, the reason for ``explain``.
    """
    if batch_dim is not None:
        return _asked(blocks[0], shape, layouts, batch_dim)
    if len(layouts) == 1:
        return layouts[0], "the only reading of the stream's shape and the model's inputs"
    told = []
    for block in _one_per_class(gm, blocks):
        example = _example(gm, block.node)
        if example is None:
            continue
        mixed = mixed_dims(gm.get_submodule(block.node.target), example, block.in_slot, layouts)
        if mixed is None:
            continue
        told.append(block)
        free = [layout for layout in layouts if layout.batch_dim not in mixed]
        if len(free) == 1 and free[0].token_dim in mixed:
            dims = ", ".join(map(str, sorted(mixed)))
            return free[0], (
                f"block {block.path} mixes dim {dims} of the stream (its tokens) and never "
                f"dim {free[0].batch_dim}: samples stay apart along it"
            )
        if not free:
            raise _refusal(blocks[0], shape, layouts, f"block {block.path} mixes all of them")
    if told:  # every block computes each position on its own: samples stay apart either way
        return layouts[0], UNTOLD
    raise _refusal(blocks[0], shape, layouts, "no block of the stack could be run to tell")


def untold_warning(block_path: str, shape: Sequence[int]) -> str:
    """The warning for a batch dim no block tells (:data:`UNTOLD`)."""
    return (
        f"the stream {list(shape)} entering {block_path} may hold its batch on dim 0 or 1, and "
        "no block mixes positions along either, so samples stay apart either way; the main "
        "input's dim 0 was taken as the batch. Pass batch_dim=0 to route() to keep this "
        "reading without this warning, or batch_dim=1 for the other."
    )


def _asked(block: Any, shape: Sequence[int], layouts: list[Layout], asked: int) -> tuple:
    """The layout ``batch_dim=`` names (its own reading when the shape did not offer it)."""
    for layout in layouts:
        if layout.batch_dim == asked:
            return layout, f"batch_dim={asked} was given"
    if asked not in (0, 1) or len(shape) < 3:
        raise TokenStreamError(
            f"batch_dim={asked} was given, but the stream entering block {block.path} has "
            f"shape {list(shape)}; its batch dim is 0 or 1 (its tokens are the other). "
            "Pass batch_dim=0 or batch_dim=1, or None to let the blocks decide."
        )
    return Layout(asked, 1 - asked, shape[asked]), f"batch_dim={asked} was given"


def _refusal(block: Any, shape: Sequence[int], layouts: list[Layout], why: str) -> Exception:
    options = " or ".join(f"batch_dim={layout.batch_dim}" for layout in layouts)
    readings = "; ".join(layout.describe(shape) for layout in layouts)
    return TokenStreamError(
        f"the stream {list(shape)} entering {block.path} may hold its batch on dim "
        f"{' or '.join(str(layout.batch_dim) for layout in layouts)}, and its blocks do not "
        f"show which; pass {options}.\n"
        f"Readings its shape and the model's inputs allow: {readings}. tread_fx tells the "
        "batch dim by what the blocks compute: attention, scans and token convolutions mix "
        f"the tokens, and nothing mixes the samples; here {why}. Routing along the wrong dim "
        "would keep some samples and drop others."
    )


def _example(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The real ``(args, kwargs)`` of the block call ``node``: its own, kept by the trace for
    the first call of its class, else those of a call of its class it matches."""
    if EXAMPLE_KEY in node.meta:
        return node.meta[EXAMPLE_KEY]
    found = example_of(gm, node)
    return None if found is None else found[0]


def _one_per_class(gm: fx.GraphModule, blocks: Sequence[Any]) -> Iterator[Any]:
    """The first call of each block class in the stack, in order."""
    seen: set[type] = set()
    for block in blocks:
        cls = type(gm.get_submodule(block.node.target))
        if cls not in seen:
            seen.add(cls)
            yield block


def mixed_dims(
    module: nn.Module, example: Any, slot: tuple, layouts: Sequence[Layout]
) -> set[int] | None:
    """The candidate batch dims along which ``module`` mixes its stream, or ``None`` when the
    block does not tell (it fails on its example, or its control flow follows the data).

    Args:
        module: A block.
        example: ``(args, kwargs)`` of one real call of it.
        slot: Where the stream is in the call (``("arg", i)`` / ``("kwarg", name)``, then
            indices into nested tuples).
        layouts: The candidate readings; each one's ``batch_dim`` is probed.
    """
    stream = _at(example, slot)
    if not isinstance(stream, torch.Tensor) or not stream.is_floating_point():
        return None
    probed = [
        (lay.batch_dim, lay.folded) for lay in layouts if stream.shape[lay.batch_dim] > lay.folded
    ]
    streams = [_copy(stream), *(_replaced(stream, dim, width) for dim, width in probed)]
    runs = _runs(module, example, slot, streams)
    if runs is None or any(run is None or len(run) != len(runs[0]) for run in runs):
        return None
    base, changed = runs[0], runs[1:]
    return {
        dim
        for (dim, width), run in zip(probed, changed)
        if any(_moved(a, b, stream.shape, dim, width) for a, b in zip(base, run))
    }


def _runs(module: nn.Module, example: Any, slot: tuple, streams: list) -> list | None:
    """:func:`_recorded` for each of ``streams``; for a block with call hooks (FSDP2's
    ``fully_shard`` gathers its parameters in one), from inside one real call of it, after
    its hooks ran, so the hooks leave it as they found it. ``None`` when that call fails."""
    if not any(has_call_hooks(m) for m in module.modules()):
        return [_recorded(module, example, slot, s) for s in streams]
    found: list = []

    def probe_here(hooked: nn.Module, args: tuple, kwargs: dict) -> None:
        inner = type(hooked).forward.__get__(hooked)
        found.extend(_recorded(hooked, (args, kwargs), slot, s, inner) for s in streams)

    handle = module.register_forward_pre_hook(probe_here, with_kwargs=True)
    try:
        with torch.no_grad(), dynamo_wrappers_run_original():
            module(*example[0], **example[1])
    except Exception:  # noqa: BLE001 - a block whose own call fails here tells nothing
        return None
    finally:
        handle.remove()
    return found or None


def _at(example: Any, slot: tuple) -> Any:
    """The value at ``slot`` of ``(args, kwargs)``."""
    args, kwargs = example
    kind, key, *inner = slot
    value = args[key] if kind == "arg" and key < len(args) else kwargs.get(key)
    for index in inner:
        value = value[index] if isinstance(value, (tuple, list)) else None
    return value


def _replaced(stream: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """``stream`` with its first ``width`` slices along ``dim`` replaced by other values."""
    out = stream.detach().clone()
    first = out.narrow(dim, 0, width)
    gen = torch.Generator(device=stream.device).manual_seed(0)
    noise = torch.randn(first.shape, generator=gen, device=stream.device, dtype=stream.dtype)
    first.copy_(noise * (stream.detach().float().std().nan_to_num(1.0) + 1.0) + 1.0)
    return out.requires_grad_(stream.requires_grad)  # a block may read the flag


def _moved(a: Any, b: Any, shape: Sequence[int], dim: int, width: int) -> bool:
    """Whether a recorded value laid out like the stream changed beyond the first slices."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dim() < 2 or tuple(a.shape[:2]) != tuple(shape[:2]) or a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return False
    rest_a, rest_b = (v.narrow(dim, width, v.shape[dim] - width) for v in (a, b))
    scale = float(rest_a.abs().max()) if rest_a.numel() else 0.0
    return bool((rest_a - rest_b).abs().max() > 1e-6 * (scale + 1e-30))


def _recorded(
    module: nn.Module, example: Any, slot: tuple, stream: torch.Tensor, call: Any = None
) -> list | None:
    """The tensors ``module`` and its submodules return on ``example`` with ``stream`` at
    ``slot``, in call order (``call``: how to call it, default ``module`` itself); ``None``
    when the call fails."""
    args, kwargs = _with(example, slot, stream)
    seen: list = []
    record = lambda _m, _i, out: seen.extend(pytree.tree_leaves(out))  # noqa: E731
    handles = [m.register_forward_hook(record) for m in module.modules()]
    try:
        with (
            _evaluating(module),
            torch.no_grad(),
            random_state_kept([]),
            dynamo_wrappers_run_original(),
        ):  # a compiled block runs its own code, uncompiled
            seed_every_generator(0)
            out = (call or module)(*args, **kwargs)
            if call is not None:  # the block's own hook does not see a call of its forward
                seen.extend(pytree.tree_leaves(out))
    except Exception:  # noqa: BLE001 - a block that cannot run on its example tells nothing
        return None
    finally:
        for handle in handles:
            handle.remove()
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in seen]


def _with(example: Any, slot: tuple, stream: torch.Tensor) -> tuple[tuple, dict]:
    """A copy of ``example`` (tensors cloned: a block may write into them) with ``stream``
    at ``slot``."""
    args, kwargs = pytree.tree_map(_copy, example)
    args, kwargs = list(args), dict(kwargs)
    kind, key, *inner = slot
    holder, name = (args, key) if kind == "arg" else (kwargs, key)
    holder[name] = _put(holder[name], inner, stream)
    return tuple(args), kwargs


def _copy(value: Any) -> Any:
    """A tensor's copy with its ``requires_grad`` flag (a block may read it); others as is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.requires_grad and value.is_floating_point())


def _put(value: Any, path: list, stream: torch.Tensor) -> Any:
    if not path:
        return stream
    items = list(value)
    items[path[0]] = _put(items[path[0]], path[1:], stream)
    return type(value)(items) if isinstance(value, tuple) else items


@contextmanager
def _evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (no dropout, running statistics), its modes restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
