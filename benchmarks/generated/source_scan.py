"""The source of the scan round's block branch (:mod:`~benchmarks.generated.grammar_scan`).

Every block gets one more residual branch after its attention: norm, token shift, depthwise
``Conv1d`` along the tokens, an input projection, the scan order, the recurrence (and its
flipped twin), the order undone, an output projection. The branch is the same code in the
model and the twin (the twin calls the blocks), so the twin needs nothing of its own: it keeps
the gathered tokens in ascending order, and whole rows where the order reshapes to the grid.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> d = next(draw(s) for s in range(100) if draw(s).scan is not None)
    >>> any("self." in line for line in scan_forward(d))
    True
"""

from __future__ import annotations

from benchmarks.generated.grammar import Draw

__all__ = ["scan_helpers", "scan_init", "scan_forward"]


def _recurrence(d: Draw) -> str:
    fn = d.names["fn_scan"]
    kind = d.scan.scan
    if kind == "cumsum":
        return f"""

def {fn}(u, bias):
    g = torch.sigmoid(u + bias)
    return torch.cumsum(g * u, dim=1) / (torch.cumsum(g, dim=1) + 1.0)
"""
    if kind == "loop":
        return f"""

def {fn}(u, bias):
    a = torch.sigmoid(bias)
    state = torch.zeros_like(u[:, 0])
    out = []
    for t in range(u.shape[1]):
        state = a * state + (1 - a) * u[:, t]
        out.append(state)
    return torch.stack(out, dim=1)
"""
    return f"""

def {fn}(u, bias):
    dt = F.softplus(u)
    decay = torch.exp(-dt * torch.exp(bias))
    state = torch.zeros_like(u[:, 0])
    out = []
    for t in range(u.shape[1]):
        state = decay[:, t] * state + dt[:, t] * u[:, t]
        out.append(state * torch.tanh(u[:, t]))
    return torch.stack(out, dim=1)
"""


def _zigzag(d: Draw) -> str:
    return f"""

def {d.names["fn_zigzag"]}(rows, cols):
    ids = torch.arange(rows * cols).reshape(rows, cols)
    ids[1::2] = ids[1::2].flip(1)
    return ids.flatten()
"""


def scan_helpers(d: Draw) -> str:
    """Module-level helpers of the branch: the recurrence and the zigzag order."""
    if d.scan is None:
        return ""
    text = _recurrence(d) if d.scan.scan else ""
    return text + (_zigzag(d) if d.scan.order == "zigzag_index" else "")


def scan_init(d: Draw) -> list[str]:
    """The block's ``__init__`` lines of the branch (4-space indented)."""
    s, n = d.scan, d.names
    if s is None:
        return []
    lines = [
        f"self.{n['s_norm']} = nn.LayerNorm(din)",
        f"self.{n['s_in']} = nn.Linear(din, din)",
        f"self.{n['s_out']} = nn.Linear(din, din)",
    ]
    if s.shift:
        lines.append(f"self.{n['s_mix']} = nn.Parameter(torch.rand(din))")
    if s.conv:
        pad = s.kernel // 2 if s.conv == "same" else s.kernel - 1
        conv = f"nn.Conv1d(din, din, {s.kernel}, padding={pad}, groups=din)"
        lines.append(f"self.{n['s_conv']} = {conv}")
    if s.scan:
        lines.append(f"self.{n['s_decay']} = nn.Parameter(torch.linspace(-2.0, 2.0, din))")
    if s.order == "zigzag_index":
        rows, cols = d.grid
        make = f"{n['fn_zigzag']}({rows}, {cols})"
        lines += [
            f"self.register_buffer({n['s_order']!r}, {make}, persistent=False)",
            f"self.register_buffer({n['s_inverse']!r}, torch.argsort({make}), persistent=False)",
        ]
    return ["    " + line for line in lines]


def _shift(d: Draw) -> list[str]:
    mix = f"self.{d.names['s_mix']}"
    pad, roll = "F.pad(h, (0, 0, 1, -1))", "torch.roll(h, 1, dims=1)"
    shifted = pad if d.scan.shift == "pad" else roll
    return [f"h = h * {mix} + {shifted} * (1 - {mix})"]


def _conv(d: Draw) -> list[str]:
    conv = f"self.{d.names['s_conv']}(h.transpose(1, 2))"
    if d.scan.conv == "causal":
        conv += "[..., : h.shape[1]]"
    return [f"h = h + F.silu({conv}.transpose(1, 2))"]


def _reorder(d: Draw, v: str, back: bool) -> list[str]:
    order, cols = d.scan.order, d.grid[-1]
    if order == "zigzag_index":
        buf = d.names["s_inverse" if back else "s_order"]
        return [f"{v} = {v}[:, self.{buf}]"]
    if order == "transpose":
        split = f"{cols}, -1" if back else f"-1, {cols}"
        return [
            f"{v} = {v}.reshape({v}.shape[0], {split}, {v}.shape[-1]).transpose(1, 2)",
            f"{v} = {v}.reshape({v}.shape[0], -1, {v}.shape[-1])",
        ]
    return []


def _scan(d: Draw) -> list[str]:
    s, fn, bias = d.scan, d.names["fn_scan"], f"self.{d.names['s_decay']}"
    if not s.scan:
        return ["y = u"]
    if s.bidirectional:
        return [f"y = {fn}(u, {bias}) + {fn}(u.flip(1), {bias}).flip(1)"]
    return [f"y = {fn}(u, {bias})"]


def scan_forward(d: Draw) -> list[str]:
    """The block's forward lines of the branch (4-space indented; ``x`` is the stream)."""
    s, n = d.scan, d.names
    if s is None:
        return []
    lines = [f"h = self.{n['s_norm']}(x)"]
    lines += _shift(d) if s.shift else []
    lines += _conv(d) if s.conv else []
    lines.append(f"u = self.{n['s_in']}(h)")
    lines += _reorder(d, "u", back=False) + _scan(d) + _reorder(d, "y", back=True)
    lines.append(f"x = x + self.{n['s_out']}(y)")
    return ["    " + line for line in lines]
