"""Routes across a change of the stream's form: where each image token lands after it.

Between two blocks a model may move the image stream into a longer stream (text written in
front of or after it, per sample into a padded buffer), slice other tokens off again, or split
the text off. A route crosses such a *form change* by splitting at it: the kept tokens are
written back before the hand-off (which runs on the full stream, as the model wrote it) and
gathered again after it, at the places they land, with all the other tokens (text, padding),
which are never routed. Exact when the hand-off only moves tokens.

Where each token lands is found by data flow on the example call: the hand-off is evaluated
with the stream replaced by tags (each token's position and sample, written into its
features) and the tags are read back after it. A hand-off that mixes tokens is refused.

Example:
    >>> # used by tread_fx.pipeline.build for routes whose stream changes form inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx

from tread_fx.errors import TokenStreamError
from tread_fx.module_state import attributes_kept, random_state_kept, seed_every_generator
from tread_fx.passes.locate.layout import crossing_prefix, stream_tokens
from tread_fx.passes.locate.stream import StreamInfo
from tread_fx.passes.trace.tracer import TensorMeta
from tread_fx.routes import Route

__all__ = [
    "FormChange",
    "changes_form",
    "form_changes",
    "cut_at_route_ends",
    "needs_split",
    "locate_tokens",
    "refuse_interleaved",
]

_BASE = 64  # tag digits stay exact integers in every float dtype (bf16 included)
_DIGITS = 3


@dataclass
class FormChange:
    """Where the route's image tokens are after the hand-off into block ``index``.

    Attributes:
        index: The block after the hand-off.
        positions: [B, N] long, the place of image token ``n`` of sample ``b``.
        others: [B, L - N] long, the places of every other token (ascending).
    """

    index: int
    positions: torch.Tensor
    others: torch.Tensor


def _tokens(node: fx.Node, info: StreamInfo) -> int | None:
    meta = node.meta.get("tread_meta")
    if not isinstance(meta, TensorMeta) or len(meta.shape) <= info.layout.token_dim:
        return None
    return meta.shape[info.layout.token_dim]


_MOVES = {"getitem", "cat", "concat", "concatenate", "stack", "functional_setitem", "pad",
          "narrow", "split", "chunk", "tensor_split", "index_select", "pad_sequence"}  # fmt: skip


def _moves(node: fx.Node) -> bool:
    """An op that moves tokens (slices, concatenates, writes into a buffer), not a module or
    a computation (a side branch over other tokens, e.g. perceiver latents, is no form)."""
    name = getattr(node.target, "__name__", node.target)
    return node.op in ("call_function", "call_method") and name in _MOVES


def changes_form(g: nx.DiGraph, info: StreamInfo, index: int) -> bool:
    """The hand-off into block ``index`` changes the token count on its way by moving tokens
    (cat, slice, per-sample writes), not only the values."""
    source, target = info.blocks[index - 1].stream_out, info.blocks[index].stream_in
    count = _tokens(source, info)
    if _tokens(target, info) != count:
        return True
    rank = len(source.meta["tread_meta"].shape)
    between = nx.descendants(g, source) & (nx.ancestors(g, target) | {target})
    for node in between:
        meta = node.meta.get("tread_meta")
        if not isinstance(meta, TensorMeta) or len(meta.shape) != rank or not _moves(node):
            continue
        batch = meta.shape[info.layout.batch_dim] == info.layout.batch_size
        if batch and _tokens(node, info) != count:
            return True
    return False


def form_changes(g: nx.DiGraph, info: StreamInfo, route: Route) -> list[int]:
    """Blocks inside ``route`` whose incoming hand-off changes the stream's form."""
    return [j for j in range(route.start + 1, route.end) if changes_form(g, info, j)]


def cut_at_route_ends(g: nx.DiGraph, info: StreamInfo, route: Route) -> None:
    """Make the route end at its last block's outputs when the hand-off after it changes
    the stream's form (that hand-off runs on the full stream, after the scatter)."""
    if route.end < info.depth and changes_form(g, info, route.end):
        info.form_cuts.add(route.end)
    last = info.depth - 1
    if route.end == info.depth and last > route.start and changes_form(g, info, last):
        info.stream_after = info.blocks[last].stream_out  # no replay of a slice and a cat


def needs_split(g: nx.DiGraph, info: StreamInfo, route: Route, changes: list[int]) -> bool:
    """Whether the route must split at its form changes (the prefix crossing cannot carry it).

    A single concatenation of other tokens in front of the image stream is crossed by
    carrying the kept tokens through it (:func:`~tread_fx.passes.locate.layout.crossing_prefix`);
    anything else (a suffix, per-sample writes, a split, a slice between blocks of one
    length) splits.
    """
    if not changes:
        return False
    if any(stream_tokens(info.blocks[j], info) == stream_tokens(info.blocks[j - 1], info)
           for j in changes):  # fmt: skip
        return True
    try:
        crossing_prefix(g, info, route)
    except TokenStreamError:
        return True
    return False


class _Reached(Exception):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value


class _Tagging(fx.Interpreter):
    """Runs the graph with some values replaced, up to (and returning) another value."""

    def __init__(self, gm: fx.GraphModule, sources: set, target: fx.Node, tag) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.sources, self.target, self.tag = sources, target, tag

    def run_node(self, n: fx.Node):
        value = self.tag(super().run_node(n)) if n in self.sources else super().run_node(n)
        if n is self.target:
            raise _Reached(value)
        return value


def _tag(value: torch.Tensor, token_dim: int, sign: float) -> torch.Tensor:
    """Write (position digits, sample) into the first features of every token."""
    x = value.movedim(token_dim, 1) if token_dim != 1 else value
    b, n = x.shape[0], x.shape[1]
    pos = torch.arange(n, device=x.device)
    digits = [(pos // _BASE**d) % _BASE + 1 for d in range(_DIGITS)]
    sample = torch.arange(b, device=x.device)[:, None].expand(b, n) + 1
    one = torch.ones(b, n, dtype=torch.long, device=x.device)  # a sum of tokens has more
    fields = torch.stack([*(d.expand(b, n) for d in digits), sample, one], dim=-1).to(x.dtype)
    tagged = torch.zeros_like(x.reshape(b, n, -1))
    tagged[..., : fields.shape[-1]] = sign * fields
    tagged = tagged.reshape(x.shape)
    return tagged.movedim(1, token_dim) if token_dim != 1 else tagged


def _read(gm, info: StreamInfo, index: int, tensors: list, sign: float) -> torch.Tensor:
    source, target = info.blocks[index - 1].stream_out, info.blocks[index].stream_in
    runner = _Tagging(gm, {source}, target, lambda v: _tag(v, info.layout.token_dim, sign))
    with random_state_kept([]), torch.no_grad():
        seed_every_generator(0)
        try:
            runner.run(*tensors)
        except _Reached as reached:
            value = reached.value
    value = value.movedim(info.layout.token_dim, 1) if info.layout.token_dim != 1 else value
    return value.reshape(value.shape[0], value.shape[1], -1)


def _refuse(info: StreamInfo, index: int, what: str) -> TokenStreamError:
    prev, block = info.blocks[index - 1], info.blocks[index]
    return TokenStreamError(
        f"a route crosses the hand-off from block {prev.index} ({prev.path}) to block "
        f"{block.index} ({block.path}), where the token stream changes form, but {what}; "
        "tread_fx can route across a hand-off that only moves tokens (concatenates, pads, "
        f"slices). End the route at block {block.index} or start it there."
    )


def _landing(gm, info: StreamInfo, index: int, tensors: list) -> torch.Tensor:
    """[B, L] source position landing at each place after the hand-off (-1: another token)."""
    width = _DIGITS + 2
    if (_tokens(info.blocks[index - 1].stream_out, info) or 0) >= _BASE**_DIGITS:
        raise _refuse(info, index, f"the stream has {_BASE**_DIGITS} tokens or more")
    first, second = (_read(gm, info, index, tensors, s) for s in (1.0, -1.0))
    if first.shape[-1] < width:
        raise _refuse(info, index, f"its tokens have fewer than {width} features")
    moved = (first != second).any(-1)
    fields = first[..., :width].round().long()
    clean = (first[..., :width] == fields).all(-1) & (
        second[..., :width] == -first[..., :width]
    ).all(-1)
    clean &= (first[..., width:] == 0).all(-1) & (fields[..., -1] == 1)
    if (moved & ~clean).any():
        raise _refuse(info, index, "the tokens after it are computed from several tokens")
    samples = torch.arange(first.shape[0], device=first.device)[:, None] + 1
    if (moved & (fields[..., -2] != samples)).any():
        raise _refuse(info, index, "it moves tokens from one sample into another")
    pos = sum((fields[..., d] - 1) * _BASE**d for d in range(_DIGITS))
    return torch.where(moved, pos, torch.full_like(pos, -1))


def locate_tokens(
    gm: fx.GraphModule, info: StreamInfo, route: Route, changes: list[int], tensors: list
) -> list[FormChange]:
    """Follow the route's image tokens through each form change (on the example call).

    Args:
        gm: The traced GraphModule (not yet rewritten).
        info: The located stream.
        route: The route.
        changes: Its form changes (:func:`form_changes`).
        tensors: The example call's tensors, in the graph's input order.

    Returns:
        One :class:`FormChange` per change, positions composed from the route start.
    """
    count = stream_tokens(info.blocks[route.start], info)
    batch = info.layout.batch_size
    positions = torch.arange(count).expand(batch, count)
    found = []
    for index in changes:
        landing = _landing(gm, info, index, tensors).cpu()
        hits = landing[:, None, :] == positions[:, :, None]  # [B, N, L]
        if (hits.sum(-1) == 0).any():
            raise _refuse(
                info,
                index,
                f"it drops tokens of the stream that the route starts on at block {route.start} "
                "(other tokens, e.g. text, that the model slices off again): start the route "
                "where the stream holds the image tokens only",
            )
        if (hits.sum(-1) > 1).any():
            raise _refuse(info, index, "it copies a token to several places")
        positions = hits.float().argmax(-1)
        taken = torch.zeros_like(landing, dtype=torch.bool).scatter(1, positions, True)
        others = torch.stack([torch.nonzero(~row).flatten() for row in taken])
        found.append(FormChange(index, positions, others))
    return found


def refuse_interleaved(gm: fx.GraphModule, info: StreamInfo, tensors: list) -> None:
    """Refuse a stream whose selectable positions hold other inputs' tokens.

    On the example call (the same random draws each time) the routed input is changed, then
    the other inputs are: the positions of the first block's stream that change with the
    routed input are its tokens, those that change only with the others are theirs. Where
    some selectable positions are theirs, the stream interleaves them (BESO's
    ``[s_1, a_1, s_2, a_2, ...]``: the states between the noisy actions), and a route would
    select those too. Positions no input reaches (empty voxels, padding) decide nothing.

    Raises:
        TokenStreamError: some selectable positions hold other inputs' tokens.
    """
    primary, layout = info.primary, info.layout
    if primary.op != "placeholder" or layout.batch_dim == -1 or layout.routable <= 0:
        return
    others = {n for n in gm.graph.find_nodes(op="placeholder") if n is not primary}
    if not others:
        return  # no other input whose tokens could sit between the routed input's
    gen = torch.Generator().manual_seed(7)
    same, mine, theirs = (
        _positions_at(gm, info, sources, tensors, tag)
        for sources, tag in (
            ({primary}, lambda v: v),
            ({primary}, lambda v: _perturbed(v, gen)),
            (others, lambda v: _perturbed(v, gen) if isinstance(v, torch.Tensor) else v),
        )
    )
    if same is None or mine is None or theirs is None:
        return
    lo, hi = layout.prefix, layout.num_tokens - layout.suffix
    held = (same != mine).any(1)
    foreign = ((same != theirs).any(1) & ~held)[lo:hi]
    held = held[lo:hi]
    if not held.any() or not foreign.any():
        return  # positions no input reaches (empty voxels, padding) decide nothing
    at = [lo + int(i) for i in torch.nonzero(held).flatten()[:8]]
    raise TokenStreamError(
        f"{int(foreign.sum())} of the {hi - lo} selectable positions entering "
        f"{info.blocks[0].path} hold other inputs' tokens, not the routed input's; not routed.\n"
        f"The routed input's tokens are at positions {at}{' ...' if held.sum() > 8 else ''}, "
        "between the others (interleaved, as states between actions), and a route would "
        "select those too. tread_fx routes one run of positions after a prefix; pass "
        "stream= naming another input, or keep_prefix= where the others lead the stream."
    )


def _positions_at(gm, info: StreamInfo, sources: set, tensors: list, tag) -> torch.Tensor | None:
    """Per position of the stream entering the first block, its values (flattened) with
    ``sources`` replaced by ``tag(value)``; ``None`` where the graph cannot be run that far."""
    value = _value_at(gm, sources, info.blocks[0].stream_in, tensors, tag)
    if value is None:
        return None
    dim = info.layout.token_dim
    return value.movedim(dim, 0).reshape(value.shape[dim], -1)


def _perturbed(value: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if value.dtype == torch.bool:
        return ~value
    if value.is_floating_point():
        return value + torch.randn(value.shape, generator=gen, dtype=value.dtype).to(value.device)
    return torch.where(value > 0, value - 1, value + 1)


def _value_at(gm, sources: set, target: fx.Node, tensors: list, tag) -> torch.Tensor | None:
    """``target``'s value with ``sources``' replaced by ``tag(value)``, the random draws
    repeated; ``None`` where the graph cannot be run that far."""
    runner = _Tagging(gm, sources, target, tag)
    with random_state_kept([]), torch.no_grad(), attributes_kept(gm):
        seed_every_generator(0)  # BatchNorm statistics and caches are put back afterwards
        try:
            runner.run(*tensors)
        except _Reached as reached:
            return reached.value if isinstance(reached.value, torch.Tensor) else None
        except Exception:  # noqa: BLE001 - code that cannot run twice tells nothing
            return None
    return None
