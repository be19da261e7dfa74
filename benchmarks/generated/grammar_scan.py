"""The scan grammar round: state-space and recurrent mixers inside the generated blocks.

A :class:`ScanDraw` adds one residual branch to every block, as research repositories write
them in plain torch: an RWKV-style token shift (``F.pad`` or ``torch.roll`` by one token), a
depthwise ``nn.Conv1d`` along the tokens (centred, or causal as Mamba's), a causal recurrence
over the tokens (a gated running mean by ``cumsum``, a decayed sum or a tiny selective scan as
Python loops), bidirectional with ``torch.flip``, and a scan order that permutes the tokens
for the scan and back (transposed rows by reshape, or a zigzag held as an index buffer).

What the twin must do follows from docs/design.md, never from ``route()``:

- kept ids ascend whatever the selection, so a shift, a conv or a scan over the kept tokens
  runs on them in their order: the twin gathers, runs the same blocks, scatters (routable);
- none of these reshape the tokens to the grid, so ``selection="auto"`` is ``random``;
  the transposed-rows order does reshape to ``(-1, W)``: the grid is found by use and whole
  rows are kept (the block transposes the kept ``r x W`` grid; routable, rows). Its way back
  reshapes the transposed tokens to ``(W, -1)``: on an oblong grid the rule "factorizations
  no one grid refines are refused" would refuse it, but that factorization is of the
  transposed order, not of the stream's token dim, and the routed result on whole rows is
  well defined, so the draw stays routable (labelled ``scan_grid=oblong``);
- a zigzag order held as a ``[N]`` index buffer is a table built from a buffer whose use is
  ``ids`` inside the block: refused (``SideInputError``; nothing says how a permutation of all
  ``N`` tokens applies to the kept ones), so the draw is must-refuse (``refuse="scan_index"``).

Cumulative decays built from ``arange(T)`` are left out on purpose: the design cuts such a
table at the kept tokens' original positions, which the plain block on the kept tokens
does not compute.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> d = draw(7)
    >>> d.scan is None or d.scan.has_branch
    True
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.generated.grammar import Draw

__all__ = ["SCAN_ROLES", "ScanDraw", "draw_scan", "scan_features", "scan_rows", "scan_reason"]

SCAN_ROLES = (
    # block attributes
    "s_norm", "s_in", "s_out", "s_decay", "s_mix", "s_conv", "s_order", "s_inverse",
    # module-level helpers
    "fn_scan", "fn_zigzag",
)  # fmt: skip


@dataclass
class ScanDraw:
    """The scan branch of every block.

    Attributes:
        shift: ``None``, ``pad`` (``F.pad`` by one token) or ``roll`` (``torch.roll``).
        conv: ``None``, ``same`` (centred depthwise ``Conv1d``) or ``causal`` (padded ``k - 1``,
            cut to the token count).
        kernel: The conv's kernel size.
        scan: ``None``, ``cumsum`` (gated running mean), ``loop`` (decayed sum, a Python loop
            over the tokens) or ``selective`` (input-dependent decay, a Python loop).
        bidirectional: The scan also runs on the flipped tokens (``torch.flip``), flipped back.
        order: ``None``, ``transpose`` (column-major over the patch grid by reshape) or
            ``zigzag_index`` (a boustrophedon order held as an index buffer; must-refuse).
    """

    shift: str | None = None
    conv: str | None = None
    kernel: int = 3
    scan: str | None = None
    bidirectional: bool = False
    order: str | None = None

    @property
    def has_branch(self) -> bool:
        """Whether the branch does anything along the tokens."""
        return bool(self.shift or self.conv or self.scan)


def _scan_rng(seed: int) -> random.Random:
    return random.Random(f"generated-scan-{seed}")


def _order(rng: random.Random, d: Draw) -> str | None:
    """A scan order over the patch grid: images only (a 2-D grid), on routable draws. The
    stream must be the patches alone: company tokens are dropped and a joined text becomes a
    context (neither would sit on the grid)."""
    if not d.input_kind.startswith("image") or d.refuse is not None or rng.random() >= 0.6:
        return None
    d.company, d.einops_repeat = [], False
    if d.text in ("prefix", "suffix"):
        d.text = "context"
    return "zigzag_index" if rng.random() < 0.4 else "transpose"


def draw_scan(d: Draw) -> None:
    """Draw the scan branch into ``d`` (in place; from a generator of its own).

    Only on models whose blocks see the input's tokens in ``[B, N, C]`` form: folded tokens
    (one-token sequences) and latents are left without it.
    """
    rng = _scan_rng(d.seed)
    if d.refuse in ("fold", "latents") or rng.random() >= 0.45:
        return
    s = ScanDraw(
        shift=rng.choice([None, None, "pad", "roll"]),
        conv=rng.choice([None, None, "same", "causal"]),
        kernel=rng.choice([3, 4]),
        scan=rng.choice([None, "cumsum", "loop", "selective", "cumsum"]),
        bidirectional=rng.random() < 0.5,
    )
    if s.conv == "same":
        s.kernel = 3  # centred: odd
    if not s.has_branch:
        s.scan = "cumsum"
    if s.scan:
        s.order = _order(rng, d)
    if s.order == "zigzag_index":
        d.refuse, d.change_at = "scan_index", d.start
        d.ints = [kind for kind in d.ints if kind != "coincident"]
    d.scan = s


def scan_rows(d: Draw) -> bool:
    """Whether the scan branch reshapes the tokens to the patch grid (whole rows kept)."""
    return d.scan is not None and d.scan.order == "transpose"


def scan_reason(d: Draw) -> str:
    """The must-refuse reason of the scan round (empty when it adds none)."""
    if d.refuse == "scan_index":
        return "the blocks scan in a zigzag order held as an [N] index buffer (SideInputError)"
    return ""


def scan_features(d: Draw) -> list[str]:
    """The table labels of the scan round."""
    s = d.scan
    if s is None:
        return []
    out = [f"shift={s.shift}"] if s.shift else []
    out += [f"conv1d={s.conv}"] if s.conv else []
    if s.scan:
        out.append(f"scan={s.scan}" + ("-bi" if s.bidirectional else ""))
    out += [f"scan_order={s.order}"] if s.order else []
    if s.order == "transpose":
        out.append("scan_grid=" + ("square" if d.grid[0] == d.grid[1] else "oblong"))
    return out
