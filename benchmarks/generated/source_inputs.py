"""The source of a generated model's inputs side: embedding, text, masks, ``inputs()``.

Shared line for line by the model and its twin: the patch embedding (image, audio, token
and video inputs), the Python predicates of the model's own code, the text stream and the
attention masks over the stream, and the head's unpatchify; plus the ``inputs()`` function.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> "def inputs():" in inputs_source(draw(0))
    True
"""

from __future__ import annotations

from benchmarks.generated.grammar import BATCH, Draw
from benchmarks.generated.source_containers import text_pack_lines

__all__ = [
    "embed_init", "embed_line", "head_out", "unpatchify", "predicate_lines", "text_lines",
    "mask_lines", "forward_params", "inputs_source", "indent",
]  # fmt: skip


def indent(lines: list[str], depth: int) -> str:
    """The lines joined, each indented ``depth`` levels."""
    pad = "    " * depth
    return "\n".join(pad + line for line in lines)


def embed_init(d: Draw) -> str:
    """The patch embedding module."""
    c, p, w = d.channels, d.patch, d.width
    if d.input_kind == "image_conv":
        return f"nn.Conv2d({c}, {w}, {p}, stride={p})"
    if d.input_kind in ("image_linear", "video_linear"):
        return f"nn.Linear({c * p * p}, {w})"
    if d.input_kind == "video_conv":
        return f"nn.Conv3d({c}, {w}, (1, {p}, {p}), stride=(1, {p}, {p}))"
    if d.input_kind == "audio":
        return f"nn.Conv1d({c}, {w}, {p}, stride={p})"
    return f"nn.Linear({c}, {w})"


def head_out(d: Draw) -> int:
    """The head's output features per token."""
    flat = d.input_kind.startswith(("image", "video"))
    return d.channels * (d.patch * d.patch if flat else d.patch)


def embed_line(d: Draw) -> str:
    """``x = <the input as tokens>``."""
    n, inp, p = d.names, d.names["arg_in"], d.patch
    embed = f"self.{n['embed']}"
    if d.input_kind in ("image_conv", "video_conv"):
        return f"x = {embed}({inp}).flatten(2).transpose(1, 2)"
    if d.input_kind == "audio":
        return f"x = {embed}({inp}).transpose(1, 2)"
    if d.input_kind == "tokens":
        return f"x = {embed}({inp})"
    if d.input_kind == "video_linear":
        pattern = "b c f (h p1) (w p2) -> b (f h w) (p1 p2 c)"
        return f"x = {embed}(einops.rearrange({inp}, {pattern!r}, p1={p}, p2={p}))"
    if d.patch_embed == "unfold":
        return f"x = {embed}(F.unfold({inp}, {p}, stride={p}).transpose(1, 2))"
    pattern = "b c (h p1) (w p2) -> b (h w) (p1 p2 c)"
    return f"x = {embed}(einops.rearrange({inp}, {pattern!r}, p1={p}, p2={p}))"


def unpatchify(d: Draw) -> list[str]:
    """The head's tokens back to the input's layout (``return ...``)."""
    p, c = d.patch, d.channels
    if d.input_kind.startswith("image"):
        pattern = "b (h w) (p1 p2 c) -> b c (h p1) (w p2)"
        return [f"return einops.rearrange(x, {pattern!r}, h={d.grid[0]}, p1={p}, p2={p})"]
    if d.input_kind.startswith("video"):
        pattern = "b (f h w) (p1 p2 c) -> b c f (h p1) (w p2)"
        sizes = f"f={d.grid[0]}, h={d.grid[1]}, p1={p}, p2={p}"
        return [f"return einops.rearrange(x, {pattern!r}, {sizes})"]
    if d.input_kind == "audio":
        return [
            f"x = x.reshape(x.shape[0], -1, {p}, {c}).permute(0, 3, 1, 2)",
            f"return x.reshape(x.shape[0], {c}, -1)",
        ]
    return ["return x"]


def _input_shape(d: Draw) -> tuple[int, ...]:
    p = d.patch
    if d.input_kind.startswith("image"):
        return (BATCH, d.channels, d.grid[0] * p, d.grid[1] * p)
    if d.input_kind.startswith("video"):
        return (BATCH, d.channels, d.grid[0], d.grid[1] * p, d.grid[2] * p)
    if d.input_kind == "audio":
        return (BATCH, d.channels, d.grid[0] * p)
    return (BATCH, d.grid[0], d.channels)


def predicate_lines(d: Draw) -> list[str]:
    """Python checks on the inputs in the model's own code (before the embedding)."""
    t, inp = d.names["arg_t"], d.names["arg_in"]
    lines = []
    if "is_tensor" in d.predicates:
        lines += [f"if not torch.is_tensor({t}):", f"    {t} = torch.full(({inp}.shape[0],), {t})"]
    if "isinstance" in d.predicates:
        lines += [
            f"if isinstance({t}, torch.Tensor) and {t}.dim() == 0:",
            f"    {t} = {t}[None].expand({inp}.shape[0])",
        ]
    if "data_branch" in d.predicates:
        lines += [f"if bool(({t} > 1).any()):", f"    {t} = {t} / 1000.0"]
    if "ndim_model" in d.predicates:
        rank = len(_input_shape(d))
        lines += [f"if {inp}.dim() == {rank - 1}:", f"    {inp} = {inp}[None]"]
    return lines


def text_lines(d: Draw) -> list[str]:
    """The text stream projected, and joined to the stream when the draw joins it."""
    if not d.text:
        return []
    lines = [f"txt = self.{d.names['txt_proj']}({d.names['arg_txt']})"]
    if d.text_join == "pack":
        lines += text_pack_lines(d)
    elif d.text == "prefix":
        lines.append("x = torch.cat([txt, x], dim=1)")
    elif d.text == "suffix":
        lines.append("x = torch.cat([x, txt], dim=1)")
    if d.text == "context" and d.text_mask:
        lines.append(f"tm = {d.names['arg_txt_mask']}")
    return lines


def _fill(kind: str, count: int) -> str:
    if kind == "bool":
        return f"torch.ones(x.shape[0], {count}, dtype=torch.bool)"
    return f"torch.zeros(x.shape[0], {count})"


def mask_lines(d: Draw) -> list[str]:
    """``m``: the key mask over the whole stream (patch mask, company, joined text)."""
    kind = d.stream_mask
    if not kind:
        return []
    mask = d.names["arg_mask"]
    lines = [f"m = {mask}" if d.mask else f"m = {_fill(kind, d.num_patches)}"]
    if d.company:
        make = "new_ones" if kind == "bool" else "new_zeros"
        extra = f"m.{make}(x.shape[0], {d.num_company})"
        joined = [extra, "m"] if d.company_side == "prepend" else ["m", extra]
        lines.append(f"m = torch.cat([{', '.join(joined)}], dim=1)")
    if d.joined_text:
        tm = d.names["arg_txt_mask"] if d.text_mask else _fill(kind, d.text_tokens)
        joined = [tm, "m"] if d.text == "prefix" else ["m", tm]
        lines.append(f"m = torch.cat([{', '.join(joined)}], dim=1)")
    return lines


def forward_params(d: Draw) -> list[str]:
    """The model's forward parameters."""
    n = d.names
    params = [n["arg_in"], n["arg_t"]]
    params += [n["arg_y"]] if d.label else []
    params += [n["arg_mask"]] if d.mask else []
    params += [n["arg_txt"]] if d.text else []
    return params + ([n["arg_txt_mask"]] if d.text_mask else [])


def _mask_input(kind: str, count: int, masked: tuple[int, ...], key: str) -> list[str]:
    bool_ = kind == "bool"
    fill = "False" if bool_ else "-10000.0"
    dtype = ", dtype=torch.bool" if bool_ else ""
    return [
        f"mask = torch.{'ones' if bool_ else 'zeros'}({BATCH}, {count}{dtype})",
        f"for row, count in enumerate({masked!r}):",
        f"    mask[row, {count} - count :] = {fill}",
        f"kwargs[{key!r}] = mask",
    ]


def inputs_source(d: Draw) -> str:
    """The module's ``inputs()``: ``(args, kwargs)`` for one call, seeded."""
    n = d.names
    lines = [
        "gen = torch.Generator().manual_seed(SEED)",
        f"x = torch.randn({_input_shape(d)!r}, generator=gen)",
        f"t = torch.rand({BATCH}, generator=gen)",
        "kwargs = {}",
    ]
    if d.label:
        lines.append(f"kwargs[{n['arg_y']!r}] = torch.randint(0, 10, ({BATCH},), generator=gen)")
    if d.mask:
        lines += _mask_input(d.mask, d.num_patches, d.masked, n["arg_mask"])
    if d.text:
        shape = (BATCH, d.text_tokens, d.text_width)
        lines.append(f"kwargs[{n['arg_txt']!r}] = torch.randn({shape!r}, generator=gen)")
    if d.text_mask:
        key = n["arg_txt_mask"]
        lines += _mask_input(d.text_mask_kind, d.text_tokens, d.text_masked, key)
    lines.append("return (x, t), kwargs")
    return f"\n\ndef inputs():\n{indent(lines, 1)}\n"
