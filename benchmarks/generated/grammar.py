"""The first grammar: the features of one generated backbone, drawn from its seed.

A :class:`Draw` is everything the source writer and the twin need to know by construction:
what the input is, which company tokens join the stream and where, how the blocks are held
and called, which side values reach them, where the route is, and whether the model must be
refused. :func:`draw` fills it from ``random.Random(seed)``; :class:`Names` gives every class,
attribute and argument a random identifier (never a real model's name).

Later feature families add fields and a ``features()`` entry; the writer reads only fields.

Example:
    >>> d = draw(3)
    >>> d == draw(3), 4 <= d.depth <= 8, 0 <= d.start < d.end <= d.depth
    (True, True, True)
"""

from __future__ import annotations

import keyword
import random
from dataclasses import dataclass, field

from benchmarks.generated.grammar_containers import (
    CONTAINER_ROLES,
    containers_features,
    draw_containers,
)
from benchmarks.generated.grammar_more import MORE_ROLES, draw_more, more_features
from benchmarks.generated.grammar_scan import SCAN_ROLES, ScanDraw, draw_scan, scan_features
from benchmarks.generated.grammar_seqfirst import SEQ_ROLES, SeqDraw, draw_seqfirst, seq_features
from benchmarks.generated.grammar_video import VIDEO_ROLES, VideoDraw, draw_video, video_features

__all__ = ["Company", "Draw", "Names", "draw", "BATCH"]

BATCH = 2
_PIECES = ("ka", "lo", "ri", "zu", "ne", "ta", "vi", "po", "se", "mu", "dr", "qe", "ox", "yl")


class Names:
    """Random identifiers, unique within one model, drawn from the model's own generator.

    Example:
        >>> names = Names(random.Random(0))
        >>> a, b = names.fresh(), names.fresh()
        >>> a != b and a.isidentifier() and not keyword.iskeyword(a)
        True
    """

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._used: set[str] = set()

    def fresh(self) -> str:
        """A new identifier: two or three word pieces and a hex tail (``"kalo_3f"``)."""
        while True:
            count = self._rng.randint(2, 3)
            word = "".join(self._rng.choice(_PIECES) for _ in range(count))
            name = f"{word}_{self._rng.randrange(256):02x}"
            if name not in self._used and not keyword.iskeyword(name):
                self._used.add(name)
                return name

    def cls(self) -> str:
        """A class name (capitalised)."""
        return self.fresh().capitalize()


@dataclass
class Company:
    """One part of the stream's company (tokens that join the stream and are never routed).

    Attributes:
        kind: ``"register"`` (learned tokens), ``"cls"`` (one learned token) or ``"time"``
            (one token projected from the timestep embedding).
        count: Tokens in this part.
        attr: Attribute holding its parameter or projection.
    """

    kind: str
    count: int
    attr: str


@dataclass
class Draw:
    """The features of one generated backbone (see the module docstring).

    Attributes:
        seed: The seed everything was drawn from.
        input_kind: ``image_conv``, ``image_linear``, ``tokens`` (pre-patchified) or ``audio``.
        patch_embed: For ``image_linear``: ``rearrange`` or ``unfold``.
        channels: Image/audio channels, or the token feature size for ``tokens``.
        grid: Patch grid ``(h, w)`` for images, ``(n,)`` otherwise.
        patch: Patch size (images: side, audio: samples per token, tokens: 1).
        width: Stream width at the route start.
        heads: Attention heads.
        depth: Blocks.
        label: Whether a class label joins the timestep embedding.
        adaln: Whether blocks take the conditioning (adaLN); else it is added to the tokens.
        company: Parts joining the stream, in order.
        company_side: ``prepend`` or ``append``.
        company_join: ``cat`` (torch.cat) or ``pack`` (einops.pack).
        container: ``modulelist``, ``sequential``, ``numbered`` or ``two_lists``.
        split: For ``two_lists``: blocks in the first list.
        call: ``positional`` or ``keyword``.
        ret: ``tensor``, ``tuple`` (an extra output) or ``dict``.
        side_order: Block arguments after the stream, in order (``cond``, ``rope``, ``mask``).
        rope: ``None``, ``nd`` (``[N, d]`` tables) or ``bnd`` (``[B, N, d]``).
        rope_buffer: The angles are a buffer sliced to N (else computed for N).
        rope_block_slice: Each block slices the tables to its own token count.
        mask: ``None``, ``bool`` or ``additive`` key-padding mask over the stream.
        masked: Masked (trailing) patch tokens per sample.
        attention: ``sdpa`` or ``explicit`` softmax.
        refuse: ``None``, ``width`` (width changes inside the route) or ``merge`` (pairs of
            tokens merged inside the route).
        change_at: The block whose output changes width or token count (``refuse`` only).
        start: Route start block.
        end: Route end block (``depth`` re-enters after the last block).
        rate: Route rate.
        names: Identifiers for every class, attribute and argument, by role.

    The second round's fields (:mod:`~benchmarks.generated.grammar_more`, defaults: absent):
    ``input_kind`` may also be ``video_conv``/``video_linear`` (``grid`` is ``(F, h, w)``);
    ``wrap`` is how blocks are called (``plain``, ``checkpoint``, ``checkpoint_train``,
    ``partial``, ``partial_checkpoint``); ``ret`` may also be ``list`` or ``tuple3``;
    ``hook`` (``scale``/``record``) is registered on the blocks ``hooked``; ``ints`` are int
    block arguments (``count``: the stream's length, ``grid``/``grid_tuple``: the patch grid,
    ``coincident``: a feature size equal to the token count); ``predicates`` are Python
    checks in the model's code; ``einops_heads``/``einops_repeat`` use einops in the block /
    for the company; ``text`` is a text stream joined as ``prefix``/``suffix`` or passed as
    ``context`` (``text_tokens`` of ``text_width``, padding ``text_mask`` of
    ``text_mask_kind`` with ``text_masked`` trailing tokens); ``refuse`` may also be
    ``fold`` (tokens folded into the batch before block ``change_at``) or ``latents`` (the
    blocks run on ``latent_tokens`` learned latents, the patches as their context).
    ``video`` (:mod:`~benchmarks.generated.grammar_video`) makes it a factorised video model
    (``refuse`` may then be ``stacks_tie``); ``seq``
    (:mod:`~benchmarks.generated.grammar_seqfirst`) a sequence-first one (``input_kind``
    ``tokens_seq_first``: ``[T, B, C]`` in and out).
    """

    seed: int
    input_kind: str
    patch_embed: str
    channels: int
    grid: tuple[int, ...]
    patch: int
    width: int
    heads: int
    depth: int
    label: bool
    adaln: bool
    company: list[Company]
    company_side: str
    company_join: str
    container: str
    split: int
    call: str
    ret: str
    side_order: list[str]
    rope: str | None
    rope_buffer: bool
    rope_block_slice: bool
    mask: str | None
    masked: tuple[int, ...]
    attention: str
    refuse: str | None
    change_at: int
    start: int
    end: int
    rate: float
    names: dict[str, str] = field(default_factory=dict)
    wrap: str = "plain"
    hook: str | None = None
    hooked: tuple[int, ...] = ()
    ints: list[str] = field(default_factory=list)
    predicates: list[str] = field(default_factory=list)
    einops_heads: bool = False
    einops_repeat: bool = False
    text: str | None = None
    text_tokens: int = 0
    text_width: int = 0
    text_mask: bool = False
    text_mask_kind: str | None = None
    text_masked: tuple[int, ...] = ()
    latent_tokens: int = 0
    scan: ScanDraw | None = None  # the scan round (grammar_scan.py)
    dict_walk: str = "values"  # the containers round (grammar_containers.py)
    stages: tuple[int, ...] = ()
    text_join: str = "cat"
    video: VideoDraw | None = None  # the factorised video round (grammar_video.py)
    seq: SeqDraw | None = None  # the sequence-first round (grammar_seqfirst.py)

    @property
    def batch_dim(self) -> int:
        """The dim of the model's input and output holding the samples."""
        return 1 if self.seq else 0

    @property
    def num_patches(self) -> int:
        """Routable (patch) tokens."""
        n = 1
        for g in self.grid:
            n *= g
        return n

    @property
    def num_company(self) -> int:
        """Company tokens."""
        return sum(part.count for part in self.company)

    @property
    def joined_text(self) -> int:
        """Text tokens joined into the stream (0 when none, or kept beside it)."""
        return self.text_tokens if self.text in ("prefix", "suffix") else 0

    @property
    def stream_tokens(self) -> int:
        """Tokens of the stream the blocks see (patches, company and joined text)."""
        if self.refuse == "latents":
            return self.latent_tokens
        return self.num_patches + self.num_company + self.joined_text

    @property
    def stream_mask(self) -> str | None:
        """The kind of the self-attention key mask over the stream (patch or text part)."""
        if self.mask:
            return self.mask
        return self.text_mask_kind if (self.text_mask and self.joined_text) else None

    @property
    def routable(self) -> bool:
        """Whether the model must route (no must-refuse structure in the route)."""
        return self.refuse is None

    def features(self) -> list[str]:
        """The feature labels the benchmark table counts, e.g. ``"container=numbered"``."""
        if self.video:
            return video_features(self)
        if self.seq:
            return seq_features(self)
        out = [f"input={self.input_kind}", f"container={self.container}", f"call={self.call}"]
        if self.input_kind == "image_linear":
            out.append(f"patch_embed={self.patch_embed}")
        out += [f"return={self.ret}", f"attention={self.attention}"]
        out.append("cond=adaln" if self.adaln else "cond=added")
        if self.label:
            out.append("label")
        for part in self.company:
            out.append(f"company={part.kind}")
        if self.company:
            out.append(f"company_join={self.company_join}-{self.company_side}")
        if self.rope:
            out.append(f"rope={self.rope}")
            out += ["rope.buffer"] if self.rope_buffer else []
            out += ["rope.block_slice"] if self.rope_block_slice else []
        if self.mask:
            out.append(f"mask={self.mask}")
        if self.refuse:
            out.append(f"refuse={self.refuse}")
        out += more_features(self) + scan_features(self) + containers_features(self)
        out.append(f"rate={self.rate}")
        out.append("route_end=depth" if self.end == self.depth else "route_end=inner")
        return out


def _input(rng: random.Random) -> dict:
    kind = rng.choice(["image_conv", "image_linear", "tokens", "audio"])
    if kind.startswith("image"):
        grid = (rng.choice([4, 6, 8]), rng.choice([4, 6, 8]))
        return dict(input_kind=kind, grid=grid, patch=2, channels=rng.choice([3, 4]))
    n = rng.choice([16, 24, 32, 48, 64])
    if kind == "tokens":
        return dict(input_kind=kind, grid=(n,), patch=1, channels=rng.choice([8, 12]))
    return dict(input_kind=kind, grid=(n,), patch=4, channels=rng.choice([1, 2]))


def _company(rng: random.Random, names: Names) -> list[Company]:
    parts = []
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        kind = rng.choice(["register", "cls", "time"])
        count = rng.randint(1, 4) if kind == "register" else 1
        parts.append(Company(kind, count, names.fresh()))
    return parts


def _route(rng: random.Random, depth: int) -> tuple[int, int]:
    start = rng.randrange(depth)
    return start, rng.randint(start + 1, depth)


def _masked(rng: random.Random, patches: int, rate: float) -> tuple[int, ...]:
    """Trailing masked tokens per sample: fewer than half the kept count, so every sample
    keeps unmasked keys whatever the selection."""
    most = max(1, (patches - int(patches * rate)) // 2)
    return tuple(rng.randint(1, most) for _ in range(BATCH))


def _refusal(rng: random.Random, d: Draw) -> None:
    """A must-refuse structure inside the route: it excludes what cannot follow it."""
    d.refuse = rng.choice(["width", "merge"])
    d.change_at = rng.randint(d.start, d.end - 1)
    if d.refuse == "width" and d.container == "two_lists" and d.change_at == d.split - 1:
        # a width change at the end of the first list makes lists of two forms: the design
        # routes the longer one, so the change would not lie inside the route
        d.container = "modulelist"
    d.rope = None
    if d.refuse == "merge":
        d.company, d.mask = [], None


def draw(seed: int) -> Draw:
    """The features of the backbone of ``seed`` (deterministic).

    Example:
        >>> draw(0).seed
        0
    """
    rng = random.Random(seed)
    names = Names(rng)
    width = rng.choice([32, 48])
    depth = rng.randint(4, 8)
    start, end = _route(rng, depth)
    d = Draw(
        seed=seed, **_input(rng), patch_embed=rng.choice(["rearrange", "unfold"]),
        width=width, heads=rng.choice([2, 3]) if width == 48 else 2, depth=depth,
        label=rng.random() < 0.5, adaln=rng.random() < 0.75, company=_company(rng, names),
        company_side=rng.choice(["prepend", "append"]), company_join=rng.choice(["cat", "pack"]),
        container=rng.choice(["modulelist", "sequential", "numbered", "two_lists"]),
        split=rng.randint(1, depth - 1), call=rng.choice(["positional", "keyword"]),
        ret=rng.choice(["tensor", "tuple", "dict"]), side_order=[],
        rope=rng.choice([None, None, "nd", "bnd"]), rope_buffer=rng.random() < 0.5,
        rope_block_slice=rng.random() < 0.3, mask=rng.choice([None, None, "bool", "additive"]),
        masked=(), attention=rng.choice(["sdpa", "explicit"]), refuse=None, change_at=-1,
        start=start, end=end, rate=rng.choice([0.25, 0.5, 0.5, 0.75]),
    )  # fmt: skip
    if rng.random() < 0.2:
        _refusal(rng, d)
    draw_more(d)
    draw_scan(d)
    draw_containers(d)
    draw_video(d)
    draw_seqfirst(d)
    d.masked = _masked(rng, d.num_patches, d.rate) if d.mask else ()
    d.side_order = _sides(rng, d)
    d.names = {role: names.fresh() for role in _ROLES}
    d.names.update({role: names.cls() for role in ("model", "block")})
    d.names.update({role: names.fresh() for role in MORE_ROLES})
    d.names.update({role: names.fresh() for role in SCAN_ROLES + CONTAINER_ROLES})
    d.names.update({role: names.fresh() for role in VIDEO_ROLES})
    d.names.update({role: names.fresh() for role in SEQ_ROLES})
    return d


def _sides(rng: random.Random, d: Draw) -> list[str]:
    """The block arguments after the stream, shuffled."""
    sides = (["cond"] if d.adaln else []) + (["rope"] if d.rope else [])
    sides += ["mask"] if d.stream_mask else []
    sides += ["ctx"] if d.text == "context" or d.refuse == "latents" else []
    sides += ["ctx_mask"] if d.text == "context" and d.text_mask else []
    for kind in d.ints:
        sides += {"count": ["count"], "coincident": ["coin"], "grid_tuple": ["grid"]}.get(
            kind, ["gh", "gw"] + (["gf"] if len(d.grid) == 3 else [])
        )
    rng.shuffle(sides)
    return sides


_ROLES = (
    # model attributes
    "embed", "pos", "t1", "t2", "label_emb", "time_tok", "rope_buf", "list1", "list2",
    "numbered", "final_norm", "final_ada", "head", "unmerge",
    # block attributes
    "n1", "qkv", "o", "n2", "f1", "f2", "ada", "wproj", "merge",
    # model forward arguments
    "arg_in", "arg_t", "arg_y", "arg_mask",
    # block forward arguments
    "b_x", "b_cond", "b_rope", "b_mask",
    # dict keys, helpers, constants
    "key_out", "key_aux", "fn_rot", "fn_freq", "fn_angles", "const_heads",
)  # fmt: skip
