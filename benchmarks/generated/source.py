"""The source of one generated backbone module: the model, ``build``, ``inputs`` and the twin.

The model's forward and the twin share their prologue (embedding, conditioning, company
tokens, side values) and epilogue (company stripped, final adaLN, head, unpatchify) line for
line; only the block section differs: the twin walks the blocks by index, gathers the
stream (and each token-aligned side value along its token dims) at the route start, and
scatters the processed tokens into the saved stream at the route end. Everything it does
comes from the :class:`~benchmarks.generated.grammar.Draw`, never from ``route()``.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> text = module_source(draw(0))
    >>> compile(text, "gen_0.py", "exec") is not None
    True
"""

from __future__ import annotations

from benchmarks.generated.grammar import BATCH, Draw
from benchmarks.generated.source_block import block_params, block_source, helpers_source

__all__ = ["module_source", "company_ids", "kept_count"]

_HEADER = '''"""Generated backbone, seed {seed}: python -m benchmarks.generated --seed {seed} --show

Features: {features}
"""

import math

import einops
import torch
import torch.nn.functional as F
from torch import nn

SEED = {seed}
ROUTES = [({start}, {end})]
RATE = {rate}
ROUTABLE = {routable}
REASON = {reason!r}
FEATURES = {features_list!r}
'''

_TWIN_HELPERS = """

def _twin_gather(v, kept):
    return v.gather(1, kept[..., None].expand(-1, -1, v.shape[-1]))


def _twin_scatter(full, kept, part):
    return full.scatter(1, kept[..., None].expand(-1, -1, full.shape[-1]), part)
"""


def company_ids(d: Draw) -> list[int]:
    """Stream positions of the company tokens (never routed)."""
    first = 0 if d.company_side == "prepend" else d.num_patches
    return list(range(first, first + d.num_company))


def kept_count(d: Draw) -> int:
    """Kept tokens per sample: company plus the kept share of the patch tokens."""
    return d.num_company + d.num_patches - int(d.num_patches * d.rate)


def _spec(d: Draw) -> list[tuple[int, int, bool]]:
    """Per block ``(din, dout, merge)``: a width change or merge at ``change_at``."""
    other = 48 if d.width == 32 else (32 if d.heads == 2 else 24)
    spec, width = [], d.width
    for i in range(d.depth):
        out = other if (d.refuse == "width" and i == d.change_at) else width
        spec.append((width, out, d.refuse == "merge" and i == d.change_at))
        width = out
    return spec


def _final_width(d: Draw) -> int:
    return _spec(d)[-1][1]


def _embed_init(d: Draw) -> str:
    c, p, w = d.channels, d.patch, d.width
    if d.input_kind == "image_conv":
        return f"nn.Conv2d({c}, {w}, {p}, stride={p})"
    if d.input_kind == "image_linear":
        return f"nn.Linear({c * p * p}, {w})"
    if d.input_kind == "audio":
        return f"nn.Conv1d({c}, {w}, {p}, stride={p})"
    return f"nn.Linear({c}, {w})"


def _head_out(d: Draw) -> int:
    return d.channels * (d.patch * d.patch if d.input_kind.startswith("image") else d.patch)


def _container_init(d: Draw) -> list[str]:
    n, blk = d.names, d.names["block"]
    spec = _spec(d)
    make = f"{blk}(di, do, mg) for di, do, mg in "
    if d.container == "numbered":
        return [f"self.{n['numbered']}{i} = {blk}{args}" for i, args in enumerate(spec)]
    if d.container == "sequential":
        return [f"self.{n['list1']} = nn.Sequential(*[{make}{spec!r}])"]
    if d.container == "modulelist":
        return [f"self.{n['list1']} = nn.ModuleList([{make}{spec!r}])"]
    first, second = spec[: d.split], spec[d.split :]
    return [
        f"self.{n['list1']} = nn.ModuleList([{make}{first!r}])",
        f"self.{n['list2']} = nn.ModuleList([{make}{second!r}])",
    ]


def _company_init(d: Draw) -> list[str]:
    w = d.width
    lines = []
    for part in d.company:
        if part.kind == "time":
            lines.append(f"self.{part.attr} = nn.Linear({w}, {part.count * w})")
        else:
            lines.append(f"self.{part.attr} = nn.Parameter(torch.randn(1, {part.count}, {w}))")
    return lines


def _init(d: Draw) -> list[str]:
    n, w, wf = d.names, d.width, _final_width(d)
    lines = [
        "def __init__(self):",
        "super().__init__()",
        f"self.{n['embed']} = {_embed_init(d)}",
        f"self.{n['pos']} = nn.Parameter(torch.randn(1, {d.num_patches}, {w}) * 0.02)",
        f"self.{n['t1']} = nn.Linear(32, {w})",
        f"self.{n['t2']} = nn.Linear({w}, {w})",
    ]
    if d.label:
        lines.append(f"self.{n['label_emb']} = nn.Embedding(10, {w})")
    lines += _company_init(d)
    if d.rope and d.rope_buffer:
        rows = d.num_patches + d.num_company + 8
        table = f"{n['fn_angles']}({rows}, {w // d.heads})"
        lines.append(f"self.register_buffer({n['rope_buf']!r}, {table}, persistent=False)")
    lines += _container_init(d)
    lines.append(f"self.{n['final_norm']} = nn.LayerNorm({wf}, elementwise_affine=False)")
    lines.append(f"self.{n['final_ada']} = nn.Linear({w}, {2 * wf})")
    if d.refuse == "merge":
        lines.append(f"self.{n['unmerge']} = nn.Linear({wf}, {2 * wf})")
    lines.append(f"self.{n['head']} = nn.Linear({wf}, {_head_out(d)})")
    return [lines[0]] + ["    " + line for line in lines[1:]]


def _forward_params(d: Draw) -> list[str]:
    n = d.names
    params = [n["arg_in"], n["arg_t"]]
    params += [n["arg_y"]] if d.label else []
    return params + ([n["arg_mask"]] if d.mask else [])


def _embed_line(d: Draw) -> str:
    n, inp, p = d.names, d.names["arg_in"], d.patch
    embed = f"self.{n['embed']}"
    if d.input_kind == "image_conv":
        return f"x = {embed}({inp}).flatten(2).transpose(1, 2)"
    if d.input_kind == "audio":
        return f"x = {embed}({inp}).transpose(1, 2)"
    if d.input_kind == "tokens":
        return f"x = {embed}({inp})"
    if d.patch_embed == "unfold":
        return f"x = {embed}(F.unfold({inp}, {p}, stride={p}).transpose(1, 2))"
    pattern = "b c (h p1) (w p2) -> b (h w) (p1 p2 c)"
    return f"x = {embed}(einops.rearrange({inp}, {pattern!r}, p1={p}, p2={p}))"


def _company_lines(d: Draw) -> list[str]:
    parts = []
    for part in d.company:
        if part.kind == "time":
            parts.append(f"self.{part.attr}(c).reshape(x.shape[0], {part.count}, {d.width})")
        else:
            parts.append(f"self.{part.attr}.expand(x.shape[0], -1, -1)")
    joined = [*parts, "x"] if d.company_side == "prepend" else ["x", *parts]
    if d.company_join == "pack":
        return [f"x, packed = einops.pack([{', '.join(joined)}], 'b * d')"]
    return [f"x = torch.cat([{', '.join(joined)}], dim=1)"]


def _mask_lines(d: Draw) -> list[str]:
    mask = d.names["arg_mask"]
    if not d.company:
        return [f"m = {mask}"]
    make = "new_ones" if d.mask == "bool" else "new_zeros"
    extra = f"{mask}.{make}(x.shape[0], {d.num_company})"
    joined = [extra, mask] if d.company_side == "prepend" else [mask, extra]
    return [f"m = torch.cat([{', '.join(joined)}], dim=1)"]


def _rope_lines(d: Draw) -> list[str]:
    n = d.names
    if d.rope_buffer:
        lines = [f"ang = self.{n['rope_buf']}[: x.shape[1]]"]
    else:
        lines = [f"ang = {n['fn_angles']}(x.shape[1], {d.width // d.heads})"]
    if d.rope == "bnd":
        scale = "(1 + 0.1 * torch.arange(x.shape[0], dtype=ang.dtype))[:, None, None]"
        lines.append(f"ang = ang[None] * {scale}")
    return lines + ["rope = (ang.cos(), ang.sin())"]


def _prologue(d: Draw) -> list[str]:
    n = d.names
    lines = [f"c = self.{n['t2']}(F.silu(self.{n['t1']}({n['fn_freq']}({n['arg_t']}))))"]
    if d.label:
        lines.append(f"c = c + self.{n['label_emb']}({n['arg_y']})")
    lines += [_embed_line(d), f"x = x + self.{n['pos']}"]
    if not d.adaln:
        lines.append("x = x + c[:, None]")
    lines += _company_lines(d) if d.company else []
    lines += _mask_lines(d) if d.mask else []
    return lines + (_rope_lines(d) if d.rope else [])


def _strip_company(d: Draw) -> list[str]:
    if not d.company:
        return []
    if d.company_join == "pack":
        index = -1 if d.company_side == "prepend" else 0
        return [f"x = einops.unpack(x, packed, 'b * d')[{index}]"]
    if d.company_side == "prepend":
        return [f"x = x[:, {d.num_company}:]"]
    return [f"x = x[:, : {d.num_patches}]"]


def _epilogue(d: Draw) -> list[str]:
    n, wf = d.names, _final_width(d)
    lines = _strip_company(d)
    if d.refuse == "merge":
        lines.append(f"x = self.{n['unmerge']}(x).reshape(x.shape[0], -1, {wf})")
    lines += [
        f"shift, scale = self.{n['final_ada']}(F.silu(c)).chunk(2, dim=-1)",
        f"x = self.{n['final_norm']}(x) * (1 + scale[:, None]) + shift[:, None]",
        f"x = self.{n['head']}(x)",
    ]
    p, c = d.patch, d.channels
    if d.input_kind.startswith("image"):
        pattern = "b (h w) (p1 p2 c) -> b c (h p1) (w p2)"
        return lines + [f"return einops.rearrange(x, {pattern!r}, h={d.grid[0]}, p1={p}, p2={p})"]
    if d.input_kind == "audio":
        return lines + [
            f"x = x.reshape(x.shape[0], -1, {p}, {c}).permute(0, 3, 1, 2)",
            f"return x.reshape(x.shape[0], {c}, -1)",
        ]
    return lines + ["return x"]


def _call(d: Draw, block: str) -> str:
    """``x = <block call>`` in the drawn call style and return form."""
    n = d.names
    values = {"cond": "c", "rope": "rope", "mask": "m"}
    args = ["x"] + [values[side] for side in d.side_order]
    if d.call == "keyword":
        args = [f"{p}={a}" for p, a in zip([n["b_x"], *block_params(d)], args)]
    call = f"{block}({', '.join(args)})"
    if d.ret == "tuple":
        return f"x, aux = {call}"
    if d.ret == "dict":
        return f"x = {call}[{n['key_out']!r}]"
    return f"x = {call}"


def _blocks(d: Draw) -> list[str]:
    n = d.names
    if d.container == "numbered":
        return [_call(d, f"self.{n['numbered']}{i}") for i in range(d.depth)]
    lists = [n["list1"]] + ([n["list2"]] if d.container == "two_lists" else [])
    lines = []
    for name in lists:
        lines += [f"for blk in self.{name}:", "    " + _call(d, "blk")]
    return lines


def _block_list(d: Draw) -> str:
    n = d.names
    if d.container == "numbered":
        return "[" + ", ".join(f"self.{n['numbered']}{i}" for i in range(d.depth)) + "]"
    if d.container == "two_lists":
        return f"[*self.{n['list1']}, *self.{n['list2']}]"
    return f"list(self.{n['list1']})"


def _twin_checks(d: Draw) -> list[str]:
    lines = [
        "assert not checks or kept.shape == (x.shape[0], " + f"{kept_count(d)}), (",
        f"    f'kept {{tuple(kept.shape)}}; by construction (B, {kept_count(d)})')",
        f"for j in {company_ids(d)!r} if checks else []:",
        "    assert bool((kept == j).any(dim=1).all()), f'company token {j} was routed'",
    ]
    if d.rope == "nd":
        lines += [
            "assert not checks or bool((kept == kept[:1]).all()), (",
            "    'a batch-free [N, d] rotary table needs one kept subset for the whole batch')",
        ]
    return lines


def _twin_blocks(d: Draw) -> list[str]:
    lines = [f"blocks = {_block_list(d)}", *_twin_checks(d)]
    lines += ["for i, blk in enumerate(blocks):", f"    if i == {d.start}:"]
    lines += ["        full = x", "        x = _twin_gather(x, kept)"]
    if d.mask:
        lines.append("        m_full, m = m, m.gather(1, kept)")
    if d.rope == "nd":
        lines.append("        rope_full, rope = rope, tuple(r[kept[0]] for r in rope)")
    elif d.rope == "bnd":
        lines.append("        rope_full, rope = rope, tuple(_twin_gather(r, kept) for r in rope)")
    lines += [f"    if i == {d.end}:", "        x = _twin_scatter(full, kept, x)"]
    lines += ["        m = m_full"] if d.mask else []
    lines += ["        rope = rope_full"] if d.rope else []
    lines.append("    " + _call(d, "blk"))
    if d.end == d.depth:
        lines.append("x = _twin_scatter(full, kept, x)")
    return lines


def _indent(lines: list[str], depth: int) -> str:
    pad = "    " * depth
    return "\n".join(pad + line for line in lines)


def _model_source(d: Draw) -> str:
    params = ", ".join(_forward_params(d))
    body = _prologue(d) + _blocks(d) + _epilogue(d)
    return (
        f"\n\nclass {d.names['model']}(nn.Module):\n{_indent(_init(d), 1)}\n\n"
        f"    def forward(self, {params}):\n{_indent(body, 2)}\n"
    )


def _twin_source(d: Draw) -> str:
    params = ", ".join(_forward_params(d))
    body = _prologue(d) + _twin_blocks(d) + _epilogue(d)
    return (
        f"{_TWIN_HELPERS}\n\ndef _twin_forward(self, kept, checks, {params}):\n"
        "    # TREAD by hand, from what the generator knows (never from route()).\n"
        f"{_indent(body, 1)}\n\n\n"
        "def twin(model, args, kwargs, kept, checks=True):\n"
        '    """The routed training forward, written by hand: ``kept`` [B, k] ids; ``checks``\n'
        '    asserts the by-construction facts about them (off for the all-tokens self-test)."""\n'
        "    return _twin_forward(model, kept, checks, *args, **kwargs)\n"
    )


def _inputs_source(d: Draw) -> str:
    n = d.names
    if d.input_kind.startswith("image"):
        shape = (BATCH, d.channels, d.grid[0] * d.patch, d.grid[1] * d.patch)
    elif d.input_kind == "audio":
        shape = (BATCH, d.channels, d.grid[0] * d.patch)
    else:
        shape = (BATCH, d.grid[0], d.channels)
    lines = [
        "gen = torch.Generator().manual_seed(SEED)",
        f"x = torch.randn({shape!r}, generator=gen)",
        f"t = torch.rand({BATCH}, generator=gen)",
        "kwargs = {}",
    ]
    if d.label:
        lines.append(f"kwargs[{n['arg_y']!r}] = torch.randint(0, 10, ({BATCH},), generator=gen)")
    if d.mask:
        np_ = d.num_patches
        bool_ = d.mask == "bool"
        fill = "False" if bool_ else "-10000.0"
        dtype = ", dtype=torch.bool" if bool_ else ""
        lines += [
            f"mask = torch.{'ones' if bool_ else 'zeros'}({BATCH}, {np_}{dtype})",
            f"for row, count in enumerate({d.masked!r}):",
            f"    mask[row, {np_} - count :] = {fill}",
            f"kwargs[{n['arg_mask']!r}] = mask",
        ]
    lines.append("return (x, t), kwargs")
    return f"\n\ndef inputs():\n{_indent(lines, 1)}\n"


def _build_source(d: Draw) -> str:
    return f"\n\ndef build():\n    torch.manual_seed(SEED)\n    return {d.names['model']}()\n"


def _reason(d: Draw) -> str:
    if d.refuse == "width":
        return f"the stream's width changes in block {d.change_at}, inside the route"
    if d.refuse == "merge":
        return f"block {d.change_at} merges token pairs, inside the route"
    return ""


def module_source(d: Draw) -> str:
    """The whole module text of the backbone drawn as ``d``."""
    features = d.features()
    header = _HEADER.format(
        seed=d.seed, features=", ".join(features), start=d.start, end=d.end, rate=d.rate,
        routable=d.routable, reason=_reason(d), features_list=features,
    )  # fmt: skip
    parts = [header, helpers_source(d), block_source(d), _model_source(d)]
    parts += [_build_source(d), _inputs_source(d), _twin_source(d)]
    return "".join(parts)
