"""The source of a generated model's block section: calls, hooks, and the twin's route.

A block call comes in the drawn argument style (positional / keyword), wrapping (plain,
``torch.utils.checkpoint``, ``functools.partial``, both, or checkpointing in training only)
and return form (tensor, tuple, three outputs, list, dict). The model walks its containers;
the twin walks the same blocks by index, gathers the stream and every token-aligned side
value at the route start, tells the blocks the routed sizes (token count, grid height), and
scatters back at the end. Everything comes from the draw, never from ``route()``.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> any("blk" in line for line in model_blocks(draw(0)))
    True
"""

from __future__ import annotations

from benchmarks.generated.grammar import Draw
from benchmarks.generated.grammar_containers import MORE_CONTAINERS
from benchmarks.generated.source_containers import container_block_list, container_walk

__all__ = [
    "block_params", "call_lines", "model_blocks", "twin_route_blocks", "block_list",
    "hook_source", "hook_init", "int_lines",
]  # fmt: skip

_ROLE = {
    "cond": "b_cond", "rope": "b_rope", "mask": "b_mask", "ctx": "b_ctx",
    "ctx_mask": "b_ctx_mask", "count": "b_count", "gh": "b_gh", "gw": "b_gw", "gf": "b_gf",
    "grid": "b_grid", "coin": "b_coin",
}  # fmt: skip
_CKPT = "torch.utils.checkpoint.checkpoint"


def block_params(d: Draw) -> list[str]:
    """The block's forward parameters after the stream, in the drawn order."""
    return [d.names[_ROLE[side]] for side in d.side_order]


def _values(d: Draw) -> dict[str, str]:
    ctx = "ctx_tokens" if d.refuse == "latents" else "txt"
    cond = "cb" if d.refuse == "fold" else "c"
    return {
        "cond": cond, "rope": "rope", "mask": "m", "ctx": ctx, "ctx_mask": "tm",
        "count": "ntok", "gh": "gh", "gw": "gw", "gf": "gf", "grid": "grid",
        "coin": f"self.{d.names['coin']}",
    }  # fmt: skip


def _unpack(d: Draw, call: str) -> str:
    if d.ret == "tuple":
        return f"x, aux = {call}"
    if d.ret == "tuple3":
        return f"x, aux, extra = {call}"
    if d.ret == "list":
        return f"x = {call}[0]"
    if d.ret == "dict":
        return f"x = {call}[{d.names['key_out']!r}]"
    return f"x = {call}"


def call_lines(d: Draw, block: str, values: dict[str, str] | None = None) -> list[str]:
    """``x = <block call>`` in the drawn style, wrapping and return form (one or more lines);
    ``values`` overrides what a side argument is given (the latents' decoder)."""
    vals = {**_values(d), **(values or {})}
    stream = vals.get("x", "x")
    sides = [vals[side] for side in d.side_order]
    names = block_params(d)
    keyword = [f"{p}={a}" for p, a in zip(names, sides)]
    plain = [f"{d.names['b_x']}={stream}", *keyword] if d.call == "keyword" else None
    plain = plain or [stream, *sides]
    if d.wrap in ("partial", "partial_checkpoint"):
        bound = ", ".join([block, *keyword])
        first = f"fn = functools.partial({bound})"
        if d.wrap == "partial":
            return [first, _unpack(d, f"fn({stream})")]
        return [first, _unpack(d, f"{_CKPT}(fn, {stream}, use_reentrant=False)")]
    direct = _unpack(d, f"{block}({', '.join(plain)})")
    if d.wrap == "plain":
        return [direct]
    ckpt_args = ", ".join([block, stream, *sides] if d.call == "positional" else [block, *plain])
    ckpt = _unpack(d, f"{_CKPT}({ckpt_args}, use_reentrant=False)")
    if d.wrap == "checkpoint":
        return [ckpt]
    return ["if self.training:", f"    {ckpt}", "else:", f"    {direct}"]


def block_list(d: Draw) -> str:
    """An expression for the model's blocks in order (``self`` is the model)."""
    n = d.names
    if d.container in MORE_CONTAINERS:
        return container_block_list(d)
    if d.container == "numbered":
        return "[" + ", ".join(f"self.{n['numbered']}{i}" for i in range(d.depth)) + "]"
    if d.container == "two_lists":
        return f"[*self.{n['list1']}, *self.{n['list2']}]"
    return f"list(self.{n['list1']})"


def _fold_lines() -> list[str]:
    """Tokens folded into the batch: each token its own one-token sequence."""
    return [
        "cb = cb.repeat_interleave(x.shape[1], dim=0)",
        "x = einops.rearrange(x, 'b n d -> (b n) 1 d')",
    ]


def model_blocks(d: Draw) -> list[str]:
    """The model's block section (the containers walked, a fold where drawn)."""
    n = d.names
    fold = d.refuse == "fold"
    lines = ["cb = c"] if fold else []
    if d.container in MORE_CONTAINERS:  # never with a fold (grammar_containers.py)
        lines += container_walk(d, call_lines(d, "blk"))
    elif d.container == "numbered":
        for i in range(d.depth):
            lines += _fold_lines() if fold and i == d.change_at else []
            lines += call_lines(d, f"self.{n['numbered']}{i}")
    else:
        lists = [n["list1"]] + ([n["list2"]] if d.container == "two_lists" else [])
        offsets = [0, d.split]
        for name, offset in zip(lists, offsets):
            if fold:
                lines.append(f"for i, blk in enumerate(self.{name}, start={offset}):")
                lines += ["    " + line for line in _if(d.change_at, _fold_lines())]
            else:
                lines.append(f"for blk in self.{name}:")
            lines += ["    " + line for line in call_lines(d, "blk")]
    if fold:
        lines.append("x = x.reshape(c.shape[0], -1, x.shape[-1])")
    if d.refuse == "latents":
        lines += call_lines(d, f"self.{n['dec']}", {"x": "ctx_tokens", "ctx": "x"})
    return lines


def _if(index: int, body: list[str]) -> list[str]:
    return [f"if i == {index}:", *("    " + line for line in body)]


def int_lines(d: Draw) -> list[str]:
    """The ints the blocks are told, computed in the model's forward from the shapes."""
    inp, p = d.names["arg_in"], d.patch
    lines = ["ntok = x.shape[1]"] if "count" in d.ints else []
    if any(kind.startswith("grid") for kind in d.ints):
        lines.append(f"gh, gw = {inp}.shape[-2] // {p}, {inp}.shape[-1] // {p}")
        video = len(d.grid) == 3
        lines += [f"gf = {inp}.shape[2]"] if video else []
        lines.append("grid = (gf, gh, gw)" if video else "grid = (gh, gw)")
    return lines


def _routed_ints(d: Draw) -> tuple[list[str], list[str]]:
    """The twin's int updates at the route start, and their restores at the end."""
    start, end = [], []
    if "count" in d.ints:
        start.append("ntok_full, ntok = ntok, x.shape[1]")
        end.append("ntok = ntok_full")
    if any(kind.startswith("grid") for kind in d.ints):
        video = len(d.grid) == 3
        rows = "x.shape[1] // (gf * gw)" if video else "x.shape[1] // gw"
        start.append(f"grid_full, gh = (grid, gh), {rows}")
        start.append("grid = (gf, gh, gw)" if video else "grid = (gh, gw)")
        end.append("grid, gh = grid_full")
    return start, end


def twin_route_blocks(d: Draw) -> list[str]:
    """The twin's walk over the blocks: gather at the route start, scatter at its end."""
    lines = ["for i, blk in enumerate(blocks):", f"    if i == {d.start}:"]
    lines += ["        full = x", "        x = _twin_gather(x, kept)"]
    if d.stream_mask:
        lines.append("        m_full, m = m, m.gather(1, kept)")
    if d.rope == "nd":
        lines.append("        rope_full, rope = rope, tuple(r[kept[0]] for r in rope)")
    elif d.rope == "bnd":
        lines.append("        rope_full, rope = rope, tuple(_twin_gather(r, kept) for r in rope)")
    start, end = _routed_ints(d)
    lines += ["        " + line for line in start]
    lines += [f"    if i == {d.end}:", "        x = _twin_scatter(full, kept, x)"]
    lines += ["        m = m_full"] if d.stream_mask else []
    lines += ["        rope = rope_full"] if d.rope else []
    lines += ["        " + line for line in end]
    lines += ["    " + line for line in call_lines(d, "blk")]
    if d.end == d.depth:
        lines.append("x = _twin_scatter(full, kept, x)")
    return lines


def _hooked_stream(d: Draw, scale: str) -> str:
    out = "output"
    if d.ret in ("tuple", "tuple3"):
        return f"({out}[0]{scale}, *{out}[1:])"
    if d.ret == "list":
        return f"[{out}[0]{scale}, *{out}[1:]]"
    if d.ret == "dict":
        key = d.names["key_out"]
        return f"{{**{out}, {key!r}: {out}[{key!r}]{scale}}}"
    return f"{out}{scale}"


def _recorded(d: Draw) -> str:
    if d.ret in ("tuple", "tuple3", "list"):
        return "output[0]"
    if d.ret == "dict":
        return f"output[{d.names['key_out']!r}]"
    return "output"


def hook_source(d: Draw) -> str:
    """The module-level forward hook (scales the block's stream output, or records it)."""
    if not d.hook:
        return ""
    fn = d.names["fn_hook"]
    if d.hook == "scale":
        body = f"    return {_hooked_stream(d, ' * 0.5')}"
    else:
        body = f"    module.{d.names['rec']} = {_recorded(d)}"
    return f"\n\ndef {fn}(module, args, output):\n{body}\n"


def hook_init(d: Draw) -> list[str]:
    """``__init__`` lines registering the hook on the drawn blocks."""
    if not d.hook:
        return []
    blocks = block_list(d)
    return [
        f"for i in {list(d.hooked)!r}:",
        f"    {blocks}[i].register_forward_hook({d.names['fn_hook']})",
    ]
