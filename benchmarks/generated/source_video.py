"""The source of a factorised video model (:mod:`~benchmarks.generated.grammar_video`).

The model folds the frames into the batch, alternates a spatial block (``[B * F, h * w, D]``)
and a temporal block (``[B * h * w, F, D]``) from two lists, refolding in between, and
unfolds the head's tokens back to the video. The twin routes the spatial stack, as the
design's rule for interleaved stacks says a plain ``route()`` does (the stream with the most
tokens on dim 1; ``docs/design.md``, "Interleaved stacks"): one kept subset shared by every
frame of every video, gathered at the input of spatial block ``start``; the temporal blocks
in between run on the kept positions and get the kept positions' rows of their folded
conditioning; at the input of spatial block ``end`` (with ``end == depth``: right after the
last spatial block, the design's "re-enter after the last block" of the routed stack, so the
last temporal block runs on every token) the kept tokens are scattered back into the stream as
it was at ``start``.

Left out (the design fixes neither): blocks that fold the frames themselves inside (a stream
``[B, F * h * w, D]`` between blocks: a random subset of it is no set of whole frames, so the
blocks' per-frame view would need whole-frame selection the design does not define for a fold
inside a block), and one list alternating spatial and temporal blocks (one stack whose stream
changes form every block: not the two stacks the rule is written for).

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> d = next(draw(s) for s in range(200) if draw(s).video)
    >>> compile(video_module(d), "video.py", "exec") is not None
    True
"""

from __future__ import annotations

from benchmarks.generated.grammar import Draw
from benchmarks.generated.source_block import helpers_source
from benchmarks.generated.source_inputs import embed_init, indent, inputs_source

__all__ = ["video_module", "video_reason"]

_TWIN_HELPERS = """

def _twin_gather(v, kept):
    return v.gather(1, kept[..., None].expand(-1, -1, v.shape[-1]))


def _twin_scatter(full, kept, part):
    return full.scatter(1, kept[..., None].expand(-1, -1, full.shape[-1]), part)
"""


def video_reason(d: Draw) -> str:
    """Why a factorised model must be refused (empty when routable)."""
    if d.refuse == "folded_tie":
        return (
            "the temporal stack is routed (equal token counts, fewer ops between its blocks) "
            "and a spatial block inside the route gets the conditioning folded [B * F, D], "
            "whose rows cannot be told from the [B * h * w, D] rows when F == h * w"
        )
    if d.refuse == "stacks_tie":
        tokens = d.grid[1] * d.grid[2]
        return (
            f"spatial and temporal stacks both run on {tokens} tokens ({d.grid[0]} frames of "
            f"{tokens} positions): interleaved stacks of equal token counts are refused "
            "(both listed when their hand-offs tie; else the folded rows cannot be told apart)"
        )
    return ""


def _block(d: Draw) -> str:
    n, w = d.names, d.width
    affine = "False" if d.adaln else "True"
    params = ", ".join([n["b_x"]] + ([n["b_cond"]] if d.adaln else []))
    init = [
        "def __init__(self):",
        "    super().__init__()",
        f"    self.{n['n1']} = nn.LayerNorm({w}, elementwise_affine={affine})",
        f"    self.{n['qkv']} = nn.Linear({w}, {3 * w})",
        f"    self.{n['o']} = nn.Linear({w}, {w})",
        f"    self.{n['n2']} = nn.LayerNorm({w}, elementwise_affine={affine})",
        f"    self.{n['f1']} = nn.Linear({w}, {2 * w})",
        f"    self.{n['f2']} = nn.Linear({2 * w}, {w})",
    ]
    init += [f"    self.{n['ada']} = nn.Linear({w}, {6 * w})"] if d.adaln else []
    fwd = [f"def forward(self, {params}):", f"    x = {n['b_x']}"]
    fwd += ["    batch, count, width = x.shape", f"    heads = {n['const_heads']}"]
    if d.adaln:
        fwd += [
            f"    s1, c1, g1, s2, c2, g2 = self.{n['ada']}(F.silu({n['b_cond']})).chunk(6, dim=-1)",
            f"    h = self.{n['n1']}(x) * (1 + c1[:, None]) + s1[:, None]",
        ]
    else:
        fwd.append(f"    h = self.{n['n1']}(x)")
    fwd += [
        f"    q, k, v = self.{n['qkv']}(h).reshape(batch, count, 3, heads, -1).unbind(2)",
        "    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)",
    ]
    if d.attention == "sdpa":
        fwd.append("    a = F.scaled_dot_product_attention(q, k, v)")
    else:
        fwd += [
            "    s = (q @ k.transpose(-2, -1)) * (width // heads) ** -0.5",
            "    a = s.softmax(dim=-1) @ v",
        ]
    fwd.append(f"    a = self.{n['o']}(a.transpose(1, 2).reshape(batch, count, width))")
    if d.adaln:
        fwd += [
            "    x = x + g1[:, None] * a",
            f"    h = self.{n['n2']}(x) * (1 + c2[:, None]) + s2[:, None]",
            f"    x = x + g2[:, None] * self.{n['f2']}(F.gelu(self.{n['f1']}(h)))",
        ]
    else:
        fwd += [
            "    x = x + a",
            f"    x = x + self.{n['f2']}(F.gelu(self.{n['f1']}(self.{n['n2']}(x))))",
        ]
    fwd.append("    return x")
    body = "\n".join(("    " + line) if line else "" for line in [*init, "", *fwd])
    return f"\n\nclass {n['block']}(nn.Module):\n{body}\n"


def _init(d: Draw) -> list[str]:
    n, w, v = d.names, d.width, d.video
    positions = d.grid[1] * d.grid[2]
    lines = [
        f"self.{n['embed']} = {embed_init(d)}",
        f"self.{n['pos']} = nn.Parameter(torch.randn(1, {positions}, {w}) * 0.02)",
        f"self.{n['t1']} = nn.Linear(32, {w})",
        f"self.{n['t2']} = nn.Linear({w}, {w})",
    ]
    if v.frame_pos:
        lines.append(
            f"self.{n['frame_pos']} = nn.Parameter(torch.randn(1, {v.frames}, {w}) * 0.02)"
        )
    blocks = f"nn.ModuleList([{n['block']}() for _ in range({d.depth})])"
    lines += [f"self.{n['spatial']} = {blocks}", f"self.{n['temporal']} = {blocks}"]
    lines += [
        f"self.{n['final_norm']} = nn.LayerNorm({w}, elementwise_affine=False)",
        f"self.{n['final_ada']} = nn.Linear({w}, {2 * w})",
        f"self.{n['head']} = nn.Linear({w}, {d.channels * d.patch * d.patch})",
    ]
    return ["def __init__(self):", "    super().__init__()"] + ["    " + x for x in lines]


def _prologue(d: Draw) -> list[str]:
    n, p, inp = d.names, d.patch, d.names["arg_in"]
    lines = [
        f"c = self.{n['t2']}(F.silu(self.{n['t1']}({n['fn_freq']}({n['arg_t']}))))",
        f"b, f = {inp}.shape[0], {inp}.shape[2]",
    ]
    if d.input_kind == "video_conv":
        pattern = "b d f h w -> (b f) (h w) d"
        lines.append(f"x = einops.rearrange(self.{n['embed']}({inp}), {pattern!r})")
    else:
        pattern = "b c f (h p1) (w p2) -> (b f) (h w) (p1 p2 c)"
        lines.append(f"x = self.{n['embed']}(einops.rearrange({inp}, {pattern!r}, p1={p}, p2={p}))")
    lines += [f"x = x + self.{n['pos']}", "cs = c.repeat_interleave(f, dim=0)"]
    if d.adaln:
        lines.append("ct = c.repeat_interleave(x.shape[1], dim=0)")
    else:
        lines.append("x = x + cs[:, None]")
    return lines


def _call(d: Draw, block: str, cond: str) -> str:
    n = d.names
    if not d.adaln:
        args = f"{n['b_x']}=x" if d.call == "keyword" else "x"
    elif d.call == "keyword":
        args = f"{n['b_x']}=x, {n['b_cond']}={cond}"
    else:
        args = f"x, {cond}"
    return f"x = {block}({args})"


def _folds(d: Draw, twin: bool) -> tuple[str, str]:
    """(to the temporal form, back to the spatial form). The model's code reads the frame
    count it was given; the twin's reads every size from the stream (a route over the
    temporal stack runs the spatial blocks on the kept frames)."""
    w, fold = d.width, d.video.fold
    if fold.startswith("einops"):
        by = "b=b" if twin or fold == "einops_b" else "f=f"
        return (
            f"x = einops.rearrange(x, '(b f) n d -> (b n) f d', {by})",
            "x = einops.rearrange(x, '(b n) f d -> (b f) n d', b=b)",
        )
    if twin or fold == "reshape_read":
        return (
            f"x = x.reshape(b, -1, x.shape[1], {w}).transpose(1, 2)"
            f".reshape(-1, x.shape[0] // b, {w})",
            f"x = x.reshape(b, -1, x.shape[1], {w}).transpose(1, 2)"
            f".reshape(-1, x.shape[0] // b, {w})",
        )
    return (
        f"x = x.reshape(b, f, -1, {w}).transpose(1, 2).reshape(-1, f, {w})",
        f"x = x.reshape(b, -1, f, {w}).transpose(1, 2).reshape(b * f, -1, {w})",
    )


def _frame_pos(d: Draw) -> list[str]:
    return ["if i == 0:", f"    x = x + self.{d.names['frame_pos']}"] if d.video.frame_pos else []


def _temporal(d: Draw, block: str, cond: str, twin: bool = False) -> list[str]:
    """The stream to the temporal form, the temporal block, and back."""
    to_t, to_s = _folds(d, twin)
    return [to_t, *_frame_pos(d), _call(d, block, cond), to_s]


def _model_blocks(d: Draw) -> list[str]:
    n = d.names
    if d.video.loop == "zip":
        head = f"for i, (sb, tb) in enumerate(zip(self.{n['spatial']}, self.{n['temporal']})):"
        spatial, temporal = "sb", "tb"
    else:
        head = f"for i in range(len(self.{n['spatial']})):"
        spatial, temporal = f"self.{n['spatial']}[i]", f"self.{n['temporal']}[i]"
    body = [_call(d, spatial, "cs"), *_temporal(d, temporal, "ct")]
    return [head] + ["    " + line for line in body]


def _twin_blocks(d: Draw) -> list[str]:
    n, v, positions = d.names, d.video, d.grid[1] * d.grid[2]
    temporal = v.stack == "temporal"
    rows, count = ("b * f", positions) if not temporal else (f"b * {positions}", v.frames)
    kept_count = count - int(count * d.rate)
    lines = [
        f"assert not checks or kept.shape == ({rows}, {kept_count}), (",
        f"    f'kept {{tuple(kept.shape)}}; by construction ({rows}, {kept_count})')",
        "assert not checks or bool((kept == kept[:1]).all()), (",
        "    'the batch folds several sequences: one kept subset for every folded row')",
    ]
    other = "cs" if temporal else "ct"  # the other stack's rows: (sample, routed token)
    if d.adaln:
        lines += [
            f"{other}_full = {other}",
            f"{other}_kept = {other}.reshape(b, -1, {other}.shape[-1])[:, kept[0]]"
            f".reshape(-1, {other}.shape[-1])",
        ]
    routed = ["full = x", "x = _twin_gather(x, kept)"]
    back = ["x = _twin_scatter(full, kept, x)"]
    if d.adaln:
        routed, back = routed + [f"{other} = {other}_kept"], back + [f"{other} = {other}_full"]
    enter = [f"if i == {d.start}:", *("    " + x for x in routed)]
    if d.end < d.depth:
        enter += [f"if i == {d.end}:", *("    " + x for x in back)]
    leave = [f"if i == {d.depth - 1}:", *("    " + x for x in back)] if d.end == d.depth else []
    spatial = _call(d, f"self.{n['spatial']}[i]", "cs")
    temporal_call = _call(d, f"self.{n['temporal']}[i]", "ct")
    to_t, to_s = _folds(d, twin=True)
    if temporal:
        body = [spatial, to_t, *_frame_pos(d), *enter, temporal_call, *leave, to_s]
    else:
        body = [*enter, spatial, *leave, to_t, *_frame_pos(d), temporal_call, to_s]
    return lines + [f"for i in range({d.depth}):"] + ["    " + x for x in body]


def _epilogue(d: Draw) -> list[str]:
    n, p = d.names, d.patch
    pattern = "(b f) (h w) (p1 p2 c) -> b c f (h p1) (w p2)"
    return [
        f"shift, scale = self.{n['final_ada']}(F.silu(cs)).chunk(2, dim=-1)",
        f"x = self.{n['final_norm']}(x) * (1 + scale[:, None]) + shift[:, None]",
        f"x = self.{n['head']}(x)",
        f"return einops.rearrange(x, {pattern!r}, b=b, h={d.grid[1]}, p1={p}, p2={p})",
    ]


def video_module(d: Draw) -> str:
    """Everything after the module header: helpers, block, model, ``build``, ``inputs``,
    twin."""
    n = d.names
    params = f"{n['arg_in']}, {n['arg_t']}"
    model = _prologue(d) + _model_blocks(d) + _epilogue(d)
    twin = _prologue(d) + _twin_blocks(d) + _epilogue(d)
    return (
        helpers_source(d) + _block(d)
        + f"\n\nclass {n['model']}(nn.Module):\n{indent(_init(d), 1)}\n\n"
        f"    def forward(self, {params}):\n{indent(model, 2)}\n"
        f"\n\ndef build():\n    torch.manual_seed(SEED)\n    return {n['model']}()\n"
        + inputs_source(d) + _TWIN_HELPERS
        + f"\n\ndef _twin_forward(self, kept, checks, {params}):\n"
        "    # TREAD by hand, from what the generator knows (never from route()).\n"
        f"{indent(twin, 1)}\n\n\n"
        "def twin(model, args, kwargs, kept, checks=True):\n"
        '    """The routed training forward, written by hand: ``kept`` [B * F, k] ids."""\n'
        "    return _twin_forward(model, kept, checks, *args, **kwargs)\n"
    )  # fmt: skip
