"""Where the stream enters a member that is a list of sub-blocks (a per-layer role container).

The boundary of such a member is the first call into it (``for skip_proj, attn, ff in
self.layers``). Code of the member may run before that call and change the stream's shape:
a long skip concatenated beside the features and projected back (``x = skip_proj(cat([skip,
x], -1))``, U-ViT written with ``[skip_proj | None, attn, ff]`` layers). The stream the
member before hands on is then the stream-shaped value that code starts from, not the
concatenation: a route starting there gathers it (and the skip, by its use), a route ending
there scatters it, and the concatenation runs after the scatter on the full stream, with the
skip the route produced scattered too. A member whose first call takes a stream-shaped value
keeps it as the boundary.

Example:
    >>> # used by tread_fx.passes.locate.stream.locate; see tests/test_role_container_skips.py
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import torch.fx as fx

from tread_fx.passes.locate.dataflow import data_ancestors, input_slots, tensor_meta

__all__ = ["handed_into_member", "member_prologue", "stream_entering"]


def _shape(node: Any) -> tuple | None:
    meta = tensor_meta(node)
    return meta.shape if meta is not None else None


def _is_nested(block: Any) -> bool:
    """A sub-block call: the block's path lies below its member ``<list>.<i>``."""
    return block.path.rpartition(".")[0] != block.list_path


def handed_into_member(block: Any, prev: Any, value: fx.Node, block_nodes: set) -> fx.Node:
    """The stream entering ``block`` (a ``BlockCall``): ``value`` (what its first call
    receives in the stream slot), or, for a nested member whose first call receives a value
    of another shape than the stream ``prev`` (the block before, or ``None``) took, the one
    stream-shaped value that value is computed from (by code, no module call between) and
    that the member before computed (not searching past ``block_nodes``).
    """
    if prev is None or prev.list_path != block.list_path or not _is_nested(block):
        return value
    want = _shape(prev.stream_in)
    if want is None or _shape(value) == want:
        return value
    found, seen, todo = [], {value}, [value]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg in seen:
                continue
            seen.add(arg)
            if _shape(arg) == want:
                found.append(arg)
            elif arg.op in ("call_function", "call_method"):
                todo.append(arg)
    handed = [n for n in found if n is prev.node or prev.node in data_ancestors(n, block_nodes)]
    return handed[0] if len(handed) == 1 else value


def stream_entering(block: Any) -> fx.Node:
    """The stream entering ``block`` (a ``BlockCall``) in the graph as it is now: what its
    call receives in the stream slot (a route planned and rewritten before may have replaced
    the located value by its scatter), or, for a member whose own code changes the stream's
    shape before its first call, the value that code starts from (``block.stream_in``).
    """
    slot = input_slots(block.node).get(block.in_slot)
    if slot is block.stream_in or _shape(slot) == _shape(block.stream_in):
        return slot
    return _scattered(block.stream_in)


def _scattered(node: fx.Node) -> fx.Node:
    """``node``, or the scatter a route ending here put in its place
    (``tread_fx/passes/rewrite/insert.py``
    marks it ``tread_role == "scatter"``, the routed value its second argument)."""
    for user in node.users:
        if user.meta.get("tread_role") == "scatter" and user.args[1:2] == (node,):
            return _scattered(user)
    return node


def member_prologue(g: nx.DiGraph, block: Any) -> set[fx.Node]:
    """Nodes of the data-flow graph ``g`` between the stream entering ``block`` and its first
    call (the member's own code before that call); empty where the call receives the stream.
    """
    entering = stream_entering(block)
    if input_slots(block.node).get(block.in_slot) is entering:
        return set()
    return nx.descendants(g, entering) & nx.ancestors(g, block.node)
