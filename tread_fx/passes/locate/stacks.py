"""The block stack: which containers hold the blocks the token stream flows through.

Candidates are ModuleList/Sequential containers of same-class modules, runs of same-class
block attributes of one parent (``"{blk0,blk1}"``, :mod:`tread_fx.passes.locate.members`) and
one-block containers of their class, which join the list beside them only where the stream
flows from one to the other (without any, mixed-class ModuleLists: hybrid stacks); a member that
is itself a list of sub-blocks (``for attn, ff in self.layers``) is entered at its first
sub-block. Among the containers whose members are called
once each, in order, the stack is the longest chain (a container whose first block depends on
the previous one's last: Flux's joint then single blocks) that the model's main input (the one
the prediction is shaped like) flows through, handing the stream most directly from block to
block (:mod:`tread_fx.passes.locate.stack_choice` chooses; of interleaved chains, the one
whose stream has the most tokens). ``blocks=`` names the containers instead.
Used by :mod:`tread_fx.passes.locate.stream`.

Example:
    >>> import torch
    >>> m = torch.nn.Module()
    >>> m.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    >>> list(candidate_stacks(m))
    ['blocks']
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from tread_fx.errors import (
    BlockStackNotFoundError,
    TokenStreamError,
    with_article,
)
from tread_fx.passes.locate.dataflow import (
    data_ancestors,
    fed_by,
    input_slots,
    nodes_in,
    tensor_meta,
)
from tread_fx.passes.locate.dims import channels_last
from tread_fx.passes.locate.members import (
    attribute_runs,
    checked_run,
    is_composite,
    is_run,
    member_path,
    run_key,
    stack_members,
)
from tread_fx.passes.trace.tracer import MODEL_PREFIX, TensorMeta, TracedCall

__all__ = [
    "candidate_stacks",
    "resolve_block_lists",
    "block_leaf_paths",
    "main_input",
    "block_calls",
    "block_class",
    "carrying_lists",
    "refuse_hierarchical_stages",
    "convolutional_block",
]


def candidate_stacks(model: nn.Module) -> dict[str, Any]:
    """Return the candidate block containers by path: ModuleList/Sequential of >= 2 modules
    that all share one class, runs of block attributes
    (:func:`~tread_fx.passes.locate.members.attribute_runs`, ``"{blk0,blk1}"``), and
    one-member containers whose member has the class of those (a list of one block before or
    after a longer list of its class: data flow decides whether they chain).

    Without any, ModuleLists of >= 2 modules of different classes (hybrid stacks that
    interleave attention and scan layers, Jamba-style): data flow then decides whether their
    members hand the token stream on, and same-class stays the preference.
    """
    found: dict[str, Any] = {}
    single, mixed = {}, {}
    for path, module in model.named_modules():
        if not isinstance(module, _BLOCK_CONTAINERS):
            continue
        members = list(module.children())  # a ModuleDict's values, in insertion order
        if len(members) >= 2 and len({block_class(c) for c in members}) == 1:
            found[path] = members
        elif len(members) == 1:
            single[path] = members
        elif not isinstance(module, nn.Sequential) and len(members) >= 2:
            mixed[path] = members
    found |= _runs_of_blocks(model, found)
    classes = {block_class(m) for members in found.values() for m in members}
    # a one-block list inside a block is part of that block; inside a list of stages (lists
    # of blocks: ``stages[1]`` holding one block between longer stages) it is a stage
    inside = tuple(f"{p}." for p, members in found.items() if not _all_lists(members))
    for path, module in single.items():
        if block_class(module[0]) in classes and not path.startswith(inside):
            found[path] = module
    found |= _lone_blocks(model, found, classes)
    return found or mixed


def _lone_blocks(model: nn.Module, lists: dict[str, Any], classes: set[type]) -> dict[str, Any]:
    """Attributes holding one block of a found list's class beside that list (U-ViT's and
    DiS's ``mid_block`` between ``in_blocks`` and ``out_blocks``), as one-member runs
    (``"{mid_block}"``): like a one-member list, data flow decides whether they chain."""
    parents = {path.rpartition(".")[0] for path in lists if path and not is_run(path)}
    members = {id(m) for found in lists.values() for m in found}
    lone = {}
    for parent in parents:
        for name, child in model.get_submodule(parent).named_children():
            key = run_key(parent, [name])
            if is_composite(child) and block_class(child) in classes and id(child) not in members:
                lone[key] = [child]
    return lone


def _runs_of_blocks(model: nn.Module, lists: dict[str, Any]) -> dict[str, Any]:
    """Runs of block attributes (:func:`~tread_fx.passes.locate.members.attribute_runs`) whose
    members hold none of ``lists``: a run of stages that each hold a block list of their own
    (CaiT's patch and class-attention transformers) would be traced as leaves and hide the
    blocks of those lists, which are the candidates there."""
    runs = attribute_runs(model, lists, block_class)
    return {
        path: members
        for path, members in runs.items()
        if not any(p.startswith(f"{m}.") for m, _ in stack_members(model, path) for p in lists)
    }


#: containers whose members may be the blocks (a ModuleDict iterated by its values or keys)
_BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _all_lists(members: Any) -> bool:
    return all(isinstance(m, (nn.ModuleList, nn.Sequential)) for m in members)


def block_class(module: nn.Module) -> type:
    """A member's class; a member compiled on its own (``torch.compile(block)``, dynamo's
    ``OptimizedModule``) counts as the class it wraps.

    Example:
        >>> block_class(nn.Linear(2, 2)).__name__
        'Linear'
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return block_class(module._orig_mod)
    return type(module)


def resolve_block_lists(
    model: nn.Module, blocks: str | Sequence[str] | nn.Module | None
) -> list[str]:
    """Turn the user's ``blocks=`` into container paths, or all candidates when ``None``."""
    if blocks is None:
        return list(candidate_stacks(model))
    items = [blocks] if isinstance(blocks, (str, nn.Module)) else list(blocks)
    names = {id(m): p for p, m in model.named_modules()}
    paths = []
    for item in items:
        path = names.get(id(item)) if isinstance(item, nn.Module) else item
        if not isinstance(path, str):
            raise BlockStackNotFoundError(
                f"blocks= was given {item!r}, which is not a submodule of "
                f"{type(model).__name__}; pass an attribute path such as 'blocks'."
            )
        if is_run(path):
            paths.append(checked_run(model, path))
            continue
        try:
            container = model.get_submodule(path)
        except AttributeError:
            raise BlockStackNotFoundError(
                f"blocks={path!r} was asked for, but {type(model).__name__} has no submodule "
                f"at that path; candidates are {sorted(candidate_stacks(model)) or 'none'}."
            ) from None
        if not isinstance(container, _BLOCK_CONTAINERS) or len(container) == 0:
            raise BlockStackNotFoundError(
                f"blocks={path!r} is {with_article(type(container).__name__)}, not a non-empty "
                "ModuleList/Sequential/ModuleDict of blocks; name the container that holds "
                "the blocks."
            )
        paths.append(path)
    return paths


def _is_nested_member(module: nn.Module) -> bool:
    """A member that is itself a list of sub-blocks called in turn (``for attn, ff in
    self.layers``): a ModuleList is never called as a whole."""
    return isinstance(module, nn.ModuleList) and len(module) > 0


def block_leaf_paths(model: nn.Module, list_paths: Iterable[str]) -> set[str]:
    """Return the paths of every member of the given containers (traced as leaves); for a
    member that is a list of sub-blocks, the paths of its sub-blocks, entering lists nested in
    it (``ModuleList([norms, block, residual])`` whose ``norms`` is a list again)."""
    paths = set()
    for p in list_paths:
        for path, member in stack_members(model, p):
            paths |= _sub_block_paths(member, path) if _is_nested_member(member) else {path}
    return paths


def _sub_block_paths(member: nn.Module, path: str) -> set[str]:
    paths = set()
    for sub, child in member.named_children():
        nested = isinstance(child, nn.ModuleList)
        paths |= _sub_block_paths(child, f"{path}.{sub}") if nested else {f"{path}.{sub}"}
    return paths


def block_calls(traced: TracedCall, list_paths: list[str]) -> dict[str, list[fx.Node]]:
    """Calls of each container's (or run's) members, in order; for a member that is a list
    of sub-blocks, its first sub-block call at any depth (the block boundary)."""
    model = traced.wrapper.model
    calls: dict[str, list[fx.Node]] = {p: [] for p in list_paths}
    owner = {m: p for p in list_paths for m, _ in stack_members(model, p)}
    entered: set[str] = set()
    for node in traced.gm.graph.nodes:
        if node.op != "call_module":
            continue
        target = node.target[len(MODEL_PREFIX) :]
        if target in owner:
            calls[owner[target]].append(node)
            continue
        member = _nested_member_of(target, owner)
        if member is None or not _is_nested_member(model.get_submodule(member)):
            continue  # a call into a plain block's submodule from outside it (DiT's norm1.emb)
        if member not in entered:
            entered.add(member)
            calls[owner[member]].append(node)
    return calls


def _nested_member_of(target: str, owner: dict[str, str]) -> str | None:
    """The innermost member (a key of ``owner``) that ``target`` lies in, below the member
    itself; ``None`` when it lies in none."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if (member := ".".join(parts[:cut])) in owner:
            return member
    return None


def _valid_sequence(model: nn.Module, path: str, nodes: list[fx.Node]) -> bool:
    """Members called once each, in order, each on what the one before computed: parallel
    calls on one input (patch embedders at several scales, per-branch heads) are no stack.
    A run's members may be called in any order (data flow orders them), each once, all
    handing on in one argument slot, the one the first member takes the stream in (a
    same-class text block feeding the first block's context is no part of it, nor is a
    class-attention stage taking the stage before it as its context)."""
    members = [m for m, _ in stack_members(model, path)]
    called = [member_path(n.target[len(MODEL_PREFIX) :], path) for n in nodes]
    run = is_run(path)
    if (sorted(called) if run else called) != (sorted(members) if run else members):
        return False
    if len(set(called)) != len(called):
        return False
    if not all(a in data_ancestors(b, {a}) for a, b in zip(nodes, nodes[1:])):
        return False
    return (
        not run or len(nodes) < 2 or bool(_common_handed_slots(nodes) & set(input_slots(nodes[0])))
    )


def _common_handed_slots(nodes: list[fx.Node]) -> set[tuple]:
    """The argument slots in which every call receives a value the call before computed."""
    pairs = zip(nodes, nodes[1:])
    slots = [{k for k, v in input_slots(b).items() if fed_by(v, a)} for a, b in pairs]
    return set.intersection(*slots) if slots else set()


def _shape_distance(a: object, b: object) -> int | None:
    """0: same shape; 1: same rank, one dim differs (channels, a learned sigma); else None."""
    tensors = isinstance(a, TensorMeta) and isinstance(b, TensorMeta)
    if not tensors or len(a.shape) != len(b.shape):
        return None
    differing = sum(x != y for x, y in zip(a.shape, b.shape))
    return differing if differing <= 1 else None


def main_input(graph: fx.Graph) -> fx.Node:
    """The model's main input: the noisy sample, whose shape the prediction has.

    The tensor input with the shape of the first output (exactly, else up to one dim such as
    the channels of a learned-sigma prediction) is the noisy input; a text or conditioning
    input never has that shape. Without such an input, the first tensor input.
    """
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    first = next(iter(nodes_in(output.args)), None)
    out_meta = first.meta.get("tread_meta") if first is not None else None
    ranked = [
        (d, i) for i, n in enumerate(inputs)
        if (d := _shape_distance(n.meta.get("tread_meta"), out_meta)) is not None
    ]  # fmt: skip
    return inputs[min(ranked)[1]] if ranked else inputs[0]


def _handed_slots(nodes: list[fx.Node]) -> tuple[dict[tuple, fx.Node], list[tuple]]:
    """(the first block's input slots, those of them the second block receives computed by
    the first): the values a list's blocks hand on to each other."""
    first = input_slots(nodes[0])
    return first, [
        k for k, v in input_slots(nodes[1]).items() if k in first and fed_by(v, nodes[0])
    ]


def _stream_fed_by(nodes: list[fx.Node], primary: fx.Node) -> bool:
    """Whether the value a list's blocks hand on to each other comes from ``primary`` (a text
    refiner receives RoPE tables computed from the main input, but hands on the text)."""
    if len(nodes) < 2:
        return fed_by(nodes[0], primary)
    first, handed = _handed_slots(nodes)
    if not handed:
        return fed_by(nodes[0], primary)
    return any(fed_by(first[k], primary) for k in handed)


def carrying_lists(
    model: nn.Module, calls: dict[str, list[fx.Node]], primary: fx.Node
) -> list[str]:
    """The lists whose members are called once each, in order, and hand on a value fed by
    ``primary``: the lists that carry its stream."""
    return [
        p
        for p, nodes in calls.items()
        if nodes and _valid_sequence(model, p, nodes) and _stream_fed_by(nodes, primary)
    ]


def _chains(
    model: nn.Module, calls: dict[str, list[fx.Node]], primary: fx.Node | None = None
) -> list[list[str]]:
    # a list whose blocks never see the model's main input (a text refiner, a perceiver over
    # reference embeddings) neither heads nor competes with the stack the noisy input flows
    # through; when no list sees it (an unusual argument order) all stay candidates
    fed = carrying_lists(model, calls, primary) if primary is not None else []
    valid = fed or [p for p, nodes in calls.items() if nodes and _valid_sequence(model, p, nodes)]
    order = {n: i for i, n in enumerate(calls[valid[0]][0].graph.nodes)} if valid else {}
    valid.sort(key=lambda p: order[calls[p][0]])
    chains: list[list[str]] = []
    for path in valid:
        for chain in chains:
            last = calls[chain[-1]][-1]
            first = calls[path][0]
            joined = order[first] > order[last] and last in data_ancestors(first, set())
            joined = joined and _same_form(chain[-1], path, calls)
            if joined and (primary is None or _hands_to(chain[-1], path, calls)):
                chain.append(path)
                break
        else:
            chains.append([path])
    others = [p for p, nodes in calls.items() if p not in valid and nodes]
    return [_with_lists_before(chain, others, calls, order) for chain in chains] if fed else chains


def _with_lists_before(chain: list[str], others: list[str], calls: dict, order: dict) -> list:
    """``chain`` with the same-form lists before it that hand it its stream in the slot its
    blocks hand on (a perceiver's latent blocks attending to the input, then more of them):
    their first block shows where the stream comes from (learned latents are refused)."""
    for path in sorted(others, key=lambda p: -order.get(calls[p][-1], -1)):
        if calls[path][-1] not in order:
            continue
        if _same_form(path, chain[0], calls) and _feeds_handed_slot(path, chain[0], calls):
            chain = [path, *chain]
    return chain


def _feeds_handed_slot(before: str, after: str, calls: dict[str, list[fx.Node]]) -> bool:
    """Whether the last block of ``before`` feeds the first of ``after`` in an argument slot
    ``after`` hands from block to block (its stream), not only in a context slot."""
    a, b = calls[before], calls[after]
    if len(b) < 2 or _node_class(a[-1]) is not _node_class(b[0]):
        return False
    slots = input_slots(b[0])
    return any(k in slots and fed_by(slots[k], a[-1]) for k in _handed_slots(b)[1])


def _hands_to(before: str, after: str, calls: dict[str, list[fx.Node]]) -> bool:
    """Whether a one-block list joins the list beside it: only a block of the same class
    that the stream flows through, from the one to the other, in the argument slot the longer
    list hands from block to block (a same-class block whose output the next list only reads
    as context is no part of the stack). Lists of >= 2 blocks join as before."""
    a, b = calls[before], calls[after]
    if len(a) > 1 and len(b) > 1:
        return True
    if _node_class(a[-1]) is not _node_class(b[0]):
        return False
    lead = b if len(b) > 1 else a if len(a) > 1 else None
    slots = input_slots(b[0])
    keys = _handed_slots(lead)[1] if lead is not None else list(slots)
    return any(k in slots and fed_by(slots[k], a[-1]) for k in keys)


def _node_class(node: fx.Node) -> type:
    return block_class(node.graph.owning_module.get_submodule(node.target))


def _same_form(before: str, after: str, calls: dict[str, list[fx.Node]]) -> bool:
    """Whether two lists called one after the other carry one stream: the value each hands
    from block to block has the same rank and width (a projection between encoder and
    decoder widths splits them). Unclear forms (one block, several values) join."""
    a, b = _handed_stream([before], calls), _handed_stream([after], calls)
    if a is None or b is None:
        return True
    return len(a.shape) == len(b.shape) and a.shape[-1] == b.shape[-1]


def _handed_stream(chain: list[str], calls: dict[str, list[fx.Node]]) -> TensorMeta | None:
    """The value a chain's first block hands on to its second (its token stream), if it is
    one tensor with at least a batch, a token and a feature dim."""
    nodes = [n for path in chain for n in calls[path]]
    if len(nodes) < 2:
        return None
    first, slots = _handed_slots(nodes)
    metas = [m for k in slots if (m := tensor_meta(first[k])) is not None and len(m.shape) >= 3]
    return metas[0] if len(metas) == 1 else None


def _form_break(chains: list[list[str]], calls: dict[str, list[fx.Node]]) -> str:
    """``"encoder: [2, 16, 32]; decoder: [2, 16, 48]"`` when the chains (in call order)
    carry streams of different forms; empty when they do not."""
    metas = {p: _handed_stream([p], calls) for chain in chains for p in chain}
    known = {p: m for p, m in metas.items() if m is not None}
    forms = {(len(m.shape), m.shape[-1]) for m in known.values()}
    return "; ".join(f"{p}: {list(m.shape)}" for p, m in known.items()) if len(forms) > 1 else ""


#: layers that compute on feature maps [B, C, H, W] (or [B, C, F, H, W]) and on nothing else
_FEATURE_MAP_LAYERS = (
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.GroupNorm,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


def convolutional_block(member: nn.Module) -> bool:
    """Whether a block computes on feature maps only: it holds a 2-D/3-D convolution, and
    every part with parameters of its own is a convolution or a channel norm (no linear layer,
    attention, embedding or token norm that could read a token sequence).

    Example:
        >>> convolutional_block(nn.Sequential(nn.Conv2d(4, 4, 3), nn.GroupNorm(2, 4), nn.SiLU()))
        True
        >>> convolutional_block(nn.Sequential(nn.Conv2d(4, 4, 3), nn.Linear(4, 4)))
        False
    """
    parts = list(member.modules())
    owners = [m for m in parts if any(True for _ in m.parameters(recurse=False))]
    convs = [m for m in parts if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    return bool(convs) and all(isinstance(m, _FEATURE_MAP_LAYERS) for m in owners)


def _feature_map(model: nn.Module, chain: list[str], calls: dict[str, list[fx.Node]]) -> bool:
    """Whether a chain's blocks hand on a feature map (``[B, C, H, W]`` read by convolutions
    on dim 1, or a value of rank 5 and more) rather than a token sequence."""
    meta = _handed_stream(chain, calls)
    if meta is None:
        return False
    first = model.get_submodule(calls[chain[0]][0].target[len(MODEL_PREFIX) :])
    rank = len(meta.shape)
    return rank > 4 or (rank == 4 and not channels_last(first, tuple(meta.shape)))


def refuse_hierarchical_stages(model: nn.Module, blocks: list[Any]) -> None:
    """Refuse a stack of hierarchical stages (members that hold block lists of their own and
    hand on a stream of another shape than they take: patch merging between stages); the
    error names a stage's list. ``blocks`` are the located ``BlockCall``s."""
    members = [b for b in blocks if b.path == member_path(b.path, b.list_path)]  # not nested
    for block in members:
        before, after = tensor_meta(block.stream_in), tensor_meta(block.stream_out)
        if before is None or after is None or before.shape[:-1] == after.shape[:-1]:
            continue
        inner = [
            f"{b.path}.{p}" for b in members for p in candidate_stacks(model.get_submodule(b.path))
        ]
        if not inner:
            return
        raise TokenStreamError(
            f"the blocks of {block.list_path!r} are hierarchical stages, not a stack of blocks\n"
            f"{block.path} takes the stream as {list(before.shape)} and hands it on as "
            f"{list(after.shape)}, and the stages hold their own block lists ({inner}); a "
            "route cannot span stages whose token count changes. Route inside one stage, "
            f"e.g. blocks={inner[0]!r}."
        )
