"""Which chain of block containers is the stack: :func:`choose_stack`.

Of the chains :mod:`tread_fx.passes.locate.stacks` finds, the longest wins; of interleaved
chains (factorised spatial/temporal video blocks, which both carry the stream), the one whose
stream has the most tokens; then the one whose blocks hand the stream on most directly (fewest
ops between consecutive blocks). When that hop count decides between interleaved chains of
equal token counts, it is a rule's choice and a ``StreamChoiceWarning`` names the candidates
and the ``blocks=`` options; still tied, refused naming them. ``blocks=`` names the containers
instead.

Example:
    >>> _choices([["spatial"], ["temporal"]])
    "blocks='spatial' or blocks='temporal'"
"""

from __future__ import annotations

import math

import torch.fx as fx
from torch import nn

from tread_fx.errors import (
    AmbiguousBlockStackError,
    BlockStackNotFoundError,
    StreamChoiceWarning,
    shown,
    warn_at_caller,
)
from tread_fx.passes.locate.dataflow import forward_path, tensor_meta
from tread_fx.passes.locate.stacks import _chains, _feature_map, _form_break, _handed_stream

__all__ = ["choose_stack"]


def _hand_off_hops(chain: list[str], calls: dict[str, list[fx.Node]]) -> int:
    """Ops on the paths from each block of ``chain`` to the next (fewest: the main stack)."""
    nodes = [n for path in chain for n in calls[path]]
    return sum(len(forward_path(a, b)) for a, b in zip(nodes, nodes[1:]))


def choose_stack(
    model: nn.Module, calls: dict, primary: fx.Node | None, explicit: bool
) -> list[str]:
    """The chain of container paths that is the block stack (refuses with the reason)."""
    chains = _chains(model, calls, primary)
    if explicit:
        if len(chains) > 1 and (widths := _form_break(chains, calls)):
            raise BlockStackNotFoundError(
                f"blocks= named {' + '.join(c for chain in chains for c in chain)}, which carry "
                f"streams of different forms\n({widths}): one route cannot span the "
                "change (a projection between them); name the lists of one form, e.g. "
                f"blocks={chains[0] if len(chains[0]) > 1 else chains[0][0]!r}."
            )
        if len(chains) != 1:
            raise BlockStackNotFoundError(
                f"blocks= named {sorted(calls)}, but their members are not called once each, "
                "in order, one container after the other; name only the block containers "
                "of the main stack, in call order."
            )
        return chains[0]
    # a one-block list is a stack only joined to another list (one-member containers are
    # candidates for that); alone it is some other module
    chains = [c for c in chains if sum(len(calls[p]) for p in c) > 1]
    if not chains:
        raise BlockStackNotFoundError(
            f"{type(model).__name__} calls no list of same-class blocks in order, so tread_fx "
            "finds no block stack; pass blocks='<attribute path>' to route().\n"
            "No ModuleList/Sequential of same-class modules is called once per member in "
            f"order (candidates: {sorted(calls) or 'none'})."
        )
    # a list of conv blocks around an attention encoder never beats a token list
    chains = [c for c in chains if not _feature_map(model, c, calls)] or chains
    size = lambda chain: sum(len(calls[p]) for p in chain)
    best = max(size(c) for c in chains)
    top = [c for c in chains if size(c) == best]
    interleaved = len(top) > 1 and _interleaving(top, calls)
    if interleaved:  # both carry the stream: more to save
        top = _most_tokens(top, calls)
    tied = list(top)
    if len(top) > 1:  # the stack hands the stream straight on; a side branch takes detours
        hops = {tuple(c): _hand_off_hops(c, calls) for c in top}
        top = [c for c in top if hops[tuple(c)] == min(hops.values())]
    if len(top) > 1:
        raise AmbiguousBlockStackError(
            f"{type(model).__name__} has {len(top)} block stacks of {best} blocks and data "
            f"flow does not pick one; pass {_choices(top)} to route() to choose one.\n"
            f"The stacks: {[' + '.join(c) for c in top]} "
            f"({'; '.join(_describe(c, calls) for c in top)}){_interleaving(top, calls)}."
        )
    if interleaved and len(tied) > 1:  # equal token counts: the hop count picked, say so
        warn_at_caller(_hop_choice(top[0], tied, hops, calls), StreamChoiceWarning)
    return top[0]


def _choices(chains: list[list[str]]) -> str:
    return " or ".join(f"blocks={c[0]!r}" if len(c) == 1 else f"blocks={c}" for c in chains)


def _hop_choice(chosen: list[str], tied: list[list[str]], hops: dict, calls: dict) -> str:
    """The warning for interleaved stacks of equal token counts decided by the hop count
    (one op more in one stack's hand-offs, a frame embedding, tips it)."""
    counts = "; ".join(f"{_describe(c, calls)}, {hops[tuple(c)]} ops between blocks" for c in tied)
    return (
        f"interleaved block stacks with equal token counts; a rule chose "
        f"{' + '.join(chosen)!r}: pass {_choices([c for c in tied if c != chosen])} to route "
        f"another, blocks={chosen[0]!r} to keep this one.\n  because: its blocks hand the "
        f"stream on with the fewest ops\n  candidates: {counts}"
    )


def _most_tokens(chains: list[list[str]], calls: dict[str, list[fx.Node]]) -> list[list[str]]:
    """Of interleaved stacks of equal length (spatial ``[B * F, N, C]`` and temporal ``[B * N,
    F, C]`` blocks), the one whose stream has the most tokens (dim 1); all of them when the
    counts tie or a stream's shape is unclear."""
    metas = [_handed_stream(c, calls) for c in chains]
    if any(m is None for m in metas):
        return chains
    counts = [m.shape[1] for m in metas]
    best = [c for c, n in zip(chains, counts) if n == max(counts)]
    return best if len(best) == 1 else chains


def _describe(chain: list[str], calls: dict[str, list[fx.Node]]) -> str:
    """``path: 4 blocks, [8, 16, 32] (16 tokens)``: the stream its first block hands on (else
    the largest tensor entering that block)."""
    first = calls[chain[0]][0]
    metas = [m for a in first.all_input_nodes if (m := tensor_meta(a)) is not None]
    shapes = [tuple(m.shape) for m in metas if len(m.shape) >= 2]
    count = sum(len(calls[p]) for p in chain)
    if not shapes:
        return f"{' + '.join(map(shown, chain))}: {count} blocks"
    handed = _handed_stream(chain, calls)
    shape = tuple(handed.shape) if handed else max(shapes, key=lambda sh: math.prod(sh))
    tokens = f" ({shape[1]} tokens)" if len(shape) >= 3 else ""
    return f"{' + '.join(map(shown, chain))}: {count} blocks on {list(shape)}{tokens}"


def _interleaving(chains: list[list[str]], calls: dict[str, list[fx.Node]]) -> str:
    """A note when the stacks' blocks alternate (factorised spatial/temporal attention)."""
    order = {n: i for i, n in enumerate(calls[chains[0][0]][0].graph.nodes)}
    spans = [(order[calls[c[0]][0]], order[calls[c[-1]][-1]]) for c in chains]
    if not any(a[0] < b[0] < a[1] for a in spans for b in spans if a != b):
        return ""
    return (
        ". Their blocks are interleaved: one stream alternates between them, reshaped in "
        "between (e.g. spatial attention over the tokens of each frame, temporal attention "
        "over the frames of each position, the batch folded with frames or positions); "
        "a route over one stack also runs the other stack's blocks on the kept tokens"
    )
