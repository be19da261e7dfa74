"""The factorised video round: spatial and temporal blocks alternating (Latte-style).

A factorised model embeds a video ``[B, C, F, H, W]`` into the stream with the frames folded
into the batch (``[B * F, h * w, D]``), runs a spatial block (attention over the ``h * w``
positions of each frame), reshapes to the positions folded into the batch
(``[B * h * w, F, D]``) for a temporal block (attention over the frames of each position),
and back, for every block pair; the spatial and temporal blocks are two lists. What
``route()`` does with such a model is fixed by ``docs/design.md`` ("Interleaved stacks"):
without ``blocks=`` the stack whose stream has the most tokens on dim 1 is routed (here the
spatial one: ``h * w > F``), with one selection shared by all folded rows; the temporal
blocks inside the route run on the kept positions (``[B * k, F, D]``) and their per-row
conditioning (``[B * h * w, D]``) keeps the kept positions' rows.

Equal counts (``F == h * w``) fall through to the hop count (fewest ops between consecutive
blocks): a frame embedding added before the first temporal block is one op more in the
spatial stack's first hand-off, so the temporal stack is routed (over the frames); without one
the hand-offs tie and the model is refused naming both stacks (``refuse="stacks_tie"``). With
the temporal stack routed, the spatial blocks inside the route get the conditioning folded
``[B * F, D]``: with ``F == h * w`` it has the rows of the temporal blocks' ``[B * h * w, D]``,
so which rows are the kept frames' cannot be told from the values, and the design refuses it
(tests/test_interleaved_stacks.py, "F == N"): ``refuse="folded_tie"``, where adaLN
conditioning reaches a spatial block inside the route.

Left out: blocks that fold the frames themselves (a stream ``[B, F * h * w, D]`` between blocks,
each block rearranging inside), and one list alternating spatial and temporal blocks; the
design fixes neither (see the module docstring of ``source_video.py``).

:func:`draw_video` decides from a generator of its own, so the other rounds' draws of a seed
stay what they were unless the seed becomes factorised, which replaces them (every other
family is cleared: the factorised writer draws its own few).

Example:
    >>> from benchmarks.generated.grammar import draw
    >>> d = next(draw(s) for s in range(200) if draw(s).video)
    >>> d.video.stack in ("spatial", "temporal")
    True
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.generated.grammar import Draw

__all__ = ["VIDEO_ROLES", "VideoDraw", "draw_video", "video_features"]

VIDEO_ROLES = ("spatial", "temporal", "frame_pos", "v_fold")
_FOLDS = ("reshape", "reshape_read", "einops", "einops_b")


@dataclass
class VideoDraw:
    """The features of a factorised video model.

    Attributes:
        frames: Frames ``F``.
        fold: How the model refolds between the stacks: ``reshape`` (reshape/transpose with
            the frame count read from the input), ``reshape_read`` (every size read from the
            stream), ``einops`` (``einops.rearrange`` told the frame count) or ``einops_b``
            (told the batch).
        loop: ``zip`` (``for s, t in zip(spatial, temporal)``) or ``index`` (``range``).
        frame_pos: A learned ``[1, F, D]`` frame embedding added before the first temporal
            block.
        cond: ``adaln`` (each block gets the conditioning repeated over its folded rows) or
            ``added`` (added to the tokens before the blocks).
        stack: The stack the design routes: ``spatial`` (more tokens) or ``temporal`` (equal
            counts, fewer ops between its blocks).
    """

    frames: int
    fold: str
    loop: str
    frame_pos: bool
    cond: str
    stack: str = "spatial"


def draw_video(d: Draw) -> None:
    """Make ``d`` a factorised video model for some seeds (in place; see the module
    docstring)."""
    rng = random.Random(f"generated-video-{d.seed}")
    if rng.random() >= 0.08:
        return
    tie = rng.random() < 0.25
    if tie:  # as many frames as positions: both stacks' streams are [B * F, F, D]
        h, w = 2, 2
        frames = 4
    else:
        h, w = 4, rng.choice([4, 6])
        frames = rng.choice([2, 3])
    d.video = VideoDraw(
        frames=frames, fold=rng.choice(_FOLDS), loop=rng.choice(["zip", "index"]),
        frame_pos=rng.random() < 0.5, cond=rng.choice(["adaln", "adaln", "added"]),
    )  # fmt: skip
    d.input_kind = rng.choice(["video_conv", "video_linear"])
    d.grid, d.patch, d.channels = (frames, h, w), 2, rng.choice([3, 4])
    d.depth = rng.randint(2, 4)
    d.start = rng.randrange(d.depth)
    d.end = rng.randint(d.start + 1, d.depth)
    d.adaln = d.video.cond == "adaln"
    d.refuse = None
    if tie and not d.video.frame_pos:
        d.refuse = "stacks_tie"
    elif tie:
        d.video.stack = "temporal"
        # the spatial blocks inside a temporal route: those after temporal block `start`,
        # up to spatial block `end` (none when the route is the last temporal block alone)
        spatial_inside = not (d.end == d.depth and d.start == d.depth - 1)
        d.refuse = "folded_tie" if d.adaln and spatial_inside else None
    # every other family is the joint writer's: cleared
    d.company, d.rope, d.mask, d.text, d.text_mask, d.text_mask_kind = (
        [],
        None,
        None,
        None,
        False,
        None,
    )
    d.ints, d.predicates, d.hook, d.hooked, d.scan = [], [], None, (), None
    d.einops_heads = d.einops_repeat = False
    d.container, d.stages, d.wrap, d.ret, d.label = "two_lists", (), "plain", "tensor", False


def video_features(d: Draw) -> list[str]:
    """The table labels of a factorised video model (it has no other round's features)."""
    v = d.video
    out = [f"input={d.input_kind}", "video=factorised", f"video_fold={v.fold}"]
    out += [f"video_loop={v.loop}", f"call={d.call}", f"attention={d.attention}"]
    out += [f"cond={v.cond}"] + (["video_frame_pos"] if v.frame_pos else [])
    out += ["video_stack=temporal"] if v.stack == "temporal" else []
    out += [f"refuse={d.refuse}"] if d.refuse else []
    out.append(f"rate={d.rate}")
    out.append("route_end=depth" if d.end == d.depth else "route_end=inner")
    return out
