"""The second grammar round: block call forms, ints, Python predicates, text, video, folds.

:func:`draw_more` adds these families to a :class:`~benchmarks.generated.grammar.Draw`
from a generator of its own (seeded from the draw's seed), so the first round's draws of a seed
stay what they were. Each family excludes only what it cannot be combined with; every
exclusion is written next to its draw. :func:`more_features` gives their table labels.

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> all(label.count("=") <= 1 for label in more_features(draw(5)))
    True
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.generated.grammar import Draw

__all__ = ["MORE_ROLES", "draw_more", "more_features", "more_rng"]

MORE_ROLES = (
    # model attributes and locals
    "txt_proj", "coin", "latents", "dec", "fn_hook", "rec",
    # model forward arguments
    "arg_txt", "arg_txt_mask",
    # block attributes
    "dw", "cn", "cq", "ckv", "co",
    # block forward arguments
    "b_count", "b_gf", "b_gh", "b_gw", "b_grid", "b_coin", "b_ctx", "b_ctx_mask",
)  # fmt: skip

_WRAPS = ("plain", "plain", "checkpoint", "checkpoint_train", "partial", "partial_checkpoint")
_PREDICATES = ("is_tensor", "isinstance", "dim_block", "ndim_model", "data_branch")


def more_rng(seed: int) -> random.Random:
    """The second round's generator for ``seed`` (independent of the first round's)."""
    return random.Random(f"generated-more-{seed}")


def _video(rng: random.Random, d: Draw) -> None:
    frames, h, w = rng.choice([2, 3]), 4, rng.choice([4, 4, 6])
    d.input_kind = rng.choice(["video_conv", "video_linear"])
    d.grid, d.patch, d.channels = (frames, h, w), 2, rng.choice([3, 4])


def _text(rng: random.Random, d: Draw) -> None:
    d.text = rng.choice(["prefix", "suffix", "context", "context"])
    if d.refuse == "merge" and d.text != "context":
        d.text = "context"  # a merge pairs tokens: a joined text would pair with image tokens
    d.text_tokens = rng.choice([5, 8, 16])
    d.text_width = rng.choice([16, 24])
    d.text_mask = rng.random() < 0.5
    if d.text_mask:
        d.text_mask_kind = d.mask if (d.mask and d.text != "context") else None
        d.text_mask_kind = d.text_mask_kind or rng.choice(["bool", "additive"])
        d.text_masked = tuple(rng.randint(1, d.text_tokens - 2) for _ in range(2))


def _ints(rng: random.Random, d: Draw) -> None:
    ints: list[str] = []
    d.ints = ints
    if d.refuse in ("merge", "fold", "latents"):
        return  # the token count changes inside the route: later blocks would get a stale one
    if rng.random() < 0.3:
        ints.append("count")
    image = d.input_kind.startswith(("image", "video"))
    joined = d.company or d.text in ("prefix", "suffix")
    if image and not joined and rng.random() < 0.6:
        ints.append(rng.choice(["grid", "grid_tuple"]))  # a grid of patch tokens only
    if d.refuse is None and d.stream_tokens <= 2 * d.width and rng.random() < 0.3:
        ints.append("coincident")  # a feature size that equals the stream's token count


def _fold_or_latents(rng: random.Random, d: Draw) -> None:
    """The second round's must-refuse structures (replacing the first round's)."""
    if rng.random() < 0.7 and d.end - d.start >= 2:
        d.refuse = "fold"
        d.change_at = rng.randint(d.start + 1, d.end - 1)
    else:
        d.refuse = "latents"
        d.latent_tokens = rng.choice([8, 12])
    # a context would have the unfolded batch (fold) or be the patches themselves (latents)
    d.rope, d.mask, d.company, d.ints = None, None, [], []
    d.text, d.text_mask, d.text_mask_kind = None, False, None


def draw_more(d: Draw) -> None:
    """Draw the second round's features into ``d`` (in place; their roles are named by
    :func:`~benchmarks.generated.grammar.draw`, from :data:`MORE_ROLES`)."""
    rng = more_rng(d.seed)
    if rng.random() < 0.2:
        _video(rng, d)
    if rng.random() < 0.35:
        _text(rng, d)
    d.wrap = rng.choice(_WRAPS)
    d.ret = rng.choice([d.ret, d.ret, "list", "tuple3"])
    if rng.random() < 0.25:
        d.hook = rng.choice(["scale", "record"])
        d.hooked = tuple(sorted(rng.sample(range(d.depth), rng.randint(1, d.depth))))
    d.predicates = sorted(p for p in _PREDICATES if rng.random() < 0.15)
    d.einops_heads = rng.random() < 0.25
    d.einops_repeat = bool(d.company) and rng.random() < 0.4
    if d.routable and rng.random() < 0.1:
        _fold_or_latents(rng, d)
    _ints(rng, d)


def more_features(d: Draw) -> list[str]:
    """The table labels of the second round's features."""
    out = [f"wrap={d.wrap}"]
    if d.hook:
        out.append(f"hook={d.hook}")
    out += [f"int={kind}" for kind in d.ints]
    out += [f"predicate={p}" for p in d.predicates]
    out += ["einops.heads"] if d.einops_heads else []
    out += ["einops.repeat"] if d.einops_repeat else []
    if d.text:
        out.append(f"text={d.text}")
        out += [f"text_mask={d.text_mask_kind}"] if d.text_mask else []
    return out
