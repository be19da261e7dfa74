"""The source of a generated model's block class and its module-level helpers.

One class serves every block: its constructor takes ``(din, dout, merge)`` so that a
must-refuse model can change the stream's width (``dout != din``) or merge token pairs in one
block of the route. The block runs pre-norm attention and a feed-forward, with adaLN from
the conditioning when the draw has it, rotary ``(cos, sin)`` tables and a key-padding mask
when it has them.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> "class " in block_source(draw(0))
    True
"""

from __future__ import annotations

from benchmarks.generated.grammar import Draw
from benchmarks.generated.source_calls import block_params
from benchmarks.generated.source_scan import scan_forward, scan_helpers, scan_init

__all__ = ["helpers_source", "block_source"]


def helpers_source(d: Draw) -> str:
    """Module-level helpers: rotate-half, timestep frequencies and rotary angles."""
    n = d.names
    return f"""
{n["const_heads"]} = {d.heads}


def {n["fn_rot"]}(v):
    v1, v2 = v.chunk(2, dim=-1)
    return torch.cat([-v2, v1], dim=-1)


def {n["fn_freq"]}(t, dim=32):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = t[:, None].float() * 1000.0 * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def {n["fn_angles"]}(count, dim):
    inv = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(count, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([angles, angles], dim=-1)
""" + scan_helpers(d)


def _init(d: Draw) -> list[str]:
    n = d.names
    affine = "False" if d.adaln else "True"
    lines = [
        "def __init__(self, din, dout, merge):",
        "    super().__init__()",
        f"    self.{n['n1']} = nn.LayerNorm(din, elementwise_affine={affine})",
        f"    self.{n['qkv']} = nn.Linear(din, 3 * din)",
        f"    self.{n['o']} = nn.Linear(din, din)",
        f"    self.{n['n2']} = nn.LayerNorm(din, elementwise_affine={affine})",
        f"    self.{n['f1']} = nn.Linear(din, 2 * din)",
        f"    self.{n['f2']} = nn.Linear(2 * din, din)",
    ]
    if d.adaln:
        lines.append(f"    self.{n['ada']} = nn.Linear({d.width}, 6 * din)")
    if d.refuse == "width":
        lines.append(f"    self.{n['wproj']} = nn.Linear(din, dout) if din != dout else None")
    if d.refuse == "merge":
        lines.append(f"    self.{n['merge']} = nn.Linear(2 * din, din) if merge else None")
    return lines + _more_init(d) + scan_init(d)


def _more_init(d: Draw) -> list[str]:
    """The second round's block modules: a grid mixer, cross-attention."""
    n, lines = d.names, []
    if any(kind.startswith("grid") for kind in d.ints):
        if len(d.grid) == 3:
            conv = "nn.Conv3d(2 * din, 2 * din, (1, 3, 3), padding=(0, 1, 1), groups=2 * din)"
        else:
            conv = "nn.Conv2d(2 * din, 2 * din, 3, padding=1, groups=2 * din)"
        lines.append(f"    self.{n['dw']} = {conv}")
    if d.text == "context" or d.refuse == "latents":
        lines += [
            f"    self.{n['cn']} = nn.LayerNorm(din)",
            f"    self.{n['cq']} = nn.Linear(din, din)",
            f"    self.{n['ckv']} = nn.Linear({d.width}, 2 * din)",
            f"    self.{n['co']} = nn.Linear(din, din)",
        ]
    return lines


def _rotary(d: Draw) -> list[str]:
    n = d.names
    lines = [f"    cos, sin = {n['b_rope']}"]
    if d.rope_block_slice:
        cut = "[:count]" if d.rope == "nd" else "[:, :count]"
        lines.append(f"    cos, sin = cos{cut}, sin{cut}")
    if d.rope == "bnd":
        lines.append("    cos, sin = cos[:, None], sin[:, None]")
    rot = n["fn_rot"]
    lines += [
        f"    q = q * cos + {rot}(q) * sin",
        f"    k = k * cos + {rot}(k) * sin",
    ]
    return lines


def _attention(d: Draw) -> list[str]:
    mask = d.names["b_mask"]
    if d.attention == "sdpa":
        extra = f", attn_mask={mask}[:, None, None, :]" if d.stream_mask else ""
        return [f"    a = F.scaled_dot_product_attention(q, k, v{extra})"]
    lines = ["    s = (q @ k.transpose(-2, -1)) * (width // heads) ** -0.5"]
    if d.stream_mask == "bool":
        lines.append(f"    s = s.masked_fill(~{mask}[:, None, None, :], float('-inf'))")
    elif d.stream_mask == "additive":
        lines.append(f"    s = s + {mask}[:, None, None, :]")
    return lines + ["    a = s.softmax(dim=-1) @ v"]


def _modulated(d: Draw, norm: str, shift: str, scale: str) -> str:
    if not d.adaln:
        return f"    h = self.{d.names[norm]}(x)"
    return f"    h = self.{d.names[norm]}(x) * (1 + {scale}[:, None]) + {shift}[:, None]"


def _heads_split(d: Draw) -> list[str]:
    qkv = f"self.{d.names['qkv']}(h)"
    if d.einops_heads:
        pattern = "b n (three h d) -> three b h n d"
        return [f"    q, k, v = einops.rearrange({qkv}, {pattern!r}, three=3, h=heads)"]
    return [
        f"    q, k, v = {qkv}.reshape(batch, count, 3, heads, -1).unbind(2)",
        "    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)",
    ]


def _heads_merge(d: Draw, a: str) -> str:
    if d.einops_heads:
        return f"einops.rearrange({a}, 'b h n d -> b n (h d)', n=count)"
    return f"{a}.transpose(1, 2).reshape(batch, count, width)"


def _cross(d: Draw) -> list[str]:
    """Cross-attention from the stream to the context (text, or the perceiver's input)."""
    if not (d.text == "context" or d.refuse == "latents"):
        return []
    n = d.names
    ctx = n["b_ctx"]
    mask = f", attn_mask={n['b_ctx_mask']}[:, None, None, :]" if "ctx_mask" in d.side_order else ""
    return [
        f"    h = self.{n['cn']}(x)",
        f"    q = self.{n['cq']}(h).reshape(batch, count, heads, -1).transpose(1, 2)",
        f"    k, v = self.{n['ckv']}({ctx}).reshape(batch, {ctx}.shape[1], 2, heads, -1).unbind(2)",
        "    k, v = k.transpose(1, 2), v.transpose(1, 2)",
        f"    a2 = F.scaled_dot_product_attention(q, k, v{mask})",
        f"    x = x + self.{n['co']}({_heads_merge(d, 'a2')})",
    ]


def _ffn(d: Draw) -> list[str]:
    """The feed-forward: a grid mixer (depthwise conv over the patch grid) and a feature
    slice sized by an int equal to the token count by coincidence, where drawn."""
    n = d.names
    lines = [f"    h = F.gelu(self.{n['f1']}(h))"]
    if "coincident" in d.ints:
        coin = n["b_coin"]
        lines.append(f"    h = torch.cat([h[..., :{coin}] * 0.5, h[..., {coin}:]], dim=-1)")
    if any(kind.startswith("grid") for kind in d.ints):
        video = len(d.grid) == 3
        if "grid" in d.side_order:
            lines.append(f"    {'gf, ' if video else ''}gh, gw = {n['b_grid']}")
        else:
            lines.append(f"    gh, gw = {n['b_gh']}, {n['b_gw']}")
            lines += [f"    gf = {n['b_gf']}"] if video else []
        sizes = "gf, gh, gw" if video else "gh, gw"
        lines += [
            f"    g = h.transpose(1, 2).reshape(batch, -1, {sizes})",
            f"    h = h + self.{n['dw']}(g).flatten(2).transpose(1, 2)",
        ]
    return lines + [f"    h = self.{n['f2']}(h)"]


def _forward(d: Draw) -> list[str]:
    n = d.names
    x = n["b_x"]
    params = ", ".join([x, *block_params(d)])
    lines = [f"def forward(self, {params}):", f"    x = {x}"]
    if "dim_block" in d.predicates:
        lines += [
            "    if x.dim() != 3:",
            "        raise ValueError(f'expected [B, N, C] tokens, got {tuple(x.shape)}')",
        ]
    if "count" in d.ints:
        lines += ["    batch, _, width = x.shape", f"    count = {n['b_count']}"]
    else:
        lines.append("    batch, count, width = x.shape")
    lines.append(f"    heads = {n['const_heads']}")
    if d.adaln:
        lines.append(f"    mod = self.{n['ada']}(F.silu({n['b_cond']}))")
        lines.append("    s1, c1, g1, s2, c2, g2 = mod.chunk(6, dim=-1)")
    lines.append(_modulated(d, "n1", "s1", "c1"))
    lines += _heads_split(d)
    lines += _rotary(d) if d.rope else []
    lines += _attention(d)
    lines.append(f"    a = self.{n['o']}({_heads_merge(d, 'a')})")
    lines.append("    x = x + g1[:, None] * a" if d.adaln else "    x = x + a")
    lines += _cross(d) + scan_forward(d)
    lines.append(_modulated(d, "n2", "s2", "c2"))
    lines += _ffn(d)
    lines.append("    x = x + g2[:, None] * h" if d.adaln else "    x = x + h")
    if d.refuse == "width":
        lines += [f"    if self.{n['wproj']} is not None:", f"        x = self.{n['wproj']}(x)"]
    if d.refuse == "merge":
        merge = n["merge"]
        lines += [
            f"    if self.{merge} is not None:",
            f"        x = self.{merge}(x.reshape(batch, count // 2, 2 * width))",
        ]
    lines.append(_return(d))
    return lines


def _return(d: Draw) -> str:
    if d.ret == "tuple":
        return "    return x, a"
    if d.ret == "tuple3":
        return "    return x, a, h"
    if d.ret == "list":
        return "    return [x, a]"
    if d.ret == "dict":
        return f"    return {{{d.names['key_out']!r}: x, {d.names['key_aux']!r}: a}}"
    return "    return x"


def block_source(d: Draw) -> str:
    """The block class's source (4-space indented methods)."""
    body = _init(d) + [""] + _forward(d)
    text = "\n".join(("    " + line) if line else "" for line in body)
    return f"\n\nclass {d.names['block']}(nn.Module):\n{text}\n"
