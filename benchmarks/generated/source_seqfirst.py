"""The source of a sequence-first model (:mod:`~benchmarks.generated.grammar_seqfirst`).

The model embeds its ``[T, B, C]`` tokens, adds a ``[T, 1, D]`` position embedding and (unless
its own blocks take adaLN) the timestep embedding ``c[None]``, runs the stack (a torch
container called once, a loop over torch's layers, or a loop over blocks of its own class; a
``permuted`` model turns the stream to ``[B, T, D]`` before the loop and back after it), then a
final adaLN and the head: ``[T, B, C]`` out. The twin walks the same layers by index: at layer
``start`` it keeps the stream and gathers each sample's kept tokens along the token dim (dim 0
of a sequence-first stream, by way of a ``[B, T, D]`` view), after layer ``end - 1`` it
scatters the processed tokens back, then applies the container's final ``norm`` when it has
one, as ``nn.TransformerEncoder``/``nn.TransformerDecoder`` do after their layers.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> d = next(draw(s) for s in range(400) if draw(s).seq)
    >>> compile(seqfirst_module(d), "seq.py", "exec") is not None
    True
"""

from __future__ import annotations

from benchmarks.generated.grammar import BATCH, Draw
from benchmarks.generated.source_block import helpers_source
from benchmarks.generated.source_inputs import indent

__all__ = ["seqfirst_module", "seq_kept_count"]

_MEMORY_WIDTH = 16

_TWIN_HELPERS = """

def _twin_gather(v, kept):
    return v.gather(1, kept[..., None].expand(-1, -1, v.shape[-1]))


def _twin_scatter(full, kept, part):
    return full.scatter(1, kept[..., None].expand(-1, -1, full.shape[-1]), part)


def _twin_gather_seq(v, kept):
    # [T, B, D]: each sample's kept tokens along dim 0, by way of the [B, T, D] view
    return _twin_gather(v.transpose(0, 1), kept).transpose(0, 1)


def _twin_scatter_seq(full, kept, part):
    return _twin_scatter(full.transpose(0, 1), kept, part.transpose(0, 1)).transpose(0, 1)
"""


def seq_kept_count(d: Draw) -> int:
    """Kept tokens per sample (every token is routable)."""
    return d.num_patches - int(d.num_patches * d.rate)


def _batch_first(d: Draw) -> bool:
    """Whether the blocks see the stream batch-first (``[B, T, D]``)."""
    return d.seq.form == "permuted"


def _attention(d: Draw) -> list[str]:
    """The block's attention lines: ``h`` in, ``a`` out (both laid out like the stream)."""
    n, s = d.names, d.seq
    if s.attend == "mha":
        return [f"a = self.{n['attn']}(h, h, h, need_weights=False)[0]"]
    qkv = f"self.{n['qkv']}(h)"
    if _batch_first(d):
        lines = [
            f"q, k, v = {qkv}.reshape(batch, count, 3, heads, -1).unbind(2)",
            "q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)",
        ]
        if s.attend == "sdpa":
            lines.append("a = F.scaled_dot_product_attention(q, k, v)")
        else:
            lines += [
                "s = (q @ k.transpose(-2, -1)) * (width // heads) ** -0.5",
                "a = s.softmax(dim=-1) @ v",
            ]
        back = "a.transpose(1, 2).reshape(batch, count, width)"
        return lines + [f"a = self.{n['o']}({back})"]
    if s.attend == "einsum":
        return [
            f"q, k, v = {qkv}.reshape(count, batch, 3, heads, -1).unbind(2)",
            "s = torch.einsum('tbhd,sbhd->bhts', q, k) * (width // heads) ** -0.5",
            "a = torch.einsum('bhts,sbhd->tbhd', s.softmax(dim=-1), v)",
            f"a = self.{n['o']}(a.reshape(count, batch, width))",
        ]
    return [  # sdpa: the heads of each sample to [B, H, T, d] and back
        f"q, k, v = {qkv}.reshape(count, batch, 3, heads, -1).permute(2, 1, 3, 0, 4)",
        "a = F.scaled_dot_product_attention(q, k, v)",
        f"a = self.{n['o']}(a.permute(2, 0, 1, 3).reshape(count, batch, width))",
    ]


def _block(d: Draw) -> str:
    """The block class of the ``dim0``/``permuted`` forms."""
    n, w, s = d.names, d.width, d.seq
    affine = "False" if d.adaln else "True"
    init = [
        "def __init__(self):",
        "    super().__init__()",
        f"    self.{n['n1']} = nn.LayerNorm({w}, elementwise_affine={affine})",
    ]
    if s.attend == "mha":
        first = "True" if _batch_first(d) else "False"
        mha = f"nn.MultiheadAttention({w}, {n['const_heads']}, batch_first={first})"
        init.append(f"    self.{n['attn']} = {mha}")
    else:
        init += [
            f"    self.{n['qkv']} = nn.Linear({w}, {3 * w})",
            f"    self.{n['o']} = nn.Linear({w}, {w})",
        ]
    init += [
        f"    self.{n['n2']} = nn.LayerNorm({w}, elementwise_affine={affine})",
        f"    self.{n['f1']} = nn.Linear({w}, {2 * w})",
        f"    self.{n['f2']} = nn.Linear({2 * w}, {w})",
    ]
    init += [f"    self.{n['ada']} = nn.Linear({w}, {6 * w})"] if d.adaln else []
    params = ", ".join([n["b_x"]] + ([n["b_cond"]] if d.adaln else []))
    sizes = "batch, count, width" if _batch_first(d) else "count, batch, width"
    fwd = [f"x = {n['b_x']}", f"{sizes} = x.shape", f"heads = {n['const_heads']}"]
    per = "[:, None]" if _batch_first(d) else "[None]"  # the [B, D] rows over the tokens
    if d.adaln:
        chunks = f"self.{n['ada']}(F.silu({n['b_cond']})).chunk(6, dim=-1)"
        fwd += [
            f"s1, c1, g1, s2, c2, g2 = {chunks}",
            f"h = self.{n['n1']}(x) * (1 + c1{per}) + s1{per}",
        ]
    else:
        fwd.append(f"h = self.{n['n1']}(x)")
    fwd += _attention(d)
    mlp = f"self.{n['f2']}(F.gelu(self.{n['f1']}(h)))"
    if d.adaln:
        fwd += [
            f"x = x + g1{per} * a",
            f"h = self.{n['n2']}(x) * (1 + c2{per}) + s2{per}",
            f"x = x + g2{per} * {mlp}",
        ]
    else:
        fwd += ["x = x + a", f"h = self.{n['n2']}(x)", f"x = x + {mlp}"]
    fwd.append("return x")
    body = indent(init, 1) + f"\n\n    def forward(self, {params}):\n" + indent(fwd, 2)
    return f"\n\nclass {n['block']}(nn.Module):\n{body}\n"


def _layer(d: Draw) -> str:
    """The torch layer expression (``batch_first=False``, no dropout)."""
    s, w = d.seq, d.width
    cls = (
        "nn.TransformerEncoderLayer"
        if s.form.startswith("encoder")
        else "nn.TransformerDecoderLayer"
    )
    return (
        f"{cls}({w}, {d.heads}, {2 * w}, dropout=0.0, activation={s.activation!r}, "
        f"batch_first=False, norm_first={s.norm_first})"
    )


def _stack_init(d: Draw) -> str:
    s, n, w = d.seq, d.names, d.width
    if s.form in ("encoder", "decoder"):
        container = "nn.TransformerEncoder" if s.form == "encoder" else "nn.TransformerDecoder"
        norm = f"nn.LayerNorm({w})" if s.final_norm else "None"
        nested = ", enable_nested_tensor=False" if s.form == "encoder" else ""
        return f"self.{n['stack']} = {container}({_layer(d)}, {d.depth}, norm={norm}{nested})"
    make = _layer(d) if s.torch_layers else f"{n['block']}()"
    return f"self.{n['stack']} = nn.ModuleList([{make} for _ in range({d.depth})])"


def _init(d: Draw) -> list[str]:
    n, w, s = d.names, d.width, d.seq
    lines = [
        f"self.{n['embed']} = nn.Linear({d.channels}, {w})",
        f"self.{n['pos']} = nn.Parameter(torch.randn({d.num_patches}, 1, {w}) * 0.02)",
        f"self.{n['t1']} = nn.Linear(32, {w})",
        f"self.{n['t2']} = nn.Linear({w}, {w})",
    ]
    if s.memory == "context":
        lines.append(f"self.{n['memory_proj']} = nn.Linear({_MEMORY_WIDTH}, {w})")
    lines += [
        _stack_init(d),
        f"self.{n['final_norm']} = nn.LayerNorm({w}, elementwise_affine=False)",
        f"self.{n['final_ada']} = nn.Linear({w}, {2 * w})",
        f"self.{n['head']} = nn.Linear({w}, {d.channels})",
    ]
    return ["def __init__(self):", "    super().__init__()"] + ["    " + x for x in lines]


def _params(d: Draw) -> list[str]:
    n = d.names
    return [n["arg_in"], n["arg_t"]] + ([n["arg_memory"]] if d.seq.memory == "context" else [])


def _folds(d: Draw) -> tuple[list[str], list[str]]:
    """The stream to ``[B, T, D]`` before the blocks, and back after them (``permuted``)."""
    how = d.seq.permute
    if how is None:
        return [], []
    if how == "einops":
        return (
            ["x = einops.rearrange(x, 't b d -> b t d')"],
            ["x = einops.rearrange(x, 'b t d -> t b d')"],
        )
    turn = "x = x.permute(1, 0, 2)" if how == "permute" else "x = x.transpose(0, 1)"
    return [turn], [turn]


def _prologue(d: Draw) -> list[str]:
    n, s = d.names, d.seq
    lines = [
        f"c = self.{n['t2']}(F.silu(self.{n['t1']}({n['fn_freq']}({n['arg_t']}))))",
        f"x = self.{n['embed']}({n['arg_in']}) + self.{n['pos']}",
    ]
    lines += [] if d.adaln else ["x = x + c[None]"]
    if s.memory == "context":
        lines.append(f"mem = self.{n['memory_proj']}({n['arg_memory']})")
    elif s.memory == "cond":
        lines.append("mem = c[None]")
    return lines + _folds(d)[0]


def _call(d: Draw, layer: str) -> str:
    """``x = <one layer's call>``."""
    n, s = d.names, d.seq
    if s.torch_layers:
        decoder = s.form.startswith("decoder")
        if d.call == "keyword":
            args = "tgt=x, memory=mem" if decoder else "src=x"
        else:
            args = "x, mem" if decoder else "x"
    elif d.call == "keyword":
        args = f"{n['b_x']}=x" + (f", {n['b_cond']}=c" if d.adaln else "")
    else:
        args = "x, c" if d.adaln else "x"
    return f"x = {layer}({args})"


def _model_blocks(d: Draw) -> list[str]:
    s, stack = d.seq, f"self.{d.names['stack']}"
    if s.form == "encoder":
        return [f"x = {stack}(x)"]
    if s.form == "decoder":
        return [f"x = {stack}(x, mem)"]
    return [f"for layer in {stack}:", "    " + _call(d, "layer")]


def _epilogue(d: Draw) -> list[str]:
    """Back to ``[T, B, D]`` (``permuted``), the final adaLN over the tokens, the head."""
    n = d.names
    return [
        *_folds(d)[1],
        f"shift, scale = self.{n['final_ada']}(F.silu(c)).chunk(2, dim=-1)",
        f"x = self.{n['final_norm']}(x) * (1 + scale[None]) + shift[None]",
        f"return self.{n['head']}(x)",
    ]


def _twin_blocks(d: Draw) -> list[str]:
    s, stack, k = d.seq, f"self.{d.names['stack']}", seq_kept_count(d)
    tail = "" if _batch_first(d) else "_seq"
    layers = f"list({stack}.layers)" if s.form in ("encoder", "decoder") else f"list({stack})"
    lines = [
        f"layers = {layers}",
        f"assert not checks or kept.shape == ({BATCH}, {k}), (",
        f"    f'kept {{tuple(kept.shape)}}; by construction ({BATCH}, {k})')",
        f"for i in range({d.depth}):",
        f"    if i == {d.start}:",
        "        full = x",
        f"        x = _twin_gather{tail}(x, kept)",
        "    " + _call(d, "layers[i]"),
        f"    if i == {d.end - 1}:",
        f"        x = _twin_scatter{tail}(full, kept, x)",
    ]
    if s.final_norm:  # the container's norm= after its layers
        lines.append(f"x = {stack}.norm(x)")
    return lines


def _inputs(d: Draw) -> str:
    n = d.names
    lines = [
        "gen = torch.Generator().manual_seed(SEED)",
        f"x = torch.randn({(d.num_patches, BATCH, d.channels)!r}, generator=gen)",
        f"t = torch.rand({BATCH}, generator=gen)",
        "kwargs = {}",
    ]
    if d.seq.memory == "context":
        shape = (d.seq.memory_tokens, BATCH, _MEMORY_WIDTH)
        lines.append(f"kwargs[{n['arg_memory']!r}] = torch.randn({shape!r}, generator=gen)")
    lines.append("return (x, t), kwargs")
    return f"\n\ndef inputs():\n{indent(lines, 1)}\n"


def seqfirst_module(d: Draw) -> str:
    """Everything after the module header: helpers, block, model, ``build``, ``inputs``,
    twin."""
    n, params = d.names, ", ".join(_params(d))
    model = _prologue(d) + _model_blocks(d) + _epilogue(d)
    twin = _prologue(d) + _twin_blocks(d) + _epilogue(d)
    block = "" if d.seq.torch_layers else _block(d)
    return (
        helpers_source(d) + block
        + f"\n\nclass {n['model']}(nn.Module):\n{indent(_init(d), 1)}\n\n"
        f"    def forward(self, {params}):\n{indent(model, 2)}\n"
        f"\n\ndef build():\n    torch.manual_seed(SEED)\n    return {n['model']}()\n"
        + _inputs(d) + _TWIN_HELPERS
        + f"\n\ndef _twin_forward(self, kept, checks, {params}):\n"
        "    # TREAD by hand, from what the generator knows (never from route()).\n"
        f"{indent(twin, 1)}\n\n\n"
        "def twin(model, args, kwargs, kept, checks=True):\n"
        '    """The routed training forward, written by hand: ``kept`` [B, k] ids."""\n'
        "    return _twin_forward(model, kept, checks, *args, **kwargs)\n"
    )  # fmt: skip
