"""Which stream is routed: the one that carries the noisy input to the prediction.

A model may feed its blocks from several inputs (an image and a text, a latent and a
reference), as one joint stream (``cat([embed(x), embed(context)])``) or as separate
streams handed from block to block. Each tensor input that reaches the blocks is a
candidate: the locate pass is run with it as the main input, giving the stream and the
positions a route would select. Data flow then decides:

1. a candidate whose blocks do not hand its stream on from block to block is no stream
   (a cross-attention context, a mask passed unchanged to every block);
2. a candidate whose selectable positions never reach the model's output is not what is
   predicted (the text part of a joint stream, sliced off before the final layer; a text
   stream the last block drops), see :mod:`tread_fx.passes.locate.positions`;
3. candidates that select the same positions are one stream, and a candidate whose stack
   is a proper part of the shape-matched input's stack (a text written into the buffer an
   image refiner's output goes to) is that stream continued.

When one stream is left, it is routed. When several are (a model returning both streams),
the documented rule picks the one with the most selectable tokens (where routing saves the
most; the image outnumbers the text in every population measured), then the input shaped
like the first output, then the first in the forward's order; and the choice is reported
(:class:`StreamChoice`, a :class:`~tread_fx.errors.StreamChoiceWarning` at the first routed
call, ``explain``). ``route(..., stream=...)`` names the input instead. No name decides:
names are shown only. A stream whose image positions a per-token mask computed from data
decides (:func:`~tread_fx.passes.locate.positions.role_mask`) is refused.

A default stack split over several lists (U-ViT's ``in_blocks`` / ``out_blocks`` with long
skips) may be taken only in part, where the stream's way into a later list is unclear: routes
then save little, without error. :func:`thin_stack` reports a stack that holds under half the
blocks the stream flows through (counted by data flow: the lists that carry it, and modules of
their blocks' class outside every list, U-ViT's mid block).

Example:
    >>> # used by tread_fx.pipeline.build: info = choose_stream(traced, model, paths, ...)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from tread_fx.errors import TokenStreamError, TreadFxError
from tread_fx.passes.locate.dataflow import data_ancestors, fed_by, input_slots, tensor_meta
from tread_fx.passes.locate.members import stack_members
from tread_fx.passes.locate.positions import ALL as _ALL_SPAN
from tread_fx.passes.locate.positions import Span, reaches_output, role_mask
from tread_fx.passes.locate.stacks import block_calls, carrying_lists, main_input
from tread_fx.passes.locate.stream import StreamInfo, locate
from tread_fx.passes.trace.tracer import TensorMeta, TracedCall

__all__ = ["StreamChoice", "choose_stream", "input_label", "check_stream_option", "thin_stack"]


@dataclass
class StreamChoice:
    """How the routed stream was chosen.

    Attributes:
        chosen: The chosen candidate, described (input, stream, positions).
        reason: Why it was chosen.
        candidates: Every candidate stream considered, described.
        guessed: ``True`` when the data flow left several streams and the rule picked one
            (a warning is emitted at the first routed call).
        option: The ``stream=`` value that picks the chosen input, for the message.
        others: ``stream=`` values that pick the other candidates.
    """

    chosen: str
    reason: str
    candidates: list[str] = field(default_factory=list)
    guessed: bool = False
    option: str = ""
    others: list[str] = field(default_factory=list)

    def message(self) -> str:
        """The warning text: the choice and the option first, then candidates and reason."""
        others = " or ".join(f"stream={o}" for o in self.others) or "stream=<forward argument>"
        return (
            f"several streams could be routed; a rule chose input {self.option}: pass "
            f"{others} to route another, stream={self.option} to keep this one.\n"
            f"  routed: {self.chosen}\n  because: {self.reason}\n"
            f"  candidates: {'; '.join(self.candidates)}"
        )


def _forward_params(model: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(type(model).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []


def _positional(params: list[inspect.Parameter]) -> list[str]:
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def input_label(model: nn.Module, placeholder: fx.Node) -> str:
    """The forward argument a traced tensor input came from (``"x"``; ``"arg2"`` if unknown)."""
    name = placeholder.meta.get("tread_input_name", placeholder.name)
    if name.startswith("arg") and name[3:].isdigit():
        positional = _positional(_forward_params(model))
        index = int(name[3:])
        return positional[index] if index < len(positional) else name
    return name


def check_stream_option(model: nn.Module, stream: object) -> None:
    """Validate ``stream=`` against the model's forward signature (before any trace).

    Raises:
        TokenStreamError: ``stream`` is not ``None``, a forward argument name or a position.
    """
    if stream is None:
        return
    params = _forward_params(model)
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = _positional(params)
    open_kw = any(p.kind is p.VAR_KEYWORD for p in params) or not params
    open_pos = any(p.kind is p.VAR_POSITIONAL for p in params) or not params
    ok = (isinstance(stream, str) and (stream in names or open_kw)) or (
        type(stream) is int and stream >= 0 and (stream < len(positional) or open_pos)
    )
    if not ok:
        raise TokenStreamError(
            f"stream={stream!r} names no argument of {type(model).__name__}.forward "
            f"(arguments: {names}); pass the name or position of the argument that holds "
            "the noisy input, or stream=None to choose by data flow."
        )


def _matches(model: nn.Module, placeholder: fx.Node, stream: str | int) -> bool:
    name = placeholder.meta.get("tread_input_name", "")
    if isinstance(stream, int):
        positional = _positional(_forward_params(model))
        by_name = stream < len(positional) and name == positional[stream]
        return name == f"arg{stream}" or by_name
    return input_label(model, placeholder) == stream


def _stream_input(traced: TracedCall, model: nn.Module, stream: str | int) -> fx.Node:
    inputs = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    found = [n for n in inputs if _matches(model, n, stream)]
    if not found:
        labels = sorted({input_label(model, n) for n in inputs})
        raise TokenStreamError(
            f"stream={stream!r} was asked for, but this call passes no tensor in that argument "
            f"of {type(model).__name__}.forward (tensor inputs: {labels}); name the argument "
            "that holds the noisy input in this call."
        )
    return found[0]


def _candidates(graph: fx.Graph, calls: dict) -> list[fx.Node]:
    """Tensor inputs (rank >= 2) that feed a block; the shape-matched main input first."""
    first = main_input(graph)
    feeding = set().union(*(data_ancestors(nodes[0], set()) for nodes in calls.values() if nodes))
    inputs = [
        n
        for n in graph.nodes
        if n.op == "placeholder"
        and n in feeding
        and (meta := tensor_meta(n)) is not None
        and len(meta.shape) >= 2
    ]
    return [first, *(n for n in inputs if n is not first)]


def _hands_on(info: StreamInfo, block_nodes: set[fx.Node], shape_matched: bool = False) -> bool:
    """The candidate's stream is fed by its input directly (not only through other blocks, as
    position ids feeding every block's RoPE table) and handed from block to block; for the
    input shaped like the prediction, only the first (it is no context the blocks attend)."""
    first = info.blocks[0]
    if not fed_by(first.stream_in, info.primary, block_nodes):
        return False
    return shape_matched or info.depth < 2 or fed_by(info.blocks[1].stream_in, first.node)


def _block_steps(info: StreamInfo, calls: dict) -> dict:
    """For the position walk: each block hands the span on from its stream argument only;
    blocks of the other lists, from the argument their list carries from block to block."""

    def step_for(block):
        def step(node: fx.Node, span: object) -> object:
            slots = [k for k, v in input_slots(block.node).items() if v is node]
            if block.in_slot not in slots:
                return None  # another argument: mixed in by attention, not positional
            return span if block.out_slot is None else {block.out_slot: span}

        return step

    steps = {}
    chain = {b.node for b in info.blocks}
    for nodes in calls.values():
        carried = _carried_in_slots(nodes)
        for call in nodes:
            if call not in chain:
                steps[call] = _other_block_step(call, carried)
    steps.update({b.node: step_for(b) for b in info.blocks})
    return steps


def _carried_in_slots(nodes: list[fx.Node]) -> set | None:
    """Argument slots a list's blocks hand on (``None``: unknown, a one-block list)."""
    if len(nodes) < 2:
        return None
    return {k for k, v in input_slots(nodes[1]).items() if fed_by(v, nodes[0], set(nodes))}


def _other_block_step(call: fx.Node, carried: set | None):
    def step(node: fx.Node, span: object) -> object:
        if carried is None:
            return _ALL_SPAN
        slots = {k for k, v in input_slots(call).items() if v is node}
        if not slots & carried:
            return None  # read only (a context attended to): its positions do not pass on
        meta = call.meta.get("tread_meta")
        return span if isinstance(meta, TensorMeta) and span != _ALL_SPAN else _ALL_SPAN

    return step


def _reaches(info: StreamInfo, calls: dict) -> bool:
    layout = info.layout
    if layout.batch_dim == -1 or layout.routable <= 0:  # packed: positions are not followed
        return True
    lo, n = layout.prefix, layout.num_tokens
    span = Span(lo, n - layout.suffix, layout.token_dim, n)
    return reaches_output(info.blocks[0].stream_in, span, _block_steps(info, calls))


def _key(info: StreamInfo) -> tuple:
    return tuple(info.list_paths), info.blocks[0].in_slot, info.layout.prefix, info.layout.suffix


def _describe(model: nn.Module, info: StreamInfo) -> str:
    shape = list(info.stream_meta.shape)
    layout = info.layout
    where = f"positions {layout.prefix}..{layout.num_tokens - layout.suffix}"
    return (
        f"input {input_label(model, info.primary)!r}: {layout.routable} tokens ({where} of "
        f"{shape} entering {info.blocks[0].path})"
    )


def choose_stream(
    traced: TracedCall,
    model: nn.Module,
    list_paths: list[str],
    explicit: bool,
    keep_prefix: int | None = None,
    stream: str | int | None = None,
    batch_dim: int | None = None,
) -> StreamInfo:
    """Locate the stack and the routed stream, choosing among the model's inputs by data flow.

    The arguments are :func:`~tread_fx.passes.locate.stream.locate`'s, and ``stream`` is the
    user's ``stream=`` (a forward argument name or position, or ``None``) and ``batch_dim``
    its ``batch_dim=``. Returns the
    :class:`StreamInfo` of the chosen stream, its ``choice`` filled in.
    """
    if stream is not None:
        primary = _stream_input(traced, model, stream)
        info = locate(traced, model, list_paths, explicit, keep_prefix, primary, batch_dim)
        info.choice = StreamChoice(
            _describe(model, info), f"stream={stream!r} was given", option=repr(stream)
        )
        return _refuse_role_masks(model, info)
    calls = block_calls(traced, list_paths)
    block_nodes = {n for nodes in calls.values() for n in nodes}
    located, refusal, first = [], None, None
    for i, primary in enumerate(_candidates(traced.gm.graph, calls)):
        try:
            located.append(
                locate(traced, model, list_paths, explicit, keep_prefix, primary, batch_dim)
            )
            first = located[-1] if i == 0 else first
        except TreadFxError as err:
            if i == 0 and not getattr(err, "context_only", False):
                raise  # the shape-matched input's refusal stands (two stacks it feeds alike)
            refusal = err if i == 0 else refusal
    # a context attended by the blocks (RDT's image tokens, as long as the prediction) hands
    # nothing on; the shape-matched input stays a candidate (or its refusal stands) only if
    # no input does
    handing = [info for info in located if _hands_on(info, block_nodes, info is first)]
    if not handing and refusal is not None:
        raise refusal
    handing = handing or located[:1]
    found: dict[tuple, StreamInfo] = {}
    for info in handing:
        found.setdefault(_key(info), info)
    infos = list(found.values())
    reaching = [info for info in infos if _reaches(info, calls)]
    reaching = _own_streams(reaching, infos[0]) or infos[:1]
    return _refuse_role_masks(model, _decide(model, infos, reaching))


def _own_streams(reaching: list[StreamInfo], first: StreamInfo) -> list[StreamInfo]:
    """Drop a reaching candidate whose stack is a proper part of the stack of ``first`` (the
    input shaped like the prediction), when that one reaches too: its stream is the first's
    continued (e.g. text written into a buffer after an image refiner), not its own."""
    if first not in reaching:
        return reaching
    own = set(first.list_paths)
    return [info for info in reaching if info is first or not set(info.list_paths) < own]


def _refuse_role_masks(model: nn.Module, info: StreamInfo) -> StreamInfo:
    """Refuse a stream whose image positions a per-token mask computed from data decides."""
    why = role_mask(info)
    if why is not None:
        raise TokenStreamError(
            f"{type(model).__name__}: data, not the graph, decides which stream positions hold "
            "the noisy input; pass blocks= naming a stack that sees only image tokens.\n"
            f"{why}. tread_fx routes by position and cannot follow such a mask yet; route a "
            "model that builds its joint stream by concatenation."
        )
    return info


def _decide(model: nn.Module, infos: list[StreamInfo], reaching: list[StreamInfo]) -> StreamInfo:
    guessed = len(reaching) > 1
    if not guessed:
        chosen, dropped = reaching[0], len(infos) - 1
        reason = (
            "the only input whose tokens the blocks hand on"
            if not dropped
            else f"data flow: the selectable tokens of the other {dropped} candidate(s) never "
            "reach the model's output"
        )
    else:
        most = max(info.layout.routable for info in reaching)
        chosen = next(info for info in reaching if info.layout.routable == most)
        tied = sum(info.layout.routable == most for info in reaching) > 1
        reason = (
            "the rule: most selectable tokens, then the input shaped like the first output, "
            "then the forward's argument order"
            + ("; several have as many tokens" if tied else f"; it has the most ({most})")
        )
    chosen.choice = StreamChoice(
        _describe(model, chosen),
        reason,
        [_describe(model, info) for info in infos],
        guessed=guessed,
        option=repr(input_label(model, chosen.primary)),
        others=[repr(input_label(model, i.primary)) for i in reaching if i is not chosen],
    )
    return chosen


def thin_stack(
    traced: TracedCall,
    model: nn.Module,
    info: StreamInfo,
    list_paths: list[str],
    keep_prefix: int | None,
    batch_dim: int | None = None,
) -> str | None:
    """A warning (with the count and a ``blocks=`` that covers more) when ``info``, located
    without ``blocks=``, holds under half the blocks of ``list_paths`` that carry the stream
    (else ``None``). ``keep_prefix`` checks the suggested ``blocks=``."""
    calls = block_calls(traced, list_paths)
    carrying = carrying_lists(model, calls, info.primary)
    loose = _loose_blocks(model, carrying, list_paths)
    total = sum(len(calls[p]) for p in carrying) + len(loose)
    if info.depth * 2 >= total:
        return None
    order = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
    carrying.sort(key=lambda p: order[calls[p][0]])
    try:
        wider = locate(traced, model, carrying, True, keep_prefix, info.primary, batch_dim)
        hint = f"pass blocks={carrying} to route() to span {wider.depth} blocks"
    except TreadFxError:
        others = [p for p in carrying if p not in info.list_paths]
        largest = max(others, key=lambda p: len(calls[p]), default=None)
        if largest is not None and len(calls[largest]) > info.depth:
            hint = (
                f"they do not form one stack that data flow can follow; pass "
                f"blocks={largest!r} ({len(calls[largest])} blocks) to route() to route those"
            )
        else:
            hint = (
                "no other blocks= spans more of them as one stack here (the data flow does "
                "not show how the stream passes from one list to the next)"
            )
    counts = ", ".join([*(f"{p}: {len(calls[p])}" for p in carrying), *(f"{p}: 1" for p in loose)])
    return (
        f"the routes span the block stack {' + '.join(info.list_paths)}, {info.depth} of the "
        f"{total} blocks the token stream flows through ({counts}), so they save less than "
        f"they could; {hint}."
    )


def _loose_blocks(model: nn.Module, carrying: list[str], list_paths: list[str]) -> list[str]:
    """Modules of a carrying list's block class outside every block list (U-ViT's mid block)."""
    classes = {type(m) for p in carrying for _, m in stack_members(model, p)}
    members = {m for p in list_paths for m, _ in stack_members(model, p)}
    inside = tuple(f"{m}." for m in members)
    return [
        path
        for path, module in model.named_modules()
        if path and type(module) in classes and path not in members and not path.startswith(inside)
    ]
