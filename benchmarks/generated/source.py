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

from benchmarks.generated.grammar import Draw
from benchmarks.generated.grammar_containers import MORE_CONTAINERS
from benchmarks.generated.grammar_scan import scan_reason, scan_rows
from benchmarks.generated.source_block import block_source, helpers_source
from benchmarks.generated.source_calls import (
    block_list,
    hook_init,
    hook_source,
    int_lines,
    model_blocks,
    twin_route_blocks,
)
from benchmarks.generated.source_containers import (
    container_init,
    text_unpack_lines,
)
from benchmarks.generated.source_inputs import (
    embed_init,
    embed_line,
    forward_params,
    head_out,
    indent,
    inputs_source,
    mask_lines,
    predicate_lines,
    text_lines,
    unpatchify,
)
from benchmarks.generated.source_seqfirst import seqfirst_module
from benchmarks.generated.source_video import video_module, video_reason

__all__ = ["module_source", "protected_ids", "kept_count", "patch_offset"]

_HEADER = '''"""Generated backbone, seed {seed}: python -m benchmarks.generated --seed {seed} --show

Features: {features}
"""

import functools
import math

import einops
import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

SEED = {seed}
ROUTES = [({start}, {end})]
RATE = {rate}
ROUTABLE = {routable}
REASON = {reason!r}
BATCH_DIM = {batch_dim}  # the dim of the input and the output holding the samples
FEATURES = {features_list!r}
'''

_TWIN_HELPERS = """

def _twin_gather(v, kept):
    return v.gather(1, kept[..., None].expand(-1, -1, v.shape[-1]))


def _twin_scatter(full, kept, part):
    return full.scatter(1, kept[..., None].expand(-1, -1, full.shape[-1]), part)
"""


def patch_offset(d: Draw) -> int:
    """The stream position of the first patch token (text prefix, then prepended company)."""
    first = d.text_tokens if d.text == "prefix" else 0
    return first + (d.num_company if d.company_side == "prepend" else 0)


def protected_ids(d: Draw) -> list[int]:
    """Stream positions of the tokens that are never routed (company, joined text)."""
    first = patch_offset(d)
    patches = range(first, first + d.num_patches)
    return [i for i in range(d.stream_tokens) if i not in patches]


def _rows_selected(d: Draw) -> bool:
    """Whether the blocks reshape to the patch grid (so TREAD keeps whole rows)."""
    return any(kind.startswith("grid") for kind in d.ints) or scan_rows(d)


def kept_count(d: Draw) -> int:
    """Kept tokens per sample: the never-routed ones plus the kept share of the patches
    (whole rows of every frame when the blocks reshape to the grid)."""
    if _rows_selected(d):
        rows, width = d.grid[-2], d.grid[-1]
        frames = d.grid[0] if len(d.grid) == 3 else 1
        return (rows - int(rows * d.rate)) * width * frames
    others = d.stream_tokens - d.num_patches
    return others + d.num_patches - int(d.num_patches * d.rate)


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


def _container_init(d: Draw) -> list[str]:
    n, blk = d.names, d.names["block"]
    spec = _spec(d)
    make = f"{blk}(di, do, mg) for di, do, mg in "
    if d.container in MORE_CONTAINERS:
        return container_init(d, spec)
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
        f"self.{n['embed']} = {embed_init(d)}",
        f"self.{n['pos']} = nn.Parameter(torch.randn(1, {d.num_patches}, {w}) * 0.02)",
        f"self.{n['t1']} = nn.Linear(32, {w})",
        f"self.{n['t2']} = nn.Linear({w}, {w})",
    ]
    if d.label:
        lines.append(f"self.{n['label_emb']} = nn.Embedding(10, {w})")
    lines += _company_init(d)
    if d.rope and d.rope_buffer:
        rows = d.stream_tokens + 8
        table = f"{n['fn_angles']}({rows}, {w // d.heads})"
        lines.append(f"self.register_buffer({n['rope_buf']!r}, {table}, persistent=False)")
    lines += _container_init(d) + _more_init(d)
    lines.append(f"self.{n['final_norm']} = nn.LayerNorm({wf}, elementwise_affine=False)")
    lines.append(f"self.{n['final_ada']} = nn.Linear({w}, {2 * wf})")
    if d.refuse == "merge":
        lines.append(f"self.{n['unmerge']} = nn.Linear({wf}, {2 * wf})")
    lines.append(f"self.{n['head']} = nn.Linear({wf}, {head_out(d)})")
    return [lines[0]] + ["    " + line for line in lines[1:]]


def _company_lines(d: Draw) -> list[str]:
    parts = []
    for part in d.company:
        if part.kind == "time":
            parts.append(f"self.{part.attr}(c).reshape(x.shape[0], {part.count}, {d.width})")
        elif d.einops_repeat:
            parts.append(f"einops.repeat(self.{part.attr}, '1 n d -> b n d', b=x.shape[0])")
        else:
            parts.append(f"self.{part.attr}.expand(x.shape[0], -1, -1)")
    joined = [*parts, "x"] if d.company_side == "prepend" else ["x", *parts]
    if d.company_join == "pack":
        return [f"x, packed = einops.pack([{', '.join(joined)}], 'b * d')"]
    return [f"x = torch.cat([{', '.join(joined)}], dim=1)"]


def _more_init(d: Draw) -> list[str]:
    """``__init__`` lines of the second round: text projection, latents, hooks, ints."""
    n, w = d.names, d.width
    lines = [f"self.{n['txt_proj']} = nn.Linear({d.text_width}, {w})"] if d.text else []
    if d.refuse == "latents":
        shape = f"1, {d.latent_tokens}, {w}"
        lines.append(f"self.{n['latents']} = nn.Parameter(torch.randn({shape}))")
        lines.append(f"self.{n['dec']} = {n['block']}({w}, {w}, False)")
    if "coincident" in d.ints:
        lines.append(f"self.{n['coin']} = {d.stream_tokens}")
    return lines + hook_init(d)


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
    lines = predicate_lines(d)
    lines.append(f"c = self.{n['t2']}(F.silu(self.{n['t1']}({n['fn_freq']}({n['arg_t']}))))")
    if d.label:
        lines.append(f"c = c + self.{n['label_emb']}({n['arg_y']})")
    lines += [embed_line(d), f"x = x + self.{n['pos']}"]
    if not d.adaln:
        lines.append("x = x + c[:, None]")
    if d.refuse == "latents":
        lines += ["ctx_tokens = x", f"x = self.{n['latents']}.expand(x.shape[0], -1, -1)"]
    lines += _company_lines(d) if d.company else []
    lines += text_lines(d) + mask_lines(d)
    return lines + (_rope_lines(d) if d.rope else []) + int_lines(d)


def _strip_company(d: Draw) -> list[str]:
    if not d.company:
        return []
    if d.company_join == "pack":
        index = -1 if d.company_side == "prepend" else 0
        return [f"x = einops.unpack(x, packed, 'b * d')[{index}]"]
    if d.company_side == "prepend":
        return [f"x = x[:, {d.num_company}:]"]
    return [f"x = x[:, : {d.num_patches}]"]


def _strip_text(d: Draw) -> list[str]:
    if d.text_join == "pack":
        return text_unpack_lines(d)
    if d.text == "prefix":
        return [f"x = x[:, {d.text_tokens}:]"]
    if d.text == "suffix":
        return [f"x = x[:, : -{d.text_tokens}]"]
    return []


def _epilogue(d: Draw) -> list[str]:
    n, wf = d.names, _final_width(d)
    lines = _strip_text(d) + _strip_company(d)
    if d.refuse == "merge":
        lines.append(f"x = self.{n['unmerge']}(x).reshape(x.shape[0], -1, {wf})")
    lines += [
        f"shift, scale = self.{n['final_ada']}(F.silu(c)).chunk(2, dim=-1)",
        f"x = self.{n['final_norm']}(x) * (1 + scale[:, None]) + shift[:, None]",
        f"x = self.{n['head']}(x)",
    ]
    return lines + unpatchify(d)


def _rows_checks(d: Draw) -> list[str]:
    """Whole rows of the grid: each kept run of ``W`` ids starts a row and is consecutive."""
    width = d.grid[-1]
    return [
        f"runs = kept.reshape(kept.shape[0], -1, {width})",
        f"assert not checks or bool((runs[..., 0] % {width} == 0).all()), (",
        "    'the blocks reshape to the grid: the kept tokens must be whole rows')",
        "assert not checks or bool((runs.diff(dim=-1) == 1).all()), 'kept rows are not whole'",
    ]


def _twin_checks(d: Draw) -> list[str]:
    lines = [
        "assert not checks or kept.shape == (x.shape[0], " + f"{kept_count(d)}), (",
        f"    f'kept {{tuple(kept.shape)}}; by construction (B, {kept_count(d)})')",
        f"for j in {protected_ids(d)!r} if checks else []:",
        "    assert bool((kept == j).any(dim=1).all()), f'never-routed token {j} was routed'",
    ]
    if d.rope == "nd":
        lines += [
            "assert not checks or bool((kept == kept[:1]).all()), (",
            "    'a batch-free [N, d] rotary table needs one kept subset for the whole batch')",
        ]
    return lines + (_rows_checks(d) if _rows_selected(d) else [])


def _twin_blocks(d: Draw) -> list[str]:
    return [f"blocks = {block_list(d)}", *_twin_checks(d), *twin_route_blocks(d)]


def _model_source(d: Draw) -> str:
    params = ", ".join(forward_params(d))
    body = _prologue(d) + model_blocks(d) + _epilogue(d)
    return (
        f"\n\nclass {d.names['model']}(nn.Module):\n{indent(_init(d), 1)}\n\n"
        f"    def forward(self, {params}):\n{indent(body, 2)}\n"
    )


def _twin_source(d: Draw) -> str:
    params = ", ".join(forward_params(d))
    body = _prologue(d) + _twin_blocks(d) + _epilogue(d)
    return (
        f"{_TWIN_HELPERS}\n\ndef _twin_forward(self, kept, checks, {params}):\n"
        "    # TREAD by hand, from what the generator knows (never from route()).\n"
        f"{indent(body, 1)}\n\n\n"
        "def twin(model, args, kwargs, kept, checks=True):\n"
        '    """The routed training forward, written by hand: ``kept`` [B, k] ids; ``checks``\n'
        '    asserts the by-construction facts about them (off for the all-tokens self-test)."""\n'
        "    return _twin_forward(model, kept, checks, *args, **kwargs)\n"
    )


def _build_source(d: Draw) -> str:
    return f"\n\ndef build():\n    torch.manual_seed(SEED)\n    return {d.names['model']}()\n"


def _reason(d: Draw) -> str:
    if d.refuse == "width":
        return f"the stream's width changes in block {d.change_at}, inside the route"
    if d.refuse == "merge":
        return f"block {d.change_at} merges token pairs, inside the route"
    if d.refuse == "fold":
        return f"the tokens are folded into the batch before block {d.change_at}, in the route"
    if d.refuse == "latents":
        return "the blocks run on learned latents, not on tokens computed from the input"
    if d.video:
        return video_reason(d)
    return scan_reason(d)


def module_source(d: Draw) -> str:
    """The whole module text of the backbone drawn as ``d``."""
    features = d.features()
    header = _HEADER.format(
        seed=d.seed, features=", ".join(features), start=d.start, end=d.end, rate=d.rate,
        routable=d.routable, reason=_reason(d), features_list=features, batch_dim=d.batch_dim,
    )  # fmt: skip
    if d.video:
        return header + video_module(d)
    if d.seq:
        return header + seqfirst_module(d)
    parts = [header, helpers_source(d), hook_source(d), block_source(d), _model_source(d)]
    parts += [_build_source(d), inputs_source(d), _twin_source(d)]
    return "".join(parts)
