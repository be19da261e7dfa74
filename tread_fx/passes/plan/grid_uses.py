"""The patch grid, found by how the routed blocks use it (never by an attribute's name).

A block that needs the grid reshapes its tokens to it: a ``view``/``reshape``/``unflatten`` of
a stream-derived tensor whose sizes split the token dim (of the routable tokens) into two or
three factors (rows x cols, frames x rows x cols) is a use of the grid, wherever its ints came
from (:class:`GridUse`):

- ``slot``: an int argument of the block call, or an int inside a tuple argument
  (``patch_resolution=(H, W)``), tagged by :func:`~tread_fx.passes.plan.uses.tagged_example`;
  the block is told the kept row count there (``layout.grid_arguments``);
- ``literal``: a number the block holds itself (an attribute, a closure, a constant): the block
  is inlined into the routed graph with the kept factor in its place (:func:`inline_kept_grid`);
- ``data``: a size read from the tokens (``-1``, ``x.shape``, ``n // w``): it follows the kept
  tokens by itself.

Under ``selection="rows"`` the routed blocks see the kept grid: the kept rows of every frame,
all the columns. A use that merges factors (``(F, H * W)`` beside ``(F, H, W)``) is told the
merged kept factors; factorizations that no one grid refines are refused, naming ``grid=``.

Example:
    >>> kept_factors((4, 16), (4, 4, 4), 2)
    (4, 8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from tread_fx.errors import SelectionError, warn_at_caller
from tread_fx.passes.locate.dataflow import argument_items, input_slots, int_value, tensor_shape
from tread_fx.passes.locate.layout import stream_tokens
from tread_fx.passes.locate.stream import BlockCall, StreamInfo
from tread_fx.passes.plan.dim_flow import follow_dim
from tread_fx.passes.plan.inline_tables import InlineBlock
from tread_fx.passes.plan.uses import TaggedInt, _forward, _name, tagged_example
from tread_fx.passes.trace.block import example_of, trace_through
from tread_fx.passes.trace.tracer import TracedCall

__all__ = [
    "GridUse",
    "height_slots",
    "grid_uses",
    "grid_by_use",
    "kept_factors",
    "needs_inlining",
    "inline_kept_grid",
]

_RESHAPE = {"view", "reshape", "unflatten"}


@dataclass(frozen=True)
class GridUse:
    """One reshape of a block's tokens to a grid.

    Attributes:
        block: The block call in the model's graph.
        node: The reshape's name in the block traced through.
        factors: The sizes the token dim is split into.
        sources: Per factor, ``"slot"``, ``"literal"`` or ``"data"`` (see the module docstring).
        paths: Per factor, where it stands in the reshape's ``args``.
        inlinable: Whether the block can be traced through to be inlined.
        slots: Per factor, the argument slot of the block call it was read from (``None``
            when its source is not ``"slot"``).
        on_token_dim: Whether the dim it splits holds the stream's tokens by data flow
            (:func:`~tread_fx.passes.plan.dim_flow.follow_dim`); ``None``: not known.
    """

    block: BlockCall
    node: str
    factors: tuple[int, ...]
    sources: tuple[str, ...]
    paths: tuple[tuple[int, ...], ...]
    inlinable: bool
    slots: tuple[tuple | None, ...] = ()
    on_token_dim: bool | None = None

    def describe(self) -> str:
        """``block 1 (blocks.1) reshapes its tokens to (4, 4) (literal, literal)``."""
        told = ", ".join(self.sources)
        return (
            f"block {self.block.index} ({self.block.path}) reshapes its tokens to "
            f"{self.factors} ({told})"
        )


def _at(args: tuple, path: tuple[int, ...]) -> object:
    value: object = args
    for i in path:
        value = value[i]  # type: ignore[index]
    return value


def _source(value: object) -> str:
    if isinstance(value, TaggedInt):
        return "slot"
    return "literal" if type(value) is int and value != -1 else "data"


def _size_paths(node: fx.Node) -> tuple[int, list[tuple[int, ...]]] | None:
    """(first output dim, paths in ``args`` of each size) of a reshape's sizes."""
    if _name(node) == "unflatten":
        sizes = node.args[2] if len(node.args) > 2 else None
        if not isinstance(sizes, (tuple, list)) or not isinstance(node.args[1], int):
            return None
        return -1, [(2, j) for j in range(len(sizes))]
    if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)):
        return 0, [(1, j) for j in range(len(node.args[1]))]
    return 0, [(j,) for j in range(1, len(node.args))]


def _factorization(node: fx.Node, routable: int, flow_dim: int = -1) -> tuple | None:
    """(factors, their paths, the input dim split) where ``node`` splits a dim of ``routable``
    tokens of its input into 2 or 3 factors, each above 1; ``None`` when it does not. Where
    the input has several dims of that size, the one data flow shows holds the tokens
    (``flow_dim``, from :func:`~tread_fx.passes.plan.dim_flow.follow_dim`) is read; unknown,
    none is."""
    shape, out = tensor_shape(node.args[0]) if node.args else None, tensor_shape(node)
    found = _size_paths(node) if shape and out and _name(node) in _RESHAPE else None
    if found is None or routable not in shape:
        return None
    if sum(s == routable for s in shape) == 1:
        d = shape.index(routable)
    elif 0 <= flow_dim < len(shape) and shape[flow_dim] == routable:
        d = flow_dim
    else:
        return None
    lo, hi = math.prod(shape[:d]), math.prod(shape[: d + 1])
    first, paths = found
    if first == -1:  # unflatten(dim, sizes)
        dim, factors = node.args[1] % len(shape), tuple(out[d : d + len(paths)])
        fits = dim == d and len(factors) in (2, 3) and min(factors) > 1
        return (factors, paths, d) if fits else None
    if len(paths) != len(out):
        return None
    for i in range(len(out)):
        for j in (i + 2, i + 3):
            if j <= len(out) and math.prod(out[:i]) == lo and math.prod(out[:j]) == hi:
                factors = tuple(out[i:j])
                if min(factors) > 1:
                    return factors, paths[i:j], d
    return None


def _trace(gm: fx.GraphModule, block: BlockCall) -> tuple[TracedCall | None, bool, list]:
    """(the block traced through on tagged inputs, whether it can be inlined, flat inputs)."""
    kept = example_of(gm, block.node)
    if kept is None:
        return None, False, []
    module, example = gm.get_submodule(block.node.target), tagged_example(kept[0], block.node)
    traced = trace_through(module, example, inlined=True)
    if traced is not None:
        return traced, True, kept[1]
    return trace_through(module, example, inlined=False), False, kept[1]


def _class_uses(gm: fx.GraphModule, block: BlockCall, routable: int, token_dim: int) -> list:
    """``(reshape name, factors, sources, paths, inlinable, slots, on_token_dim)`` of each
    grid use."""
    traced, inlinable, leaves = _trace(gm, block)
    if traced is None:
        return []
    placeholders = traced.gm.graph.find_nodes(op="placeholder")
    stream = input_slots(block.node)[block.in_slot]
    at = [i for i, (node, _) in enumerate(leaves) if node is stream]
    if len(placeholders) != len(leaves) or not at:
        return []
    data = set().union(*(_forward(placeholders[i]) for i in at))
    flow = follow_dim(placeholders[at[0]], token_dim)
    found = []
    for node in traced.gm.graph.nodes:
        flow_dim = flow.get(node.args[0], -1) if node.args else -1
        split = _factorization(node, routable, flow_dim) if node in data else None
        if split is not None:
            factors, paths, split_dim = split
            sizes = [_at(node.args, p) for p in paths]
            sources = tuple(map(_source, sizes))
            slots = tuple(getattr(v, "slot", None) for v in sizes)
            on_tokens = None if flow_dim == -1 else split_dim == flow_dim
            found.append((node.name, factors, sources, tuple(paths), inlinable, slots, on_tokens))
    return found


def grid_uses(
    gm: fx.GraphModule, info: StreamInfo, blocks: list[BlockCall], decided: bool = False
) -> list[GridUse]:
    """The grid uses of ``blocks`` (those that see the first block's stream), each block
    class traced through once per call signature (cached on the graph). ``decided``: the grid
    is settled already (``grid=``, or planning a route of rows), so no ambiguity is reported.

    Example:
        >>> # driven by tread_fx.pipeline (see tests/test_grid_by_use.py)
    """
    cache = gm.graph.__dict__.setdefault("_tread_grid_uses", {})
    routable, found = info.layout.routable, []
    for block in blocks:
        kept = example_of(gm, block.node)
        if kept is None or stream_tokens(block, info) != info.layout.num_tokens:
            continue
        key = (type(gm.get_submodule(block.node.target)), id(kept[0]), block.in_slot)
        if key not in cache:
            cache[key] = _class_uses(gm, block, routable, info.layout.token_dim)
        found += [GridUse(block, *use) for use in cache[key]]
    return found if decided else _unless_width(found, info)


def _unless_width(found: list[GridUse], info: StreamInfo) -> list[GridUse]:
    """``found``, where no other dim of the stream (its width) holds as many values as the
    routable tokens. Where one does, a split of that many values may be the features' (attention
    heads): the uses that data flow shows to split the token dim are kept, those it shows to
    split another dim are not grid uses; when it cannot tell for one, none is taken and a
    warning names the choice."""
    shape, dim = info.stream_meta.shape, info.layout.token_dim
    if not found or info.layout.routable not in [s for i, s in enumerate(shape) if i != dim]:
        return found
    unclear = [u for u in found if u.on_token_dim is None]
    if not unclear:
        return [u for u in found if u.on_token_dim]
    warn_at_caller(
        f"{unclear[0].describe()}, but the stream {tuple(shape)} also has "
        f"{info.layout.routable} values on another dim, so tread_fx cannot tell whether that is "
        "a patch grid or a split of the features (heads); it is not taken for the grid. If it "
        "is the grid, pass grid=(H, W) and selection='rows' to route()."
    )
    return []


def _value_at(node: fx.Node, slot: tuple) -> int | None:
    """The int the block call ``node`` passes at ``slot`` (nested into tuples), or ``None``."""
    value: object = dict(argument_items(node)).get(tuple(slot[:2]))
    for j in slot[2:]:
        if not isinstance(value, (tuple, list)) or j >= len(value):
            return None
        value = value[j]
    return int_value(value)


def height_slots(uses: list[GridUse], grid: tuple[int, ...]) -> list[tuple]:
    """``(block node, slot)`` of each block argument that a grid use reshapes the tokens by as
    the grid's height (its rows per frame): data flow names the argument, wherever it stands
    among the call's arguments (``partial(blk, w=gw, ..., h=gh)``).

    Example:
        >>> height_slots([], (4, 4))
        []
    """
    found = []
    for use in uses:
        if tuple(use.factors) != tuple(grid) or len(use.slots) != len(grid):
            continue
        slot = use.slots[-2]
        told = _value_at(use.block.node, slot) if slot is not None else None
        if told == grid[-2] and (use.block.node, slot) not in found:
            found.append((use.block.node, slot))
    return found


def _cuts(factors: tuple[int, ...]) -> set[int]:
    return {math.prod(factors[:i]) for i in range(1, len(factors))}


def grid_by_use(uses: list[GridUse], given: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The grid the uses agree on: the finest factorization, every other one merging its
    factors; ``given`` (``grid=``) when set. Refuses uses that no one grid refines.

    Example:
        >>> grid_by_use([], None) is None
        True
    """
    shapes = {u.factors for u in uses}
    finest = given or max(shapes, key=len, default=None)
    odd = [s for s in shapes if finest is None or not _cuts(s) <= _cuts(tuple(finest))]
    if odd:
        seen = "; ".join(u.describe() for u in uses if u.factors in {*odd, finest})
        raise SelectionError(
            f"the routed blocks reshape their tokens to grids that no one grid refines: "
            f"{seen}. tread_fx cannot tell which is the patch grid; pass grid=(H, W) (or "
            "(F, H, W)) to route()."
            if given is None
            else f"grid={tuple(given)} was given, but {seen}, which it does not refine; "
            "pass the grid the blocks use."
        )
    return tuple(finest) if finest is not None else None


def kept_factors(factors: tuple[int, ...], grid: tuple[int, ...], keep: int) -> tuple:
    """``factors`` (merged runs of ``grid``) for the kept grid: ``keep`` rows of each frame.

    Example:
        >>> kept_factors((4, 4), (4, 4), 2)
        (2, 4)
    """
    kept = (*grid[:-2], keep, grid[-1])
    ends = [math.prod(factors[: i + 1]) for i in range(len(factors))]
    bounds = [next(j for j in range(len(grid) + 1) if math.prod(grid[:j]) == e) for e in ends]
    return tuple(math.prod(kept[a:b]) for a, b in zip([0, *bounds], bounds))


def needs_inlining(uses: list[GridUse], grid: tuple[int, ...], keep: int) -> list[GridUse]:
    """The uses with a factor the block holds itself (no argument to tell the kept one) that
    differs in the kept grid (a fixed width stays right).

    Example:
        >>> needs_inlining([], (4, 4), 2)
        []
    """
    found = []
    for use in uses:
        kept = kept_factors(use.factors, grid, keep)
        changed = [(s, a) for s, a, b in zip(use.sources, use.factors, kept) if a != b]
        literals = [a for s, a in changed if s == "literal"]
        if literals and use.on_token_dim is not True and grid[-1] in literals:
            raise SelectionError(_orientation_unclear(use, grid, literals))
        if literals:
            found.append(use)
    return found


def _orientation_unclear(use: GridUse, grid: tuple[int, ...], literals: list[int]) -> str:
    return (
        f"{use.describe()}: the number {literals[0]} it holds itself stands where the rows of "
        f"the grid {tuple(grid)} would be, but the grid's width is {grid[-1]} too, and tread_fx "
        "cannot follow the token order into that reshape (a column-major scan transposes it "
        "first), so whether the number counts the rows (told the kept rows) or the columns "
        "(kept as it is) cannot be told. Route blocks without that reshape (blocks= or other "
        "routes)."
    )


def _put(args: tuple, path: tuple[int, ...], value: int) -> tuple:
    items = list(args)
    items[path[0]] = value if len(path) == 1 else _put(items[path[0]], path[1:], value)
    return type(args)(items)


def inline_kept_grid(
    gm: fx.GraphModule,
    uses: list[GridUse],
    grid: tuple[int, ...],
    keep: int,
    found: list[InlineBlock],
) -> list[InlineBlock]:
    """Blocks to inline with the kept grid in place of numbers they hold themselves.

    Each reshape of such a block (in the block traced through afresh, or in the trace already
    kept for its token tables in ``found``) is given the kept factors. A block inlined for its
    token tables is given them for grid numbers it was handed too (Diffusion-RWKV's
    ``patch_resolution``): the call that would tell it the kept grid is inlined away.

    Returns:
        The new :class:`InlineBlock` (no token tables) of the blocks not in ``found``.

    Raises:
        SelectionError: A block with such a number cannot be traced through to inline it.
    """
    inlined = {b.block.node: b for b in found}
    new: dict[fx.Node, InlineBlock] = {}
    handed = [u for u in uses if u.block.node in inlined and "slot" in u.sources]
    changed = [u for u in handed if kept_factors(u.factors, grid, keep) != tuple(u.factors)]
    for use in [*needs_inlining(uses, grid, keep), *changed]:
        if not use.inlinable:
            raise SelectionError(
                f"{use.describe()} with numbers it holds itself (not arguments), and it cannot "
                "be traced through to run it on the kept rows; pass blocks= to route others."
            )
        target = inlined.get(use.block.node) or new.get(use.block.node)
        if target is None:
            traced = _trace(gm, use.block)[0]
            graph = traced.gm.graph
            data = set().union(*map(_forward, graph.find_nodes(op="placeholder")))
            target = new[use.block.node] = InlineBlock(use.block, traced, data, {})
        node = next(n for n in target.traced.gm.graph.nodes if n.name == use.node)
        for path, factor in zip(use.paths, kept_factors(use.factors, grid, keep)):
            if _source(_at(node.args, path)) != "data":
                node.args = _put(node.args, path, factor)
    return list(new.values())
