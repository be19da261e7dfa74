"""Pass 2 — locate: find the block stack and the token stream that flows through it.

The block stack is chosen by :mod:`tread_fx.passes.locate.stacks`. The token stream is found by
data flow: the value block ``i`` hands to block ``i + 1`` that descends from the model's main
input; its dims by :mod:`tread_fx.passes.locate.dims`.

Example:
    >>> # used by tread_fx.passes.locate.choice: info = locate(traced, model, paths, False)
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn

from tread_fx.adapters.values import StreamLayout
from tread_fx.errors import TokenStreamError, shown
from tread_fx.passes.locate.dataflow import (
    data_ancestors,
    fed_by,
    forward_path,
    input_slots,
    output_slots,
    tensor_meta,
    tensor_shape,
)
from tread_fx.passes.locate.dims import joint_parts, stream_dims
from tread_fx.passes.locate.members import member_path
from tread_fx.passes.locate.stack_choice import choose_stack
from tread_fx.passes.locate.stacks import (
    block_calls,
    block_class,
    main_input,
    refuse_hierarchical_stages,
)
from tread_fx.passes.trace.tracer import MODEL_PREFIX, TensorMeta, TracedCall

__all__ = ["BlockCall", "StreamInfo", "handed_values", "locate", "same_block_class"]

SlotKey = tuple  # ("arg", i) | ("kwarg", name), then (..., j, ...) into nested tuples


@dataclass
class BlockCall:
    """One call of one block in the stack.

    Attributes:
        index: Position in the (possibly chained) stack, from 0.
        node: The ``call_module`` node.
        path: Module path relative to the model, e.g. ``"blocks.3"``.
        list_path: Path of the container holding the block.
        in_slot: Where the token stream enters the block's arguments.
        out_slot: Where it leaves the block's return value (``None``: the value itself).
        stream_in: The node passed in ``in_slot``.
        stream_out: The node holding the stream after the block.
    """

    index: int
    node: fx.Node
    path: str
    list_path: str
    in_slot: SlotKey
    out_slot: tuple | None = None
    stream_in: fx.Node | None = None
    stream_out: fx.Node | None = None


@dataclass
class StreamInfo:
    """What the locate pass found: the block stack and the token stream's layout."""

    blocks: list[BlockCall]
    list_paths: list[str]
    layout: StreamLayout  # at the first block (grid None: the pipeline finds it later)
    stream_meta: TensorMeta
    primary: fx.Node
    carried: dict[str, dict[tuple, SlotKey]] = field(default_factory=dict)
    stream_after: fx.Node | None = None
    form_cuts: set[int] = field(default_factory=set)  # blocks a route split ends before
    choice: Any = None  # how the stream was chosen (tread_fx/passes/locate/choice.py StreamChoice)
    batch_reason: str = ""  # how its batch dim was told (tread_fx/passes/locate/batch_dim.py)

    @property
    def depth(self) -> int:
        return len(self.blocks)


def locate(
    traced: TracedCall,
    model: nn.Module,
    list_paths: list[str],
    explicit: bool,
    keep_prefix: int | None = None,
    primary: fx.Node | None = None,
    batch_dim: int | None = None,
) -> StreamInfo:
    """Find the block stack and the token stream in a traced call.

    Args:
        traced: The output of the trace pass (block containers' members traced as leaves).
        model: The model (for container contents and ``num_prefix_tokens``).
        list_paths: Candidate container paths (all candidates, or the user's ``blocks=``).
        explicit: Whether ``list_paths`` came from the user.
        keep_prefix: Number of leading tokens never routed; ``None`` detects it.
        primary: The model input whose stream is routed (``None``: the input shaped like
            the first output; :mod:`tread_fx.passes.locate.choice` tries each candidate).
        batch_dim: The user's ``batch_dim=`` (``None``: the blocks tell it).

    Returns:
        The :class:`StreamInfo`.
    """
    calls = block_calls(traced, list_paths)
    primary = main_input(traced.gm.graph) if primary is None else primary
    chain = choose_stack(model, calls, None if explicit else primary, explicit)
    _unpack_handed_containers(traced.gm, [node for path in chain for node in calls[path]])
    while True:
        pairs = enumerate((p, n) for p in chain for n in calls[p])
        blocks = [BlockCall(i, n, n.target[len(MODEL_PREFIX) :], p, ()) for i, (p, n) in pairs]
        try:
            _assign_stream_slots(blocks, primary, {b.node for b in blocks})
            break
        except _UnclearHandOff as err:
            if explicit:
                raise
            # the stream's way into a later list is unclear (CaiT's class-attention blocks
            # take (tokens, cls)): the stack ends before that list
            chain = chain[: chain.index(err.list_path)]
    carried = {p: _carried_slots(_with_next(blocks, p)) for p in chain}
    first = blocks[0]
    meta = first.stream_in.meta.get("tread_meta")
    if not isinstance(meta, TensorMeta):
        raise TokenStreamError(
            f"no token sequence flows through {shown(chain[0])}: its first block takes no "
            "tensor stream; route a token-based backbone, or pass blocks= naming another list.\n"
            f"The value entering block {first.path} is {meta!r}."
        )
    module = model.get_submodule(first.path)
    dims, why = stream_dims(traced, module, blocks, primary, chain, batch_dim)
    batch_dim, token_dim, batch, folded = dims
    refuse_hierarchical_stages(model, blocks)  # after: a feature map is no token sequence
    num_tokens = meta.shape[token_dim]
    prefix, suffix = joint_parts(
        model, keep_prefix, first.stream_in, primary, token_dim, num_tokens
    )
    layout = StreamLayout(batch_dim, token_dim, batch, num_tokens, prefix, None, suffix, folded)
    after = _stream_after_last(blocks)
    return StreamInfo(blocks, chain, layout, meta, primary, carried, after, batch_reason=why)


def _unpack_handed_containers(gm: fx.GraphModule, calls: list[fx.Node]) -> None:
    """Pass each block's whole list/tuple result on to the next block as unpacked elements.

    A multi-scale stack calls ``xs = block(xs)`` with ``xs`` a list of token streams. Each
    such hand-off is rewritten (in place, same values) into one ``getitem`` per element,
    passed on as a list (or tuple): the stream slots are then ``("arg", i, j)`` and
    ``("item", j)``, and data flow chooses the stream among the elements.
    """
    for before, after in zip(calls, calls[1:]):
        meta = before.meta.get("tread_meta")
        is_container = isinstance(meta, (list, tuple)) and meta
        if not is_container or not all(isinstance(m, TensorMeta) for m in meta):
            continue
        if before not in after.args and before not in after.kwargs.values():
            continue
        with gm.graph.inserting_before(after):
            getitem = gm.graph.call_function
            items = [getitem(operator.getitem, (before, j)) for j in range(len(meta))]
        for item, item_meta in zip(items, meta):
            item.meta["tread_meta"] = item_meta
        unpacked = type(meta)(items)
        after.args = tuple(unpacked if a is before else a for a in after.args)
        after.kwargs = {k: unpacked if v is before else v for k, v in after.kwargs.items()}


def _stream_after_last(blocks: list[BlockCall]) -> fx.Node:
    """The stream after the last block: the ops from block ``depth-2``'s output to block
    ``depth-1``'s input (the residual ``add`` of ``x = x + block(x)``) replayed after it."""
    last = blocks[-1]
    if len(blocks) < 2 or blocks[-2].list_path != last.list_path:
        return last.stream_out
    path = forward_path(blocks[-2].stream_out, last.stream_in)
    node = last.stream_out
    # sub-blocks of a nested member (``layers.{i}.1``) replay as the last member's own
    same = lambda t: (
        t.replace(_member_of(blocks[-2]), _member_of(last), 1) if isinstance(t, str) else t
    )
    for step in path:
        matches = [u for u in node.users if (u.op, u.target) == (step.op, same(step.target))]
        if len(matches) != 1:
            return last.stream_out
        node = matches[0]
    return node


def _member_of(block: BlockCall) -> str:
    """``model.<list>.<i>.``: the prefix of every module path inside the block's member."""
    return f"{MODEL_PREFIX}{member_path(block.path, block.list_path)}."


def _tensor_slots(node: fx.Node) -> dict[SlotKey, fx.Node]:
    return {
        k: n
        for k, n in input_slots(node).items()
        if (meta := tensor_meta(n)) is not None and len(meta.shape) >= 2
    }


def _handed(block: BlockCall, following: BlockCall, keys: list, block_nodes: set) -> list:
    """The argument slots of ``keys`` that ``block`` hands on to ``following`` (its list's
    next block receives there a value computed by it)."""
    next_in = input_slots(following.node)
    return [k for k in keys if k in next_in and fed_by(next_in[k], block.node, block_nodes)]


def _first_stream_slot(
    block: BlockCall, primary: fx.Node, block_nodes: set, following: BlockCall | None
) -> SlotKey:
    """The argument of the first block that holds the stream: fed by the main input and,
    among those, handed on from block to block (a per-token modulation or a mask built
    from the input is passed unchanged to every block); the largest such tensor."""
    slots = _tensor_slots(block.node)
    if not slots:
        raise TokenStreamError(
            f"block {block.path} receives no tensor of rank >= 2; nothing to route."
        )
    from_primary = [k for k, n in slots.items() if fed_by(n, primary)]
    pool = from_primary or list(slots)
    if following is not None:
        handed = _handed(block, following, pool, block_nodes)
        if from_primary and not handed:
            _refuse_latents(
                block, slots, from_primary, _handed(block, following, list(slots), block_nodes)
            )
        pool = handed or pool
    return max(pool, key=lambda k: math.prod(slots[k].meta["tread_meta"].shape))


def _refuse_latents(block: BlockCall, slots: dict, from_input: list, handed: list) -> None:
    """Refuse blocks that hand on a value not computed from the model's input while the input
    reaches every block unchanged (a perceiver's latents attending to it as context)."""
    if not handed:
        return
    shape = lambda k: list(slots[k].meta["tread_meta"].shape)
    refusal = TokenStreamError(
        f"the blocks of {block.list_path!r} carry no token of the model's input (learned "
        "latents?), so there is nothing to route; route a backbone whose blocks carry them.\n"
        "They process values not computed from the input's tokens: "
        f"{block.path} hands on {_slot_name(handed[0])} "
        f"{shape(handed[0])} from block to block; "
        "the model's input reaches every block unchanged as "
        f"{_slot_name(from_input[0])} {shape(from_input[0])} (a cross-attention context, as in a"
        " perceiver). TREAD routes the tokens of the input's stream through the blocks; there "
        "are none here. Route a backbone whose blocks carry the input's tokens, or pass blocks= "
        "naming such a list."
    )
    refusal.context_only = True  # the input is attended to, not carried: not a stream
    raise refusal


def _slot_name(key: SlotKey) -> str:
    return f"argument {key[1]}" if key[0] == "arg" else f"{key[1]}="


def _depends_on(node: fx.Node, outputs: dict[tuple, fx.Node], block_nodes: set) -> list[tuple]:
    reach = data_ancestors(node, block_nodes) | {node}
    return [key for key, out in outputs.items() if out in reach]


def _out_slot(block: BlockCall, following: BlockCall | None, block_nodes: set) -> tuple | None:
    if isinstance(block.node.meta.get("tread_meta"), TensorMeta):
        return None
    outs = output_slots(block.node)
    if following is not None:
        following_in = input_slots(following.node).get(block.in_slot)
        keys = _depends_on(following_in, outs, block_nodes) if following_in is not None else []
        if len(keys) == 1:
            return keys[0]
    shape = block.stream_in.meta["tread_meta"].shape
    same = [k for k, n in outs.items() if getattr(n.meta.get("tread_meta"), "shape", None) == shape]
    if len(same) != 1:
        raise TokenStreamError(
            f"cannot tell which output of block {block.path} carries the token stream "
            f"(outputs {sorted(map(str, outs))}); pass blocks= with the main stack only, or "
            "register an adapter."
        )
    return same[0]


class _UnclearHandOff(TokenStreamError):
    """Which argument of a later list's first block continues the stream is unclear."""

    def __init__(self, list_path: str, message: str) -> None:
        super().__init__(message)
        self.list_path = list_path


def _assign_stream_slots(blocks: list[BlockCall], primary: fx.Node, block_nodes: set) -> None:
    for i, block in enumerate(blocks):
        prev = blocks[i - 1] if i else None
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        if following is not None and following.list_path != block.list_path:
            # only a block of the same list is handed the stream on; a one-block list hands
            # it to the next list's block of its class like to its own next member
            lead = following if same_block_class(block, following) else None
            following = None
        else:
            lead = following
        if prev is None:
            block.in_slot = _first_stream_slot(block, primary, block_nodes, lead)
        elif prev.list_path == block.list_path:
            block.in_slot = prev.in_slot
        else:
            slots = _tensor_slots(block.node)
            keys = [k for k, n in slots.items() if fed_by(n, prev.stream_out, block_nodes)]
            keys = _same_form_as_first(keys, slots, blocks[0]) if len(keys) > 1 else keys
            if len(keys) > 1 and following is not None:
                # a U-ViT's out blocks take (x, skip), both from the in blocks, and hand x on
                keys = _handed(block, following, keys, block_nodes) or keys
            if len(keys) > 1 and prev.in_slot in keys and same_block_class(prev, block):
                # a pair (hidden, residual) through a mid block traced as code: both handed
                # on, both computed from both; blocks of one class read it in one argument
                keys = [prev.in_slot]
            if len(keys) != 1:
                raise _UnclearHandOff(
                    block.list_path,
                    f"cannot tell which argument of block {block.path} continues the token "
                    f"stream of block {prev.path} (candidates {keys}); pass blocks= explicitly, "
                    f"e.g. blocks={prev.list_path!r} to route only the blocks before it.",
                )
            block.in_slot = keys[0]
            _check_handed_on(block, following, block_nodes)
        slots = input_slots(block.node)
        if block.in_slot not in slots:
            raise TokenStreamError(
                f"block {block.path} is not called with a token stream in {block.in_slot} like "
                "the blocks before it; route() needs blocks called the same way."
            )
        block.stream_in = _handed_into_member(block, prev, slots[block.in_slot], block_nodes)
        outs = output_slots(block.node)
        if following is None and _returns_like(block, prev, outs):
            block.out_slot = prev.out_slot  # the last block is called like the ones before it
        else:  # (members of several kinds: attention returns a tuple, a feed-forward a tensor)
            block.out_slot = _out_slot(block, lead, block_nodes)
        block.stream_out = block.node if block.out_slot is None else outs[block.out_slot]


def same_block_class(a: BlockCall, b: BlockCall) -> bool:
    """Whether two block calls run one block class (so their arguments mean the same).

    Example:
        >>> # same_block_class(info.blocks[2], info.blocks[3]) -> True for U-ViT's in/out
    """
    gm = a.node.graph.owning_module
    modules = (gm.get_submodule(n.target) for n in (a.node, b.node))
    return block_class(next(modules)) is block_class(next(modules))


def _handed_into_member(
    block: BlockCall, prev: BlockCall | None, value: fx.Node, block_nodes: set
) -> fx.Node:
    """The stream entering ``block``: ``value`` (what its first call receives in the stream
    slot), or, for a nested member (a list of sub-blocks, entered at its first call) whose
    code changes the stream's shape before that call (U-ViT's ``x = skip_proj(cat([skip, x],
    -1))`` in ``[skip_proj | None, attn, ff]`` layers), the one value shaped like ``prev``'s
    stream that ``value`` is computed from (by code, no module call between) and that the
    member before computed (not searching past ``block_nodes``). A route starting there
    gathers it (the skip by its use); one ending there scatters it, the code running after.
    """
    nested = block.path != member_path(block.path, block.list_path)  # below <list>.<i>
    if prev is None or prev.list_path != block.list_path or not nested:
        return value
    want = tensor_shape(prev.stream_in)
    if want is None or tensor_shape(value) == want:
        return value
    found, seen, todo = [], {value}, [value]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg in seen:
                continue
            seen.add(arg)
            if tensor_shape(arg) == want:
                found.append(arg)
            elif arg.op in ("call_function", "call_method"):
                todo.append(arg)
    handed = [n for n in found if n is prev.node or prev.node in data_ancestors(n, block_nodes)]
    return handed[0] if len(handed) == 1 else value


def _returns_like(block: BlockCall, prev: BlockCall | None, outs: dict) -> bool:
    """Whether ``block`` returns the stream where ``prev`` of the same list (or of the same
    class: a one-block list after a list of its class) does."""
    if prev is None or (prev.list_path != block.list_path and not same_block_class(prev, block)):
        return False
    if prev.out_slot is None:
        return isinstance(block.node.meta.get("tread_meta"), TensorMeta)
    return prev.out_slot in outs


def _same_form_as_first(keys: list, slots: dict, first: BlockCall) -> list:
    """Of several arguments fed by the previous list, the one shaped like the stack's stream
    (the image part of ``text, image = x[:, :T], x[:, T:]``), else the one of its rank and
    channel count (a longer joint stream, not a mask fed by it)."""
    shape = first.stream_in.meta["tread_meta"].shape
    shapes = {k: getattr(slots[k].meta.get("tread_meta"), "shape", ()) for k in keys}
    same = [k for k in keys if shapes[k] == shape]
    if len(same) == 1:
        return same
    # a longer stream ([text | image | padding]) keeps the rank and the channel count
    alike = [k for k in keys if len(shapes[k]) == len(shape) and shapes[k][-1:] == shape[-1:]]
    return alike if len(alike) == 1 else keys


def _check_handed_on(block: BlockCall, following: BlockCall | None, block_nodes: set) -> None:
    """A later list continues the stack only if its blocks hand the stream on: CaiT's
    class-attention blocks take the same token stream each and hand on the class token."""
    if following is not None and not _handed(block, following, [block.in_slot], block_nodes):
        raise _UnclearHandOff(
            block.list_path,
            f"the blocks of {block.list_path} do not hand the token stream on from one to the "
            f"next (block {following.path} receives in {block.in_slot} a value that does not "
            f"come from block {block.path}); pass blocks= naming the lists that do.",
        )


def _with_next(blocks: list[BlockCall], list_path: str) -> list[BlockCall]:
    """The members of ``list_path``; a one-member list (DiS's ``mid_block``) with the next
    block of the stack, which shows what it hands on."""
    members = [b for b in blocks if b.list_path == list_path]
    if len(members) == 1:
        at = blocks.index(members[0])
        return blocks[at : at + 2]
    return members


def _carried_slots(blocks: list[BlockCall]) -> dict[tuple, SlotKey]:
    """Map each output slot of a block to the input slot of the next block it feeds."""
    if len(blocks) < 2 or isinstance(blocks[0].node.meta.get("tread_meta"), TensorMeta):
        return {None: blocks[0].in_slot}
    outs = output_slots(blocks[0].node)
    nodes = {b.node for b in blocks}
    carried = {}
    for key, node in input_slots(blocks[1].node).items():
        deps = _depends_on(node, outs, nodes)
        if len(deps) == 1:
            carried[deps[0]] = key
    return carried


def handed_values(info: StreamInfo, list_path: str) -> dict[SlotKey, fx.Node]:
    """Each carried input slot of list ``list_path`` with the value its first member that
    receives a node there is handed (the stream slot included).

    Usually the list's first block; for a slot the first block is handed ``None`` in (a
    ``mamba_ssm``-style ``(hidden_states, residual)`` pair: no residual into the first
    block), the value the first block hands on there.

    Example:
        >>> # info.carried == {"layers": {("item", 0): ("arg", 0), ("item", 1): ("arg", 1)}}
        >>> # handed_values(info, "layers") -> {("arg", 0): embed, ("arg", 1): getitem_1}
    """
    members = [b for b in info.blocks if b.list_path == list_path]
    keys = {*info.carried.get(list_path, {}).values(), members[0].in_slot}
    found: dict[SlotKey, fx.Node] = {}
    for member in members:
        slots = input_slots(member.node)
        found |= {k: _unrouted(slots[k]) for k in keys - found.keys() if k in slots}
    return found


def _unrouted(node: fx.Node) -> fx.Node:
    """``node``, or the value a route planned before put a gather or a scatter around (the
    rewrite marks them ``tread_role``; the full value is a gather's first argument, the
    routed one a scatter's second)."""
    while isinstance(node, fx.Node) and node.meta.get("tread_role") in ("gather", "scatter"):
        node = node.args[0 if node.meta["tread_role"] == "gather" else 1]
    return node
