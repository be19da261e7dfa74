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

__all__ = ["helpers_source", "block_source", "block_params"]


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
"""


def block_params(d: Draw) -> list[str]:
    """The block's forward parameters after the stream, in the drawn order."""
    role = {"cond": "b_cond", "rope": "b_rope", "mask": "b_mask"}
    return [d.names[role[side]] for side in d.side_order]


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
        extra = f", attn_mask={mask}[:, None, None, :]" if d.mask else ""
        return [f"    a = F.scaled_dot_product_attention(q, k, v{extra})"]
    lines = ["    s = (q @ k.transpose(-2, -1)) * (width // heads) ** -0.5"]
    if d.mask == "bool":
        lines.append(f"    s = s.masked_fill(~{mask}[:, None, None, :], float('-inf'))")
    elif d.mask == "additive":
        lines.append(f"    s = s + {mask}[:, None, None, :]")
    return lines + ["    a = s.softmax(dim=-1) @ v"]


def _modulated(d: Draw, norm: str, shift: str, scale: str) -> str:
    if not d.adaln:
        return f"    h = self.{d.names[norm]}(x)"
    return f"    h = self.{d.names[norm]}(x) * (1 + {scale}[:, None]) + {shift}[:, None]"


def _forward(d: Draw) -> list[str]:
    n = d.names
    x = n["b_x"]
    params = ", ".join([x, *block_params(d)])
    lines = [f"def forward(self, {params}):", f"    x = {x}", "    batch, count, width = x.shape"]
    lines.append(f"    heads = {n['const_heads']}")
    if d.adaln:
        lines.append(f"    mod = self.{n['ada']}(F.silu({n['b_cond']}))")
        lines.append("    s1, c1, g1, s2, c2, g2 = mod.chunk(6, dim=-1)")
    lines.append(_modulated(d, "n1", "s1", "c1"))
    lines.append(f"    q, k, v = self.{n['qkv']}(h).reshape(batch, count, 3, heads, -1).unbind(2)")
    lines.append("    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)")
    lines += _rotary(d) if d.rope else []
    lines += _attention(d)
    lines.append(f"    a = self.{n['o']}(a.transpose(1, 2).reshape(batch, count, width))")
    lines.append("    x = x + g1[:, None] * a" if d.adaln else "    x = x + a")
    lines.append(_modulated(d, "n2", "s2", "c2"))
    lines.append(f"    h = self.{n['f2']}(F.gelu(self.{n['f1']}(h)))")
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
    if d.ret == "dict":
        return f"    return {{{d.names['key_out']!r}: x, {d.names['key_aux']!r}: a}}"
    return "    return x"


def block_source(d: Draw) -> str:
    """The block class's source (4-space indented methods)."""
    body = _init(d) + [""] + _forward(d)
    text = "\n".join(("    " + line) if line else "" for line in body)
    return f"\n\nclass {d.names['block']}(nn.Module):\n{text}\n"
