"""The sequence-first round: token streams given as ``[T, B, C]`` (issue 55).

A sequence-first model takes its tokens as ``[T, B, C]`` (the tokens first, the samples on
dim 1), adds a timestep embedding, runs a stack of blocks and returns ``[T, B, C]``. The
blocks are one of these forms:

- ``encoder`` / ``encoder_list``: torch's own ``nn.TransformerEncoderLayer`` with
  ``batch_first=False``, held in an ``nn.TransformerEncoder`` (with or without its final
  ``norm=``) or in an ``nn.ModuleList`` walked by a loop;
- ``decoder`` / ``decoder_list``: ``nn.TransformerDecoderLayer`` with ``batch_first=False``,
  in an ``nn.TransformerDecoder`` or an ``nn.ModuleList``, cross-attending to a memory: a
  context stream ``[S, B, C']`` the model is given (projected), or the conditioning as one
  token ``[1, B, C]``;
- ``dim0``: a block of its own class attending over dim 0 (``einsum`` over ``t``/``s``, the
  heads permuted to ``[B, H, T, d]`` for ``sdpa``, or ``nn.MultiheadAttention`` with
  ``batch_first=False``), with adaLN from the conditioning ``[B, C]`` or the conditioning
  added before the blocks;
- ``permuted``: the input permuted inside the forward to ``[B, T, C]`` (``permute``,
  ``transpose`` or ``einops.rearrange``) for batch-first blocks of its own class, and back
  after them.

What the twin does follows from the design (tread_fx tells the batch dim by what the blocks
mix, never by a convention): the tokens are routed, never the samples, so it gathers each
sample's kept tokens along the token dim (dim 0 of a sequence-first stream), runs the routed
blocks and scatters them back. Every draw is routable; the module's ``BATCH_DIM`` is 1 (the
input and the output hold the samples on dim 1).

:func:`draw_seqfirst` decides from a generator of its own, so the other rounds' draws of a
seed stay what they were unless the seed becomes sequence-first, which replaces them (every
other family is cleared, as for factorised video, whose seeds it never takes).

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> d = next(draw(s) for s in range(400) if draw(s).seq)
    >>> d.seq.form in FORMS and d.batch_dim == 1
    True
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.generated.grammar import Draw

__all__ = ["FORMS", "SEQ_ROLES", "SeqDraw", "draw_seqfirst", "seq_features", "SHARE"]

SHARE = 0.06  # of the seeds not already factorised video
FORMS = ("encoder", "encoder_list", "decoder", "decoder_list", "dim0", "permuted")
_WEIGHTS = (2, 1, 1, 1, 2, 2)
SEQ_ROLES = ("stack", "memory_proj", "arg_memory", "attn", "b_memory", "fn_fold")


@dataclass
class SeqDraw:
    """The features of a sequence-first model.

    Attributes:
        form: One of :data:`FORMS` (see the module docstring).
        norm_first: torch layers: ``norm_first=True`` (pre-norm).
        activation: torch layers: ``relu`` or ``gelu``.
        final_norm: ``encoder``/``decoder``: the container's ``norm=`` (a final LayerNorm).
        memory: decoders: ``context`` (a ``[S, B, C']`` input, projected) or ``cond`` (the
            conditioning as one memory token).
        memory_tokens: ``S`` of a context memory.
        attend: ``dim0``: ``einsum``, ``sdpa`` or ``mha``; ``permuted``: ``sdpa``,
            ``explicit`` or ``mha`` (``nn.MultiheadAttention``, ``batch_first=True``).
        permute: ``permuted``: ``permute``, ``transpose`` or ``einops``.
    """

    form: str
    norm_first: bool = False
    activation: str = "relu"
    final_norm: bool = False
    memory: str | None = None
    memory_tokens: int = 0
    attend: str | None = None
    permute: str | None = None

    @property
    def torch_layers(self) -> bool:
        """Whether the blocks are torch's own transformer layers."""
        return self.form.startswith(("encoder", "decoder"))


def draw_seqfirst(d: Draw) -> None:
    """Make ``d`` a sequence-first model for some seeds (in place; see the module docstring)."""
    rng = random.Random(f"generated-seqfirst-{d.seed}")
    if d.video or rng.random() >= SHARE:
        return
    s = SeqDraw(form=rng.choices(FORMS, _WEIGHTS)[0])
    if s.torch_layers:
        s.norm_first = rng.random() < 0.5
        s.activation = rng.choice(["relu", "gelu"])
        s.final_norm = s.form in ("encoder", "decoder") and rng.random() < 0.5
    if s.form.startswith("decoder"):
        s.memory = rng.choice(["context", "context", "cond"])
        s.memory_tokens = rng.choice([4, 7, 10]) if s.memory == "context" else 1
    if s.form == "dim0":
        s.attend = rng.choice(["einsum", "sdpa", "mha"])
    if s.form == "permuted":
        s.attend = rng.choice(["sdpa", "explicit", "mha"])
        s.permute = rng.choice(["permute", "transpose", "einops"])
    d.seq = s
    d.input_kind, d.patch = "tokens_seq_first", 1
    d.grid, d.channels = (rng.choice([16, 24, 32, 48]),), rng.choice([8, 12])
    d.depth = rng.randint(2, 6)
    d.start = rng.randrange(d.depth)
    d.end = rng.randint(d.start + 1, d.depth)
    # torch's layers get the conditioning added to the tokens; the own blocks may take it
    d.adaln = not s.torch_layers and rng.random() < 0.6
    d.refuse = None
    # every other family is the sequence-first writer's: cleared
    d.company, d.rope, d.mask, d.text, d.latent_tokens = [], None, None, None, 0
    d.text_mask, d.text_mask_kind = False, None
    d.ints, d.predicates, d.hook, d.hooked, d.scan = [], [], None, (), None
    d.einops_heads = d.einops_repeat = False
    d.container, d.stages, d.wrap, d.ret, d.label = "modulelist", (), "plain", "tensor", False


def seq_features(d: Draw) -> list[str]:
    """The table labels of a sequence-first model (it has no other round's features)."""
    s = d.seq
    out = [f"input={d.input_kind}", f"seq_first={s.form}"]
    if s.torch_layers:
        out += [f"seq_activation={s.activation}"] + (["seq_norm_first"] if s.norm_first else [])
        out += ["seq_final_norm"] if s.final_norm else []
    else:
        out.append(f"seq_attend={s.attend}")
    out += [f"call={d.call}"] if s.form not in ("encoder", "decoder") else []
    out += [f"seq_memory={s.memory}"] if s.memory else []
    out += [f"seq_permute={s.permute}"] if s.permute else []
    out.append("cond=adaln" if d.adaln else "cond=added")
    out.append(f"rate={d.rate}")
    out.append("route_end=depth" if d.end == d.depth else "route_end=inner")
    return out
