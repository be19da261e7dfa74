"""The source of the containers round (:mod:`~benchmarks.generated.grammar_containers`):
the containers' ``__init__`` lines, the model's walk over them, the flat block list the twin
and the hooks index, and the text stream packed with ``einops.pack`` and unpacked.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> d = next(draw(s) for s in range(100) if draw(s).container == "stages")
    >>> "for" in container_block_list(d)
    True
"""

from __future__ import annotations

from benchmarks.generated.grammar import Draw

__all__ = [
    "container_init", "container_block_list", "container_walk", "text_pack_lines",
    "text_unpack_lines",
]  # fmt: skip


def container_init(d: Draw, spec: list[tuple[int, int, bool]]) -> list[str]:
    """``__init__`` lines holding the blocks built from ``spec`` (``(din, dout, merge)``)."""
    n, blk = d.names, d.names["block"]
    if d.container == "moduledict":
        items = ", ".join(f"'{n['dict_key']}{i}': {blk}{args}" for i, args in enumerate(spec))
        return [f"self.{n['stages']} = nn.ModuleDict({{{items}}})"]
    stages, start = [], 0
    for size in d.stages:
        stages.append(spec[start : start + size])
        start += size
    make = f"nn.ModuleList([{blk}(di, do, mg) for di, do, mg in {n['stage']}])"
    return [f"self.{n['stages']} = nn.ModuleList([{make} for {n['stage']} in {stages!r}])"]


def container_block_list(d: Draw) -> str:
    """An expression for the blocks in call order (``self`` is the model)."""
    held = f"self.{d.names['stages']}"
    if d.container == "moduledict":
        return f"list({held}.values())"
    return f"[blk for {d.names['stage']} in {held} for blk in {d.names['stage']}]"


def container_walk(d: Draw, call: list[str]) -> list[str]:
    """The model's walk over the blocks, ``call`` being the lines calling ``blk``."""
    held, stage = f"self.{d.names['stages']}", d.names["stage"]
    if d.container == "stages":
        body = ["        " + line for line in call]
        return [f"for {stage} in {held}:", f"    for blk in {stage}:", *body]
    body = ["    " + line for line in call]
    if d.dict_walk == "values":
        return [f"for blk in {held}.values():", *body]
    if d.dict_walk == "items":
        return [f"for {stage}, blk in {held}.items():", *body]
    return [f"for {stage} in {held}:", f"    blk = {held}[{stage}]", *body]


def text_pack_lines(d: Draw) -> list[str]:
    """The text joined to the stream with ``einops.pack`` (prefix or suffix)."""
    joined = "[txt, x]" if d.text == "prefix" else "[x, txt]"
    return [f"x, packed_txt = einops.pack({joined}, 'b * d')"]


def text_unpack_lines(d: Draw) -> list[str]:
    """The stream's patch part taken back with ``einops.unpack``."""
    index = 1 if d.text == "prefix" else 0
    return [f"x = einops.unpack(x, packed_txt, 'b * d')[{index}]"]
