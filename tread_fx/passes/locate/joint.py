"""Never-routed parts of a joint stream: the tokens in front of and behind the image tokens.

A model may build the stream its blocks see by concatenating the tokens computed from its
main input (the image) with other tokens along the token dim: cls/register tokens in front
(timm), a text or conditioning stream behind (``cat([image, text], 1)``), or both. Only the
image tokens are routed; the others are an unrouted *prefix* and *suffix*: they are kept by
every route, pass through the routed blocks and are written back in place at the route end.

Example:
    >>> # used by tread_fx.passes.locate.stream.locate; the counts land in StreamInfo.prefix/suffix.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from tread_fx.errors import TokenStreamError
from tread_fx.passes.locate.stacks import ancestors
from tread_fx.passes.trace.concats import concatenation_parts
from tread_fx.passes.trace.tracer import TensorMeta

__all__ = ["joint_parts", "parts_from_concat"]


def joint_parts(
    model: nn.Module,
    keep_prefix: int | None,
    stream0: fx.Node,
    primary: fx.Node,
    token_dim: int,
    num_tokens: int,
) -> tuple[int, int]:
    """``(prefix, suffix)``: leading and trailing tokens of the stream that are never routed.

    Args:
        model: The model (its ``num_prefix_tokens`` declares the prefix, as timm's do).
        keep_prefix: The user's prefix count (``None``: declared or detected).
        stream0: The stream entering the first block.
        primary: The model's main input (the image).
        token_dim: The stream's token dim.
        num_tokens: The stream's token count.

    Returns:
        The prefix and suffix token counts; the suffix is always detected, and the declared
        ``num_prefix_tokens`` counts only where a concatenation along the token dim builds
        the stream (else no token is concatenated in front at this point).
    """
    prefix, suffix = parts_from_concat(stream0, primary, token_dim, num_tokens)
    declared = getattr(model, "num_prefix_tokens", None)
    if keep_prefix is not None:
        prefix = keep_prefix
        if prefix + suffix >= num_tokens:
            raise TokenStreamError(
                f"keep_prefix={keep_prefix} leaves no token to route:\nthe stream has "
                f"{num_tokens} tokens ({suffix} trailing ones never routed); pass a smaller "
                "keep_prefix, or None to detect the cls/register tokens."
            )
    elif isinstance(declared, int) and _concatenated(stream0, token_dim, num_tokens):
        prefix = declared  # the model's own count of the tokens it concatenates in front
    return prefix, suffix


def _concatenated(stream0: fx.Node, token_dim: int, num_tokens: int) -> bool:
    """Whether a concatenation along the token dim builds the stream: without one, every
    position is computed alike from the main input, and a declared prefix (CaiT's and
    ConViT's class token, added only before their later blocks) is not in this stream."""
    upstream = ancestors(stream0, set()) | {stream0}
    return any(_concat_parts(n, token_dim, num_tokens) is not None for n in upstream)


def parts_from_concat(
    stream0: fx.Node, primary: fx.Node, token_dim: int, num_tokens: int
) -> tuple[int, int]:
    """Count tokens concatenated in front of (cls, registers) and behind (text) the tokens
    computed from ``primary``, in a concatenation along the token dim that builds the stream.

    Parts computed from the main input are image tokens; the parts before the first of them
    are the prefix, the parts after the last of them the suffix. The concatenation nearest
    to the stream decides. Concatenations may nest (``cat([long, cat([mid, cat([short,
    x])])])``, history frames added one group at a time): a single image part that is itself
    such a concatenation is searched in turn, and the counts of every level add up.
    """
    upstream = ancestors(stream0, set()) | {stream0}
    for node in reversed([n for n in stream0.graph.nodes if n in upstream]):
        found = _concat_parts(node, token_dim, num_tokens)
        if found is None:
            continue
        parts, sizes = found
        image = [i for i, part in enumerate(parts) if _from_primary(part, primary)]
        if not image:
            continue
        prefix, suffix = sum(sizes[: image[0]]), sum(sizes[image[-1] + 1 :])
        part = parts[image[0]]
        if len(image) == 1 and part is not primary and sizes[image[0]] != num_tokens:
            inner = parts_from_concat(part, primary, token_dim, sizes[image[0]])
            prefix, suffix = prefix + inner[0], suffix + inner[1]
        return prefix, suffix
    return 0, 0


def _concat_parts(
    node: fx.Node, token_dim: int, num_tokens: int
) -> tuple[list[fx.Node], list[int]] | None:
    """Parts and their token counts of a concatenation along the token dim into
    ``num_tokens``: a ``torch.cat``, or a leaf function whose values showed one
    (``pack([x, registers], "b * d")``, :mod:`tread_fx.passes.trace.concats`)."""
    out = node.meta.get("tread_meta")
    if not isinstance(out, TensorMeta) or len(out.shape) <= token_dim:
        return None
    if out.shape[token_dim] != num_tokens:
        return None
    return concatenation_parts(node, token_dim)


def _from_primary(part: fx.Node, primary: fx.Node) -> bool:
    return part is primary or primary in ancestors(part, set())
