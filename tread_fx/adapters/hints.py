"""Name hints: what an argument name suggests a side value is, for when its use cannot tell.

Rules decide by use (:mod:`tread_fx.passes.uses`). Only where no block receiving a value could
be traced through, or the value meets the stream only inside an op tread_fx cannot see into
(a leaf module), does the plan ask these hints; a value decided by a hint is reported with a
warning that names the hint and the option that overrides it (an ``Adapter``). Renaming such a
value's argument can therefore change what happens to it, and the warning says so.

Example:
    >>> hinted_use(frozenset({"attention_mask"}))
    'mask'
    >>> hinted_use(frozenset({"zq"})) is None
    True
"""

from __future__ import annotations

__all__ = ["hinted_use"]

_HINTS: dict[str, frozenset[str]] = {
    "context": frozenset(
        {"encoder_hidden_states", "context", "cond", "condition", "c", "y", "temb", "timestep",
         "encoder_attention_mask", "text_embeds", "pooled_projections", "added_cond_kwargs"}
    ),
    "table": frozenset(
        {"image_rotary_emb", "rotary_emb", "rotary_pos_emb", "rope", "rot_pos_embed", "rope_emb",
         "freqs_cis", "freqs", "pos_emb", "position_embeddings", "rotary_embeddings",
         "rotary_position_embeddings", "freqs_cos", "freqs_sin", "pe"}
    ),
    "mask": frozenset(
        {"attention_mask", "attn_mask", "mask", "key_padding_mask", "padding_mask",
         "src_key_padding_mask", "joint_attention_mask", "cu_seqlens", "cu_seq_lens",
         "cu_seqlens_q", "cu_seqlens_k", "cu_seq_lens_q", "cu_seq_lens_k", "cumulative_seqlens",
         "cu_lens", "seq_offsets", "segment_ids", "seg_ids", "seq_ids", "sequence_ids",
         "document_ids", "doc_ids", "sample_ids", "packed_ids"}
    ),
    "ids": frozenset({"position_ids", "cache_position", "pos_ids", "positions"}),
}  # fmt: skip


def hinted_use(arg_names: frozenset[str]) -> str | None:
    """The use every name a value is received under suggests, or ``None``.

    A value inside a dict argument is received as ``argument.key``; either part may hint.
    """
    found = set()
    for name in arg_names:
        uses = {use for use, names in _HINTS.items() for part in name.split(".") if part in names}
        if len(uses) != 1:
            return None
        found |= uses
    return found.pop() if len(found) == 1 else None
